package maps

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/topolb/topolb/internal/netns"
)

// hook is one attach point kind of an interface; its name prefixes the
// link pin.
type hook string

const (
	// hookTC is tc_lb on the tc ingress (a tcx link or a clsact filter,
	// Options.TCAttach) of a pod's host-side veth.
	hookTC hook = "tc"
	// hookTCEgress is tc_lb_egress on the tc egress of a pod's
	// host-side veth.
	hookTCEgress hook = "tcegress"
	// hookXDP is xdp_lb on an uplink.
	hookXDP hook = "xdp"
	// hookUplink is the tc ingress of an uplink: tc_uplink beside XDP
	// (it delivers what xdp_lb hands over in packet metadata), or
	// tc_uplink_lb alone on the tc path (uplink.go).
	hookUplink hook = "uplink"
	// hookUplinkEgress is tc_lb_egress on the tc egress of an uplink:
	// replies of host-network backends to outside clients.
	hookUplinkEgress hook = "uplinkegress"
)

var hooks = []hook{hookTC, hookTCEgress, hookXDP, hookUplink, hookUplinkEgress}

func (d *attacher) linksDir() string { return filepath.Join(d.opts.PinPath, "links") }

func (d *attacher) linkPin(h hook, ifname string) string {
	return filepath.Join(d.linksDir(), string(h)+"_"+ifname)
}

// AttachPod attaches the datapath to ifname, the host side of a pod veth:
// tc_lb to its tc ingress (the pod's packets: DNAT, replies of local
// backends, ICMP errors from the pod, rejects), tc_lb_egress to its tc
// egress (ICMP errors the node sends to the pod), and records the
// interface in tlb_ifaces. As tcx links, they are pinned under
// PinPath/links, and a link pinned by an earlier process for the same
// interface is updated to this program instead of failing; as clsact
// filters, an earlier process's filter is replaced in place
// (attachFilter).
func (d *attacher) AttachPod(ifname string) error {
	if err := d.attach(ifname, tcIfaceKindIFACE_POD, hookTC, hookTCEgress); err != nil {
		return fmt.Errorf("attach to pod interface %s: %w", ifname, err)
	}
	return nil
}

// program returns the program attached at h.
func (d *attacher) program(h hook) *ebpf.Program {
	switch h {
	case hookTC:
		return d.tcProg
	case hookTCEgress, hookUplinkEgress:
		return d.tcEgressProg
	case hookUplink:
		return d.uplinkProg
	default:
		return d.xdpProg
	}
}

// attach attaches the programs of hs to ifname and records it as kind. A
// hook attached before a later one fails stays attached: it works alone,
// and attaching again completes the set.
func (d *attacher) attach(ifname string, kind tcIfaceKind, hs ...hook) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.linksReady(); err != nil {
		return err
	}
	return d.inNetNS(func() error {
		iface, err := net.InterfaceByName(ifname)
		if err != nil {
			return err
		}
		for _, h := range hs {
			if err := d.attachHook(iface, h, d.program(h), xdpDriverOrGeneric); err != nil {
				return fmt.Errorf("%s: %w", h, err)
			}
		}
		return d.putIface(iface, kind)
	})
}

// linksReady checks, with mu held, that the Datapath is open, and creates
// the links directory.
func (d *attacher) linksReady() error {
	if d.closed() {
		return ErrClosed
	}
	return os.MkdirAll(d.linksDir(), 0o700)
}

// xdpModes are the XDP attach modes attachHook tries, in order.
type xdpModes int

const (
	// xdpDriverOrGeneric falls back to generic (skb) mode where the
	// driver has no native XDP.
	xdpDriverOrGeneric xdpModes = iota
	// xdpDriverOnly fails where the driver has no native XDP.
	xdpDriverOnly
)

