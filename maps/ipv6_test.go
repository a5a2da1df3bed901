package maps

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"
)

// IPv6 next-header values the frames below use.
const (
	v6HopByHop = 0
	v6Fragment = 44
	v6DestOpts = 60
	v6ICMP     = 58
	v6NoNext   = 59
)

// The ICMPv6 messages a node lives on (RFC 4861, RFC 3810, RFC 4443).
const (
	icmp6EchoRequest  = 128
	icmp6MLDv2Report  = 143
	icmp6RouterAdvert = 134
	icmp6NeighSolicit = 135
)

// v6Ext is an IPv6 extension header: its type (the next-header value that
// names it) and its bytes, whose first, the next header, ipv6Frame fills.
type v6Ext struct {
	kind uint8
	hdr  []byte
}

// ipv6Frame is an Ethernet frame carrying an IPv6 packet from src to dst:
// the extension headers ext, then l4 of protocol next. The TCP, UDP and ICMPv6 checksums are
// computed over the IPv6 pseudo header (RFC 8200 8.1).
func ipv6Frame(src, dst netip.Addr, hopLimit uint8, ext []v6Ext, next uint8, l4 []byte) frame {
	l4 = append([]byte(nil), l4...)
	if off, ok := map[uint8]int{protoTCP: 16, protoUDP: 6, v6ICMP: 2}[next]; ok {
		l4[off], l4[off+1] = 0, 0
		binary.BigEndian.PutUint16(l4[off:], csum(pseudoOf(src, dst, next, len(l4)), l4))
	}
	first := next
	var chain []byte
	for i := len(ext) - 1; i >= 0; i-- {
		h := append([]byte(nil), ext[i].hdr...)
		h[0] = first
		chain = append(h, chain...)
		first = ext[i].kind
	}
	hdr := ipv6Header(src, dst, hopLimit, first, len(chain)+len(l4))
	return frame{etherType: 0x86dd, payload: append(append(hdr, chain...), l4...)}
}

// tcp6 is a TCP header (no options) from sport to dport with flags.
func tcp6(sport, dport uint16, flags uint8) []byte {
	b := make([]byte, 20)
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	b[12] = 5 << 4
	b[13] = flags
	binary.BigEndian.PutUint16(b[14:], 65535)
	return b
}

// udp6 is a UDP datagram from sport to dport carrying payload.
func udp6(sport, dport uint16, payload string) []byte {
	b := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	binary.BigEndian.PutUint16(b[4:], uint16(8+len(payload)))
	return append(b, payload...)
}

// icmp6 is an ICMPv6 message of type typ with body after the 4-byte
// header.
func icmp6(typ uint8, body []byte) []byte {
	return append([]byte{typ, 0, 0, 0}, body...)
}

// routerAlert is a hop-by-hop options header with the router alert
// option (RFC 2711) that MLD reports carry.
var routerAlert = v6Ext{v6HopByHop, []byte{0, 0, 5, 2, 0, 0, 1, 0}}

// fragmentHeader is an IPv6 fragment header (RFC 8200 4.5): the first
// fragment of datagram 0x42 when off is 0.
func fragmentHeader(off uint16, more bool) v6Ext {
	b := make([]byte, 8)
	v := off << 3
	if more {
		v |= 1
	}
	binary.BigEndian.PutUint16(b[2:], v)
	binary.BigEndian.PutUint32(b[4:], 0x42)
	return v6Ext{v6Fragment, b}
}

// destOpts is an empty destination options header (RFC 8200 4.6: a PadN
// option filling its 8 bytes).
var destOpts = v6Ext{v6DestOpts, []byte{0, 0, 1, 4, 0, 0, 0, 0}}

