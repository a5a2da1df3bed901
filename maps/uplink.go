package maps

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/netns"
)

// UplinkPath is how an uplink balances frontends of scope external
// (docs/datapath.md, "Uplink paths").
type UplinkPath string

const (
	// UplinkAuto chooses per uplink (probeUplink): XDP where the frames
	// it transmits and redirects are taken, tc elsewhere.
	UplinkAuto UplinkPath = "auto"
	// UplinkXDP is xdp_lb, in driver mode where the driver has it and
	// generic mode otherwise, with tc_uplink finishing its handovers. On a
	// veth whose peer has no NAPI (no native XDP program, no GRO) the
	// frames it sends back out are dropped by the kernel.
	UplinkXDP UplinkPath = "xdp"
	// UplinkTC is tc_uplink_lb alone on the uplink's tc ingress: the
	// same decisions, maps and conntrack on skbs, delivered everywhere.
	UplinkTC UplinkPath = "tc"
)

// UplinkPaths are the values ParseUplinkPath accepts.
var UplinkPaths = []UplinkPath{UplinkAuto, UplinkXDP, UplinkTC}

// ParseUplinkPath parses "auto", "xdp" or "tc".
func ParseUplinkPath(s string) (UplinkPath, error) { return parseChoice("uplink path", s, UplinkPaths) }

// parseChoice returns s as one of values, or an error naming what and
// the values.
func parseChoice[T ~string](what, s string, values []T) (T, error) {
	if v := T(s); slices.Contains(values, v) {
		return v, nil
	}
	names := make([]string, len(values))
	for i, v := range values {
		names[i] = string(v)
	}
	return "", fmt.Errorf("%s %q: want %s or %s", what, s, strings.Join(names[:len(names)-1], ", "), names[len(names)-1])
}

// The paths an uplink has as read back from the kernel (UplinkStatus.Path).
const (
	// UplinkPathXDPGeneric is xdp_lb in generic (skb) mode: forced with
	// UplinkXDP on a driver without native XDP.
	UplinkPathXDPGeneric = "xdp-generic"
	// UplinkPathIncomplete is a set of programs that is neither path
	// (an attach failed half-way; attaching again completes it).
	UplinkPathIncomplete = "incomplete"
)

// UplinkStatus is one uplink's path as the kernel has it.
type UplinkStatus struct {
	Interface string `json:"interface"`
	// Path is "xdp" (driver mode), "xdp-generic", "tc" or "incomplete",
	// from the programs attached to the interface.
	Path string `json:"path"`
	// Programs are the names of the programs attached to it, with the XDP
	// attach mode: "xdp_lb/driver", "tc_uplink", "tc_lb_egress".
	Programs []string `json:"programs"`
	// Reason is why this agent chose the path ("" for an uplink another
	// process attached).
	Reason string `json:"reason,omitempty"`
}

// AttachUplink attaches the uplink programs to ifname along the path
// Options.UplinkPath gives (with UplinkAuto, the one probeUplink finds
// for it), then tc_lb_egress to its tc egress (replies of host-network
// backends on this node to outside clients); it pins the links and
// records ifname as an uplink in tlb_ifaces, so flows are forwarded out
// of it without the host stack. Attaching again updates pinned links, so
// an agent restarted with another path swaps the programs in place, the
// new path's first: both use the same conntrack, and no established flow
// is lost. A failure leaves what was attached in place; Detach removes
// them all.
func (d *attacher) AttachUplink(ifname string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.linksReady(); err != nil {
		return fmt.Errorf("attach to uplink %s: %w", ifname, err)
	}
	err := d.inNetNS(func() error {
		iface, err := net.InterfaceByName(ifname)
		if err != nil {
			return err
		}
		path, reason, err := d.attachUplinkPath(iface)
		if err != nil {
			return err
		}
		if err := d.attachHook(iface, hookUplinkEgress, d.tcEgressProg, xdpDriverOnly); err != nil {
			return fmt.Errorf("%s: %w", hookUplinkEgress, err)
		}
		if err := d.putIface(iface, tcIfaceKindIFACE_UPLINK); err != nil {
			return err
		}
		d.uplinkReasons[ifname] = reason
		d.log.Info("uplink path", "interface", ifname, "path", path, "reason", reason)
		return nil
	})
	if err != nil {
		return fmt.Errorf("attach to uplink %s: %w", ifname, err)
	}
	return nil
}