// attachHook attaches prog at h to iface: a tc hook as this process's
// attach mode says (a tcx link, or a clsact filter), removing what the
// other mode left there once prog runs; XDP as a pinned link. An earlier
// process's link or filter is updated in place. modes applies to hookXDP.
func (d *attacher) attachHook(iface *net.Interface, h hook, prog *ebpf.Program, modes xdpModes) error {
	if tcHook(h) && d.tcAttach == TCAttachTC {
		if err := d.attachFilter(iface, h, prog); err != nil {
			return err
		}
		// A tcx link an agent in tcx mode left runs before any clsact
		// filter: it goes once the filter is in place.
		return d.unpinLink(h, iface.Name, false)
	}
	if err := d.attachLink(iface, h, prog, modes); err != nil || !tcHook(h) {
		return err
	}
	// The other way round: a filter an agent in tc mode left goes once
	// the tcx link, which runs first, is in place.
	l, err := netlink.LinkByIndex(iface.Index)
	if err != nil {
		return fmt.Errorf("link %s: %w", iface.Name, err)
	}
	_, err = deleteFilter(l, h)
	return err
}

// attachLink attaches prog at h to iface as a link and pins it, or
// updates the link an earlier process pinned.
func (d *attacher) attachLink(iface *net.Interface, h hook, prog *ebpf.Program, modes xdpModes) error {
	pin := d.linkPin(h, iface.Name)
	if done, err := d.readopt(pin, iface.Index, prog); done || err != nil {
		return err
	}
	var (
		l   link.Link
		err error
	)
	switch h {
	case hookTC, hookUplink:
		l, err = link.AttachTCX(link.TCXOptions{Interface: iface.Index, Program: prog, Attach: ebpf.AttachTCXIngress})
	case hookTCEgress, hookUplinkEgress:
		l, err = link.AttachTCX(link.TCXOptions{Interface: iface.Index, Program: prog, Attach: ebpf.AttachTCXEgress})
	case hookXDP:
		l, err = link.AttachXDP(link.XDPOptions{Interface: iface.Index, Program: prog, Flags: link.XDPDriverMode})
		if err != nil && modes == xdpDriverOrGeneric {
			d.log.Info("driver-mode XDP unavailable, using generic mode", "interface", iface.Name, "err", err)
			l, err = link.AttachXDP(link.XDPOptions{Interface: iface.Index, Program: prog, Flags: link.XDPGenericMode})
		}
	}
	if err != nil {
		return err
	}
	defer l.Close()
	if err := l.Pin(pin); err != nil {
		return fmt.Errorf("pin link: %w", err)
	}
	d.log.Info("attached", "hook", h, "interface", iface.Name, "ifindex", iface.Index, "mode", "link")
	return nil
}

// putIface records what an interface is in tlb_ifaces, for redirects.
func (d *attacher) putIface(iface *net.Interface, kind tcIfaceKind) error {
	v := tcIfaceValue{Kind: uint8(kind)}
	copy(v.Mac[:], iface.HardwareAddr)
	if err := d.ifaces.Update(uint32(iface.Index), &v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("record interface %s in tlb_ifaces: %w", iface.Name, err)
	}
	d.ifindexOf[iface.Name] = iface.Index
	return nil
}

// readopt updates a link pinned at pin to prog when it is still attached to
// ifindex. It reports done=false, after removing the pin, when the link is
// stale (the interface was re-created), and when there is no pin.
func (d *attacher) readopt(pin string, ifindex int, prog *ebpf.Program) (done bool, err error) {
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("load pinned link %s: %w", pin, err)
	}
	defer l.Close()
	if linkIfindex(l) == ifindex {
		if err := l.Update(prog); err == nil {
			d.log.Info("re-adopted pinned link", "pin", pin, "ifindex", ifindex)
			return true, nil
		}
	}
	if err := l.Unpin(); err != nil {
		return false, fmt.Errorf("unpin stale link %s: %w", pin, err)
	}
	return false, nil
}

func linkIfindex(l link.Link) int {
	info, err := l.Info()
	if err != nil {
		return -1
	}
	if x := info.TCX(); x != nil {
		return int(x.Ifindex)
	}
	if x := info.XDP(); x != nil {
		return int(x.Ifindex)
	}
	return -1
}