// TestIPv6PassesUntouched sends IPv6 frames through every packet hook
// with IPv6 frontends programmed: what is not a TCP or UDP packet to a
// frontend is the kernel's on every hook, byte for byte and without a
// counter: NDP, router advertisements, MLD (behind a hop-by-hop header),
// echo, a chain of extension headers longer than the parser walks to a
// port that is no frontend (TestIPv6LongChains has those to frontends;
// fragments are frag_test.go's). A SYN or a datagram to an IPv6 frontend passes tc egress, which
// does not translate it; XDP and tc on uplinks pass the datagram to the
// internal frontend (the SYN to the external one is TestXDPNorthSouth6's
// and TestTCUplinkNorthSouth6's); on pod veths
// (TestTCProgram's ipv6 rows) it is translated, also behind extension
// headers the parser walks. An IPv6 packet never matches an IPv4
// frontend, even to its IPv4-mapped address.
func TestIPv6PassesUntouched(t *testing.T) {
	d := setupTable(t)
	vip := netip.MustParseAddr("fd00:96::10")
	backend := netip.MustParseAddr("fd00:1::1")
	for _, f := range []Frontend{
		{Addr: netip.AddrPortFrom(vip, 80), Proto: TCP},
		{Addr: netip.AddrPortFrom(vip, 80), Proto: TCP, Scope: ScopeExternal},
		{Addr: netip.AddrPortFrom(vip, 53), Proto: UDP},
	} {
		mustSet(t, d, f, Backend{Addr: netip.AddrPortFrom(backend, f.Addr.Port())})
	}
	client := netip.MustParseAddr("fd00:2::7")
	linkLocal := netip.MustParseAddr("fe80::1")
	// A target's solicited-node multicast group, and the all-nodes and
	// all-MLDv2-routers groups.
	solicited := netip.MustParseAddr("ff02::1:ff00:10")
	allNodes := netip.MustParseAddr("ff02::1")
	mldRouters := netip.MustParseAddr("ff02::16")
	// IPv4-mapped: the IPv4 frontend's key, which an IPv6 packet must
	// never reach.
	mappedVIP := netip.AddrFrom16(netip.MustParseAddr(vipTCP[:len(vipTCP)-3]).As16())
	tooLong := []v6Ext{destOpts, destOpts, destOpts, destOpts, destOpts}

	type row struct {
		name string
		in   frame
	}
	untouched := []row{
		{"tcp_syn_to_ipv4_mapped_frontend", ipv6Frame(client, mappedVIP, 64, nil, protoTCP, tcp6(41000, 80, tcpSYN))},
		{"neighbor_solicitation", ipv6Frame(linkLocal, solicited, 255, nil, v6ICMP,
			icmp6(icmp6NeighSolicit, append(make([]byte, 4), vip.AsSlice()...)))},
		{"router_advertisement", ipv6Frame(linkLocal, allNodes, 255, nil, v6ICMP,
			icmp6(icmp6RouterAdvert, []byte{64, 0, 0, 30, 0, 0, 0, 0, 0, 0, 0, 0}))},
		{"mld_report_behind_hop_by_hop", ipv6Frame(linkLocal, mldRouters, 1, []v6Ext{routerAlert}, v6ICMP,
			icmp6(icmp6MLDv2Report, []byte{0, 0, 0, 0}))},
		{"echo_request_to_ipv6_frontend", ipv6Frame(client, vip, 64, nil, v6ICMP, icmp6(icmp6EchoRequest, []byte{0, 1, 0, 1, 'p'}))},
		{"no_next_header", ipv6Frame(client, vip, 64, nil, v6NoNext, nil)},
		{"syn_to_another_port_behind_more_extension_headers_than_walked", ipv6Frame(client, vip, 64, tooLong, protoTCP, tcp6(41001, 81, tcpSYN))},
	}
	toFrontend := []row{
		{"tcp_syn_to_ipv6_frontend", ipv6Frame(client, vip, 64, nil, protoTCP, tcp6(41000, 80, tcpSYN))},
		{"udp_to_ipv6_frontend", ipv6Frame(client, vip, 64, nil, protoUDP, udp6(41000, 53, "q"))},
	}
	var rows []pktCase
	for _, h := range []hook{hookTC, hookXDP, hookUplinkTC, hookTCEgress} {
		set := untouched
		switch h {
		case hookTCEgress:
			set = append(set, toFrontend...)
		case hookUplinkTC, hookXDP:
			set = append(set, toFrontend[1])
		}
		for _, f := range set {
			rows = append(rows, pktCase{name: string(h) + "/" + f.name, hook: h, in: f.in, want: pass})
		}
	}
	// The extension headers the parser walks (hop-by-hop, destination
	// options, routing) before the L4 header: translated on pod veths.
	walked := []v6Ext{routerAlert, destOpts}
	syn := ipv6Frame(client, vip, 64, walked, protoTCP, tcp6(41002, 80, tcpSYN))
	rows = append(rows, pktCase{name: "tc/syn_behind_walked_extension_headers", hook: hookTC, in: syn,
		out: ptr(ipv6Frame(client, backend, 64, walked, protoTCP, tcp6(41002, 80, tcpSYN))),
		fwd: Frontend{Addr: netip.AddrPortFrom(vip, 80), Proto: TCP}, newFlow: true, stats: newFlowStats(nil)})
	runTable(t, d, rows)
}

