package maps

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/topolb/topolb/internal/portrange"
)

// plus adds the counts of extra to s, in a copy.
func (s stats) plus(extra stats) stats {
	out := stats{}
	for k, v := range s {
		out[k] += v
	}
	for k, v := range extra {
		out[k] += v
	}
	return out
}

// TestConntrackFloodKeepsEstablished is issue 22's attack through
// BPF_PROG_TEST_RUN: 16 established TCP streams from two sources (half
// of them on a backend that then drains), then a flood of SYNs from
// random source ports of both sources, ten times the established table.
// Every stream must still be translated to its own backend, in both
// directions, without a new flow; and a new connection is served after
// the flood. With one LRU table for all flows the flood evicts them.
func TestConntrackFloodKeepsEstablished(t *testing.T) {
	const table = 4096
	d := newDatapath(t, Options{MaxConntrack: table, MaxConntrackNew: table / 4, NewFlowsPerSource: NoSourceLimit})
	f := fe(vipTCP, TCP)
	a, b := be("10.1.0.1:8080"), be("10.1.0.2:8080")
	mustSet(t, d, f, a, b)
	send := func(fr frame, want uint32) []byte {
		t.Helper()
		ret, out := run(t, d.tcProg, fr.bytes())
		if ret != want {
			t.Fatalf("%s: verdict %d, want %d", fr.src, ret, want)
		}
		return out
	}

	type stream struct{ client, backend string }
	var streams []stream
	for _, src := range []string{"10.0.0.5", "192.0.2.77"} {
		for j := 0; j < 8; j++ {
			client := fmt.Sprintf("%s:%d", src, 20000+j)
			send(tcpFrame(client, vipTCP, tcpSYN, ""), tcOK)
			v := readCT(t, d, ctKey(client, vipTCP, protoTCP))
			backend := addrPortFromWire(v.Addr, v.Port).String()
			send(tcpFrame(backend, client, tcpSYN|tcpACK, ""), tcOK)
			send(tcpFrame(client, vipTCP, tcpACK, ""), tcOK)
			expectTable(flowOf(client, vipTCP, backend, protoTCP), true)(t, d)
			streams = append(streams, stream{client, backend})
		}
	}
	// a drains, as during a rollout: its streams keep it.
	mustSetService(t, d, f, Service{Backends: []Backend{drained(a), b}})

	before, err := d.Counters()
	must(t, err)
	rng := rand.New(rand.NewPCG(22, 1))
	const flood = 10 * table
	start := time.Now()
	for i := 0; i < flood; i++ {
		src := []string{"10.0.0.5", "192.0.2.77"}[i%2]
		port := 1024 + rng.IntN(64000)
		if port >= 20000 && port < 20008 {
			// A SYN on a stream's own tuple is that client's new
			// connection, which on a draining backend replaces the
			// stream by design.
			continue
		}
		send(tcpFrame(fmt.Sprintf("%s:%d", src, port), vipTCP, tcpSYN, ""), tcOK)
	}
	t.Logf("flood of %d SYNs in %s", flood, time.Since(start))
	after, err := d.Counters()
	must(t, err)
	if got := after.Stats[StatConntrackCreated] - before.Stats[StatConntrackCreated]; got < flood/2 {
		t.Fatalf("the flood created only %d flows: it did not reach the tables", got)
	}

	before = after
	for _, s := range streams {
		out := send(tcpFrame(s.client, vipTCP, tcpACK, "more"), tcOK)
		if want := tcpFrame(s.client, vipTCP, tcpACK, "more").withAddrs("", s.backend).bytes(); string(out) != string(want) {
			t.Errorf("stream %s -> %s: forward packet not translated to its backend after the flood", s.client, s.backend)
		}
		out = send(tcpFrame(s.backend, s.client, tcpACK, "answer"), tcOK)
		if want := tcpFrame(s.backend, s.client, tcpACK, "answer").withAddrs(vipTCP, "").bytes(); string(out) != string(want) {
			t.Errorf("stream %s -> %s: reply not translated back after the flood", s.client, s.backend)
		}
	}
	after, err = d.Counters()
	must(t, err)
	if got := after.Stats[StatConntrackCreated] - before.Stats[StatConntrackCreated]; got != 0 {
		t.Errorf("the streams created %d new flows after the flood, want 0 (an established flow was lost)", got)
	}
	// A new connection is still served, by the active backend.
	fresh := "10.0.0.9:33333"
	out := send(tcpFrame(fresh, vipTCP, tcpSYN, ""), tcOK)
	if want := tcpFrame(fresh, vipTCP, tcpSYN, "").withAddrs("", b.Addr.String()).bytes(); string(out) != string(want) {
		t.Errorf("new connection after the flood not sent to the active backend")
	}
	st, err := d.SweepConntrack(t.Context())
	must(t, err)
	t.Logf("after the flood: established %d, unreplied %d entries, evicted %d", st.Established, st.Unreplied, st.Evicted)
	if st.Established != 2*len(streams) {
		t.Errorf("established table holds %d entries, want %d", st.Established, 2*len(streams))
	}
}

