package maps

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// Fake-clock helpers: the datapath reads CLOCK_MONOTONIC_COARSE, so tests
// plant entries whose timestamps are chosen relative to it.

const sec = uint64(time.Second)

// clockSlack absorbs the coarse clock's tick and the test's own run time
// between reading the clock and the packet.
const clockSlack = uint64(200 * time.Millisecond)

func nowNS(t *testing.T) uint64 {
	t.Helper()
	n, err := monotonicNow()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func ctKey(src, dst string, proto uint8) tcCtKey {
	s, d := netip.MustParseAddrPort(src), netip.MustParseAddrPort(dst)
	return tcCtKey{Saddr: be32(s.Addr()), Daddr: be32(d.Addr()), Sport: be16(s.Port()), Dport: be16(d.Port()), Proto: proto}
}

// readCT reads k's entry from whichever conntrack table holds it.
func readCT(t *testing.T, d *Datapath, k tcCtKey) tcCtValue {
	t.Helper()
	v, err := ct4Entries.lookup(d.ctTables(), k)
	if err != nil {
		t.Fatalf("conntrack entry %s -> %s: %v", addrPortFromWire(k.Saddr, k.Sport), addrPortFromWire(k.Daddr, k.Dport), err)
	}
	return v
}

// ctTableOf is the table an entry with flags belongs in.
func ctTableOf(d *Datapath, flags uint8) *ebpf.Map {
	if flags&uint8(tcCtFlagCT_F_ASSURED) != 0 {
		return d.conntrack
	}
	return d.ctNew
}

// editCT rewrites an existing entry through edit, in its table.
func editCT(t *testing.T, d *Datapath, k tcCtKey, edit func(v *tcCtValue)) {
	t.Helper()
	v := readCT(t, d, k)
	edit(&v)
	if err := ctTableOf(d, v.Flags).Update(&k, &v, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}
}

// putCT plants an entry in the table its flags name.
func putCT(t *testing.T, d *Datapath, k tcCtKey, v tcCtValue) {
	t.Helper()
	if err := ctTableOf(d, v.Flags).Update(&k, &v, ebpf.UpdateAny); err != nil {
		t.Fatal(err)
	}
}

// expectTable checks both entries of f are in the table assured names
// (tlb_conntrack when true, tlb_ct_new when false), and not in the other.
func expectTable(f flowKeys, assured bool) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		t.Helper()
		in, out := d.ctNew, d.conntrack
		if assured {
			in, out = out, in
		}
		for _, k := range []tcCtKey{f.fwd, f.rev} {
			var v tcCtValue
			if err := in.Lookup(&k, &v); err != nil {
				t.Errorf("entry %s not in %s: %v", addrPortFromWire(k.Saddr, k.Sport), in, err)
			} else if got := v.Flags&uint8(tcCtFlagCT_F_ASSURED) != 0; got != assured {
				t.Errorf("entry %s assured flag %v in %s", addrPortFromWire(k.Saddr, k.Sport), got, in)
			}
			if err := out.Lookup(&k, &v); !errors.Is(err, ebpf.ErrKeyNotExist) {
				t.Errorf("entry %s also in %s: %v", addrPortFromWire(k.Saddr, k.Sport), out, err)
			}
		}
	}
}

// flowKeys are the two entries of a flow src -> vip served by backend.
type flowKeys struct{ fwd, rev tcCtKey }

func flowOf(src, vip, backend string, proto uint8) flowKeys {
	return flowKeys{fwd: ctKey(src, vip, proto), rev: ctKey(backend, src, proto)}
}

// setExpires plants expiry now+offset (offset may be negative) in both
// entries of f.
func setExpires(f flowKeys, offset time.Duration) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		at := uint64(int64(nowNS(t)) + int64(offset))
		for _, k := range []tcCtKey{f.fwd, f.rev} {
			editCT(t, d, k, func(v *tcCtValue) { v.Expires = at })
		}
	}
}

// setEntryExpires plants expiry now+offset in the entry under k alone.
func setEntryExpires(k tcCtKey, offset time.Duration) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		at := uint64(int64(nowNS(t)) + int64(offset))
		editCT(t, d, k, func(v *tcCtValue) { v.Expires = at })
	}
}

// expectEntryExpires checks the entry under k alone expires about
// now+ttl.
func expectEntryExpires(k tcCtKey, ttl time.Duration) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		t.Helper()
		now := nowNS(t)
		v := readCT(t, d, k)
		want := now + uint64(ttl)
		if v.Expires+clockSlack < want || v.Expires > want+clockSlack {
			t.Errorf("entry %s expires in %s, want about %s", addrPortFromWire(k.Saddr, k.Sport),
				time.Duration(int64(v.Expires)-int64(now)), ttl)
		}
	}
}

// expectState checks both entries of f: state, and expiry about now+ttl.
func expectState(f flowKeys, state tcCtState, ttl time.Duration) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		t.Helper()
		now := nowNS(t)
		for _, k := range []tcCtKey{f.fwd, f.rev} {
			v := readCT(t, d, k)
			if tcCtState(v.State) != state {
				t.Errorf("entry %s state %d, want %d", addrPortFromWire(k.Saddr, k.Sport), v.State, state)
			}
			want := now + uint64(ttl)
			if v.Expires+clockSlack < want || v.Expires > want+clockSlack {
				t.Errorf("entry %s expires in %s, want about %s", addrPortFromWire(k.Saddr, k.Sport),
					time.Duration(int64(v.Expires)-int64(now)), ttl)
			}
		}
	}
}

