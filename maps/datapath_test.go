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

// pktCase is one packet through one hook.
type pktCase struct {
	name string
	hook hook
	in   frame
	want verdict
	// out is the expected output frame; nil means byte-for-byte
	// unchanged. Ignored for drops.
	out *frame
	// fwd is the frontend whose forward counters the packet must bump;
	// the zero Frontend means none.
	fwd Frontend
	// Expected changes of the global counters.
	drops      Drops
	reverseNAT uint64
	fragments  uint64
}

func (c pktCase) runOn(t *testing.T, d *Datapath) {
	t.Helper()
	in := c.in.bytes()
	prog, okV, dropV := d.tcProg, uint32(tcOK), uint32(tcShot)
	if c.hook == hookXDP {
		prog, okV, dropV = d.xdpProg, xdpPass, xdpDrop
	}
	ret, out := run(t, prog, in)
	wantRet := okV
	if c.want == drop {
		wantRet = dropV
	}
	if ret != wantRet {
		t.Fatalf("verdict = %d, want %d", ret, wantRet)
	}
	if c.want == drop {
		return
	}
	want := in
	if c.out != nil {
		want = c.out.bytes()
		if _, err := verifyChecksums(out); err != nil {
			t.Errorf("output checksums: %v", err)
		}
	}
	if !bytes.Equal(out, want) {
		t.Errorf("output differs\n got %x\nwant %x", out, want)
	}
}

// l3Len is the IPv4 total length of a rendered frame.
func l3Len(b []byte) uint64 { return uint64(binary.BigEndian.Uint16(b[16:])) }

// runTable runs rows in order (conntrack state carries over) and checks
// every row's counter deltas, then the per-frontend totals.
func runTable(t *testing.T, d *Datapath, rows []pktCase) {
	t.Helper()
	fwd := make(map[Frontend]Traffic)
	for _, c := range rows {
		t.Run(c.name, func(t *testing.T) {
			before, err := d.Counters()
			if err != nil {
				t.Fatal(err)
			}
			c.runOn(t, d)
			after, err := d.Counters()
			if err != nil {
				t.Fatal(err)
			}
			gotDrops := Drops{
				NoBackend:    after.Drops.NoBackend - before.Drops.NoBackend,
				MapFull:      after.Drops.MapFull - before.Drops.MapFull,
				ParseError:   after.Drops.ParseError - before.Drops.ParseError,
				RewriteError: after.Drops.RewriteError - before.Drops.RewriteError,
			}
			if gotDrops != c.drops {
				t.Errorf("drops delta = %+v, want %+v", gotDrops, c.drops)
			}
			if got := after.ReverseNAT - before.ReverseNAT; got != c.reverseNAT {
				t.Errorf("reverse NAT delta = %d, want %d", got, c.reverseNAT)
			}
			if got := after.Fragments - before.Fragments; got != c.fragments {
				t.Errorf("fragments delta = %d, want %d", got, c.fragments)
			}
			for f, tr := range after.Frontends {
				delta := Traffic{tr.Packets - before.Frontends[f].Packets, tr.Bytes - before.Frontends[f].Bytes}
				want := Traffic{}
				if f == c.fwd {
					want = Traffic{1, l3Len(c.in.bytes())}
				}
				if delta != want {
					t.Errorf("frontend %s traffic delta = %+v, want %+v", f, delta, want)
				}
			}
		})
		if c.fwd != (Frontend{}) {
			tr := fwd[c.fwd]
			tr.Packets++
			tr.Bytes += l3Len(c.in.bytes())
			fwd[c.fwd] = tr
		}
	}
	got, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	for f, want := range fwd {
		if got.Frontends[f] != want {
			t.Errorf("frontend %s total = %+v, want %+v", f, got.Frontends[f], want)
		}
		var perBackend uint64
		for _, n := range got.Backends[f] {
			perBackend += n
		}
		if perBackend != want.Packets {
			t.Errorf("frontend %s: backend packets sum %d, want %d", f, perBackend, want.Packets)
		}
	}
}

