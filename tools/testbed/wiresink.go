package testbed

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"

	"github.com/topolb/topolb/internal/netns"
)

// SwitchPort returns the name of the node's port on the switch, in the
// fabric namespace: the veth peer of its uplink.
func (n *Node) SwitchPort() string { return fmt.Sprintf("n%d", n.Index) }

// WireSink measures what one node alone forwards: an XDP program on the
// node's switch port, where its uplink's frames arrive first, drops and
// counts the UDP datagrams the node sends onto the wire to Want (a flood
// translated to its backend) or to Stray (the flood's own target, not
// translated), and passes every other frame on to the bridge. Neither the
// bridge nor the next node's stack is then on a flood's path, and the
// next node sees none of it. While it is attached, the node's switch port
// keeps its NAPI instance (napiForXDP), so the node's XDP_TX still works.
type WireSink struct {
	tb     *Testbed
	node   *Node
	port   string
	counts *ebpf.Map
}

// SinkCounts are the datagrams a WireSink has dropped so far.
type SinkCounts struct {
	// Want counts those to the address the sink was attached for.
	Want uint64
	// Stray counts those to its stray address.
	Stray uint64
}

// Indices of the sink program's counters.
const (
	sinkWant  = 0
	sinkStray = 1
)

// AttachWireSink attaches a WireSink to n's switch port for UDP datagrams
// to want and stray (IPv4 both), in place of the port's pass program.
// Close puts the port back as it was.
func (tb *traffic) AttachWireSink(n *Node, want, stray netip.AddrPort) (_ *WireSink, err error) {
	if !want.Addr().Is4() || !stray.Addr().Is4() {
		return nil, fmt.Errorf("wire sink for %s and %s: IPv4 addresses only", want, stray)
	}
	counts, err := ebpf.NewMap(&ebpf.MapSpec{Name: "testbed_sink", Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 8, MaxEntries: 2})
	if err != nil {
		return nil, fmt.Errorf("create the wire sink's counters: %w", err)
	}
	defer func() {
		if err != nil {
			counts.Close()
		}
	}()
	prog, err := sinkProgram(want, stray, counts)
	if err != nil {
		return nil, err
	}
	// The attachment is netlink's, as napiForXDP's: it outlives prog's
	// file descriptor.
	defer prog.Close()
	s := &WireSink{tb: tb.Testbed, node: n, port: n.SwitchPort(), counts: counts}
	if err := tb.setXDP(s.port, prog.FD()); err != nil {
		return nil, fmt.Errorf("attach the wire sink to %s: %w", s.port, err)
	}
	return s, nil
}

// setXDP attaches the XDP program fd to the switch port (fd -1 detaches).
func (tb *traffic) setXDP(port string, fd int) error {
	l, err := tb.Fabric.Netlink().LinkByName(port)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", tb.Fabric.Name, port, err)
	}
	// The package-level call talks to the calling thread's namespace.
	return tb.Fabric.Do(func() error { return netlink.LinkSetXdpFdWithFlags(l, fd, nl.XDP_FLAGS_DRV_MODE) })
}

// Close detaches the sink and gives the port back its pass program (none
// with Options.PlainSwitchPorts).
func (s *WireSink) Close() error {
	var err error
	if s.tb.plainPorts {
		err = s.tb.setXDP(s.port, -1)
	} else {
		err = napiForXDP(s.tb.Fabric, s.port)
	}
	if err != nil {
		err = fmt.Errorf("take the wire sink off %s: %w", s.port, err)
	}
	return errors.Join(err, s.counts.Close())
}

// Counts returns the datagrams dropped so far, summed over the CPUs.
func (s *WireSink) Counts() (SinkCounts, error) {
	var c SinkCounts
	for key, into := range map[uint32]*uint64{sinkWant: &c.Want, sinkStray: &c.Stray} {
		var perCPU []uint64
		if err := s.counts.Lookup(key, &perCPU); err != nil {
			return c, fmt.Errorf("read the wire sink's counter %d: %w", key, err)
		}
		for _, v := range perCPU {
			*into += v
		}
	}
	return c, nil
}

// CountArrivals runs flood and sets the result's Arrived and Stray to the
// datagrams the sink dropped meanwhile (see the package's CountArrivals),
// and WireDrops to the frames the node's uplink and its switch port
// counted as dropped meanwhile.
func (s *WireSink) CountArrivals(flood func() (FloodResult, error)) (FloodResult, error) {
	dropsBefore, err := s.wireDrops()
	if err != nil {
		return FloodResult{}, err
	}
	before, after, res, err := arrivals(s.Counts, flood)
	if err != nil {
		return res, err
	}
	dropsAfter, err := s.wireDrops()
	if err != nil {
		return res, err
	}
	if res.Arrived, err = netns.Growth(before.Want, after.Want); err == nil {
		if res.Stray, err = netns.Growth(before.Stray, after.Stray); err == nil {
			res.WireDrops, err = netns.Growth(dropsBefore, dropsAfter)
		}
	}
	if err != nil {
		return res, fmt.Errorf("wire sink on %s: %w", s.port, err)
	}
	return res, nil
}

