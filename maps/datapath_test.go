package maps

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
)

// verdict is what a row expects, independent of the hook's numbering.
type verdict int

const (
	pass verdict = iota
	drop
)

// stats are expected changes of named counters; a counter not listed must
// not change.
type stats map[Stat]uint64

// pktCase is one packet through one hook.
type pktCase struct {
	name string
	// before runs ahead of the packet: programs a change, plants map
	// entries. Counters are read after it.
	before func(t *testing.T, d *Datapath)
	hook   hook
	in     frame
	want   verdict
	// out is the expected output frame; nil means byte-for-byte
	// unchanged. Ignored for drops.
	out *frame
	// fwd is the frontend whose forward counters the packet must bump;
	// the zero Frontend means none. newFlow says it also counts a new
	// flow there.
	fwd     Frontend
	newFlow bool
	stats   stats
	// after runs after the packet's checks: inspects map entries.
	after func(t *testing.T, d *Datapath)

	// Forwarding rows (forward_test.go) run in env's node namespace, the
	// packet arriving on interface iif. ret, when not 0, is the exact
	// verdict expected (want is then ignored); meta is the XDP metadata
	// expected in front of the output frame (nil: none).
	env  *fwdEnv
	iif  string
	ret  uint32
	meta *tcFwdMeta
}

func (c pktCase) runOn(t *testing.T, d *Datapath) {
	t.Helper()
	in := c.in.bytes()
	prog, okV, dropV := d.tcProg, uint32(tcOK), uint32(tcShot)
	switch c.hook {
	case hookXDP:
		prog, okV, dropV = d.xdpProg, xdpPass, xdpDrop
	case hookTCEgress:
		prog = d.tcEgressProg
	case hookUplinkTC:
		prog = d.uplinkLBProg
	case hookUplinkBesideXDP:
		prog = d.uplinkProg
	}
	var (
		ret       uint32
		out, meta []byte
	)
	if c.env != nil {
		ret, out, meta = c.env.run(t, c.hook, prog, in, c.iif)
	} else {
		ret, out = run(t, prog, in)
	}
	wantRet := okV
	if c.want == drop {
		wantRet = dropV
	}
	if c.ret != 0 {
		wantRet = c.ret
	}
	if ret != wantRet {
		t.Fatalf("verdict = %d, want %d", ret, wantRet)
	}
	if wantRet == dropV {
		return
	}
	checkMeta(t, meta, c.meta)
	want := in
	if c.out != nil {
		want = c.out.bytes()
		verify := func(b []byte) error { _, err := verifyChecksums(b); return err }
		if c.out.proto == protoICMP {
			verify = verifyICMP
		}
		if err := verify(out); err != nil {
			t.Errorf("output checksums: %v", err)
		}
	}
	if !bytes.Equal(out, want) {
		t.Errorf("output differs\n got %x\nwant %x", out, want)
	}
}

// l3Len is the L3 length of a rendered frame: IPv4's total length, the
// IPv6 header's 40 bytes and its payload length.
func l3Len(b []byte) uint64 {
	if binary.BigEndian.Uint16(b[12:]) == 0x86dd {
		return 40 + uint64(binary.BigEndian.Uint16(b[18:]))
	}
	return uint64(binary.BigEndian.Uint16(b[16:]))
}