// TestConntrackPromoteFull fills the established table: a flow that
// cannot be promoted goes on from the unreplied table, counted, and is
// promoted at a later refresh once there is room.
func TestConntrackPromoteFull(t *testing.T) {
	d := newDatapath(t, Options{MaxConntrack: 2, NewFlowsPerSource: NoSourceLimit})
	f := fe(vipTCP, TCP)
	mustSet(t, d, f, be(beTCP))
	first, second := flowOf("10.0.0.5:1000", vipTCP, beTCP, protoTCP), flowOf("10.0.0.6:1000", vipTCP, beTCP, protoTCP)
	handshake := func(client string, promoted stats) []pktCase {
		syn, synAck, ack := tcpFrame(client, vipTCP, tcpSYN, ""), tcpFrame(beTCP, client, tcpSYN|tcpACK, ""), tcpFrame(client, vipTCP, tcpACK, "")
		return []pktCase{
			{name: client + "_syn", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", beTCP)), fwd: f, newFlow: true, stats: newFlowStats(nil)},
			{name: client + "_syn_ack", hook: hookTC, in: synAck, out: ptr(synAck.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1}},
			{name: client + "_ack", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", beTCP)), fwd: f, stats: promoted},
		}
	}
	rows := handshake("10.0.0.5:1000", stats{StatConntrackPromoted: 1})
	rows = append(rows, handshake("10.0.0.6:1000", stats{StatConntrackPromoteFull: 1})...)
	data := tcpFrame("10.0.0.6:1000", vipTCP, tcpACK, "data")
	fin := tcpFrame("10.0.0.5:1000", vipTCP, tcpFIN|tcpACK, "")
	rows = append(rows,
		pktCase{name: "refused_flow_keeps_running_unassured", hook: hookTC, in: data, out: ptr(data.withAddrs("", beTCP)), fwd: f,
			after: expectTable(second, false)},
		pktCase{name: "first_closes_and_makes_room", hook: hookTC, in: fin, out: ptr(fin.withAddrs("", beTCP)), fwd: f,
			stats: stats{StatConntrackDemoted: 1}, after: expectTable(first, false)},
		pktCase{name: "refused_flow_promoted_at_its_next_refresh", hook: hookTC, in: data, out: ptr(data.withAddrs("", beTCP)), fwd: f,
			before: setExpires(second, TimeoutTCPSyn-2*time.Second),
			stats:  stats{StatConntrackPromoted: 1}, after: both(expectTable(second, true), expectState(second, tcCtStateCT_TCP_ESTABLISHED, TimeoutTCPEstablished))},
	)
	runTable(t, d, rows)
}

// TestConntrackSourceLimit spends one source's budget of new flows: its
// next new flow is dropped, a source whose budget is another cell's is
// not, sources whose hashes meet the first's share its cell's budget
// (so all sources together never start more than the cells' budgets
// allow: each is in one cell), and a flow of the first source that gets
// established gives its share back and proves the source, whose next new
// flows take from a budget of its own (tlb_ct_proven). In each family tc translates: an
// IPv6 source on a pod veth is its full address, so its /64 neighbour in
// another cell has its own budget.
func TestConntrackSourceLimit(t *testing.T) {
	for _, fam := range tcFamilies {
		t.Run(fam.name, func(t *testing.T) {
			// One flow a second, bursts of one: the second SYN within
			// the second is over the budget.
			d := newDatapath(t, Options{NewFlowsPerSource: 1})
			a := fam.addrs
			f := fe(a.vipTCP, TCP)
			mustSet(t, d, f, be(a.beTCP))
			clientAP := netip.MustParseAddrPort(a.client)
			cell := srcCell(d, clientAP.Addr(), uint8(tcScopeSCOPE_INTERNAL))
			at := func(addr netip.Addr, port uint16) string { return netip.AddrPortFrom(addr, port).String() }
			other := sourceNear(t, d, clientAP.Addr(), func(c uint32) bool { return c != cell })
			sharer1 := sourceNear(t, d, clientAP.Addr().Next(), func(c uint32) bool { return c == cell })
			sharer2 := sourceNear(t, d, sharer1.Next(), func(c uint32) bool { return c == cell })
			synA, synB := tcpFrame(at(clientAP.Addr(), 1000), a.vipTCP, tcpSYN, ""), tcpFrame(at(clientAP.Addr(), 1001), a.vipTCP, tcpSYN, "")
			synC := tcpFrame(at(clientAP.Addr(), 1002), a.vipTCP, tcpSYN, "")
			otherSyn := tcpFrame(at(other, 1000), a.vipTCP, tcpSYN, "")
			shareSyn1, shareSyn2 := tcpFrame(at(sharer1, 1000), a.vipTCP, tcpSYN, ""), tcpFrame(at(sharer2, 1000), a.vipTCP, tcpSYN, "")
			synAckA := tcpFrame(a.beTCP, at(clientAP.Addr(), 1000), tcpSYN|tcpACK, "")
			ackA := tcpFrame(at(clientAP.Addr(), 1000), a.vipTCP, tcpACK, "")
			t.Logf("source %s in cell %d, shared with %s and %s; %s in another", clientAP.Addr(), cell, sharer1, sharer2, other)
			runTable(t, d, []pktCase{
				{name: "first_flow_of_a_source", hook: hookTC, in: synA, out: ptr(synA.withAddrs("", a.beTCP)), fwd: f, newFlow: true, stats: newFlowStats(nil)},
				{name: "second_flow_over_its_budget", hook: hookTC, in: synB, want: drop, stats: stats{StatDropSourceLimit: 1}},
				{name: "a_source_of_another_cell_is_not_limited", hook: hookTC, in: otherSyn, out: ptr(otherSyn.withAddrs("", a.beTCP)), fwd: f, newFlow: true, stats: newFlowStats(nil)},
				{name: "a_source_sharing_the_cell_shares_its_budget", hook: hookTC, in: shareSyn1, want: drop, stats: stats{StatDropSourceLimit: 1}},
				{name: "every_source_sharing_the_cell_does", hook: hookTC, in: shareSyn2, want: drop, stats: stats{StatDropSourceLimit: 1}},
				{name: "first_flow_answered", hook: hookTC, in: synAckA, out: ptr(synAckA.withAddrs(a.vipTCP, "")), stats: stats{StatReverseNAT: 1}},
				{name: "first_flow_established_gives_its_share_back", hook: hookTC, in: ackA, out: ptr(ackA.withAddrs("", a.beTCP)), fwd: f,
					stats: stats{StatConntrackPromoted: 1}},
				// The completed handshake proved the source: its new flows
				// take from a budget of its own (eight times the cell's),
				// not from the cell its sharers spend.
				{name: "second_flow_now_served_from_the_proven_budget", hook: hookTC, in: synB, out: ptr(synB.withAddrs("", a.beTCP)), fwd: f, newFlow: true,
					stats: newFlowStats(stats{StatSourceProven: 1})},
				{name: "a_proven_source_goes_on_past_the_cell", hook: hookTC, in: synC, out: ptr(synC.withAddrs("", a.beTCP)), fwd: f, newFlow: true,
					stats: newFlowStats(stats{StatSourceProven: 1})},
			})
		})
	}
}

// sourceNear is the first address from start on (counting up) whose
// budget cell on a pod veth satisfies want.
func sourceNear(t *testing.T, d *Datapath, start netip.Addr, want func(cell uint32) bool) netip.Addr {
	t.Helper()
	a := start
	for range 1 << 24 {
		if want(srcCell(d, a, uint8(tcScopeSCOPE_INTERNAL))) {
			return a
		}
		a = a.Next()
	}
	t.Fatalf("no address from %s on in 2^24 with the cell wanted", start)
	return netip.Addr{}
}

// TestSNATPortReclaim gives SNAT one port: a flow holds it only while it
// lives. Unanswered, it lives TimeoutSNATUnreplied; once expired, the
// next flow takes the port over without a sweep, from either table; a
// reply gives the flow TimeoutSNATUnassured, the client's answer assures
// it.
func TestSNATPortReclaim(t *testing.T) {
	one := portrange.Range{Min: 61000, Max: 61000}
	e := newFwdEnv(t, Options{SNATPorts: one})
	f := extFrontend(nodeAddr+":30082", TCP)
	backend := ap(beNode2, 8080)
	mustSet(t, e.d, f, be(backend))
	natSrc := ap(nodeAddr, 61000)
	c1, c2, c3 := ap(outside, 40000), ap(outside, 40001), ap(outside, 40002)
	flowOfClient := func(c string) flowKeys {
		return flowKeys{fwd: ctKey(c, f.Addr.String(), protoTCP), rev: ctKey(backend, natSrc, protoTCP)}
	}
	syn := func(c string) frame { return tcpFrame(c, f.Addr.String(), tcpSYN, "") }
	toBackend := func(fr frame) *frame { return ptr(fr.withAddrs(natSrc, backend).forwarded(e.mac["up0"], macNode2)) }
	synAck := tcpFrame(backend, natSrc, tcpSYN|tcpACK, "")
	ack := tcpFrame(c2, f.Addr.String(), tcpACK, "")
	newSNAT := stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2}
	reclaimed := newSNAT.plus(stats{StatSNATReclaimed: 1, StatConntrackReplaced: 1})
	runTable(t, e.d, []pktCase{
		{name: "unanswered_flow_holds_the_port_for_seconds", hook: hookXDP, env: e, iif: "up0", in: syn(c1), out: toBackend(syn(c1)), ret: xdpTX,
			fwd: f, newFlow: true, stats: newSNAT, after: expectExpires(flowOfClient(c1), TimeoutSNATUnreplied)},
		{name: "port_held_while_the_flow_lives", hook: hookXDP, env: e, iif: "up0", in: syn(c2),
			want: drop, stats: stats{StatSNATCollision: uint64(SNATRetries), StatDropSNATExhausted: 1}},
		{name: "expired_unreplied_holder_reclaimed", hook: hookXDP, env: e, iif: "up0", in: syn(c2), out: toBackend(syn(c2)), ret: xdpTX,
			before: setExpires(flowOfClient(c1), -time.Millisecond),
			fwd:    f, newFlow: true, stats: reclaimed, after: expectExpires(flowOfClient(c2), TimeoutSNATUnreplied)},
		{name: "reply_gives_the_unassured_timeout", hook: hookXDP, env: e, iif: "up0", in: synAck,
			out: ptr(synAck.withAddrs(f.Addr.String(), c2).forwarded(e.mac["up0"], macRouter)), ret: xdpTX, stats: stats{StatReverseNAT: 1},
			after: both(expectExpires(flowOfClient(c2), TimeoutSNATUnassured), expectTable(flowOfClient(c2), false))},
		{name: "client_answer_assures", hook: hookXDP, env: e, iif: "up0", in: ack, out: toBackend(ack), ret: xdpTX, fwd: f,
			stats: stats{StatConntrackPromoted: 1},
			after: both(expectExpires(flowOfClient(c2), TimeoutTCPEstablished), expectTable(flowOfClient(c2), true))},
		{name: "expired_established_holder_reclaimed", hook: hookXDP, env: e, iif: "up0", in: syn(c3), out: toBackend(syn(c3)), ret: xdpTX,
			before: setExpires(flowOfClient(c2), -time.Millisecond),
			fwd:    f, newFlow: true, stats: reclaimed, after: expectTable(flowOfClient(c3), false)},
	})
}

// TestSNATPortEviction gives SNAT one port and fills it with a flow the
// backend answered but its client did not, as a spoofed source's: a new
// flow that finds no free port takes it (StatSNATEvicted), in TCP (no
// handshake-completing ACK) and UDP (no datagram after the reply). A flow
// not answered yet, or assured (its client answered), is never evicted.
// The evicted flow's forward entry finds its reply entry gone at its next
// packet and is balanced as new. Before eviction, such a flow held the
// port for TimeoutTCPSyn (UDP: promoted by the reply, TimeoutUDP) against
// every new flow.
func TestSNATPortEviction(t *testing.T) {
	one := portrange.Range{Min: 61000, Max: 61000}
	e := newFwdEnv(t, Options{SNATPorts: one})
	natSrc := ap(nodeAddr, 61000)
	backend := ap(beNode2, 8080)
	c1, c2, c3 := ap(outside, 40000), ap(outside, 40001), ap(outside, 40002)
	newSNAT := stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2}
	exhausted := stats{StatSNATCollision: uint64(SNATRetries), StatDropSNATExhausted: 1}
	evicted := newSNAT.plus(stats{StatSNATCollision: uint64(SNATRetries), StatSNATEvicted: 1, StatConntrackReplaced: 1})
	toBackend := func(fr frame) *frame { return ptr(fr.withAddrs(natSrc, backend).forwarded(e.mac["up0"], macNode2)) }

	t.Run("tcp", func(t *testing.T) {
		f := extFrontend(nodeAddr+":30082", TCP)
		mustSet(t, e.d, f, be(backend))
		flowOfClient := func(c string) flowKeys {
			return flowKeys{fwd: ctKey(c, f.Addr.String(), protoTCP), rev: ctKey(backend, natSrc, protoTCP)}
		}
		syn := func(c string) frame { return tcpFrame(c, f.Addr.String(), tcpSYN, "") }
		synAck := tcpFrame(backend, natSrc, tcpSYN|tcpACK, "")
		toClient := func(c string) *frame {
			return ptr(synAck.withAddrs(f.Addr.String(), c).forwarded(e.mac["up0"], macRouter))
		}
		ack := func(c string) frame { return tcpFrame(c, f.Addr.String(), tcpACK, "") }
		runTable(t, e.d, []pktCase{
			{name: "first_flow", hook: hookXDP, env: e, iif: "up0", in: syn(c1), out: toBackend(syn(c1)), ret: xdpTX,
				fwd: f, newFlow: true, stats: newSNAT},
			{name: "unanswered_holder_kept", hook: hookXDP, env: e, iif: "up0", in: syn(c2), want: drop, stats: exhausted},
			{name: "backend_answers", hook: hookXDP, env: e, iif: "up0", in: synAck, out: toClient(c1), ret: xdpTX,
				stats: stats{StatReverseNAT: 1},
				after: both(expectExpires(flowOfClient(c1), TimeoutSNATUnassured), expectTable(flowOfClient(c1), false))},
			{name: "unassured_holder_evicted", hook: hookXDP, env: e, iif: "up0", in: syn(c2), out: toBackend(syn(c2)), ret: xdpTX,
				fwd: f, newFlow: true, stats: evicted, after: expectExpires(flowOfClient(c2), TimeoutSNATUnreplied)},
			{name: "backend_answers_the_new_flow", hook: hookXDP, env: e, iif: "up0", in: synAck, out: toClient(c2), ret: xdpTX,
				stats: stats{StatReverseNAT: 1}},
			{name: "new_flow_assured", hook: hookXDP, env: e, iif: "up0", in: ack(c2), out: toBackend(ack(c2)), ret: xdpTX, fwd: f,
				stats: stats{StatConntrackPromoted: 1},
				after: both(expectExpires(flowOfClient(c2), TimeoutTCPEstablished), expectTable(flowOfClient(c2), true))},
			{name: "assured_holder_kept", hook: hookXDP, env: e, iif: "up0", in: syn(c3), want: drop, stats: exhausted},
			{name: "evicted_flow_orphaned", hook: hookXDP, env: e, iif: "up0", in: ack(c1), want: drop,
				stats: exhausted.plus(stats{StatConntrackOrphan: 1})},
		})
	})

	t.Run("udp", func(t *testing.T) {
		f := extFrontend(nodeAddr+":30083", UDP)
		mustSet(t, e.d, f, be(backend))
		flowOfClient := func(c string) flowKeys {
			return flowKeys{fwd: ctKey(c, f.Addr.String(), protoUDP), rev: ctKey(backend, natSrc, protoUDP)}
		}
		q := func(c string) frame { return udpFrame(c, f.Addr.String(), "q") }
		answer := udpFrame(backend, natSrc, "a")
		toClient := func(c string) *frame {
			return ptr(answer.withAddrs(f.Addr.String(), c).forwarded(e.mac["up0"], macRouter))
		}
		runTable(t, e.d, []pktCase{
			{name: "first_flow", hook: hookXDP, env: e, iif: "up0", in: q(c1), out: toBackend(q(c1)), ret: xdpTX,
				fwd: f, newFlow: true, stats: newSNAT},
			{name: "unanswered_holder_kept", hook: hookXDP, env: e, iif: "up0", in: q(c2), want: drop, stats: exhausted},
			{name: "reply_does_not_assure", hook: hookXDP, env: e, iif: "up0", in: answer, out: toClient(c1), ret: xdpTX,
				stats: stats{StatReverseNAT: 1},
				after: both(expectState(flowOfClient(c1), tcCtStateCT_UDP, TimeoutSNATUnassured), expectTable(flowOfClient(c1), false))},
			{name: "unassured_holder_evicted", hook: hookXDP, env: e, iif: "up0", in: q(c2), out: toBackend(q(c2)), ret: xdpTX,
				fwd: f, newFlow: true, stats: evicted},
			{name: "backend_answers_the_new_flow", hook: hookXDP, env: e, iif: "up0", in: answer, out: toClient(c2), ret: xdpTX,
				stats: stats{StatReverseNAT: 1}},
			{name: "client_sends_again_assured", hook: hookXDP, env: e, iif: "up0", in: q(c2), out: toBackend(q(c2)), ret: xdpTX, fwd: f,
				stats: stats{StatConntrackPromoted: 1},
				after: both(expectState(flowOfClient(c2), tcCtStateCT_UDP, TimeoutUDP), expectTable(flowOfClient(c2), true))},
			{name: "assured_holder_kept", hook: hookXDP, env: e, iif: "up0", in: q(c3), want: drop, stats: exhausted},
		})
	})
}

