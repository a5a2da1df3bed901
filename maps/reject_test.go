package maps

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Verdicts of a reject.
const (
	rejectedTC  = 7 // TC_ACT_REDIRECT: bpf_redirect back out of the veth
	rejectedXDP = 3 // XDP_TX: back out of the uplink
)

const (
	vipRejectTCP = "10.96.0.12:80"
	vipRejectUDP = "10.96.0.12:53"
	vipDropUDP   = "10.96.0.13:53"
	extReject    = "192.0.2.12:80"
	extReject6   = "[2001:db8:ff::12]:80"
)

// reply renders what a reject must look like, independently of the
// datapath: Ethernet back to the sender (the builder's frames go macA ->
// macB), then for IPv4 a header without options, id 0, TTL 64, DF for
// TCP, for IPv6 a fixed header with hop limit 64, and l4 with its
// checksum computed here (ICMPv6's over the pseudo-header, RFC 4443 2.3).
func reply(src, dst netip.Addr, proto uint8, l4 []byte) []byte {
	l4 = append([]byte(nil), l4...)
	switch proto {
	case protoTCP:
		binary.BigEndian.PutUint16(l4[16:], csum(pseudoOf(src, dst, protoTCP, len(l4)), l4))
	case protoICMP:
		binary.BigEndian.PutUint16(l4[2:], csum(0, l4))
	case v6ICMP:
		binary.BigEndian.PutUint16(l4[2:], csum(pseudoOf(src, dst, v6ICMP, len(l4)), l4))
	}
	b := append(append([]byte(nil), macA[:]...), macB[:]...)
	if src.Is6() {
		b = append(b, 0x86, 0xdd)
		return append(append(b, ipv6Header(src, dst, 64, proto, len(l4))...), l4...)
	}
	b = append(b, 0x08, 0x00)
	ip := make([]byte, 20)
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(20+len(l4)))
	if proto == protoTCP {
		binary.BigEndian.PutUint16(ip[6:], 0x4000)
	}
	ip[8] = 64
	ip[9] = proto
	s4, d4 := src.As4(), dst.As4()
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	binary.BigEndian.PutUint16(ip[10:], csum(0, ip))
	return append(append(b, ip...), l4...)
}

// l3HeaderLen is the length of the IP header of the rendered frame b: its
// IHL for IPv4, the fixed 40 bytes for IPv6 (the builder adds no
// extension headers).
func l3HeaderLen(b []byte) int {
	if binary.BigEndian.Uint16(b[12:]) == 0x86dd {
		return 40
	}
	return int(b[14]&0xf) * 4
}

// resetFor is the reset RFC 9293 asks for in answer to seg, from its
// destination: seq = its ack when it has ACK, else RST+ACK acknowledging
// its data, SYN and FIN.
func resetFor(seg frame) []byte {
	in := seg.bytes()
	hlen := l3HeaderLen(in)
	th := in[14+hlen:]
	dataLen := len(in) - 14 - hlen - int(th[12]>>4)*4
	l4 := make([]byte, 20)
	binary.BigEndian.PutUint16(l4[0:], seg.dst.Port())
	binary.BigEndian.PutUint16(l4[2:], seg.src.Port())
	l4[12] = 5 << 4
	if seg.tcpFlags&tcpACK != 0 {
		copy(l4[4:8], th[8:12])
		l4[13] = tcpRST
	} else {
		n := uint32(dataLen)
		if seg.tcpFlags&tcpSYN != 0 {
			n++
		}
		if seg.tcpFlags&tcpFIN != 0 {
			n++
		}
		binary.BigEndian.PutUint32(l4[8:], binary.BigEndian.Uint32(th[4:])+n)
		l4[13] = tcpRST | tcpACK
	}
	return reply(seg.dst.Addr(), seg.src.Addr(), protoTCP, l4)
}

// The ICMPv6 port unreachable (RFC 4443 3.1) and the longest quote an
// ICMPv6 error carries: what fits in the minimum MTU, 1280 bytes, after
// the IPv6 and ICMPv6 headers (RFC 4443 2.4 (c)).
const (
	icmp6DestUnreach  = 1
	icmp6PortUnreach  = 4
	icmp6MaxQuote     = 1280 - 40 - 8
	icmp6PacketTooBig = 2
	icmp6TimeExceeded = 3
)