// runTable runs rows in order (conntrack state carries over) and checks
// every row's verdict, output and counter deltas, then the per-frontend
// totals.
func runTable(t *testing.T, d *Datapath, rows []pktCase) {
	t.Helper()
	fwd := make(map[Frontend]Traffic)
	for _, c := range rows {
		t.Run(c.name, func(t *testing.T) {
			if c.before != nil {
				c.before(t, d)
			}
			before, err := d.Counters()
			if err != nil {
				t.Fatal(err)
			}
			c.runOn(t, d)
			after, err := d.Counters()
			if err != nil {
				t.Fatal(err)
			}
			for s := Stat(0); int(s) < numStats; s++ {
				// Whether a row's client is proven depends on the rows
				// before it (a handshake they completed): checked only by
				// the rows that name it.
				if _, named := c.stats[s]; s == StatSourceProven && !named {
					continue
				}
				if got := after.Stats[s] - before.Stats[s]; got != c.stats[s] {
					t.Errorf("%s delta = %d, want %d", s, got, c.stats[s])
				}
			}
			for f, tr := range after.Frontends {
				b, ok := before.Frontends[f]
				if !ok {
					continue
				}
				delta := Traffic{Flows: tr.Flows - b.Flows, Packets: tr.Packets - b.Packets, Bytes: tr.Bytes - b.Bytes}
				if want := c.traffic(f); delta != want {
					t.Errorf("frontend %s traffic delta = %+v, want %+v", f, delta, want)
				}
			}
			if c.after != nil {
				c.after(t, d)
			}
		})
		if c.fwd != (Frontend{}) {
			fwd[c.fwd] = fwd[c.fwd].plus(c.traffic(c.fwd))
		}
	}
	got, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	for f, want := range fwd {
		if _, ok := got.Frontends[f]; !ok {
			continue // deleted by a row
		}
		if got.Frontends[f] != want {
			t.Errorf("frontend %s total = %+v, want %+v", f, got.Frontends[f], want)
		}
		var perBackend Traffic
		for _, n := range got.BackendTraffic[f] {
			perBackend = perBackend.plus(n)
		}
		if perBackend.Packets > want.Packets {
			t.Errorf("frontend %s: backend packets sum %d exceeds the frontend's %d", f, perBackend.Packets, want.Packets)
		}
	}
}

// traffic is the forward traffic c must add to frontend f.
func (c pktCase) traffic(f Frontend) Traffic {
	if f != c.fwd || c.fwd == (Frontend{}) {
		return Traffic{}
	}
	tr := Traffic{Packets: 1, Bytes: l3Len(c.in.bytes())}
	if c.newFlow {
		tr.Flows = 1
	}
	return tr
}

func ptr(f frame) *frame { return &f }

const (
	client   = "10.0.0.2:40000"
	client2  = "10.0.0.2:40001"
	client3  = "10.0.0.3:40002"
	vipTCP   = "10.96.0.10:80"
	vipUDP   = "10.96.0.10:53"
	vipEmpty = "10.96.0.11:80"
	vipExt   = "192.0.2.10:80"
	beTCP    = "10.1.1.2:8080"
	beUDP    = "10.1.1.3:5353"
	beExt    = "10.1.1.4:8080"
)

// newFlowStats is the counters a new flow moves, plus extra: created,
// and both its directions' paths, which are the stack's in the tables'
// namespace (no interface of it is in tlb_ifaces).
func newFlowStats(extra stats) stats {
	s := stats{StatConntrackCreated: 1, StatFwdStack: 2}
	for k, v := range extra {
		s[k] += v
	}
	return s
}