// TestSweepDeletesOrphans plants, in each family, a flow whose reply
// entry is gone (as an LRU eviction leaves it) and a source-translated
// flow: the sweep deletes the orphan, keeps the whole flow, counts the
// SNAT port by backend and each table's live entries in the family's
// counts.
func TestSweepDeletesOrphans(t *testing.T) {
	for _, c := range []struct {
		name                                      string
		a                                         tcAddrs
		snatClient, snatVIP, snatBackend, snatNAT string
	}{
		{"ipv4", tcFamilies[0].addrs, "192.0.2.1:5000", "10.250.0.1:30080", "10.244.2.10:8080", "10.250.0.1:61000"},
		{"ipv6", tcFamilies[1].addrs, "[2001:db8:113::1]:5000", "[fd00:250::1]:30080", "[fd00:244:2::10]:8080", "[fd00:250::1]:61000"},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := setupTableFor(t, c.a)
			ip := netip.MustParseAddrPort(c.a.client).Addr()
			src := func(i int) string { return netip.AddrPortFrom(ip, uint16(1000+i)).String() }
			for i := range 2 {
				if ret, _ := run(t, d.tcProg, tcpFrame(src(i), c.a.vipTCP, tcpSYN, "").bytes()); ret != tcOK {
					t.Fatalf("SYN from %s: verdict %d", src(i), ret)
				}
			}
			// The second flow's reply entry, evicted.
			must(t, ctEdit(d, c.a.beTCP, src(1), protoTCP, func(m *ebpf.Map, k any) error { return m.Delete(k) }))
			plantSNATFlow(c.snatClient, c.snatVIP, c.snatBackend, c.snatNAT, protoTCP)(t, d)

			st, err := d.SweepConntrack(t.Context())
			must(t, err)
			t.Logf("%+v", st)
			if st.Orphans != 1 {
				t.Errorf("orphans deleted = %d, want 1", st.Orphans)
			}
			if err := ctEdit(d, src(1), c.a.vipTCP, protoTCP, nil); !errors.Is(err, ebpf.ErrKeyNotExist) {
				t.Errorf("the orphaned forward entry is still there: %v", err)
			}
			for _, k := range [][2]string{{src(0), c.a.vipTCP}, {c.a.beTCP, src(0)}} {
				if err := ctEdit(d, k[0], k[1], protoTCP, nil); err != nil {
					t.Errorf("entry %s -> %s of the whole flow: %v", k[0], k[1], err)
				}
			}
			if got := st.SNATPorts[netip.MustParseAddrPort(c.snatBackend)]; got != 1 || len(st.SNATPorts) != 1 {
				t.Errorf("SNAT ports in use = %v, want 1 for %s", st.SNATPorts, c.snatBackend)
			}
			want := [4]int{2, 2, 0, 0} // established and unreplied: IPv4's, IPv6's
			if ip.Is6() {
				want = [4]int{0, 0, 2, 2}
			}
			if got := [4]int{st.Established, st.Unreplied, st.Established6, st.Unreplied6}; got != want {
				t.Errorf("live entries (established, unreplied; IPv4's, IPv6's) %v, want %v", got, want)
			}
			if want := map[ConntrackKind]int{{TCP, "established"}: 2, {TCP, "syn_sent"}: 2}; fmt.Sprint(st.Live) != fmt.Sprint(want) {
				t.Errorf("live = %v, want %v", st.Live, want)
			}
		})
	}
}