// unreachableFor is the port unreachable for the datagram dg, from its
// destination: ICMP quoting its IPv4 header and first 8 bytes (RFC 792),
// or ICMPv6 quoting as much of the IPv6 packet as fits in the minimum
// MTU.
func unreachableFor(dg frame) []byte {
	ip := dg.bytes()[14:]
	if dg.is6() {
		quote := ip[:min(len(ip), icmp6MaxQuote)]
		l4 := append([]byte{icmp6DestUnreach, icmp6PortUnreach, 0, 0, 0, 0, 0, 0}, quote...)
		return reply(dg.dst.Addr(), dg.src.Addr(), v6ICMP, l4)
	}
	quote := ip[:int(ip[0]&0xf)*4+8]
	l4 := append([]byte{icmpDestUnreach, icmpPortUnreach, 0, 0, 0, 0, 0, 0}, quote...)
	return reply(dg.dst.Addr(), dg.src.Addr(), protoICMP, l4)
}

// rejectAddrs are the reject tables' frontends in one family: two reject
// frontends (TCP and UDP on one address) and a UDP frontend empty by
// policy (no reject).
type rejectAddrs struct {
	rejectTCP, rejectUDP, dropUDP string
}

// rejectFamilies are the families tc on pod veths rejects in, IPv4 first,
// beside tcFamilies' clients.
var rejectFamilies = []rejectAddrs{
	{vipRejectTCP, vipRejectUDP, vipDropUDP},
	{"[fd00:96::12]:80", "[fd00:96::12]:53", "[fd00:96::13]:53"},
}

func setupRejects(t *testing.T) *Datapath {
	d := newDatapath(t, Options{})
	for _, a := range rejectFamilies {
		mustSetService(t, d, fe(a.rejectTCP, TCP), Service{Reject: true})
		mustSetService(t, d, fe(a.rejectUDP, UDP), Service{Reject: true})
		mustSetService(t, d, fe(a.dropUDP, UDP), Service{})
	}
	mustSetService(t, d, Frontend{Addr: netip.MustParseAddrPort(extReject), Proto: TCP, Scope: ScopeExternal}, Service{Reject: true})
	mustSetService(t, d, Frontend{Addr: netip.MustParseAddrPort(extReject), Proto: UDP, Scope: ScopeExternal}, Service{Reject: true})
	mustSetService(t, d, Frontend{Addr: netip.MustParseAddrPort(extReject6), Proto: TCP, Scope: ScopeExternal}, Service{Reject: true})
	mustSetService(t, d, Frontend{Addr: netip.MustParseAddrPort(extReject6), Proto: UDP, Scope: ScopeExternal}, Service{Reject: true})
	return d
}

// runFrame feeds one frame through prog and returns the verdict and the
// whole output frame, whatever its length.
func runFrame(t *testing.T, prog *ebpf.Program, in []byte) (uint32, []byte) {
	t.Helper()
	opts := ebpf.RunOptions{Data: in, DataOut: make([]byte, len(in)+512)}
	ret, err := prog.Run(&opts)
	if err != nil {
		t.Fatalf("test run: %v", err)
	}
	return ret, opts.DataOut
}

// rejectCase is one packet to a reject frontend: want is the answer sent
// back, nil for a drop, empty for an untouched pass.
type rejectCase struct {
	name  string
	hook  hook
	in    frame
	want  []byte
	stats stats
}