// malformedRows are dropped by both hooks with a parse error.
func malformedRows(h hook) []pktCase {
	perr := stats{StatDropParseError: 1}
	syn := tcpFrame(client, vipTCP, tcpSYN, "")
	truncTCP := syn
	truncTCP.truncate, truncTCP.totLen = 14+20+10, 30
	shortIHL := syn
	shortIHL.ihl = 4
	longTot := syn
	longTot.totLen = 200
	doff := syn
	doff.tcpDoff = 4
	truncUDP := udpFrame(client, vipUDP, "")
	truncUDP.truncate, truncUDP.totLen = 14+20+4, 24
	// What the receiving kernel drops creates no state
	// (frame_creates_state): checked on the new-flow path, before
	// anything is written, for a frontend of the hook's scope, from a
	// client with no flow yet.
	vip, fresh := vipTCP, "10.0.0.90:41000"
	if h == hookXDP {
		vip = vipExt
	}
	badSum := tcpFrame(fresh, vip, tcpSYN, "")
	badSum.badIPSum = true
	badSumOpts := badSum
	badSumOpts.ipOptions = []byte{1, 1, 1, 0}
	doffBeyond := tcpFrame(fresh, vip, tcpSYN, "0123456789")
	doffBeyond.tcpDoff = 8 // 32 bytes of header in a 30-byte segment
	udpLong := udpFrame(fresh, vipUDP, "abc")
	udpLong.udpLen = 8 + 4
	udpShort := udpFrame(fresh, vipUDP, "abc")
	udpShort.udpLen = 7
	var rows []pktCase
	if h == hookTC {
		// The tables have no external UDP frontend.
		rows = append(rows,
			pktCase{name: "udp_length_beyond_payload_creates_no_flow", hook: h, in: udpLong, want: drop, stats: perr},
			pktCase{name: "udp_length_below_header_creates_no_flow", hook: h, in: udpShort, want: drop, stats: perr})
	}
	if h == hookXDP {
		// tc test runs refuse IPv4 frames without a full IPv4 header
		// (EINVAL), so only XDP can be shown these.
		rows = []pktCase{
			{name: "truncated_ip_header", hook: h, in: frame{src: syn.src, dst: syn.dst, proto: protoTCP, truncate: 14 + 10}, want: drop, stats: perr},
			{name: "ethernet_only", hook: h, in: frame{src: syn.src, dst: syn.dst, proto: protoTCP, truncate: 14}, want: drop, stats: perr},
		}
	}
	return append(rows, []pktCase{
		{name: "ihl_below_5", hook: h, in: shortIHL, want: drop, stats: perr},
		{name: "total_length_beyond_frame", hook: h, in: longTot, want: drop, stats: perr},
		{name: "truncated_tcp_header", hook: h, in: truncTCP, want: drop, stats: perr},
		{name: "tcp_data_offset_below_5", hook: h, in: doff, want: drop, stats: perr},
		{name: "truncated_udp_header", hook: h, in: truncUDP, want: drop, stats: perr},
		{name: "bad_ip_checksum_creates_no_flow", hook: h, in: badSum, want: drop, stats: perr},
		{name: "bad_ip_checksum_with_options_creates_no_flow", hook: h, in: badSumOpts, want: drop, stats: perr},
		{name: "tcp_data_offset_beyond_segment_creates_no_flow", hook: h, in: doffBeyond, want: drop, stats: perr},
	}...)
}

// tagged returns f with VLAN tags of the given TPIDs, outer first.
func tagged(f frame, tpids ...uint16) frame {
	f.vlans = tpids
	return f
}

// untouchedRows pass both hooks byte for byte.
func untouchedRows(h hook) []pktCase {
	// A SYN to a frontend of the hook's scope, from a client with no flow.
	vip := vipTCP
	if h == hookXDP {
		vip = vipExt
	}
	syn := tcpFrame("10.0.0.91:41000", vip, tcpSYN, "")
	// A first fragment not to a frontend is not remembered (frag_test.go
	// has the fragments of a Service's datagrams).
	firstFrag := udpFrame(client, "10.2.3.4:53", "fragment-one")
	firstFrag.moreFrags = true
	laterFrag := udpFrame(client, vipUDP, "fragment-two")
	laterFrag.fragOff = 185
	icmp := frame{src: netip.MustParseAddrPort(client), dst: netip.MustParseAddrPort(vipTCP), proto: protoICMP, payload: []byte("ping")}
	gre := frame{src: netip.MustParseAddrPort(client), dst: netip.MustParseAddrPort(vipTCP), proto: 47, payload: []byte("opaque")}
	return []pktCase{
		{name: "non_service_address", hook: h, in: tcpFrame(client, "10.2.3.4:80", tcpSYN, ""), want: pass},
		{name: "service_other_port", hook: h, in: tcpFrame(client, "10.96.0.10:81", tcpSYN, ""), want: pass},
		{name: "service_port_other_protocol", hook: h, in: udpFrame(client, vipTCP, "x"), want: pass},
		{name: "icmp_to_service_address", hook: h, in: icmp, want: pass},
		{name: "gre_to_service_address", hook: h, in: gre, want: pass},
		{name: "ipv6_ethertype", hook: h, in: frame{etherType: 0x86dd, payload: bytes.Repeat([]byte{0x60}, 60)}, want: pass},
		{name: "arp", hook: h, in: frame{etherType: 0x0806, payload: make([]byte, 28)}, want: pass},
		{name: "vlan_tagged", hook: h, in: frame{etherType: 0x8100, payload: make([]byte, 46)}, want: pass},
		// A frame whose tag is still in it (XDP sees every tag so; tc
		// an inner one, the kernel having taken the outer one into the
		// skb, which TestVLANTaggedTraffic covers) is not ours, even
		// when it carries a packet to a frontend: no flow is created.
		{name: "vlan_8021q_syn_to_service", hook: h, in: tagged(syn, 0x8100), want: pass},
		{name: "vlan_8021ad_8021q_syn_to_service", hook: h, in: tagged(syn, 0x88a8, 0x8100), want: pass},
		{name: "vlan_8021q_udp_to_service", hook: h, in: tagged(udpFrame("10.0.0.91:41001", vipUDP, "abc"), 0x8100), want: pass},
		{name: "first_fragment_not_to_a_service", hook: h, in: firstFrag, want: pass},
		{name: "later_fragment_without_its_first", hook: h, in: laterFrag, want: pass, stats: stats{StatFragment: 1}},
	}
}