// attachUplinkPath attaches the ingress programs of iface's path and
// removes the other path's, and returns the path and why.
//   - xdp: xdp_lb first (until it is in place, a tc_uplink_lb left by an
//     earlier agent keeps balancing), then tc_uplink;
//   - tc: tc_uplink_lb first (it also finishes XDP handovers in flight),
//     then xdp_lb is detached.
func (d *attacher) attachUplinkPath(iface *net.Interface) (UplinkPath, string, error) {
	path, reason := d.opts.UplinkPath, "forced (uplink path option)"
	modes := xdpDriverOrGeneric
	if path == UplinkAuto {
		path, reason = probeUplink(iface)
		modes = xdpDriverOnly
	}
	if path == UplinkXDP {
		err := d.attachHook(iface, hookXDP, d.xdpProg, modes)
		switch {
		case err != nil && modes == xdpDriverOnly:
			// Generic XDP has the same transmit problem and costs more
			// than tc.
			path, reason = UplinkTC, fmt.Sprintf("no native XDP (%v)", err)
		case err != nil:
			return "", "", fmt.Errorf("%s: %w", hookXDP, err)
		default:
			if err := d.attachHook(iface, hookUplink, d.uplinkProg, modes); err != nil {
				return "", "", fmt.Errorf("%s: %w", hookUplink, err)
			}
			return UplinkXDP, reason, nil
		}
	}
	if err := d.attachHook(iface, hookUplink, d.uplinkLBProg, modes); err != nil {
		return "", "", fmt.Errorf("%s: %w", hookUplink, err)
	}
	if err := d.unpinLink(hookXDP, iface.Name, false); err != nil {
		return "", "", err
	}
	return UplinkTC, reason, nil
}

// probeUplink chooses the path of iface (in the datapath's namespace)
// and says why:
//   - a veth: XDP when its peer has a native XDP program, whose NAPI
//     instance takes the frames XDP transmits into it; tc otherwise, and
//     when the peer cannot be inspected (its namespace is not reachable
//     from here, as for a node in a container whose peer is on the host).
//     GRO on the peer gives it a NAPI instance too, but on Linux 6.18 a
//     connection through XDP_TX into such a peer still loses segments
//     (measured: TestUplinkPathDelivers), so GRO alone chooses tc;
//   - any other device: XDP, where native XDP attaches (the caller falls
//     back to tc where it does not).
func probeUplink(iface *net.Interface) (UplinkPath, string) {
	l, err := netlink.LinkByIndex(iface.Index)
	if err != nil {
		return UplinkTC, fmt.Sprintf("cannot read the link (%v)", err)
	}
	if _, ok := l.(*netlink.Veth); !ok {
		return UplinkXDP, "native XDP (" + l.Type() + ")"
	}
	peer, err := inspectVethPeer(l.Attrs())
	if err != nil {
		return UplinkTC, fmt.Sprintf("veth peer not inspectable (%v)", err)
	}
	if peer.xdp {
		return UplinkXDP, "veth peer " + peer.name + " has a native XDP program"
	}
	return UplinkTC, "veth peer " + peer.name + " has no native XDP program: XDP_TX into it would be lost"
}

// vethPeer is what probeUplink needs to know of a veth's peer.
type vethPeer struct {
	name string
	xdp  bool
}

// inspectVethPeer reads the peer of the veth with attrs: its ifindex is
// IFLA_LINK, in the namespace IFLA_LINK_NETNSID names (none: this one).
func inspectVethPeer(attrs *netlink.LinkAttrs) (vethPeer, error) {
	if attrs.ParentIndex == 0 {
		return vethPeer{}, errors.New("no peer index")
	}
	read := func() (vethPeer, error) {
		pl, err := netlink.LinkByIndex(attrs.ParentIndex)
		if err != nil {
			return vethPeer{}, fmt.Errorf("peer %d: %w", attrs.ParentIndex, err)
		}
		p := vethPeer{name: pl.Attrs().Name}
		if x := pl.Attrs().Xdp; x != nil && x.Attached && x.AttachMode == nlXDPAttachedDrv {
			p.xdp = true
		}
		return p, nil
	}
	if attrs.NetNsID < 0 {
		return read()
	}
	path, err := netnsByID(attrs.NetNsID)
	if err != nil {
		return vethPeer{}, err
	}
	var p vethPeer
	err = netns.RunIn(path, func() error {
		var err error
		p, err = read()
		return err
	})
	if err == nil {
		p.name += " (in " + path + ")"
	}
	return p, err
}

// nlXDPAttachedDrv is XDP_ATTACHED_DRV (IFLA_XDP_ATTACHED), and
// nlXDPAttachedSKB XDP_ATTACHED_SKB.
const (
	nlXDPAttachedDrv = 1
	nlXDPAttachedSKB = 2
)