// tcRejectRows are the pod-veth rows of TestRejects in one family: its
// clients a, its reject frontends r.
func tcRejectRows(fam string, a tcAddrs, r rejectAddrs) []rejectCase {
	syn := tcpFrame(a.client, r.rejectTCP, tcpSYN, "")
	synData := tcpFrame(a.client2, r.rejectTCP, tcpSYN, "data on a SYN")
	ack := tcpFrame(a.client, r.rejectTCP, tcpACK|tcpPSH, "mid-flow")
	fin := tcpFrame(a.client, r.rejectTCP, tcpFIN, "bye") // FIN without ACK: acknowledged
	rst := tcpFrame(a.client, r.rejectTCP, tcpRST, "")
	udp := udpFrame(a.client3, r.rejectUDP, "a query long enough to be cut in the quote")
	udpTiny := udpFrame(a.client, r.rejectUDP, "")
	rows := []rejectCase{
		{"tc_syn_reset", hookTC, syn, resetFor(syn), stats{StatReject: 1}},
		{"tc_syn_with_data", hookTC, synData, resetFor(synData), stats{StatReject: 1}},
		{"tc_midflow_segment_reset_at_its_ack", hookTC, ack, resetFor(ack), stats{StatReject: 1, StatTCPMidflowMiss: 1}},
		{"tc_fin_acknowledged", hookTC, fin, resetFor(fin), stats{StatReject: 1, StatTCPMidflowMiss: 1}},
		{"tc_reset_never_answered", hookTC, rst, nil, stats{StatDropNoBackend: 1, StatTCPMidflowMiss: 1}},
		{"tc_udp_port_unreachable", hookTC, udp, unreachableFor(udp), stats{StatReject: 1}},
		{"tc_udp_empty_datagram_grows", hookTC, udpTiny, unreachableFor(udpTiny), stats{StatReject: 1}},
		{"tc_drop_frontend_keeps_dropping", hookTC, udpFrame(a.client, r.dropUDP, "q"), nil, stats{StatDropNoBackend: 1}},
	}
	if fam == "ipv4" {
		synOpts := synData
		synOpts.ipOptions = []byte{1, 1, 1, 0}
		udpOpts := udpFrame(a.client3, r.rejectUDP, "q")
		udpOpts.ipOptions = []byte{1, 1, 1, 1, 1, 1, 1, 0}
		rows = append(rows,
			rejectCase{"tc_syn_with_data_and_ip_options", hookTC, synOpts, resetFor(synOpts), stats{StatReject: 1}},
			rejectCase{"tc_udp_quote_keeps_ip_options", hookTC, udpOpts, unreachableFor(udpOpts), stats{StatReject: 1}})
	} else {
		// The quote is as much of the datagram as fits in the minimum
		// MTU: an odd length, a whole 1232 bytes, and a longer
		// datagram cut there.
		odd := udpFrame(a.client3, r.rejectUDP, "odd")
		whole := udpFrame(a.client3, r.rejectUDP, strings.Repeat("w", icmp6MaxQuote-40-8))
		cut := udpFrame(a.client3, r.rejectUDP, strings.Repeat("c", 1400))
		rows = append(rows,
			rejectCase{"tc_udp_odd_quote", hookTC, odd, unreachableFor(odd), stats{StatReject: 1}},
			rejectCase{"tc_udp_quote_fills_minimum_mtu", hookTC, whole, unreachableFor(whole), stats{StatReject: 1}},
			rejectCase{"tc_udp_quote_cut_at_minimum_mtu", hookTC, cut, unreachableFor(cut), stats{StatReject: 1}})
	}
	for i := range rows {
		rows[i].name = fam + "/" + rows[i].name
	}
	return rows
}

// hookXDPPath selects, in TestRejects, the XDP path of an uplink as a
// whole: xdp_lb, then tc_uplink on the frame it passed up; the counters
// are both programs'.
const hookXDPPath hook = "xdp-path"

