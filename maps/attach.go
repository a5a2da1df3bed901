package maps

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/topolb/topolb/internal/netns"
)

// hook is one attach point kind; its name prefixes the link pin.
type hook string

const (
	// hookTC is tc_lb on the tcx ingress of a pod's host-side veth.
	hookTC hook = "tc"
	// hookXDP is xdp_lb on an uplink.
	hookXDP hook = "xdp"
	// hookUplink is tc_uplink on the tcx ingress of an uplink: it
	// delivers what xdp_lb hands over in packet metadata.
	hookUplink hook = "uplink"
)

var hooks = []hook{hookTC, hookXDP, hookUplink}

func (d *Datapath) linksDir() string { return filepath.Join(d.opts.PinPath, "links") }

func (d *Datapath) linkPin(h hook, ifname string) string {
	return filepath.Join(d.linksDir(), string(h)+"_"+ifname)
}

// AttachTC attaches the tc program to ifname's tcx ingress (the host side
// of a pod veth) and pins the link under PinPath/links. A link pinned by an
// earlier process for the same interface is updated to this program
// instead of failing.
func (d *Datapath) AttachTC(ifname string) error {
	if err := d.attach(ifname, hookTC); err != nil {
		return fmt.Errorf("attach tc to %s: %w", ifname, err)
	}
	return nil
}

// AttachUplink attaches the uplink programs to ifname: tc_uplink to its
// tcx ingress, then the XDP program, in driver mode where supported and
// generic mode otherwise; it pins both links and records ifname as an
// uplink in tlb_ifaces, so flows are forwarded out of it without the host
// stack. Either program works without the other (without tc_uplink, what
// XDP hands over goes up the stack), so a failure leaves what was attached
// in place; Detach removes both. Attaching again updates pinned links.
func (d *Datapath) AttachUplink(ifname string) error {
	for _, h := range []hook{hookUplink, hookXDP} {
		if err := d.attach(ifname, h); err != nil {
			return fmt.Errorf("attach %s to uplink %s: %w", h, ifname, err)
		}
	}
	return nil
}

func (d *Datapath) attach(ifname string, h hook) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed() {
		return ErrClosed
	}
	prog, kind := d.tcProg, tcIfaceKindIFACE_POD
	switch h {
	case hookXDP:
		prog, kind = d.xdpProg, tcIfaceKindIFACE_UPLINK
	case hookUplink:
		prog, kind = d.uplinkProg, tcIfaceKindIFACE_UPLINK
	}
	if err := os.MkdirAll(d.linksDir(), 0o700); err != nil {
		return err
	}
	return d.inNetNS(func() error {
		iface, err := net.InterfaceByName(ifname)
		if err != nil {
			return err
		}
		pin := d.linkPin(h, ifname)
		if done, err := d.readopt(pin, iface.Index, prog); done || err != nil {
			if err != nil {
				return err
			}
			return d.putIface(iface, kind)
		}
		var l link.Link
		switch h {
		case hookTC, hookUplink:
			l, err = link.AttachTCX(link.TCXOptions{Interface: iface.Index, Program: prog, Attach: ebpf.AttachTCXIngress})
		case hookXDP:
			l, err = link.AttachXDP(link.XDPOptions{Interface: iface.Index, Program: prog, Flags: link.XDPDriverMode})
			if err != nil {
				d.log.Info("driver-mode XDP unavailable, using generic mode", "interface", ifname, "err", err)
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
		d.log.Info("attached", "hook", h, "interface", ifname, "ifindex", iface.Index)
		return d.putIface(iface, kind)
	})
}

// putIface records what an interface is in tlb_ifaces, for redirects.
func (d *Datapath) putIface(iface *net.Interface, kind tcIfaceKind) error {
	v := tcIfaceValue{Kind: uint8(kind)}
	copy(v.Mac[:], iface.HardwareAddr)
	if err := d.ifaces.Update(uint32(iface.Index), &v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("record interface %s in tlb_ifaces: %w", iface.Name, err)
	}
	return nil
}

// readopt updates a link pinned at pin to prog when it is still attached to
// ifindex. It reports done=false, after removing the pin, when the link is
// stale (the interface was re-created), and when there is no pin.
func (d *Datapath) readopt(pin string, ifindex int, prog *ebpf.Program) (done bool, err error) {
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

// Detach removes topolb's links from ifname, which detaches the programs.
// Detaching an interface without links is not an error.
func (d *Datapath) Detach(ifname string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.detach(ifname)
}

func (d *Datapath) detach(ifname string) error {
	var errs []error
	for _, h := range hooks {
		pin := d.linkPin(h, ifname)
		l, err := link.LoadPinnedLink(pin, nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("detach %s from %s: %w", h, ifname, err))
			continue
		}
		ifindex := linkIfindex(l)
		if err := l.Unpin(); err != nil {
			errs = append(errs, fmt.Errorf("detach %s from %s: %w", h, ifname, err))
		}
		l.Close()
		if ifindex > 0 && !d.closed() {
			if err := d.ifaces.Delete(uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				errs = append(errs, fmt.Errorf("forget %s in tlb_ifaces: %w", ifname, err))
			}
		}
		d.log.Info("detached", "hook", h, "interface", ifname)
	}
	return errors.Join(errs...)
}

// Attached lists the interfaces with a pinned topolb link (tc, XDP or
// uplink tc), sorted.
func (d *Datapath) Attached() ([]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.attached()
}

func (d *Datapath) attached() ([]string, error) {
	entries, err := os.ReadDir(d.linksDir())
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	seen := make(map[string]bool)
	var out []string
	for _, e := range entries {
		for _, h := range hooks {
			if name, ok := strings.CutPrefix(e.Name(), string(h)+"_"); ok && !seen[name] {
				seen[name] = true
				out = append(out, name)
			}
		}
	}
	sort.Strings(out)
	return out, nil
}

// inNetNS runs fn with the calling goroutine's OS thread in Options.NetNS,
// so interface names and indexes resolve there. Pins are unaffected: they
// live in the mount namespace, which setns(CLONE_NEWNET) does not change.
func (d *Datapath) inNetNS(fn func() error) error {
	if d.opts.NetNS == "" {
		return fn()
	}
	return netns.RunIn(d.opts.NetNS, fn)
}