// ctEdit calls f, when not nil, with the table of either family
// (IPv4's or IPv6's, as src's address is) that holds the entry from src
// to dst, and a pointer to its key; it returns f's error, or the lookup's
// (ebpf.ErrKeyNotExist when no table holds it).
func ctEdit(d *Datapath, src, dst string, proto uint8, f func(m *ebpf.Map, key any) error) error {
	var key, val any
	ts := d.ctTables()
	if netip.MustParseAddrPort(src).Addr().Is4() {
		k := ctKey(src, dst, proto)
		key, val = &k, new(tcCtValue)
	} else {
		k := ct6Key(src, dst, proto)
		key, val, ts = &k, new(tcCt6Value), d.ct6Tables()
	}
	for _, m := range ts {
		err := m.Lookup(key, val)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue
		}
		if err != nil || f == nil {
			return err
		}
		return f(m, key)
	}
	return ebpf.ErrKeyNotExist
}

// TestConntrackOrphanForward evicts a flow's reply entry, as the LRU of
// the unreplied table may: the forward entry's next refresh finds its
// partner gone, deletes itself, and the packet creates the flow afresh,
// both entries again.
func TestConntrackOrphanForward(t *testing.T) {
	d := setupTable(t)
	flow := flowOf(client, vipUDP, beUDP, protoUDP)
	q := udpFrame(client, vipUDP, "q")
	evictReply := func(t *testing.T, d *Datapath) {
		must(t, d.ctNew.Delete(&flow.rev))
		setExpires(flowKeys{fwd: flow.fwd, rev: flow.fwd}, 30*time.Second)(t, d)
	}
	runTable(t, d, []pktCase{
		{name: "udp_flow", hook: hookTC, in: q, out: ptr(q.withAddrs("", beUDP)), fwd: fe(vipUDP, UDP), newFlow: true, stats: newFlowStats(nil)},
		{name: "reply_entry_evicted_forward_recreates_both", before: evictReply, hook: hookTC, in: q, out: ptr(q.withAddrs("", beUDP)),
			fwd: fe(vipUDP, UDP), newFlow: true, stats: newFlowStats(stats{StatConntrackOrphan: 1}),
			after: both(expectState(flow, tcCtStateCT_UDP, TimeoutUDP), expectTable(flow, false))},
	})
}