// TestRejects answers new flows to empty reject frontends from pods (tc,
// in both families) and from northClient (XDP, and the uplinks' tc path;
// from outside over IPv6, tc_uplink beside XDP, which passes it up):
// resets for TCP segments (never for a reset), port unreachables for UDP
// (ICMP, ICMPv6), from the frontend, back where they came from; frontends
// empty by policy keep dropping.
func TestRejects(t *testing.T) {
	d := setupRejects(t)
	extSyn := tcpFrame(northClient, extReject, tcpSYN, "")
	extUDP := udpFrame(northClient, "192.0.2.12:80", "q")
	// IPv6 from outside: XDP passes it up, and tc_uplink beside it
	// answers (xdp_lb.c says why).
	ext6Syn := tcpFrame("[2001:db8:113::10]:41000", extReject6, tcpSYN, "")
	ext6UDP := udpFrame("[2001:db8:113::10]:41001", extReject6, "q")
	ext6Ack := tcpFrame("[2001:db8:113::10]:41002", extReject6, tcpACK|tcpPSH, "mid-flow")
	var rows []rejectCase
	for i, fam := range tcFamilies {
		rows = append(rows, tcRejectRows(fam.name, fam.addrs, rejectFamilies[i])...)
	}
	for _, c := range append(rows, []rejectCase{
		{"xdp_syn_reset", hookXDP, extSyn, resetFor(extSyn), stats{StatReject: 1}},
		{"xdp_udp_port_unreachable", hookXDP, extUDP, unreachableFor(extUDP), stats{StatReject: 1}},
		{"xdp_internal_frontend_not_matched", hookXDP, tcpFrame(northClient, vipRejectTCP, tcpSYN, ""), []byte{}, nil},
		{"uplink_tc_syn_reset", hookUplinkTC, extSyn, resetFor(extSyn), stats{StatReject: 1}},
		{"uplink_tc_udp_port_unreachable", hookUplinkTC, extUDP, unreachableFor(extUDP), stats{StatReject: 1}},
		{"uplink_tc_internal_frontend_not_matched", hookUplinkTC, tcpFrame(northClient, vipRejectTCP, tcpSYN, ""), []byte{}, nil},
		{"xdp_ipv6_syn_passed_to_tc_uplink", hookXDP, ext6Syn, []byte{}, nil},
		{"xdp_ipv6_udp_passed_to_tc_uplink", hookXDP, ext6UDP, []byte{}, nil},
		{"tc_uplink_beside_xdp_ipv6_syn_reset", hookUplinkBesideXDP, ext6Syn, resetFor(ext6Syn), stats{StatReject: 1}},
		{"tc_uplink_beside_xdp_ipv6_udp_port_unreachable", hookUplinkBesideXDP, ext6UDP, unreachableFor(ext6UDP), stats{StatReject: 1}},
		{"uplink_tc_ipv6_syn_reset", hookUplinkTC, ext6Syn, resetFor(ext6Syn), stats{StatReject: 1}},
		// The XDP path as the kernel runs it: xdp_lb, then tc_uplink
		// on what it passed up. A segment without SYN is one mid-flow
		// miss, counted by tc_uplink alone.
		{"xdp_path_ipv6_syn_reset", hookXDPPath, ext6Syn, resetFor(ext6Syn), stats{StatReject: 1}},
		{"xdp_path_ipv6_midflow_counted_once", hookXDPPath, ext6Ack, resetFor(ext6Ack), stats{StatReject: 1, StatTCPMidflowMiss: 1}},
		{"uplink_tc_ipv6_midflow_counted_once", hookUplinkTC, ext6Ack, resetFor(ext6Ack), stats{StatReject: 1, StatTCPMidflowMiss: 1}},
	}...) {
		t.Run(c.name, func(t *testing.T) {
			prog, answered, dropped, passed := d.tcProg, uint32(rejectedTC), uint32(tcShot), uint32(tcOK)
			switch c.hook {
			case hookXDP:
				prog, answered, dropped, passed = d.xdpProg, rejectedXDP, xdpDrop, xdpPass
			case hookUplinkTC:
				// Back out of the uplink: bpf_redirect to its egress.
				prog = d.uplinkLBProg
			case hookUplinkBesideXDP:
				prog = d.uplinkProg
			}
			before, err := d.Counters()
			must(t, err)
			in := c.in.bytes()
			var ret uint32
			var out []byte
			if c.hook == hookXDPPath {
				// xdp_lb must pass the frame up untouched.
				if ret, out = runFrame(t, d.xdpProg, in); ret != xdpPass || !bytes.Equal(out, in) {
					t.Fatalf("xdp_lb: verdict %d, want an untouched pass (%d)", ret, xdpPass)
				}
				prog = d.uplinkProg
			}
			ret, out = runFrame(t, prog, in)
			after, err := d.Counters()
			must(t, err)
			switch {
			case c.want == nil:
				if ret != dropped {
					t.Errorf("verdict %d, want drop (%d)", ret, dropped)
				}
			case len(c.want) == 0:
				if ret != passed || !bytes.Equal(out, in) {
					t.Errorf("verdict %d, want an untouched pass (%d)", ret, passed)
				}
			default:
				if ret != answered {
					t.Errorf("verdict %d, want the answer sent back (%d)", ret, answered)
				}
				if !bytes.Equal(out, c.want) {
					t.Errorf("answer differs\n got %x\nwant %x", out, c.want)
				}
				verify := func(b []byte) error { _, err := verifyChecksums(b); return err }
				if c.in.proto == protoUDP {
					verify = verifyICMP
				}
				if err := verify(out); err != nil {
					t.Errorf("answer checksums: %v", err)
				}
			}
			for s := Stat(0); int(s) < numStats; s++ {
				if got := after.Stats[s] - before.Stats[s]; got != c.stats[s] {
					t.Errorf("%s delta = %d, want %d", s, got, c.stats[s])
				}
			}
		})
	}
}