// TestIPv6LongChains: a packet to a frontend behind an extension chain
// longer than the parser walks (5 headers; or 3 of 88 bytes, beyond its
// 64) cannot be translated, and passed on it would reach the frontend's
// address untranslated (a cluster IP's towards the node's gateway): every
// hook that balances drops it and counts it as drop_unparsed. Not to a
// frontend (another port), it passes untouched; tc egress, which
// balances nothing, passes it.
func TestIPv6LongChains(t *testing.T) {
	d := setupTable(t)
	vip := netip.MustParseAddr("fd00:96::10")
	backend := netip.MustParseAddr("fd00:1::1")
	for _, f := range []Frontend{
		{Addr: netip.AddrPortFrom(vip, 80), Proto: TCP},
		{Addr: netip.AddrPortFrom(vip, 80), Proto: TCP, Scope: ScopeExternal},
		{Addr: netip.AddrPortFrom(vip, 53), Proto: UDP},
		{Addr: netip.AddrPortFrom(vip, 53), Proto: UDP, Scope: ScopeExternal},
	} {
		mustSet(t, d, f, Backend{Addr: netip.AddrPortFrom(backend, f.Addr.Port())})
	}
	client := netip.MustParseAddr("fd00:2::7")
	five := []v6Ext{destOpts, destOpts, destOpts, destOpts, destOpts}
	// A destination options header of 88 bytes: PadN filling it.
	long := v6Ext{v6DestOpts, append([]byte{0, 10, 1, 84}, make([]byte, 84)...)}
	three := []v6Ext{routerAlert, long, destOpts}
	var rows []pktCase
	for _, h := range []hook{hookTC, hookXDP, hookUplinkTC, hookTCEgress} {
		dropped, counted := drop, stats{StatDropUnparsed: 1}
		if h == hookTCEgress {
			dropped, counted = pass, nil
		}
		rows = append(rows,
			pktCase{name: string(h) + "/syn_to_frontend_behind_5_extension_headers", hook: h,
				in: ipv6Frame(client, vip, 64, five, protoTCP, tcp6(41001, 80, tcpSYN)), want: dropped, stats: counted},
			pktCase{name: string(h) + "/udp_to_frontend_behind_136_bytes_of_extension_headers", hook: h,
				in: ipv6Frame(client, vip, 64, three, protoUDP, udp6(41002, 53, "q")), want: dropped, stats: counted},
			pktCase{name: string(h) + "/udp_to_another_port_behind_5_extension_headers", hook: h,
				in: ipv6Frame(client, vip, 64, five, protoUDP, udp6(41003, 54, "q")), want: pass},
		)
	}
	runTable(t, d, rows)
}

// TestSweepConntrackIPv6 checks that a sweep deletes the expired entries
// of the IPv6 conntrack tables, leaves the live ones and counts them as
// IPv4's (by kind and table, none evicted), and keeps the deleted flows'
// counts in their frontend's.
func TestSweepConntrackIPv6(t *testing.T) {
	a := tcFamilies[1].addrs
	d := setupTableFor(t, a)
	for _, f := range []frame{
		tcpFrame(a.client, a.vipTCP, tcpSYN, ""),
		tcpFrame(a.beTCP, a.client, tcpSYN|tcpACK, ""),
		udpFrame(a.client2, a.vipUDP, "q"),
	} {
		if ret, _ := run(t, d.tcProg, f.bytes()); ret != tcOK {
			t.Fatalf("verdict %d", ret)
		}
	}
	// Expire the TCP flow's two entries.
	expired := 0
	for _, m := range d.ct6Tables() {
		must(t, walkTable(m, func(k tcCt6Key, v tcCt6Value) error {
			if k.Proto != protoTCP {
				return nil
			}
			v.Ct.Expires = 0
			expired++
			return m.Update(&k, &v, 0)
		}))
	}
	if expired != 2 {
		t.Fatalf("%d TCP entries in the IPv6 tables, want 2", expired)
	}
	st, err := d.SweepConntrack(t.Context())
	must(t, err)
	if st.Expired != 2 || st.Created != 2 || st.Evicted != 0 {
		t.Errorf("sweep expired %d entries, of %d flows created, %d evicted; want 2, 2, 0", st.Expired, st.Created, st.Evicted)
	}
	if want := map[ConntrackKind]int{{UDP, ""}: 2}; fmt.Sprint(st.Live) != fmt.Sprint(want) || st.Unreplied6 != 2 || st.Established6 != 0 {
		t.Errorf("live %v, %d unreplied and %d established IPv6 entries; want %v, 2, 0", st.Live, st.Unreplied6, st.Established6, want)
	}
	left := map[uint8]int{}
	for _, m := range d.ct6Tables() {
		must(t, walkTable(m, func(k tcCt6Key, _ tcCt6Value) error { left[k.Proto]++; return nil }))
	}
	if left[protoTCP] != 0 || left[protoUDP] != 2 {
		t.Errorf("entries left by protocol %v, want the UDP flow's 2 only", left)
	}
	c, err := d.Counters()
	must(t, err)
	if got := c.Frontends[fe(a.vipTCP, TCP)]; got.Flows != 1 || got.Packets != 1 {
		t.Errorf("swept flow's frontend counts %+v, want its flow and packet", got)
	}
}