// Detach removes topolb's links from ifname (every hook AttachPod or
// AttachUplink pinned), which detaches the programs, and forgets it in
// tlb_ifaces. Detaching an interface without links is not an error.
func (d *attacher) Detach(ifname string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.detach(ifname)
}

func (d *attacher) detach(ifname string) error {
	var errs []error
	for _, h := range hooks {
		if err := d.unpinLink(h, ifname, true); err != nil {
			errs = append(errs, err)
		}
	}
	if err := d.inNetNS(func() error { return d.detachFilters(ifname) }); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// detachFilters removes topolb's tc filters from ifname (whichever
// mode this process attaches in: an agent in the other mode may have left
// them) and, where it found one, forgets the interface in tlb_ifaces.
// The clsact qdisc stays: another tool's filters may be on it, or be
// added to it at any moment. An interface that is gone took its filters
// with it; its entry in tlb_ifaces is forgotten when this process
// recorded it.
func (d *attacher) detachFilters(ifname string) error {
	l, err := linkByName(ifname)
	if err != nil {
		return err
	}
	ifindex, recorded := d.ifindexOf[ifname]
	delete(d.ifindexOf, ifname)
	if l == nil {
		if recorded && !d.closed() {
			return d.forgetIface(ifname, ifindex)
		}
		return nil
	}
	var errs []error
	removed := false
	for _, h := range hooks {
		if !tcHook(h) {
			continue
		}
		found, err := deleteFilter(l, h)
		if err != nil {
			errs = append(errs, fmt.Errorf("detach %s from %s: %w", h, ifname, err))
		}
		if found {
			removed = true
			d.log.Info("detached", "hook", h, "interface", ifname, "mode", TCAttachTC)
		}
	}
	if removed && !d.closed() {
		if err := d.forgetIface(ifname, l.Attrs().Index); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// forgetIface deletes ifindex, once ifname, from tlb_ifaces.
func (d *attacher) forgetIface(ifname string, ifindex int) error {
	if err := d.ifaces.Delete(uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("forget %s in tlb_ifaces: %w", ifname, err)
	}
	return nil
}

// unpinLink removes the link h pinned for ifname, which detaches its
// program; with forget, it also forgets the interface in tlb_ifaces. A
// missing pin is not an error.
func (d *attacher) unpinLink(h hook, ifname string, forget bool) error {
	pin := d.linkPin(h, ifname)
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("detach %s from %s: %w", h, ifname, err)
	}
	defer l.Close()
	var errs []error
	ifindex := linkIfindex(l)
	if err := l.Unpin(); err != nil {
		errs = append(errs, fmt.Errorf("detach %s from %s: %w", h, ifname, err))
	}
	if forget && ifindex > 0 && !d.closed() {
		if err := d.forgetIface(ifname, ifindex); err != nil {
			errs = append(errs, err)
		}
	}
	d.log.Info("detached", "hook", h, "interface", ifname)
	return errors.Join(errs...)
}

// Attached lists the interfaces with a pinned topolb link (of any hook)
// or, when this process attaches in tc mode, a topolb tc filter, sorted. The socket hooks (AttachHost) are not interfaces: see
// HostAttached.
func (d *attacher) Attached() ([]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.attached()
}

func (d *attacher) attached() ([]string, error) {
	entries, err := os.ReadDir(d.linksDir())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("list links: %w", err)
	}
	var out []string
	for _, e := range entries {
		for _, h := range hooks {
			if name, ok := strings.CutPrefix(e.Name(), string(h)+"_"); ok {
				out = append(out, name)
			}
		}
	}
	if d.tcAttach == TCAttachTC {
		err := d.inNetNS(func() error {
			names, err := filtered()
			out = append(out, names...)
			return err
		})
		if err != nil {
			return nil, err
		}
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// inNetNS runs fn with the calling goroutine's OS thread in Options.NetNS,
// so interface names and indexes resolve there. Pins are unaffected: they
// live in the mount namespace, which setns(CLONE_NEWNET) does not change.
func (d *attacher) inNetNS(fn func() error) error {
	if d.opts.NetNS == "" {
		return fn()
	}
	return netns.RunIn(d.opts.NetNS, fn)
}