// TestConntrackSizeFor checks the memory rule of the default table size.
func TestConntrackSizeFor(t *testing.T) {
	const gib = uint64(1) << 30
	for _, c := range []struct {
		name string
		mem  uint64
		want uint32
	}{
		{"tiny", 512 << 20, 32768},
		{"4GiB", 4 * gib, 65536},
		{"8GiB", 8 * gib, 131072},
		{"23GiB", 23 * gib, 262144},
		{"64GiB", 64 * gib, 1 << 20},
		{"1TiB", 1024 * gib, 1 << 20},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := ConntrackSizeFor(c.mem); got != c.want {
				t.Errorf("ConntrackSizeFor(%d) = %d, want %d", c.mem, got, c.want)
			}
		})
	}
}

// TestConntrackReplyKeyReused: a client port reused for another frontend
// of the same backend gives the new flow the reply key of the old one,
// which was promoted into tlb_conntrack. The new flow's replies must show
// the new frontend.
func TestConntrackReplyKeyReused(t *testing.T) {
	d := newDatapath(t, Options{})
	f1, f2 := fe("10.96.0.10:53", UDP), fe("10.96.0.11:53", UDP)
	mustSet(t, d, f1, be(beUDP))
	mustSet(t, d, f2, be(beUDP))
	q1, q2 := udpFrame(client, "10.96.0.10:53", "q"), udpFrame(client, "10.96.0.11:53", "q")
	a := udpFrame(beUDP, client, "a")
	runTable(t, d, []pktCase{
		{name: "flow_to_f1", hook: hookTC, in: q1, out: ptr(q1.withAddrs("", beUDP)), fwd: f1, newFlow: true, stats: newFlowStats(nil)},
		{name: "f1_reply_promotes", hook: hookTC, in: a, out: ptr(a.withAddrs("10.96.0.10:53", "")), stats: stats{StatReverseNAT: 1, StatConntrackPromoted: 1}},
		{name: "same_port_to_f2", hook: hookTC, in: q2, out: ptr(q2.withAddrs("", beUDP)), fwd: f2, newFlow: true,
			stats: newFlowStats(stats{StatConntrackReplaced: 1})},
		{name: "reply_shows_f2", hook: hookTC, in: a, out: ptr(a.withAddrs("10.96.0.11:53", "")), stats: stats{StatReverseNAT: 1, StatConntrackPromoted: 1}},
	})
}