// expectExpires checks both entries of f expire about now+ttl.
func expectExpires(f flowKeys, ttl time.Duration) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		t.Helper()
		now := nowNS(t)
		for _, k := range []tcCtKey{f.fwd, f.rev} {
			v := readCT(t, d, k)
			want := now + uint64(ttl)
			if v.Expires+clockSlack < want || v.Expires > want+clockSlack {
				t.Errorf("entry %s expires in %s, want about %s", addrPortFromWire(k.Saddr, k.Sport),
					time.Duration(int64(v.Expires)-int64(now)), ttl)
			}
		}
	}
}

// TestConntrackLifecycle walks TCP and UDP flows through their states
// with chosen timestamps: timeouts per state, refresh of stale entries and
// their peers, expiry, FIN/RST closing, SYN reopening a closing flow.
func TestConntrackLifecycle(t *testing.T) {
	d := setupTable(t)
	tcpFE, udpFE := fe(vipTCP, TCP), fe(vipUDP, UDP)
	flow := flowOf(client, vipTCP, beTCP, protoTCP)
	syn := tcpFrame(client, vipTCP, tcpSYN, "")
	synAck := tcpFrame(beTCP, client, tcpSYN|tcpACK, "")
	ack := tcpFrame(client, vipTCP, tcpACK, "data")
	reply := tcpFrame(beTCP, client, tcpACK, "answer")
	fin := tcpFrame(client, vipTCP, tcpFIN|tcpACK, "")
	// The backend's answer to the SYN (seq 1000) acknowledges it.
	rstReply := tcpFrame(beTCP, client2, tcpRST|tcpACK, "").withSeq(7000, 1001)
	flow2 := flowOf(client2, vipTCP, beTCP, protoTCP)
	syn2 := tcpFrame(client2, vipTCP, tcpSYN, "")
	ack2 := tcpFrame(client2, vipTCP, tcpACK, "")
	udpFlow := flowOf(client3, vipUDP, beUDP, protoUDP)
	udp := udpFrame(client3, vipUDP, "q")
	udpReply := udpFrame(beUDP, client3, "a")

	rows := []pktCase{
		{name: "syn_creates_syn_sent", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true,
			stats: newFlowStats(nil), after: expectState(flow, tcCtStateCT_TCP_SYN_SENT, TimeoutTCPSyn)},
		{name: "syn_retransmit_keeps_flow", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", beTCP)), fwd: tcpFE,
			after: expectState(flow, tcCtStateCT_TCP_SYN_SENT, TimeoutTCPSyn)},
		// The reply establishes the flow, but only the client's answer
		// to it assures it: until then it keeps the SYN timeout and stays
		// where a flood may evict it.
		{name: "reply_establishes_both_not_assured", hook: hookTC, in: synAck, out: ptr(synAck.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1},
			after: both(expectState(flow, tcCtStateCT_TCP_ESTABLISHED, TimeoutTCPSyn), expectTable(flow, false))},
		{name: "client_ack_promotes_both", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", beTCP)), fwd: tcpFE,
			stats: stats{StatConntrackPromoted: 1},
			after: both(expectState(flow, tcCtStateCT_TCP_ESTABLISHED, TimeoutTCPEstablished), expectTable(flow, true))},
		{name: "hit_within_refresh_interval_writes_nothing", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", beTCP)), fwd: tcpFE,
			before: setExpires(flow, TimeoutTCPEstablished-500*time.Millisecond),
			after:  expectExpires(flow, TimeoutTCPEstablished-500*time.Millisecond)},
		// An assured flow's entries refresh alone, each on its own
		// direction's packets: the peer is not read.
		{name: "stale_forward_refreshes_itself_alone", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", beTCP)), fwd: tcpFE,
			before: setExpires(flow, time.Hour),
			after:  both(expectEntryExpires(flow.fwd, TimeoutTCPEstablished), expectEntryExpires(flow.rev, time.Hour))},
		{name: "stale_reply_refreshes_itself_alone", hook: hookXDP, in: reply, out: ptr(reply.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1},
			before: setExpires(flow, 5*time.Second),
			after:  both(expectEntryExpires(flow.rev, TimeoutTCPEstablished), expectEntryExpires(flow.fwd, 5*time.Second))},
		// The flow lives while either entry does: a direction silent for
		// its lifetime (a one-way stream) goes on by its peer's.
		{name: "expired_reply_of_a_live_forward_is_translated", hook: hookTC, in: reply, out: ptr(reply.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1},
			before: both(setEntryExpires(flow.rev, -time.Second), setEntryExpires(flow.fwd, time.Hour)),
			after:  both(expectEntryExpires(flow.rev, TimeoutTCPEstablished), expectEntryExpires(flow.fwd, time.Hour))},
		{name: "expired_forward_of_a_live_reply_goes_on", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", beTCP)), fwd: tcpFE,
			before: both(setEntryExpires(flow.fwd, -time.Second), setEntryExpires(flow.rev, time.Hour)),
			after: both(expectEntryExpires(flow.fwd, TimeoutTCPEstablished), expectEntryExpires(flow.rev, time.Hour),
				expectTable(flow, true))},
		{name: "expired_reply_passes_untranslated", hook: hookTC, in: reply, stats: stats{StatConntrackExpired: 1},
			before: setExpires(flow, -time.Second)},
		// The expired assured flow is deleted from tlb_conntrack, where it
		// would hide the new one.
		{name: "expired_forward_is_balanced_as_new", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true,
			stats: newFlowStats(stats{StatConntrackExpired: 1, StatConntrackReplaced: 2}),
			after: both(expectState(flow, tcCtStateCT_TCP_SYN_SENT, TimeoutTCPSyn), expectTable(flow, false))},
		{name: "reply_again", hook: hookTC, in: synAck, out: ptr(synAck.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1}},
		{name: "ack_again_promotes", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", beTCP)), fwd: tcpFE,
			stats: stats{StatConntrackPromoted: 1}, after: expectTable(flow, true)},
		// A closing flow leaves tlb_conntrack: it must not hold room an
		// established flow needs.
		{name: "fin_closes_both_and_demotes", hook: hookTC, in: fin, out: ptr(fin.withAddrs("", beTCP)), fwd: tcpFE,
			stats: stats{StatConntrackDemoted: 1},
			after: both(expectState(flow, tcCtStateCT_TCP_CLOSING, TimeoutTCPClosing), expectTable(flow, false))},
		{name: "closing_flow_still_translated", hook: hookTC, in: reply, out: ptr(reply.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1},
			after: expectState(flow, tcCtStateCT_TCP_CLOSING, TimeoutTCPClosing)},
		{name: "syn_reusing_a_closing_flow_is_new", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true,
			stats: newFlowStats(stats{StatConntrackSYNReopen: 1, StatConntrackReplaced: 2}),
			after: expectState(flow, tcCtStateCT_TCP_SYN_SENT, TimeoutTCPSyn)},
		{name: "second_flow_syn", hook: hookTC, in: syn2, out: ptr(syn2.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "rst_from_backend_closes_both", hook: hookXDP, in: rstReply, out: ptr(rstReply.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1},
			after: expectState(flow2, tcCtStateCT_TCP_CLOSING, TimeoutTCPClosing)},
		{name: "closing_flow_expires_after_its_timeout", hook: hookTC, in: ack2, out: ptr(ack2.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true,
			before: setExpires(flow2, -time.Millisecond*10),
			stats:  newFlowStats(stats{StatConntrackExpired: 1, StatConntrackReplaced: 2}),
			after:  expectState(flow2, tcCtStateCT_TCP_SYN_SENT, TimeoutTCPSyn)},
		{name: "udp_new_flow", hook: hookTC, in: udp, out: ptr(udp.withAddrs("", beUDP)), fwd: udpFE, newFlow: true, stats: newFlowStats(nil),
			after: expectState(udpFlow, tcCtStateCT_UDP, TimeoutUDP)},
		{name: "udp_one_way_stream_refreshes_the_reply_entry", hook: hookTC, in: udp, out: ptr(udp.withAddrs("", beUDP)), fwd: udpFE,
			before: setExpires(udpFlow, 30*time.Second),
			after:  expectState(udpFlow, tcCtStateCT_UDP, TimeoutUDP)},
		// A reply assures a UDP flow.
		{name: "udp_reply_promotes", hook: hookXDP, in: udpReply, out: ptr(udpReply.withAddrs(vipUDP, "")), stats: stats{StatReverseNAT: 1, StatConntrackPromoted: 1},
			before: setExpires(udpFlow, 2*time.Second),
			after:  both(expectState(udpFlow, tcCtStateCT_UDP, TimeoutUDP), expectTable(udpFlow, true))},
		{name: "udp_after_reply_hits", hook: hookTC, in: udp, out: ptr(udp.withAddrs("", beUDP)), fwd: udpFE,
			after: both(expectState(udpFlow, tcCtStateCT_UDP, TimeoutUDP), expectTable(udpFlow, true))},
		{name: "udp_expired_is_new", hook: hookTC, in: udp, out: ptr(udp.withAddrs("", beUDP)), fwd: udpFE, newFlow: true,
			before: setExpires(udpFlow, -time.Second),
			stats:  newFlowStats(stats{StatConntrackExpired: 1, StatConntrackReplaced: 2}),
			after:  expectState(udpFlow, tcCtStateCT_UDP, TimeoutUDP)},
	}
	runTable(t, d, rows)
}

// TestConntrackTCPWindow: a TCP flow's state moves on only for segments
// in its window (bpf/conntrack.h, ct_tcp_learn). A blind RST or FIN with
// a random sequence number, from either side, or a spoofed SYN leaves an
// established flow established, assured and translated; an in-window RST
// closes it, and a SYN after that opens a new one. A flow of layout 7
// (tcp_next 0 in both entries) learns from its next packets.
func TestConntrackTCPWindow(t *testing.T) {
	d := setupTable(t)
	tcpFE := fe(vipTCP, TCP)
	flow := flowOf(client, vipTCP, beTCP, protoTCP)
	// The client's sequence numbers start at 1000, the backend's at 5000.
	syn := tcpFrame(client, vipTCP, tcpSYN, "").withSeq(1000, 0)
	synAck := tcpFrame(beTCP, client, tcpSYN|tcpACK, "").withSeq(5000, 1001)
	ack := tcpFrame(client, vipTCP, tcpACK, "data").withSeq(1001, 5001)
	reply := tcpFrame(beTCP, client, tcpACK, "answer").withSeq(5001, 1005)
	// Half the sequence space away from what each side sent: as far out
	// of the window as a number gets.
	blindRST := tcpFrame(client, vipTCP, tcpRST, "").withSeq(1005+1<<31, 0)
	blindRSTReply := tcpFrame(beTCP, client, tcpRST|tcpACK, "").withSeq(5007+1<<31, 1005)
	blindFIN := tcpFrame(client, vipTCP, tcpFIN|tcpACK, "").withSeq(1005+1<<31, 5007)
	spoofedSYN := tcpFrame(client, vipTCP, tcpSYN, "").withSeq(0x7777_0000, 0)
	// The edge of the window: CT_TCP_WINDOW past what the client sent.
	edgeRST := tcpFrame(client, vipTCP, tcpRST, "").withSeq(1005+1<<18+1, 0)
	rst := tcpFrame(client, vipTCP, tcpRST, "").withSeq(1005, 0)
	ignored := stats{StatConntrackTCPIgnored: 1}
	layout7 := func(t *testing.T, d *Datapath) {
		for _, k := range []tcCtKey{flow.fwd, flow.rev} {
			editCT(t, d, k, func(v *tcCtValue) { v.TcpNext = 0 })
		}
	}
	expectNext := func(k tcCtKey, want uint32) func(t *testing.T, d *Datapath) {
		return func(t *testing.T, d *Datapath) {
			t.Helper()
			if v := readCT(t, d, k); v.TcpNext != want {
				t.Errorf("entry %s tcp_next %d, want %d", addrPortFromWire(k.Saddr, k.Sport), v.TcpNext, want)
			}
		}
	}
	established := both(expectState(flow, tcCtStateCT_TCP_ESTABLISHED, TimeoutTCPEstablished), expectTable(flow, true))

	rows := []pktCase{
		{name: "syn", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true, stats: newFlowStats(nil),
			after: both(expectNext(flow.fwd, 1001), expectNext(flow.rev, 0))},
		{name: "syn_ack", hook: hookTC, in: synAck, out: ptr(synAck.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1},
			after: expectNext(flow.rev, 5001)},
		{name: "ack_promotes", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", beTCP)), fwd: tcpFE, stats: stats{StatConntrackPromoted: 1},
			after: both(established, expectNext(flow.fwd, 1005))},
		{name: "reply", hook: hookTC, in: reply, out: ptr(reply.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1},
			after: both(established, expectNext(flow.rev, 5007))},
		{name: "blind_rst_stays_established_and_translated", hook: hookTC, in: blindRST, out: ptr(blindRST.withAddrs("", beTCP)), fwd: tcpFE,
			stats: ignored, after: both(established, expectNext(flow.fwd, 1005))},
		{name: "blind_rst_from_the_backend_side", hook: hookTC, in: blindRSTReply, out: ptr(blindRSTReply.withAddrs(vipTCP, "")),
			stats: stats{StatReverseNAT: 1, StatConntrackTCPIgnored: 1}, after: both(established, expectNext(flow.rev, 5007))},
		{name: "blind_fin_stays_established", hook: hookTC, in: blindFIN, out: ptr(blindFIN.withAddrs("", beTCP)), fwd: tcpFE,
			stats: ignored, after: both(established, expectNext(flow.fwd, 1005))},
		{name: "rst_just_past_the_window", hook: hookTC, in: edgeRST, out: ptr(edgeRST.withAddrs("", beTCP)), fwd: tcpFE,
			stats: ignored, after: established},
		{name: "spoofed_syn_does_not_reopen", hook: hookTC, in: spoofedSYN, out: ptr(spoofedSYN.withAddrs("", beTCP)), fwd: tcpFE,
			stats: ignored, after: both(established, expectNext(flow.fwd, 1005))},
		{name: "still_translated_both_ways", hook: hookTC, in: reply, out: ptr(reply.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1},
			after: established},
		{name: "in_window_rst_closes", hook: hookTC, in: rst, out: ptr(rst.withAddrs("", beTCP)), fwd: tcpFE,
			stats: stats{StatConntrackDemoted: 1}, after: expectState(flow, tcCtStateCT_TCP_CLOSING, TimeoutTCPClosing)},
		{name: "syn_after_close_reopens", hook: hookTC, in: spoofedSYN, out: ptr(spoofedSYN.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true,
			stats: newFlowStats(stats{StatConntrackSYNReopen: 1, StatConntrackReplaced: 2}),
			after: both(expectState(flow, tcCtStateCT_TCP_SYN_SENT, TimeoutTCPSyn), expectNext(flow.fwd, 0x7777_0001))},
		// Established again, then as an upgrade from layout 7 leaves it.
		{name: "syn_ack_again", hook: hookTC, in: synAck.withSeq(5000, 0x7777_0001), out: ptr(synAck.withSeq(5000, 0x7777_0001).withAddrs(vipTCP, "")),
			stats: stats{StatReverseNAT: 1}},
		{name: "layout7_flow_learns_from_its_next_packet", hook: hookTC, in: ack.withSeq(0x7777_0001, 5001),
			out: ptr(ack.withSeq(0x7777_0001, 5001).withAddrs("", beTCP)), fwd: tcpFE, stats: stats{StatConntrackPromoted: 1},
			before: layout7, after: both(established, expectNext(flow.fwd, 0x7777_0005), expectNext(flow.rev, 0))},
		{name: "layout7_flow_ignores_a_blind_rst_once_learnt", hook: hookTC, in: blindRST, out: ptr(blindRST.withAddrs("", beTCP)), fwd: tcpFE,
			stats: ignored, after: established},
		// The backend's side is still unknown: its RST must acknowledge
		// what the client sent.
		{name: "layout7_unknown_side_rst_must_ack_the_peer", hook: hookTC, in: blindRSTReply, out: ptr(blindRSTReply.withAddrs(vipTCP, "")),
			stats: stats{StatReverseNAT: 1, StatConntrackTCPIgnored: 1}, after: established},
		{name: "layout7_unknown_side_rst_acking_the_peer_closes", hook: hookTC, in: blindRSTReply.withSeq(1, 0x7777_0005),
			out: ptr(blindRSTReply.withSeq(1, 0x7777_0005).withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1, StatConntrackDemoted: 1},
			after: expectState(flow, tcCtStateCT_TCP_CLOSING, TimeoutTCPClosing)},
	}
	runTable(t, d, rows)
}

// srcFor finds a client port whose flow to f hashes to slot want of a
// table of n slots.
func srcFor(t *testing.T, ip string, f Frontend, want, n int, from int) string {
	t.Helper()
	for port := from; port < from+10000; port++ {
		src := netip.AddrPortFrom(netip.MustParseAddr(ip), uint16(port))
		if slotOf(src, f.Addr, uint8(f.Proto), n) == want {
			return src.String()
		}
	}
	t.Fatalf("no port of %s hashes to slot %d of %d", ip, want, n)
	return ""
}

// backendAt returns the backend in slot i of f's table, read back.
func backendAt(t *testing.T, d *Datapath, f Frontend, i int) string {
	t.Helper()
	prog, err := d.Programmed()
	if err != nil {
		t.Fatal(err)
	}
	ps := prog[f]
	for _, b := range ps.Backends {
		if b.Draining {
			continue
		}
		if i < int(b.Weight) {
			return b.Addr.String()
		}
		i -= int(b.Weight)
	}
	t.Fatalf("%s has no slot %d", f, i)
	return ""
}

// TestBackendStates checks, in each family tc on pod veths translates,
// what each backend state does to flows pinned to it: draining keeps established flows (a SYN does not reopen one), a SYN reopening a closed one moves, a
// gone backend's flows are re-balanced (UDP moves, TCP goes to an active
// backend, which resets it), and a stale generation is never honoured.
func TestBackendStates(t *testing.T) {
	for _, fam := range []struct{ name, vip, a, b, client string }{
		{"ipv4", "10.96.0.10", "10.1.0.1", "10.1.0.2", "10.0.0."},
		{"ipv6", "fd00:96::10", "fd00:1::1", "fd00:1::2", "fd00::"},
	} {
		t.Run(fam.name, func(t *testing.T) { testBackendStates(t, fam.vip, fam.a, fam.b, fam.client) })
	}
}

// testBackendStates is TestBackendStates in one family: frontends on
// vip, backends a and b, clients client+"5" and on.
func testBackendStates(t *testing.T, vip, aAddr, bAddr, client string) {
	at := func(addr string, port uint16) string {
		return netip.AddrPortFrom(netip.MustParseAddr(addr), port).String()
	}
	vipTCP, vipUDP := at(vip, 80), at(vip, 53)
	d := newDatapath(t, Options{})
	f := fe(vipTCP, TCP)
	u := fe(vipUDP, UDP)
	a, b := be(at(aAddr, 8080)), be(at(bAddr, 8080))
	ua, ub := be(at(aAddr, 5353)), be(at(bAddr, 5353))
	mustSet(t, d, f, a, b)
	mustSet(t, d, u, ua, ub)
	if backendAt(t, d, f, 0) != a.Addr.String() || backendAt(t, d, u, 0) != ua.Addr.String() {
		t.Fatal("tables not in the order written")
	}
	// Flows that hash to a (slot 0 of 2) and, once a is gone, to b.
	src1 := srcFor(t, client+"5", f, 0, 2, 20000)
	src2 := srcFor(t, client+"6", f, 0, 2, 20000)
	src3 := srcFor(t, client+"8", f, 0, 2, 20000)
	syn3 := tcpFrame(src3, vipTCP, tcpSYN, "")
	usrc := srcFor(t, client+"7", u, 0, 2, 20000)
	syn1, ack1 := tcpFrame(src1, vipTCP, tcpSYN, ""), tcpFrame(src1, vipTCP, tcpACK, "more")
	synAck1 := tcpFrame(a.Addr.String(), src1, tcpSYN|tcpACK, "")
	// The client's SYN (seq 1000) and ACK (seq 1000, 4 bytes) reached
	// 1004; a spoofed SYN with another sequence number.
	spoofedSYN1 := syn1.withSeq(0x5555_0000, 0)
	rst1 := tcpFrame(src1, vipTCP, tcpRST, "").withSeq(1004, 0)
	syn2, ack2 := tcpFrame(src2, vipTCP, tcpSYN, ""), tcpFrame(src2, vipTCP, tcpACK, "more")
	udp1 := udpFrame(usrc, vipUDP, "q")

	drainA := func(t *testing.T, d *Datapath) {
		mustSetService(t, d, f, Service{Backends: []Backend{drained(a), b}})
		mustSetService(t, d, u, Service{Backends: []Backend{drained(ua), ub}})
	}
	goneA := func(t *testing.T, d *Datapath) {
		mustSet(t, d, f, b)
		mustSet(t, d, u, ub)
		mustFlushStale(t, d)
	}
	bumpGen := func(t *testing.T, d *Datapath) {
		// Someone else's write: b's generation moves under the mirror,
		// without the walk that marks its flows stale (txn.finish). The
		// sweep's backstop finds them.
		m := d.fes[f].members[b.Addr]
		tx := &txn{d: d}
		if err := tx.putGeneration(m.id, m.gen+7); err != nil {
			t.Fatal(err)
		}
		n, err := markOutdated(d.ctFamilies(), d.backendStats)
		if err != nil {
			t.Fatal(err)
		}
		if n != 3 {
			t.Errorf("markOutdated marked %d flows, want 3 (the TCP flows moved to b)", n)
		}
	}
	rows := []pktCase{
		{name: "tcp_flow_to_a", hook: hookTC, in: syn1, out: ptr(syn1.withAddrs("", a.Addr.String())), fwd: f, newFlow: true, stats: newFlowStats(nil)},
		{name: "tcp_reply_from_a", hook: hookTC, in: synAck1, out: ptr(synAck1.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1}},
		{name: "second_tcp_flow_to_a", hook: hookTC, in: syn2, out: ptr(syn2.withAddrs("", a.Addr.String())), fwd: f, newFlow: true, stats: newFlowStats(nil)},
		{name: "unanswered_tcp_flow_to_a", hook: hookTC, in: syn3, out: ptr(syn3.withAddrs("", a.Addr.String())), fwd: f, newFlow: true, stats: newFlowStats(nil)},
		{name: "udp_flow_to_a", hook: hookTC, in: udp1, out: ptr(udp1.withAddrs("", ua.Addr.String())), fwd: u, newFlow: true, stats: newFlowStats(nil)},
		{name: "draining_keeps_established_tcp", before: drainA, hook: hookTC, in: ack1, out: ptr(ack1.withAddrs("", a.Addr.String())), fwd: f,
			stats: stats{StatConntrackPromoted: 1}},
		{name: "draining_keeps_udp", hook: hookTC, in: udp1, out: ptr(udp1.withAddrs("", ua.Addr.String())), fwd: u},
		{name: "draining_answers_are_translated", hook: hookTC, in: synAck1, out: ptr(synAck1.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1}},
		// A handshake nobody answered moves off a draining backend.
		{name: "unanswered_syn_to_a_draining_backend_moves", hook: hookTC, in: syn3, out: ptr(syn3.withAddrs("", b.Addr.String())), fwd: f, newFlow: true,
			stats: newFlowStats(stats{StatConntrackSYNReopen: 1, StatConntrackReplaced: 2})},
		// A SYN does not reopen an established flow, draining backend
		// or not (a spoofed one would reset it): it goes on to a, whose
		// challenge ACK draws the client's in-window reset.
		{name: "syn_on_an_established_draining_flow_stays", hook: hookTC, in: spoofedSYN1, out: ptr(spoofedSYN1.withAddrs("", a.Addr.String())), fwd: f,
			stats: stats{StatConntrackTCPIgnored: 1}},
		{name: "in_window_rst_closes_the_draining_flow", hook: hookTC, in: rst1, out: ptr(rst1.withAddrs("", a.Addr.String())), fwd: f,
			stats: stats{StatConntrackDemoted: 1}},
		// The reopened flow gets a new reverse entry (b's); both old
		// entries are deleted (a's reply entry must not linger).
		{name: "syn_reusing_a_closed_draining_flow_moves", hook: hookTC, in: syn1, out: ptr(syn1.withAddrs("", b.Addr.String())), fwd: f, newFlow: true,
			stats: newFlowStats(stats{StatConntrackSYNReopen: 1, StatConntrackReplaced: 2})},
		{name: "gone_backend_tcp_is_rebalanced", before: goneA, hook: hookTC, in: ack2, out: ptr(ack2.withAddrs("", b.Addr.String())), fwd: f, newFlow: true,
			stats: newFlowStats(stats{StatConntrackStaleBackend: 1, StatConntrackReplaced: 2})},
		{name: "gone_backend_udp_moves", hook: hookTC, in: udp1, out: ptr(udp1.withAddrs("", ub.Addr.String())), fwd: u, newFlow: true,
			stats: newFlowStats(stats{StatConntrackStaleBackend: 1, StatConntrackReplaced: 2})},
		{name: "hit_with_valid_generation", hook: hookTC, in: ack1, out: ptr(ack1.withAddrs("", b.Addr.String())), fwd: f},
	}
	runTable(t, d, rows)

	// b's generation moves under the mirror (someone else's write): its
	// flows are not honoured, and the frontend's counters lose b's record
	// until Repair (verify_test.go), so this row is checked alone.
	runTable(t, d, []pktCase{
		{name: "hit_with_stale_generation_is_rebalanced", before: bumpGen, hook: hookTC, in: ack1, out: ptr(ack1.withAddrs("", b.Addr.String())),
			stats: newFlowStats(stats{StatConntrackStaleBackend: 1, StatConntrackReplaced: 2})},
	})
}

// TestSweepTakesStaleFlowsWhole checks that a backend's removal marks its
// flows stale within the change (the datapath no longer checks
// generations per packet) and that a sweep then deletes both entries of
// such a flow: the reply entry of an established one would otherwise
// stay in tlb_conntrack, which no orphan check reads.
func TestSweepTakesStaleFlowsWhole(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipTCP, TCP)
	a, b := be("10.1.0.1:8080"), be("10.1.0.2:8080")
	mustSet(t, d, f, a, b)
	src := srcFor(t, "10.0.0.5", f, 0, 2, 20000)
	establishTCP(t, d, src, vipTCP, a.Addr.String())
	fwdKey := ctKey(src, vipTCP, protoTCP)
	var v tcCtValue
	if err := d.conntrack.Lookup(&fwdKey, &v); err != nil {
		t.Fatalf("established flow not in tlb_conntrack: %v", err)
	}
	mustSet(t, d, f, b)
	// The walk runs on its own within staleDelay: wait for it.
	deadline := time.Now().Add(10 * staleDelay)
	for {
		if err := d.conntrack.Lookup(&fwdKey, &v); err != nil {
			t.Fatal(err)
		}
		if v.Flags&uint8(tcCtFlagCT_F_STALE) != 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(staleDelay / 5)
	}
	if v.Flags&uint8(tcCtFlagCT_F_STALE) == 0 || v.Expires != 0 {
		t.Fatalf("flow to the removed backend: flags %#x expires %d, want CT_F_STALE and 0", v.Flags, v.Expires)
	}
	st, err := d.SweepConntrack(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if st.Expired != 2 || st.Established != 0 {
		t.Errorf("sweep: expired %d, established left %d; want 2 and 0", st.Expired, st.Established)
	}
	for _, m := range d.ctTables() {
		var k tcCtKey
		if it := m.Iterate(); it.Next(&k, &v) {
			t.Errorf("%s still holds %+v", m, k)
		}
	}
}

// establishTCP takes a TCP flow src -> vip, balanced to backend, through
// its handshake in tc_lb: assured, in tlb_conntrack.
func establishTCP(t *testing.T, d *Datapath, src, vip, backend string) {
	t.Helper()
	for _, fr := range []frame{
		tcpFrame(src, vip, tcpSYN, ""),
		tcpFrame(backend, src, tcpSYN|tcpACK, ""),
		tcpFrame(src, vip, tcpACK, ""),
	} {
		if ret, _ := run(t, d.tcProg, fr.bytes()); ret != tcOK {
			t.Fatalf("establishing the flow: verdict %d", ret)
		}
	}
}

// TestSweepKeepsAFlowWithALiveHalf checks, in each family tc translates,
// the sweep deletes an expired entry of an assured flow only once its
// other direction expired too: each direction refreshes its own entry
// (ct_refreshes_alone), and a one-way stream keeps its silent half.
func TestSweepKeepsAFlowWithALiveHalf(t *testing.T) {
	for _, fam := range tcFamilies {
		t.Run(fam.name, func(t *testing.T) {
			a := fam.addrs
			d := newDatapath(t, Options{})
			mustSet(t, d, fe(a.vipTCP, TCP), be(a.beTCP))
			establishTCP(t, d, a.client, a.vipTCP, a.beTCP)
			ts := d.ctTablesOf(netip.MustParseAddrPort(a.client).Addr())
			dirName := map[tcCtDir]string{tcCtDirCT_FORWARD: "forward", tcCtDirCT_REVERSE: "reverse"}
			expectBothAssured := func(when string) {
				t.Helper()
				got := map[tcCtDir]int{}
				editEntries(t, ts, func(table int, v *tcCtValue) bool {
					if table != 0 || v.Flags&uint8(tcCtFlagCT_F_ASSURED) == 0 {
						t.Errorf("%s: %s entry in table %d with flags %#x, want assured in the established table", when, dirName[tcCtDir(v.Dir)], table, v.Flags)
					}
					got[tcCtDir(v.Dir)]++
					return false
				})
				if got[tcCtDirCT_FORWARD] != 1 || got[tcCtDirCT_REVERSE] != 1 || len(got) != 2 {
					t.Fatalf("%s: entries by direction %v, want one forward and one reverse", when, got)
				}
			}
			expectBothAssured("established")
			// expireDir plants expiry now+offset in dir's entry, or in
			// both entries when dir is 0.
			expireDir := func(dir tcCtDir, offset time.Duration) {
				at := uint64(int64(nowNS(t)) + int64(offset))
				editEntries(t, ts, func(_ int, v *tcCtValue) bool {
					if dir != 0 && tcCtDir(v.Dir) != dir {
						return false
					}
					v.Expires = at
					return true
				})
			}
			for _, silent := range []tcCtDir{tcCtDirCT_REVERSE, tcCtDirCT_FORWARD} {
				live := tcCtDirCT_FORWARD
				if silent == tcCtDirCT_FORWARD {
					live = tcCtDirCT_REVERSE
				}
				expireDir(silent, -time.Second)
				expireDir(live, time.Hour)
				st, err := d.SweepConntrack(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				if st.Expired != 0 {
					t.Fatalf("sweep deleted %d entries of a flow whose %s half is live", st.Expired, dirName[live])
				}
				expectBothAssured(dirName[silent] + " half silent")
			}
			expireDir(0, -time.Second)
			st, err := d.SweepConntrack(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			left := 0
			editEntries(t, ts, func(int, *tcCtValue) bool { left++; return false })
			if st.Expired != 2 || left != 0 {
				t.Errorf("sweep of a flow expired both ways: expired %d, %d entries left; want 2 and 0", st.Expired, left)
			}
		})
	}
}

// ctTablesOf returns the conntrack tables of addr's family.
func (d *Datapath) ctTablesOf(addr netip.Addr) ctFamilyTables {
	if addr.Is4() {
		return ctFamilyTables{tables: d.ctTables()}
	}
	return ctFamilyTables{tables: d.ct6Tables(), is6: true}
}

// ctFamilyTables are one family's conntrack tables, whose keys and values
// are tcCtKey and tcCtValue (IPv4) or tcCt6Key and tcCt6Value (IPv6).
type ctFamilyTables struct {
	tables ctTables
	is6    bool
}

// editEntries calls edit with the family-neutral part of every entry of
// ts and the table it is in (0 the established one, 1 the unreplied), and
// writes back each entry edit reports it changed.
func editEntries(t *testing.T, ts ctFamilyTables, edit func(table int, v *tcCtValue) bool) {
	t.Helper()
	if ts.is6 {
		editEntriesOf[tcCt6Key](t, ts.tables, func(v *tcCt6Value) *tcCtValue { return &v.Ct }, edit)
		return
	}
	editEntriesOf[tcCtKey](t, ts.tables, func(v *tcCtValue) *tcCtValue { return v }, edit)
}

// editEntriesOf is editEntries for tables whose entries have keys K and
// values V, whose family-neutral part ct returns.
func editEntriesOf[K, V any](t *testing.T, ts ctTables, ct func(*V) *tcCtValue, edit func(table int, v *tcCtValue) bool) {
	t.Helper()
	for i, m := range ts {
		if err := walkTable(m, func(k K, v V) error {
			if !edit(i, ct(&v)) {
				return nil
			}
			return m.Update(&k, &v, ebpf.UpdateExist)
		}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSweepConntrack plants flows of every kind, expires some, and checks
// what a sweep deletes, counts and derives.
func TestSweepConntrack(t *testing.T) {
	d := setupTable(t)
	send := func(f frame) {
		t.Helper()
		if ret, _ := run(t, d.tcProg, f.bytes()); ret != tcOK {
			t.Fatalf("verdict %d", ret)
		}
	}
	// Two established TCP flows, one closing, one SYN only, two UDP.
	for i, src := range []string{"10.0.9.1:1000", "10.0.9.2:1000", "10.0.9.3:1000"} {
		send(tcpFrame(src, vipTCP, tcpSYN, ""))
		send(tcpFrame(beTCP, src, tcpSYN|tcpACK, ""))
		if i == 2 {
			send(tcpFrame(src, vipTCP, tcpFIN|tcpACK, ""))
		}
	}
	send(tcpFrame("10.0.9.4:1000", vipTCP, tcpSYN, ""))
	send(udpFrame("10.0.9.5:1000", vipUDP, "q"))
	send(udpFrame("10.0.9.6:1000", vipUDP, "q"))
	// Expire one established TCP flow and one UDP flow.
	setExpires(flowOf("10.0.9.1:1000", vipTCP, beTCP, protoTCP), -time.Second)(t, d)
	setExpires(flowOf("10.0.9.6:1000", vipUDP, beUDP, protoUDP), -time.Second)(t, d)

	st, err := d.SweepConntrack(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", st)
	want := map[ConntrackKind]int{
		{TCP, "established"}: 2,
		{TCP, "closing"}:     2,
		{TCP, "syn_sent"}:    2,
		{UDP, ""}:            2,
	}
	if fmt.Sprint(st.Live) != fmt.Sprint(want) {
		t.Errorf("live = %v, want %v", st.Live, want)
	}
	if st.Expired != 4 || st.Swept != 4 || st.Created != 6 || st.Replaced != 0 || st.Evicted != 0 {
		t.Errorf("expired %d, swept %d, created %d, replaced %d, evicted %d; want 4, 4, 6, 0, 0", st.Expired, st.Swept, st.Created, st.Replaced, st.Evicted)
	}
	if _, err := ct4Entries.lookup(d.ctTables(), ctKey("10.0.9.1:1000", vipTCP, protoTCP)); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("expired entry still there: %v", err)
	}
	if readCT(t, d, ctKey("10.0.9.2:1000", vipTCP, protoTCP)).Expires == 0 {
		t.Error("live entry lost")
	}
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Stats[StatConntrackSwept] != 4 {
		t.Errorf("StatConntrackSwept = %d, want 4", c.Stats[StatConntrackSwept])
	}

	// A second sweep finds nothing to do.
	st, err = d.SweepConntrack(context.Background())
	if err != nil || st.Expired != 0 || st.Swept != 4 {
		t.Errorf("second sweep: %+v, %v", st, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := d.SweepConntrack(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled sweep: %v", err)
	}
}

// TestSweepDerivesEvictions overfills a small conntrack table: the LRU
// evicts, and the sweep's derived count says how many.
func TestSweepDerivesEvictions(t *testing.T) {
	d := newDatapath(t, Options{MaxConntrackNew: 256})
	mustSet(t, d, fe(vipUDP, UDP), be(beUDP))
	const flows = 1000
	for i := 0; i < flows; i++ {
		src := fmt.Sprintf("10.0.%d.%d:2000", i/256, i%256)
		if ret, _ := run(t, d.tcProg, udpFrame(src, vipUDP, "q").bytes()); ret != tcOK {
			t.Fatalf("flow %d: verdict %d", i, ret)
		}
	}
	st, err := d.SweepConntrack(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	live := 0
	for _, n := range st.Live {
		live += n
	}
	t.Logf("live %d, evicted %d, created %d", live, st.Evicted, st.Created)
	if st.Created != flows || live > 256 || live == 0 {
		t.Fatalf("created %d, live %d", st.Created, live)
	}
	if want := uint64(2*flows - live); st.Evicted != want {
		t.Errorf("evicted = %d, want 2·%d − %d live = %d", st.Evicted, flows, live, want)
	}
}