func ptr(f frame) *frame { return &f }

const (
	client   = "10.0.0.2:40000"
	client2  = "10.0.0.2:40001"
	client3  = "10.0.0.3:40002"
	vipTCP   = "10.96.0.10:80"
	vipUDP   = "10.96.0.10:53"
	vipEmpty = "10.96.0.11:80"
	beTCP    = "10.1.1.2:8080"
	beUDP    = "10.1.1.3:5353"
)

// malformedRows are dropped by both hooks with a parse error.
func malformedRows(h hook) []pktCase {
	perr := Drops{ParseError: 1}
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
	var rows []pktCase
	if h == hookXDP {
		// tc test runs refuse IPv4 frames without a full IPv4 header
		// (EINVAL), so only XDP can be shown these.
		rows = []pktCase{
			{name: "truncated_ip_header", hook: h, in: frame{src: syn.src, dst: syn.dst, proto: protoTCP, truncate: 14 + 10}, want: drop, drops: perr},
			{name: "ethernet_only", hook: h, in: frame{src: syn.src, dst: syn.dst, proto: protoTCP, truncate: 14}, want: drop, drops: perr},
		}
	}
	return append(rows, []pktCase{
		{name: "ihl_below_5", hook: h, in: shortIHL, want: drop, drops: perr},
		{name: "total_length_beyond_frame", hook: h, in: longTot, want: drop, drops: perr},
		{name: "truncated_tcp_header", hook: h, in: truncTCP, want: drop, drops: perr},
		{name: "tcp_data_offset_below_5", hook: h, in: doff, want: drop, drops: perr},
		{name: "truncated_udp_header", hook: h, in: truncUDP, want: drop, drops: perr},
	}...)
}

// untouchedRows pass both hooks byte for byte.
func untouchedRows(h hook) []pktCase {
	firstFrag := tcpFrame(client, vipTCP, tcpACK, "fragment-one")
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
		{name: "first_fragment_to_service", hook: h, in: firstFrag, want: pass, fragments: 1},
		{name: "later_fragment_to_service", hook: h, in: laterFrag, want: pass, fragments: 1},
	}
}

func setupTable(t *testing.T) *Datapath {
	d := newDatapath(t, Options{})
	mustSet(t, d, fe(vipTCP, TCP), be(beTCP))
	mustSet(t, d, fe(vipUDP, UDP), be(beUDP))
	mustSet(t, d, fe(vipEmpty, TCP))
	return d
}