// netnsByID finds a file of the network namespace that the calling
// thread's namespace knows as nsid: among the named namespaces and the
// processes' namespaces visible here.
func netnsByID(nsid int) (string, error) {
	candidates, _ := filepath.Glob("/run/netns/*")
	procs, _ := filepath.Glob("/proc/[0-9]*/ns/net")
	candidates = append(candidates, procs...)
	seen := map[uint64]bool{}
	for _, path := range candidates {
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil || seen[st.Ino] {
			continue
		}
		seen[st.Ino] = true
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		id, err := netlink.GetNetNsIdByFd(int(f.Fd()))
		f.Close()
		if err == nil && id == nsid {
			return path, nil
		}
	}
	return "", fmt.Errorf("no visible network namespace has nsid %d", nsid)
}

// Uplinks reads back from the kernel the path of every uplink with a
// pinned topolb link, sorted by interface.
func (d *attacher) Uplinks() ([]UplinkStatus, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	ifaces, err := d.attached()
	if err != nil {
		return nil, err
	}
	var out []UplinkStatus
	err = d.inNetNS(func() error {
		for _, ifname := range ifaces {
			st, ok, err := d.uplinkStatus(ifname)
			if err != nil {
				return err
			}
			if ok {
				out = append(out, st)
			}
		}
		return nil
	})
	return out, err
}

// uplinkStatus reads ifname's programs: ok is false for an interface
// without uplink links (a pod's).
func (d *attacher) uplinkStatus(ifname string) (st UplinkStatus, ok bool, err error) {
	st = UplinkStatus{Interface: ifname, Reason: d.uplinkReasons[ifname]}
	var tcName string
	for _, h := range []hook{hookXDP, hookUplink, hookUplinkEgress} {
		name, mode, found, err := d.pinnedProgram(h, ifname)
		if err != nil {
			return st, false, err
		}
		if !found {
			continue
		}
		ok = true
		if h == hookUplink {
			tcName = name
		}
		if h == hookXDP {
			name += "/" + mode
			switch mode {
			case "driver":
				st.Path = string(UplinkXDP)
			case "generic":
				st.Path = UplinkPathXDPGeneric
			}
		}
		st.Programs = append(st.Programs, name)
	}
	switch {
	case !ok:
	case st.Path != "" && tcName == uplinkProgTcUplink:
	case st.Path == "" && tcName == uplinkProgTcUplinkLb:
		st.Path = string(UplinkTC)
	default:
		st.Path = UplinkPathIncomplete
	}
	return st, ok, nil
}

// pinnedProgram returns the name of the program attached at h on ifname
// (by the link h pinned for it or, for a tc hook, by topolb's tc filter)
// and, for XDP, the attach mode as the interface reports it ("driver",
// "generic", or the number). found is false without either.
func (d *attacher) pinnedProgram(h hook, ifname string) (name, mode string, found bool, err error) {
	id, found, err := d.hookProgram(h, ifname)
	if !found || err != nil {
		return "", "", found, err
	}
	name = d.programName(id)
	if h != hookXDP {
		return name, "", true, nil
	}
	nl, err := netlink.LinkByName(ifname)
	if err != nil {
		return "", "", false, fmt.Errorf("link %s: %w", ifname, err)
	}
	switch x := nl.Attrs().Xdp; {
	case x == nil || !x.Attached:
		mode = "detached"
	case x.AttachMode == nlXDPAttachedDrv:
		mode = "driver"
	case x.AttachMode == nlXDPAttachedSKB:
		mode = "generic"
	default:
		mode = strconv.Itoa(int(x.AttachMode))
	}
	return name, mode, true, nil
}

// hookProgram returns the id of the program attached at h on ifname: by
// the link pinned for it, else (tc hooks) by topolb's tc filter.
func (d *attacher) hookProgram(h hook, ifname string) (id ebpf.ProgramID, found bool, err error) {
	l, err := link.LoadPinnedLink(d.linkPin(h, ifname), nil)
	if errors.Is(err, os.ErrNotExist) {
		if !tcHook(h) {
			return 0, false, nil
		}
		return filterProgram(ifname, h)
	}
	if err != nil {
		return 0, false, fmt.Errorf("load pinned %s link of %s: %w", h, ifname, err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return 0, false, fmt.Errorf("%s link of %s: %w", h, ifname, err)
	}
	return info.Program, true, nil
}

// programName names the program with kernel id: one of this process's
// uplink programs, or "program <id>" (another process's; opening it by id
// would take CAP_SYS_ADMIN, which the agent does not have).
func (d *attacher) programName(id ebpf.ProgramID) string {
	for name, p := range map[string]*ebpf.Program{
		xdpProgXdpLb: d.xdpProg, uplinkProgTcUplink: d.uplinkProg,
		uplinkProgTcUplinkLb: d.uplinkLBProg, tcProgTcLbEgress: d.tcEgressProg,
	} {
		if info, err := p.Info(); err == nil {
			if pid, ok := info.ID(); ok && pid == id {
				return name
			}
		}
	}
	return fmt.Sprintf("program %d", id)
}