// TestConntrackFloodFromOneCell floods SYNs from many sources whose
// hashes meet in one budget cell (spoofed sources that an attacker cannot
// aim at a cell without the load's seed; the test finds them with the Go
// mirror): together they start no more flows than that one cell's budget
// allows, a source of another cell still starts its flow, and the
// unreplied flow a bystander had before the flood is still there.
func TestConntrackFloodFromOneCell(t *testing.T) {
	const burst, sources, synsEach = 4, 32, 8
	d := newDatapath(t, Options{NewFlowsPerSource: burst})
	f := fe(vipTCP, TCP)
	mustSet(t, d, f, be(beTCP))
	bystander := netip.MustParseAddrPort("192.0.2.10:30000")
	if ret, _ := run(t, d.tcProg, tcpFrame(bystander.String(), vipTCP, tcpSYN, "").bytes()); ret != tcOK {
		t.Fatalf("bystander's SYN: verdict %d", ret)
	}
	cell := srcCell(d, netip.MustParseAddr("10.0.0.5"), uint8(tcScopeSCOPE_INTERNAL))
	inCell := func(c uint32) bool { return c == cell }
	flood := []netip.Addr{sourceNear(t, d, netip.MustParseAddr("10.0.0.5"), inCell)}
	for len(flood) < sources {
		flood = append(flood, sourceNear(t, d, flood[len(flood)-1].Next(), inCell))
	}
	before, err := d.Counters()
	must(t, err)
	start := time.Now()
	for i, src := range flood {
		for j := range synsEach {
			syn := tcpFrame(netip.AddrPortFrom(src, uint16(1024+i*synsEach+j)).String(), vipTCP, tcpSYN, "")
			if ret, _ := run(t, d.tcProg, syn.bytes()); ret != tcOK && ret != tcShot {
				t.Fatalf("flood SYN from %s: verdict %d", src, ret)
			}
		}
	}
	elapsed := time.Since(start)
	after, err := d.Counters()
	must(t, err)
	created := after.Stats[StatConntrackCreated] - before.Stats[StatConntrackCreated]
	limited := after.Stats[StatDropSourceLimit] - before.Stats[StatDropSourceLimit]
	// The cell refills burst cells a second while the flood runs.
	allowed := uint64(burst) + uint64(elapsed.Seconds()*burst) + 1
	t.Logf("%d SYNs from %d sources of cell %d in %v: %d flows created, %d dropped (allowed %d)",
		sources*synsEach, sources, cell, elapsed, created, limited, allowed)
	if created+limited != sources*synsEach {
		t.Fatalf("created %d + dropped %d, want the flood's %d SYNs", created, limited, sources*synsEach)
	}
	if created == 0 || created > allowed {
		t.Errorf("the flood created %d flows; one cell's budget is %d (%d with the refill over %v)", created, burst, allowed, elapsed)
	}
	other := sourceNear(t, d, netip.MustParseAddr("10.0.0.6"), func(c uint32) bool { return c != cell })
	if ret, _ := run(t, d.tcProg, tcpFrame(netip.AddrPortFrom(other, 1000).String(), vipTCP, tcpSYN, "").bytes()); ret != tcOK {
		t.Errorf("a source of another cell after the flood: verdict %d, want its flow", ret)
	}
	expectTable(flowOf(bystander.String(), vipTCP, beTCP, protoTCP), false)(t, d)
}