func TestTCProgram(t *testing.T) {
	d := setupTable(t)
	tcpFE, udpFE := fe(vipTCP, TCP), fe(vipUDP, UDP)

	syn := tcpFrame(client, vipTCP, tcpSYN, "")
	ack := tcpFrame(client, vipTCP, tcpACK|tcpPSH, "odd-length-13")
	fin := tcpFrame(client, vipTCP, tcpFIN|tcpACK, "")
	synAck := tcpFrame(beTCP, client, tcpSYN|tcpACK, "")
	udp := udpFrame(client, vipUDP, "abcde")
	udpNoSum := udpFrame(client2, vipUDP, "zero-sum")
	udpNoSum.noUDPSum = true
	udpReply := udpFrame(beUDP, client, "reply!")
	opts := tcpFrame(client2, vipTCP, tcpSYN, "")
	opts.ipOptions = []byte{1, 1, 1, 1, 1, 1, 1, 0}
	padded := udpFrame(client3, vipUDP, "p")
	padded.pad = 17
	rst := tcpFrame(client3, vipTCP, tcpRST, "")

	rows := []pktCase{
		{name: "tcp_syn_new_flow", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", beTCP)), fwd: tcpFE},
		{name: "tcp_ack_odd_payload_conntrack_hit", hook: hookTC, in: ack, out: ptr(ack.withAddrs("", beTCP)), fwd: tcpFE},
		{name: "tcp_fin", hook: hookTC, in: fin, out: ptr(fin.withAddrs("", beTCP)), fwd: tcpFE},
		{name: "tcp_reply_from_local_backend", hook: hookTC, in: synAck, out: ptr(synAck.withAddrs(vipTCP, "")), reverseNAT: 1},
		{name: "udp_odd_payload", hook: hookTC, in: udp, out: ptr(udp.withAddrs("", beUDP)), fwd: udpFE},
		{name: "udp_zero_checksum_stays_zero", hook: hookTC, in: udpNoSum, out: ptr(udpNoSum.withAddrs("", beUDP)), fwd: udpFE},
		{name: "udp_reply_from_local_backend", hook: hookTC, in: udpReply, out: ptr(udpReply.withAddrs(vipUDP, "")), reverseNAT: 1},
		{name: "ip_options", hook: hookTC, in: opts, out: ptr(opts.withAddrs("", beTCP)), fwd: tcpFE},
		{name: "ethernet_padding_kept", hook: hookTC, in: padded, out: ptr(padded.withAddrs("", beUDP)), fwd: udpFE},
		{name: "tcp_rst_without_flow", hook: hookTC, in: rst, out: ptr(rst.withAddrs("", beTCP)), fwd: tcpFE},
		{name: "zero_backends_dropped", hook: hookTC, in: tcpFrame(client, vipEmpty, tcpSYN, ""), want: drop, drops: Drops{NoBackend: 1}},
	}
	rows = append(rows, untouchedRows(hookTC)...)
	rows = append(rows, malformedRows(hookTC)...)
	runTable(t, d, rows)
}

func TestXDPProgram(t *testing.T) {
	d := setupTable(t)
	tcpFE, udpFE := fe(vipTCP, TCP), fe(vipUDP, UDP)

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

	rows := []pktCase{
		// Flows are set up by tc on the client's veth, as on a node.
		{name: "tc_tcp_syn", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", beTCP)), fwd: tcpFE},
		{name: "tc_udp", hook: hookTC, in: udp, out: ptr(udp.withAddrs("", beUDP)), fwd: udpFE},
		{name: "tc_udp_second_flow", hook: hookTC, in: udp2, out: ptr(udp2.withAddrs("", beUDP)), fwd: udpFE},
		{name: "tcp_reply_from_remote_backend", hook: hookXDP, in: synAck, out: ptr(synAck.withAddrs(vipTCP, "")), reverseNAT: 1},
		{name: "tcp_reply_with_ip_options", hook: hookXDP, in: synAckOpts, out: ptr(synAckOpts.withAddrs(vipTCP, "")), reverseNAT: 1},
		{name: "tcp_reply_odd_payload", hook: hookXDP, in: ackData, out: ptr(ackData.withAddrs(vipTCP, "")), reverseNAT: 1},
		{name: "udp_reply", hook: hookXDP, in: udpReply, out: ptr(udpReply.withAddrs(vipUDP, "")), reverseNAT: 1},
		{name: "udp_reply_zero_checksum_stays_zero", hook: hookXDP, in: udpReplyNoSum, out: ptr(udpReplyNoSum.withAddrs(vipUDP, "")), reverseNAT: 1},
		{name: "udp_reply_ethernet_padding", hook: hookXDP, in: padded, out: ptr(padded.withAddrs(vipUDP, "")), reverseNAT: 1},
		// No DNAT on uplinks (yet): a frame to a frontend passes as is.
		{name: "service_traffic_from_wire_untouched", hook: hookXDP, in: tcpFrame(client3, vipTCP, tcpSYN, ""), want: pass},
		{name: "zero_backends_untouched_on_wire", hook: hookXDP, in: tcpFrame(client3, vipEmpty, tcpSYN, ""), want: pass},
		{name: "reply_to_unknown_flow_untouched", hook: hookXDP, in: tcpFrame(beTCP, client3, tcpSYN|tcpACK, ""), want: pass},
	}
	rows = append(rows, untouchedRows(hookXDP)...)
	rows = append(rows, malformedRows(hookXDP)...)
	runTable(t, d, rows)
}