// wireDrops is the sum of the receive and transmit drop counters of the
// node's uplink and its switch port (a veth counts there the frames its
// ring had no room for).
func (s *WireSink) wireDrops() (uint64, error) {
	var total uint64
	for _, i := range []iface{{s.node.NS, UplinkName}, {s.tb.Fabric, s.port}} {
		l, err := i.ns.Netlink().LinkByName(i.name)
		if err != nil {
			return 0, fmt.Errorf("%s: link %s: %w", i.ns.Name, i.name, err)
		}
		st := l.Attrs().Statistics
		if st == nil {
			return 0, fmt.Errorf("%s: link %s has no statistics", i.ns.Name, i.name)
		}
		total += st.RxDropped + st.TxDropped
	}
	return total, nil
}

// sinkProgram is the WireSink's XDP program: an IPv4 UDP datagram (a
// 20-byte header: one with options is not a flood's) to want counts in
// counts[sinkWant], one to stray in counts[sinkStray], and either is
// dropped; every other frame passes. Addresses and ports are compared as
// the frame carries them (network byte order), loaded in the machine's.
func sinkProgram(want, stray netip.AddrPort, counts *ebpf.Map) (*ebpf.Program, error) {
	insns := asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, 0, asm.Word), // data
		asm.LoadMem(asm.R3, asm.R1, 4, asm.Word), // data_end
	}
	insns = append(insns, ipv4UDP("pass")...)
	insns = append(insns,
		asm.LoadMem(asm.R4, asm.R2, offDaddr, asm.Word),
		asm.LoadMem(asm.R5, asm.R2, offDport, asm.Half),
		asm.Mov.Imm(asm.R6, sinkWant),
		asm.JNE.Imm32(asm.R4, be32(want.Addr()), "stray"),
		asm.JEq.Imm32(asm.R5, be16(want.Port()), "count"),
		asm.Mov.Imm(asm.R6, sinkStray).WithSymbol("stray"),
		asm.JNE.Imm32(asm.R4, be32(stray.Addr()), "pass"),
		asm.JNE.Imm32(asm.R5, be16(stray.Port()), "pass"),
		// counts[r6] += 1 (per CPU: no atomics).
		asm.StoreMem(asm.RFP, -4, asm.R6, asm.Word).WithSymbol("count"),
		asm.LoadMapPtr(asm.R1, counts.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "drop"),
		asm.LoadMem(asm.R1, asm.R0, 0, asm.DWord),
		asm.Add.Imm(asm.R1, 1),
		asm.StoreMem(asm.R0, 0, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R0, xdpDrop).WithSymbol("drop"),
		asm.Return(),
		asm.Mov.Imm(asm.R0, xdpPass).WithSymbol("pass"),
		asm.Return(),
	)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "testbed_sink", Type: ebpf.XDP, Instructions: insns, License: "GPL"})
	if err != nil {
		return nil, fmt.Errorf("load the wire sink program: %w", err)
	}
	return prog, nil
}

// FloodWire sends count UDP datagrams from the outside client e to target
// into node n's uplink, as the wire delivers the router's frames: a
// live-frame test run on n's switch port that sends each frame out of it
// (XDP_TX), so n's uplink receives it as a frame from its peer (its XDP
// program, if any, runs on it) and neither the router nor the bridge is
// on the path. A veth takes frames sent that way only with a NAPI
// instance, which a real NIC always has: an uplink with no XDP program of
// its own (kube-proxy's node, an agent on the tc path) gets napiForXDP's
// pass program for the flood's duration. The frames carry the router's
// MAC address as source.
func (tb *traffic) FloodWire(e *External, n *Node, target netip.AddrPort, count int) (FloodResult, error) {
	var res FloodResult
	err := withUplinkNAPI(n, func() error {
		var err error
		res, err = floodUDP(injection{at: iface{tb.Fabric, n.SwitchPort()}, action: xdpTX, src: iface{e.Router.NS, UplinkName}, dst: iface{n.NS, UplinkName}},
			netip.AddrPortFrom(e.Addr, floodSourcePort), target, count)
		return err
	})
	return res, err
}

// withUplinkNAPI runs fn while n's uplink has a NAPI instance: its own
// driver-mode XDP program, or napiForXDP's for fn's duration.
func withUplinkNAPI(n *Node, fn func() error) error {
	l, err := n.NS.Netlink().LinkByName(UplinkName)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", n.NS.Name, UplinkName, err)
	}
	switch xdp := l.Attrs().Xdp; {
	case xdp != nil && xdp.AttachMode == nl.XDP_ATTACHED_DRV:
		return fn()
	case xdp != nil && xdp.Attached:
		return fmt.Errorf("%s: %s has an XDP program in attach mode %d, not driver mode: no NAPI instance takes frames sent into it", n.NS.Name, UplinkName, xdp.AttachMode)
	}
	if err := napiForXDP(n.NS, UplinkName); err != nil {
		return err
	}
	err = fn()
	detach := n.NS.Do(func() error { return netlink.LinkSetXdpFdWithFlags(l, -1, nl.XDP_FLAGS_DRV_MODE) })
	if detach != nil {
		detach = fmt.Errorf("%s: detach the pass program from %s: %w", n.NS.Name, UplinkName, detach)
	}
	return errors.Join(err, detach)
}
