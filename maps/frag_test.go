package maps

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
)

// fragSize is the tables' fragment payload: three fragments of a 64-byte
// datagram with its 8-byte UDP header.
const fragSize = 24

// fragPayload is a datagram's payload, distinct per seed so a fragment of
// one datagram never passes for another's.
func fragPayload(seed byte) string {
	b := make([]byte, 64)
	for i := range b {
		b[i] = seed + byte(i)
	}
	return string(b)
}

// fragRows are the fragments of a datagram from cl to the frontend vip
// of the hook's scope (served by backend be, on this node) and of its
// reply, through hook h, in the family of the addresses.
func fragRows(h hook, cl, vip, be string, f Frontend) []pktCase {
	dg := udpFrame(cl, vip, fragPayload(1))
	dg.ipID = 0x4242
	in, out := fragmentsOf(dg, fragSize), fragmentsOf(dg.withAddrs("", be), fragSize)
	other := in[1]
	other.ipID = 0x4243
	reply := udpFrame(be, cl, fragPayload(2))
	reply.ipID = 0x5151
	rin, rout := fragmentsOf(reply, fragSize), fragmentsOf(reply.withAddrs(vip, ""), fragSize)
	icmp := frame{src: dg.src, dst: dg.dst, proto: protoICMP, payload: []byte("big ping"), moreFrags: true}
	// An IPv6 fragment is a fragment header and a slice of the datagram.
	icmp.rawL4 = dg.is6()
	return []pktCase{
		// Before its first, a later fragment has no ports: it passes
		// untranslated (and the datagram never reaches the backend
		// whole; frag.h).
		{name: "later_fragment_before_its_first_passes", hook: h, in: in[2], want: pass, stats: stats{StatFragment: 1}},
		// The first fragment's UDP length counts the whole datagram,
		// beyond the fragment: a new flow all the same.
		{name: "first_fragment_translated", hook: h, in: in[0], out: &out[0], fwd: f, newFlow: true,
			stats: newFlowStats(stats{StatFragFirst: 1})},
		// Any order after the first: the last before the middle.
		{name: "last_fragment_follows", hook: h, in: in[2], out: &out[2], fwd: f, stats: stats{StatFragFollowed: 1}},
		{name: "middle_fragment_follows", hook: h, in: in[1], out: &out[1], fwd: f, stats: stats{StatFragFollowed: 1}},
		{name: "duplicate_fragment_follows", hook: h, in: in[1], out: &out[1], fwd: f, stats: stats{StatFragFollowed: 1}},
		{name: "fragment_of_another_datagram_passes", hook: h, in: other, want: pass, stats: stats{StatFragment: 1}},
		// Replies in fragments, from the backend: the first promotes
		// the flow.
		{name: "reply_first_fragment_translated", hook: h, in: rin[0], out: &rout[0],
			stats: stats{StatReverseNAT: 1, StatConntrackPromoted: 1, StatFragFirst: 1}},
		{name: "reply_later_fragment_follows", hook: h, in: rin[2], out: &rout[2], stats: stats{StatReverseNAT: 1, StatFragFollowed: 1}},
		{name: "reply_middle_fragment_follows", hook: h, in: rin[1], out: &rout[1], stats: stats{StatReverseNAT: 1, StatFragFollowed: 1}},
		{name: "icmp_fragment_passes", hook: h, in: icmp, want: pass, stats: stats{StatFragment: 1}},
	}
}

// TestFragmentsTC runs a Service's fragmented datagram and its reply
// through tc on a pod's veth.
func TestFragmentsTC(t *testing.T) {
	d := setupTable(t)
	runTable(t, d, fragRows(hookTC, client, vipUDP, beUDP, fe(vipUDP, UDP)))
}

// TestFragmentsTC6 is TestFragmentsTC in IPv6: fragment headers with
// 32-bit identifications, remembered in tlb_frags6; a datagram whose
// identification differs from the first's in its high 16 bits only is
// another datagram.
func TestFragmentsTC6(t *testing.T) {
	a := tcFamilies[1].addrs
	d := setupTableFor(t, a)
	dg := udpFrame(a.client, a.vipUDP, fragPayload(1))
	dg.ipID = 0x4242
	high := fragmentsOf(dg, fragSize)[2]
	high.ipID6 = 0x10000 | 0x4242
	rows := append(fragRows(hookTC, a.client, a.vipUDP, a.beUDP, fe(a.vipUDP, UDP)),
		pktCase{name: "fragment_of_another_32_bit_id_passes", hook: hookTC, in: high, want: pass, stats: stats{StatFragment: 1}})
	runTable(t, d, rows)
}

