package maps

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"runtime"
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
)

// reply renders what a reject must look like, independently of the
// datapath: Ethernet back to the sender (the builder's frames go macA ->
// macB), IPv4 without options, id 0, TTL 64, DF for TCP, and l4 with its
// checksum computed here.
func reply(src, dst netip.Addr, proto uint8, l4 []byte) []byte {
	b := append(append(append([]byte(nil), macA[:]...), macB[:]...), 0x08, 0x00)
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
	l4 = append([]byte(nil), l4...)
	switch proto {
	case protoTCP:
		binary.BigEndian.PutUint16(l4[16:], csum(pseudo(s4, d4, protoTCP, len(l4)), l4))
	case protoICMP:
		binary.BigEndian.PutUint16(l4[2:], csum(0, l4))
	}
	return append(append(b, ip...), l4...)
}

// resetFor is the reset RFC 9293 asks for in answer to seg, from its
// destination: seq = its ack when it has ACK, else RST+ACK acknowledging
// its data, SYN and FIN.
func resetFor(seg frame) []byte {
	in := seg.bytes()
	ihl := int(in[14]&0xf) * 4
	th := in[14+ihl:]
	dataLen := len(in) - 14 - ihl - int(th[12]>>4)*4
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

// unreachableFor is the ICMP port unreachable for the datagram dg, from
// its destination, quoting its IPv4 header and first 8 bytes.
func unreachableFor(dg frame) []byte {
	ip := dg.bytes()[14:]
	quote := ip[:int(ip[0]&0xf)*4+8]
	l4 := append([]byte{icmpDestUnreach, icmpPortUnreach, 0, 0, 0, 0, 0, 0}, quote...)
	return reply(dg.dst.Addr(), dg.src.Addr(), protoICMP, l4)
}

func setupRejects(t *testing.T) *Datapath {
	d := newDatapath(t, Options{})
	mustSetService(t, d, fe(vipRejectTCP, TCP), Service{Reject: true})
	mustSetService(t, d, fe(vipRejectUDP, UDP), Service{Reject: true})
	mustSetService(t, d, fe(vipDropUDP, UDP), Service{})
	mustSetService(t, d, Frontend{Addr: netip.MustParseAddrPort(extReject), Proto: TCP, Scope: ScopeExternal}, Service{Reject: true})
	mustSetService(t, d, Frontend{Addr: netip.MustParseAddrPort(extReject), Proto: UDP, Scope: ScopeExternal}, Service{Reject: true})
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

// TestRejects answers new flows to empty reject frontends from pods (tc)
// and from northClient (XDP, and the uplinks' tc path): resets for TCP segments (never for a reset),
// port unreachables for UDP, from the frontend, back where they came from;
// frontends empty by policy keep dropping.
func TestRejects(t *testing.T) {
	d := setupRejects(t)
	syn := tcpFrame(client, vipRejectTCP, tcpSYN, "")
	synData := tcpFrame(client2, vipRejectTCP, tcpSYN, "data on a SYN")
	synData.ipOptions = []byte{1, 1, 1, 0}
	ack := tcpFrame(client, vipRejectTCP, tcpACK|tcpPSH, "mid-flow")
	fin := tcpFrame(client, vipRejectTCP, tcpFIN, "bye") // FIN without ACK: acknowledged
	rst := tcpFrame(client, vipRejectTCP, tcpRST, "")
	udp := udpFrame(client3, vipRejectUDP, "a query long enough to be cut in the quote")
	udpOpts := udpFrame(client3, vipRejectUDP, "q")
	udpOpts.ipOptions = []byte{1, 1, 1, 1, 1, 1, 1, 0}
	udpTiny := udpFrame(client, vipRejectUDP, "")
	extSyn := tcpFrame(northClient, extReject, tcpSYN, "")
	extUDP := udpFrame(northClient, "192.0.2.12:80", "q")

	for _, c := range []struct {
		name  string
		hook  hook
		in    frame
		want  []byte // nil: dropped
		stats stats
	}{
		{"tc_syn_reset", hookTC, syn, resetFor(syn), stats{StatReject: 1}},
		{"tc_syn_with_data_and_ip_options", hookTC, synData, resetFor(synData), stats{StatReject: 1}},
		{"tc_midflow_segment_reset_at_its_ack", hookTC, ack, resetFor(ack), stats{StatReject: 1, StatTCPMidflowMiss: 1}},
		{"tc_fin_acknowledged", hookTC, fin, resetFor(fin), stats{StatReject: 1, StatTCPMidflowMiss: 1}},
		{"tc_reset_never_answered", hookTC, rst, nil, stats{StatDropNoBackend: 1, StatTCPMidflowMiss: 1}},
		{"tc_udp_port_unreachable", hookTC, udp, unreachableFor(udp), stats{StatReject: 1}},
		{"tc_udp_quote_keeps_ip_options", hookTC, udpOpts, unreachableFor(udpOpts), stats{StatReject: 1}},
		{"tc_udp_empty_datagram_grows", hookTC, udpTiny, unreachableFor(udpTiny), stats{StatReject: 1}},
		{"tc_drop_frontend_keeps_dropping", hookTC, udpFrame(client, vipDropUDP, "q"), nil, stats{StatDropNoBackend: 1}},
		{"xdp_syn_reset", hookXDP, extSyn, resetFor(extSyn), stats{StatReject: 1}},
		{"xdp_udp_port_unreachable", hookXDP, extUDP, unreachableFor(extUDP), stats{StatReject: 1}},
		{"xdp_internal_frontend_not_matched", hookXDP, tcpFrame(northClient, vipRejectTCP, tcpSYN, ""), syn.bytes()[:0], nil},
		{"uplink_tc_syn_reset", hookUplinkTC, extSyn, resetFor(extSyn), stats{StatReject: 1}},
		{"uplink_tc_udp_port_unreachable", hookUplinkTC, extUDP, unreachableFor(extUDP), stats{StatReject: 1}},
		{"uplink_tc_internal_frontend_not_matched", hookUplinkTC, tcpFrame(northClient, vipRejectTCP, tcpSYN, ""), syn.bytes()[:0], nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			prog, answered, dropped, passed := d.tcProg, uint32(rejectedTC), uint32(tcShot), uint32(tcOK)
			switch c.hook {
			case hookXDP:
				prog, answered, dropped, passed = d.xdpProg, rejectedXDP, xdpDrop, xdpPass
			case hookUplinkTC:
				// Back out of the uplink: bpf_redirect to its egress.
				prog = d.uplinkLBProg
			}
			before, err := d.Counters()
			must(t, err)
			in := c.in.bytes()
			ret, out := runFrame(t, prog, in)
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

// TestRejectRateLimit sends rejects back to back on one CPU: the first
// RejectBurst are answered, then about one per 1/RejectRate s of elapsed
// time, and the rest are dropped and counted.
func TestRejectRateLimit(t *testing.T) {
	d := setupRejects(t)
	for _, h := range []hook{hookTC, hookXDP} {
		t.Run(string(h), func(t *testing.T) {
			// The budget is per CPU: every frame must run on one. The
			// subtest is a goroutine of its own, so it pins itself (a
			// pin of the parent's thread would leave it free to move,
			// and a run over two CPUs answers up to two bursts).
			defer pinOneCPU(t)()
			prog, in := d.tcProg, tcpFrame(client, vipRejectTCP, tcpSYN, "").bytes()
			if h == hookXDP {
				prog, in = d.xdpProg, tcpFrame(northClient, extReject, tcpSYN, "").bytes()
			}
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