// extFE is the external-scope frontend of the tables.
func extFE() Frontend {
	return Frontend{Addr: netip.MustParseAddrPort(vipExt), Proto: TCP, Scope: ScopeExternal}
}

func setupTable(t *testing.T) *Datapath {
	return setupTableFor(t, tcFamilies[0].addrs)
}

// setupTableFor programs the tables' frontends with the addresses of one
// family; the external frontend only for IPv4, the family the uplinks
// translate.
func setupTableFor(t *testing.T, a tcAddrs) *Datapath {
	d := newDatapath(t, Options{})
	mustSet(t, d, fe(a.vipTCP, TCP), be(a.beTCP))
	mustSet(t, d, fe(a.vipUDP, UDP), be(a.beUDP))
	mustSet(t, d, fe(a.vipEmpty, TCP))
	if netip.MustParseAddrPort(a.vipTCP).Addr().Is4() {
		// Node-local: no source translation (forward_test.go has those).
		mustSet(t, d, extFE(), Backend{Addr: netip.MustParseAddrPort(beExt), NodeLocal: true})
	}
	return d
}

// tcAddrs are the addresses of TestTCProgram's rows in one family.
type tcAddrs struct {
	client, client2, client3, vipTCP, vipUDP, vipEmpty, beTCP, beUDP string
}

// tcFamilies are the families tc on pod veths translates, IPv4 first
// (setupTable's).
var tcFamilies = []struct {
	name  string
	addrs tcAddrs
}{
	{"ipv4", tcAddrs{client, client2, client3, vipTCP, vipUDP, vipEmpty, beTCP, beUDP}},
	{"ipv6", tcAddrs{"[fd00::2]:40000", "[fd00::2]:40001", "[fd00::3]:40002", "[fd00:96::10]:80", "[fd00:96::10]:53",
		"[fd00:96::11]:80", "[fd00:1:1::2]:8080", "[fd00:1:1::3]:5353"}},
}

// TestTCProgram runs the pod-veth hook's table in each family it
// translates: the same rows, the family's addresses; what only IPv4 has
// (options, the external frontend, its malformations) in IPv4's, what
// only IPv6 has in TestIPv6PassesUntouched.
func TestTCProgram(t *testing.T) {
	for _, fam := range tcFamilies {
		t.Run(fam.name, func(t *testing.T) {
			a := fam.addrs
			d := setupTableFor(t, a)
			rows := tcRows(a)
			if fam.name == "ipv4" {
				rows = append(rows, tcRows4()...)
				rows = append(rows, untouchedRows(hookTC)...)
				rows = append(rows, malformedRows(hookTC)...)
			}
			runTable(t, d, rows)
		})
	}
}

