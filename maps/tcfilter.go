package maps

import (
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TCAttach is how the tc programs are attached to an interface
// (docs/datapath.md, "Attach modes").
type TCAttach string

const (
	// TCAttachAuto takes tcx where the kernel has it (Linux 6.6) and tc
	// clsact filters elsewhere.
	TCAttachAuto TCAttach = "auto"
	// TCAttachTCX attaches tcx links, pinned under PinPath/links.
	TCAttachTCX TCAttach = "tcx"
	// TCAttachTC attaches direct-action cls_bpf filters to the
	// interface's clsact qdisc through netlink, created where missing.
	// The filters live on the qdisc (no pin): they keep forwarding while
	// the agent is down, and a restarted agent finds them by name,
	// priority and handle.
	TCAttachTC TCAttach = "tc"
)

// TCAttaches are the values ParseTCAttach accepts.
var TCAttaches = []TCAttach{TCAttachAuto, TCAttachTCX, TCAttachTC}

// ParseTCAttach parses "auto", "tcx" or "tc".
func ParseTCAttach(s string) (TCAttach, error) { return parseChoice("tc attach mode", s, TCAttaches) }

// The place of topolb's filter in a clsact direction. Priority 1 runs it
// before filters added without a priority (the kernel gives those 49152
// and down), as tcx programs run before every clsact filter; the handle
// keeps it apart from another cls_bpf filter at priority 1.
const (
	tcFilterPriority = 1
	tcFilterHandle   = 0x7010b
	// tcFilterPrefix starts the name of every filter topolb attaches;
	// the hook follows it ("topolb_tc", "topolb_uplinkegress").
	tcFilterPrefix = "topolb_"
)

// tcHook reports whether h is a tc hook (tcx link or clsact filter), as
// opposed to XDP.
func tcHook(h hook) bool { return h != hookXDP }

// filterParent is the clsact direction of tc hook h.
func filterParent(h hook) uint32 {
	if h == hookTCEgress || h == hookUplinkEgress {
		return netlink.HANDLE_MIN_EGRESS
	}
	return netlink.HANDLE_MIN_INGRESS
}

func filterName(h hook) string { return tcFilterPrefix + string(h) }

// filterAt returns the cls_bpf filter at topolb's priority and handle in
// the clsact direction parent of link, nil when there is none. An
// interface without a clsact qdisc has none.
func filterAt(l netlink.Link, parent uint32) (*netlink.BpfFilter, error) {
	fs, err := netlink.FilterList(l, parent)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list tc filters of %s: %w", l.Attrs().Name, err)
	}
	for _, f := range fs {
		a := f.Attrs()
		if a.Priority != tcFilterPriority || a.Handle != tcFilterHandle {
			continue
		}
		bf, ok := f.(*netlink.BpfFilter)
		if !ok {
			return nil, fmt.Errorf("tc filter %#x at priority %d of %s is a %s filter, not topolb's", a.Handle, a.Priority, l.Attrs().Name, f.Type())
		}
		return bf, nil
	}
	return nil, nil
}

// ours reports whether f is a filter topolb attached at hook h.
func ours(f *netlink.BpfFilter, h hook) bool { return f.Name == filterName(h) }

// attachFilter makes prog the direct-action filter of h on iface: it
// creates the clsact qdisc where there is none (an existing one, and
// every filter on it, is left as it is), keeps a filter of ours that
// already runs prog, and otherwise replaces it in place (same priority
// and handle: the kernel swaps the program atomically, no packet sees
// neither). A filter of another tool at topolb's priority and handle is
// an error: it is never replaced.
func (d *attacher) attachFilter(iface *net.Interface, h hook, prog *ebpf.Program) error {
	l, err := netlink.LinkByIndex(iface.Index)
	if err != nil {
		return fmt.Errorf("link %s: %w", iface.Name, err)
	}
	clsact := &netlink.GenericQdisc{QdiscType: "clsact", QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: iface.Index, Parent: netlink.HANDLE_CLSACT, Handle: netlink.MakeHandle(0xffff, 0)}}
	if err := netlink.QdiscAdd(clsact); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("add clsact qdisc to %s: %w", iface.Name, err)
	}
	old, err := filterAt(l, filterParent(h))
	if err != nil {
		return err
	}
	id, err := programID(prog)
	if err != nil {
		return err
	}
	switch {
	case old != nil && !ours(old, h):
		return fmt.Errorf("tc filter %q holds priority %d handle %#x of %s, where topolb attaches: not replacing another tool's filter",
			old.Name, tcFilterPriority, tcFilterHandle, iface.Name)
	case old != nil && ebpf.ProgramID(old.Id) == id:
		return nil
	}
	f := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: iface.Index, Parent: filterParent(h),
			Priority: tcFilterPriority, Handle: tcFilterHandle, Protocol: unix.ETH_P_ALL},
		Fd: prog.FD(), Name: filterName(h), DirectAction: true,
	}
	if err := netlink.FilterReplace(f); err != nil {
		return fmt.Errorf("tc filter on %s: %w", iface.Name, err)
	}
	if old != nil {
		// A restarted agent's programs are new instances: even with the
		// same tag (the instructions, map references left out) their
		// load-time constants may differ.
		d.log.Info("replaced program of adopted tc filter", "hook", h, "interface", iface.Name,
			"oldProgram", old.Id, "oldTag", old.Tag, "program", id)
		return nil
	}
	d.log.Info("attached", "hook", h, "interface", iface.Name, "ifindex", iface.Index, "mode", TCAttachTC)
	return nil
}

// programID is prog's kernel id.
func programID(prog *ebpf.Program) (ebpf.ProgramID, error) {
	info, err := prog.Info()
	if err != nil {
		return 0, fmt.Errorf("program info: %w", err)
	}
	id, ok := info.ID()
	if !ok {
		return 0, errors.New("program info has no id")
	}
	return id, nil
}

// deleteFilter removes topolb's filter of h from l. A missing qdisc or
// filter, or a filter at its place that is not topolb's, is left alone:
// found says whether one of ours was removed.
func deleteFilter(l netlink.Link, h hook) (found bool, err error) {
	f, err := filterAt(l, filterParent(h))
	if err != nil || f == nil || !ours(f, h) {
		return false, err
	}
	if err := netlink.FilterDel(f); err != nil && !errors.Is(err, unix.ENOENT) {
		return false, fmt.Errorf("delete tc filter %s of %s: %w", f.Name, l.Attrs().Name, err)
	}
	return true, nil
}

// linkByName is the link ifname of the calling thread's namespace, nil
// when there is none.
func linkByName(ifname string) (netlink.Link, error) {
	l, err := netlink.LinkByName(ifname)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("link %s: %w", ifname, err)
	}
	return l, nil
}

// filterProgram returns the id of the program topolb's filter of h on
// ifname runs; found is false without one.
func filterProgram(ifname string, h hook) (id ebpf.ProgramID, found bool, err error) {
	l, err := linkByName(ifname)
	if err != nil || l == nil {
		return 0, false, err
	}
	f, err := filterAt(l, filterParent(h))
	if err != nil || f == nil || !ours(f, h) {
		return 0, false, err
	}
	return ebpf.ProgramID(f.Id), true, nil
}

// filtered lists the interfaces of the calling thread's namespace that
// carry a filter of topolb's (of any tc hook).
func filtered() ([]string, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	var out []string
	for _, l := range links {
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			f, err := filterAt(l, parent)
			if err != nil {
				return nil, err
			}
			if f != nil && strings.HasPrefix(f.Name, tcFilterPrefix) {
				out = append(out, l.Attrs().Name)
				break
			}
		}
	}
	return out, nil
}