// TestFragmentsXDP runs them through XDP on an uplink, to an external
// frontend whose backend is on this node.
func TestFragmentsXDP(t *testing.T) {
	d := setupTable(t)
	const vip, be = "192.0.2.10:53", "10.1.1.4:5353"
	f := Frontend{Addr: netip.MustParseAddrPort(vip), Proto: UDP, Scope: ScopeExternal}
	mustSet(t, d, f, Backend{Addr: netip.MustParseAddrPort(be), NodeLocal: true})
	runTable(t, d, fragRows(hookXDP, client, vip, be, f))
}

// TestFragmentsXDP6 is TestFragmentsXDP in IPv6, on both uplink paths:
// XDP (xdp_lb6) and tc alone (tc_uplink_lb).
func TestFragmentsXDP6(t *testing.T) {
	const cl, vip, be = "[2001:db8::7]:40000", "[2001:db8:100::10]:53", "[fd00:1:1::4]:5353"
	f := Frontend{Addr: netip.MustParseAddrPort(vip), Proto: UDP, Scope: ScopeExternal}
	for _, h := range []hook{hookXDP, hookUplinkTC} {
		t.Run(string(h), func(t *testing.T) {
			d := setupTable(t)
			mustSet(t, d, f, Backend{Addr: netip.MustParseAddrPort(be), NodeLocal: true})
			runTable(t, d, fragRows(h, cl, vip, be, f))
		})
	}
}

// TestFragmentsTCP: a TCP segment in fragments (a sender with DF off)
// follows the same way, in both families.
func TestFragmentsTCP(t *testing.T) {
	for _, fam := range tcFamilies {
		t.Run(fam.name, func(t *testing.T) {
			a := fam.addrs
			d := setupTableFor(t, a)
			f := fe(a.vipTCP, TCP)
			seg := tcpFrame(a.client, a.vipTCP, tcpSYN, fragPayload(3))
			seg.ipID = 0x6161
			in, out := fragmentsOf(seg, fragSize), fragmentsOf(seg.withAddrs("", a.beTCP), fragSize)
			runTable(t, d, []pktCase{
				{name: "first_fragment_translated", hook: hookTC, in: in[0], out: &out[0], fwd: f, newFlow: true,
					stats: newFlowStats(stats{StatFragFirst: 1})},
				{name: "later_fragment_follows", hook: hookTC, in: in[1], out: &out[1], fwd: f, stats: stats{StatFragFollowed: 1}},
			})
		})
	}
}

// TestFragmentTimeout: a first fragment's ports are forgotten after
// FRAG_TIMEOUT; a later fragment then passes untranslated. The entry's
// expiry is moved into the past, as time would. In both families, each
// over its own table.
func TestFragmentTimeout(t *testing.T) {
	for _, fam := range tcFamilies {
		t.Run(fam.name, func(t *testing.T) { testFragmentTimeout(t, fam.addrs) })
	}
}

func testFragmentTimeout(t *testing.T, a tcAddrs) {
	d := setupTableFor(t, a)
	f := fe(a.vipUDP, UDP)
	dg := udpFrame(a.client, a.vipUDP, fragPayload(4))
	dg.ipID = 0x7171
	in, out := fragmentsOf(dg, fragSize), fragmentsOf(dg.withAddrs("", a.beUDP), fragSize)
	table := d.frags
	if dg.is6() {
		table = d.frags6
	}
	expire := func(t *testing.T, d *Datapath) {
		var (
			key, val []byte
			n        int
		)
		iter := table.Iterate()
		for iter.Next(&key, &val) {
			// struct frag_value: sport, dport, pad, then expires.
			binary.LittleEndian.PutUint64(val[8:], 1)
			if err := table.Update(key, val, ebpf.UpdateExist); err != nil {
				t.Fatal(err)
			}
			n++
		}
		if err := iter.Err(); err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Fatalf("%d entries in the family's fragment table, want the datagram's 1", n)
		}
	}
	runTable(t, d, []pktCase{
		{name: "first_fragment_translated", hook: hookTC, in: in[0], out: &out[0], fwd: f, newFlow: true,
			stats: newFlowStats(stats{StatFragFirst: 1})},
		{name: "later_fragment_in_time_follows", hook: hookTC, in: in[1], out: &out[1], fwd: f, stats: stats{StatFragFollowed: 1}},
		{name: "later_fragment_after_the_timeout_passes", before: expire, hook: hookTC, in: in[2], want: pass, stats: stats{StatFragment: 1}},
	})
}