// TestRejectRateLimit sends rejects back to back on one CPU, on each hook
// and in each family tc answers: the first
// RejectBurst are answered, then about one per 1/RejectRate s of elapsed
// time, and the rest are dropped and counted.
func TestRejectRateLimit(t *testing.T) {
	d := setupRejects(t)
	for _, c := range []struct {
		name string
		prog *ebpf.Program
		in   frame
	}{
		{"tc", d.tcProg, tcpFrame(client, vipRejectTCP, tcpSYN, "")},
		// IPv6 draws on the same budget, with its port unreachables.
		{"tc_ipv6", d.tcProg, udpFrame(tcFamilies[1].addrs.client, rejectFamilies[1].rejectUDP, "q")},
		{"xdp", d.xdpProg, tcpFrame(northClient, extReject, tcpSYN, "")},
	} {
		t.Run(c.name, func(t *testing.T) {
			// The budget is per CPU: every frame must run on one. The
			// subtest is a goroutine of its own, so it pins itself (a
			// pin of the parent's thread would leave it free to move,
			// and a run over two CPUs answers up to two bursts).
			defer pinOneCPU(t)()
			prog, in := c.prog, c.in.bytes()
			// Let the budget fill: it refills in REJECT_BURST/REJECT_RATE.
			time.Sleep(time.Duration(RejectBurst) * time.Second / time.Duration(RejectRate) * 2)
			before, err := d.Counters()
			must(t, err)
			const sent = 4 * 50
			start := time.Now()
			for i := 0; i < sent; i++ {
				runFrame(t, prog, in)
			}
			elapsed := time.Since(start)
			after, err := d.Counters()
			must(t, err)
			answered := after.Stats[StatReject] - before.Stats[StatReject]
			limited := after.Stats[StatRejectLimited] - before.Stats[StatRejectLimited]
			// The coarse clock ticks every few ms: allow a tick of refill.
			most := uint64(RejectBurst) + uint64((elapsed+10*time.Millisecond)*time.Duration(RejectRate)/time.Second)
			t.Logf("%d sent in %s: %d answered, %d limited (at most %d may be answered)", sent, elapsed, answered, limited, most)
			if answered+limited != sent {
				t.Errorf("answered %d + limited %d != sent %d", answered, limited, sent)
			}
			if answered < uint64(RejectBurst) || answered > most {
				t.Errorf("answered %d, want %d (the burst) to %d", answered, RejectBurst, most)
			}
		})
	}
}

// pinOneCPU locks the calling goroutine to its thread and that thread to
// one CPU it may run on; the returned function undoes both.
func pinOneCPU(t *testing.T) func() {
	t.Helper()
	runtime.LockOSThread()
	var set unix.CPUSet
	must(t, unix.SchedGetaffinity(0, &set))
	cpu := -1
	for i := 0; i < 1024 && cpu < 0; i++ {
		if set.IsSet(i) {
			cpu = i
		}
	}
	var one unix.CPUSet
	one.Set(cpu)
	must(t, unix.SchedSetaffinity(0, &one))
	return func() {
		_ = unix.SchedSetaffinity(0, &set)
		runtime.UnlockOSThread()
	}
}