// tcRows are TestTCProgram's rows for a family's addresses a.
func tcRows(a tcAddrs) []pktCase {
	tcpFE, udpFE := fe(a.vipTCP, TCP), fe(a.vipUDP, UDP)
	syn := tcpFrame(a.client, a.vipTCP, tcpSYN, "")
	ack := tcpFrame(a.client, a.vipTCP, tcpACK|tcpPSH, "odd-length-13")
	fin := tcpFrame(a.client, a.vipTCP, tcpFIN|tcpACK, "")
	synAck := tcpFrame(a.beTCP, a.client, tcpSYN|tcpACK, "")
	udp := udpFrame(a.client, a.vipUDP, "abcde")
	udpReply := udpFrame(a.beUDP, a.client, "reply!")
	padded := udpFrame(a.client3, a.vipUDP, "p")
	padded.pad = 17
	rst := tcpFrame(a.client3, a.vipTCP, tcpRST, "")
	rows := []pktCase{
		{name: "tcp_syn_new_flow", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", a.beTCP)), fwd: tcpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "tcp_ack_odd_payload_conntrack_hit", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", a.beTCP)), fwd: tcpFE},
		{name: "tcp_reply_from_local_backend", hook: hookTC, in: synAck, out: ptr(synAck.withAddrs(a.vipTCP, "")), stats: stats{StatReverseNAT: 1}},
		{name: "tcp_fin", hook: hookTC, in: fin, out: ptr(fin.withAddrs("", a.beTCP)), fwd: tcpFE},
		{name: "udp_odd_payload", hook: hookTC, in: udp, out: ptr(udp.withAddrs("", a.beUDP)), fwd: udpFE, newFlow: true, stats: newFlowStats(nil)},
	}
	if netip.MustParseAddrPort(a.client).Addr().Is4() {
		// IPv6 has no UDP checksum 0 (RFC 8200 8.1).
		udpNoSum := udpFrame(a.client2, a.vipUDP, "zero-sum")
		udpNoSum.noUDPSum = true
		rows = append(rows, pktCase{name: "udp_zero_checksum_stays_zero", hook: hookTC, in: udpNoSum, out: ptr(udpNoSum.withAddrs("", a.beUDP)), fwd: udpFE, newFlow: true, stats: newFlowStats(nil)})
	}
	return append(rows, []pktCase{
		{name: "udp_reply_from_local_backend", hook: hookTC, in: udpReply, out: ptr(udpReply.withAddrs(a.vipUDP, "")), stats: stats{StatReverseNAT: 1, StatConntrackPromoted: 1}},
		{name: "ethernet_padding_kept", hook: hookTC, in: padded, out: ptr(padded.withAddrs("", a.beUDP)), fwd: udpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "tcp_rst_without_flow_is_a_midflow_miss", hook: hookTC, in: rst, out: ptr(rst.withAddrs("", a.beTCP)), fwd: tcpFE, newFlow: true, stats: newFlowStats(stats{StatTCPMidflowMiss: 1})},
		{name: "zero_backends_dropped", hook: hookTC, in: tcpFrame(a.client, a.vipEmpty, tcpSYN, ""), want: drop, stats: stats{StatDropNoBackend: 1}},
	}...)
}