// TestFragmentsBounded: tlb_frags is an LRU of fixed size, so fragments
// cannot take more memory than that whatever arrives.
func TestFragmentsBounded(t *testing.T) {
	d := newDatapath(t, Options{})
	info, err := d.frags.Info()
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != ebpf.LRUHash || info.MaxEntries != uint32(tcMapSizeDEFAULT_MAX_FRAGS) {
		t.Errorf("tlb_frags is %s of %d entries, want an LRU hash of %d", info.Type, info.MaxEntries, tcMapSizeDEFAULT_MAX_FRAGS)
	}
}

// TestFragmentsOf checks the tables' fragment builder against the rule it
// follows: the slices put back together are the datagram's L4 bytes.
func TestFragmentsOf(t *testing.T) {
	dg := udpFrame(client, vipUDP, fragPayload(5))
	frags := fragmentsOf(dg, fragSize)
	if len(frags) != 3 {
		t.Fatalf("%d fragments, want 3", len(frags))
	}
	var whole []byte
	for i, f := range frags {
		b := f.bytes()
		whole = append(whole, b[14+20:]...)
		off := binary.BigEndian.Uint16(b[14+6:])
		if int(off&0x1fff)*8 != i*fragSize || (off&0x2000 != 0) != (i < 2) {
			t.Errorf("fragment %d: frag_off %#x", i, off)
		}
	}
	if !bytes.Equal(whole, dg.bytes()[14+20:]) {
		t.Error("fragments do not add up to the datagram")
	}
}

// TestFragmentsRefusedTakeNoEntry: a first fragment the core drops (from
// outside the frontend's source ranges, or over its source's budget of
// new flows) takes no tlb_frags entry, so a refused sender can neither
// fill the table nor have later fragments translated; the check comes
// first, the entry after (frag.h).
func TestFragmentsRefusedTakeNoEntry(t *testing.T) {
	noEntry := func(t *testing.T, d *Datapath) {
		if n := countEntries[tcFragKey, tcFragValue](t, d.frags); n != 0 {
			t.Errorf("%d entries in tlb_frags, want none", n)
		}
	}
	t.Run("source_ranges", func(t *testing.T) {
		d := setupTable(t)
		f := fe("192.0.2.30:53", UDP)
		mustSetService(t, d, f, Service{Backends: []Backend{be(beUDP)}, SourceRanges: []netip.Prefix{netip.MustParsePrefix("10.0.0.2/32")}})
		dg := udpFrame(client3, f.Addr.String(), fragPayload(6))
		dg.ipID = 0x8181
		in := fragmentsOf(dg, fragSize)
		runTable(t, d, []pktCase{
			{name: "first_fragment_outside_the_ranges_dropped", hook: hookTC, in: in[0], want: drop,
				stats: stats{StatDropSourceRange: 1}, after: noEntry},
			{name: "later_fragment_passes_untranslated", hook: hookTC, in: in[1], want: pass, stats: stats{StatFragment: 1}},
		})
	})
	t.Run("source_budget", func(t *testing.T) {
		// One new flow a second per source, bursts of one: the
		// second datagram's first fragment is over the budget.
		d := newDatapath(t, Options{NewFlowsPerSource: 1})
		f := fe(vipUDP, UDP)
		mustSet(t, d, f, be(beUDP))
		first := udpFrame(client, vipUDP, fragPayload(7))
		first.ipID = 0x9191
		over := udpFrame(client2, vipUDP, fragPayload(8))
		over.ipID = 0x9292
		in, out, overIn := fragmentsOf(first, fragSize), fragmentsOf(first.withAddrs("", beUDP), fragSize), fragmentsOf(over, fragSize)
		runTable(t, d, []pktCase{
			{name: "first_fragment_within_the_budget_translated", hook: hookTC, in: in[0], out: &out[0], fwd: f, newFlow: true,
				stats: newFlowStats(stats{StatFragFirst: 1})},
			{name: "first_fragment_over_the_budget_dropped", hook: hookTC, in: overIn[0], want: drop,
				stats: stats{StatDropSourceLimit: 1}, after: func(t *testing.T, d *Datapath) {
					if n := countEntries[tcFragKey, tcFragValue](t, d.frags); n != 1 {
						t.Errorf("%d entries in tlb_frags, want the translated datagram's 1", n)
					}
				}},
			{name: "its_later_fragment_passes_untranslated", hook: hookTC, in: overIn[1], want: pass, stats: stats{StatFragment: 1}},
		})
	})
}