// tcRows4 are TestTCProgram's rows only IPv4 has.
func tcRows4() []pktCase {
	tcpFE := fe(vipTCP, TCP)
	opts := tcpFrame(client2, vipTCP, tcpSYN, "")
	opts.ipOptions = []byte{1, 1, 1, 1, 1, 1, 1, 0}
	return []pktCase{
		{name: "ip_options", hook: hookTC, in: opts, out: ptr(opts.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "external_frontend_not_matched_by_tc", hook: hookTC, in: tcpFrame(client, vipExt, tcpSYN, ""), want: pass},
	}
}

func TestXDPProgram(t *testing.T) {
	d := setupTable(t)
	tcpFE, udpFE, ext := fe(vipTCP, TCP), fe(vipUDP, UDP), extFE()

	syn := tcpFrame(client, vipTCP, tcpSYN, "")
	synAck := tcpFrame(beTCP, client, tcpSYN|tcpACK, "")
	synAckOpts := synAck
	synAckOpts.ipOptions = []byte{1, 1, 1, 0}
	ackData := tcpFrame(beTCP, client, tcpACK, "HTTP/1.1 200 OK, odd")
	udp := udpFrame(client, vipUDP, "q")
	udpReply := udpFrame(beUDP, client, "answer")
	udp2 := udpFrame(client2, vipUDP, "q2")
	udpReplyNoSum := udpFrame(beUDP, client2, "answer, no checksum")
	udpReplyNoSum.noUDPSum = true
	padded := udpReply
	padded.pad = 9
	extSyn := tcpFrame(client3, vipExt, tcpSYN, "")
	extAck := tcpFrame(client3, vipExt, tcpACK, "GET / odd")
	extReply := tcpFrame(beExt, client3, tcpSYN|tcpACK, "")

	rows := []pktCase{
		// Flows to internal frontends are set up by tc on the client's
		// veth, as on a node.
		{name: "tc_tcp_syn", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "tc_udp", hook: hookTC, in: udp, out: ptr(udp.withAddrs("", beUDP)), fwd: udpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "tc_udp_second_flow", hook: hookTC, in: udp2, out: ptr(udp2.withAddrs("", beUDP)), fwd: udpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "tcp_reply_from_remote_backend", hook: hookXDP, in: synAck, out: ptr(synAck.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1}},
		{name: "tcp_reply_with_ip_options", hook: hookXDP, in: synAckOpts, out: ptr(synAckOpts.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1}},
		{name: "tcp_reply_odd_payload", hook: hookXDP, in: ackData, out: ptr(ackData.withAddrs(vipTCP, "")), stats: stats{StatReverseNAT: 1}},
		// A UDP flow's first reply promotes it.
		{name: "udp_reply", hook: hookXDP, in: udpReply, out: ptr(udpReply.withAddrs(vipUDP, "")), stats: stats{StatReverseNAT: 1, StatConntrackPromoted: 1}},
		{name: "udp_reply_zero_checksum_stays_zero", hook: hookXDP, in: udpReplyNoSum, out: ptr(udpReplyNoSum.withAddrs(vipUDP, "")), stats: stats{StatReverseNAT: 1, StatConntrackPromoted: 1}},
		{name: "udp_reply_ethernet_padding", hook: hookXDP, in: padded, out: ptr(padded.withAddrs(vipUDP, "")), stats: stats{StatReverseNAT: 1}},
		// Internal frontends are not matched on the wire.
		{name: "internal_frontend_not_matched_by_xdp", hook: hookXDP, in: tcpFrame(client3, vipTCP, tcpSYN, ""), want: pass},
		{name: "internal_empty_frontend_not_matched_by_xdp", hook: hookXDP, in: tcpFrame(client3, vipEmpty, tcpSYN, ""), want: pass},
		{name: "reply_to_unknown_flow_untouched", hook: hookXDP, in: tcpFrame(beTCP, client3, tcpSYN|tcpACK, ""), want: pass},
		// External frontends are balanced on the wire.
		{name: "external_syn", hook: hookXDP, in: extSyn, out: ptr(extSyn.withAddrs("", beExt)), fwd: ext, newFlow: true, stats: newFlowStats(nil)},
		{name: "external_ack_hit", hook: hookXDP, in: extAck, out: ptr(extAck.withAddrs("", beExt)), fwd: ext},
		{name: "external_reply_from_local_backend", hook: hookTC, in: extReply, out: ptr(extReply.withAddrs(vipExt, "")), stats: stats{StatReverseNAT: 1}},
	}
	rows = append(rows, untouchedRows(hookXDP)...)
	rows = append(rows, malformedRows(hookXDP)...)
	runTable(t, d, rows)
}

// TestScopeSeparation programs one address:port in both scopes with
// different backends: each hook sees only its own.
func TestScopeSeparation(t *testing.T) {
	d := newDatapath(t, Options{})
	internal := fe(vipTCP, TCP)
	external := Frontend{Addr: internal.Addr, Proto: TCP, Scope: ScopeExternal}
	mustSet(t, d, internal, be(beTCP))
	mustSet(t, d, external, Backend{Addr: netip.MustParseAddrPort(beExt), NodeLocal: true})
	inSyn := tcpFrame(client, vipTCP, tcpSYN, "")
	outSyn := tcpFrame(client2, vipTCP, tcpSYN, "")
	runTable(t, d, []pktCase{
		{name: "tc_uses_the_internal_set", hook: hookTC, in: inSyn, out: ptr(inSyn.withAddrs("", beTCP)), fwd: internal, newFlow: true, stats: newFlowStats(nil)},
		{name: "xdp_uses_the_external_set", hook: hookXDP, in: outSyn, out: ptr(outSyn.withAddrs("", beExt)), fwd: external, newFlow: true, stats: newFlowStats(nil)},
		{name: "internal_deleted_tc_passes", hook: hookTC, in: tcpFrame(client3, vipTCP, tcpSYN, ""), want: pass,
			before: func(t *testing.T, d *Datapath) {
				if _, err := d.DeleteFrontend(internal); err != nil {
					t.Fatal(err)
				}
			}},
	})
	if fes := d.Frontends(); len(fes) != 1 || len(fes[external]) != 1 {
		t.Errorf("frontends after deleting the internal one: %v", fes)
	}
}
