package maps

import (
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// Addresses of the ICMP tables besides the datapath tables' own: a router
// on the path, the node's own address, and a source-NATed north-south flow
// (a client outside the cluster to an external frontend, sent to a backend
// on another node from the node's address).
const (
	icmpRouter   = "10.9.0.254"
	icmpNodeAddr = "10.1.0.1"
	northClient  = "203.0.113.10:41000"
	snatNode     = "10.9.0.1:61000"
	snatVIP      = "192.0.2.20:80"
	snatVIPU     = "192.0.2.20:53"
	snatBE       = "10.2.1.2:8080"
	snatBEU      = "10.2.1.2:5353"
	fragMTU      = 1400
	quoteFull    = -1
)

func addrOf(ap string) string { return netip.MustParseAddrPort(ap).Addr().String() }

// plantSNATFlow writes the two conntrack entries the datapath's source NAT
// (flow4_create, bpf/flow.h) creates for a flow client -> vip sent to backend
// from nat, once established, as docs/datapath.md documents them: forward {backend,
// CT_F_SNAT, nat}, reverse keyed backend -> nat {vip, CT_F_SNAT, client}.
// IPv6 addresses go to the IPv6 tables, in ct6_value's addresses.
func plantSNATFlow(client, vip, backend, nat string, proto uint8) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		c, v, b, n := netip.MustParseAddrPort(client), netip.MustParseAddrPort(vip), netip.MustParseAddrPort(backend), netip.MustParseAddrPort(nat)
		expires := nowNS(t) + uint64(time.Minute)
		state := uint8(tcCtStateCT_UDP)
		if proto == protoTCP {
			state = uint8(tcCtStateCT_TCP_ESTABLISHED)
		}
		// Established: both directions seen, in the established table.
		flags := uint8(tcCtFlagCT_F_SNAT | tcCtFlagCT_F_REPLIED | tcCtFlagCT_F_ASSURED)
		// The backend id is one no frontend of the tests holds: a forward
		// entry counts as a flow of its id (stale.go), and the planted
		// flow is no programmed backend's.
		const id = DefaultMaxBackends - 1
		fwd := tcCtValue{Port: be16(b.Port()), Dir: uint8(tcCtDirCT_FORWARD), State: state,
			Expires: expires, Flags: flags, NatPort: be16(n.Port()), BackendId: id}
		rev := tcCtValue{Port: be16(v.Port()), Dir: uint8(tcCtDirCT_REVERSE), State: state,
			Expires: expires, Flags: flags, NatPort: be16(c.Port()), BackendId: id}
		if c.Addr().Is6() {
			key := func(s, d netip.AddrPort) tcCt6Key {
				return tcCt6Key{Saddr: wireAddr(s.Addr()), Daddr: wireAddr(d.Addr()), Sport: be16(s.Port()), Dport: be16(d.Port()), Proto: proto}
			}
			for k, v := range map[tcCt6Key]tcCt6Value{
				key(c, v): {Ct: fwd, Addr: wireAddr(b.Addr()), NatAddr: wireAddr(n.Addr())},
				key(b, n): {Ct: rev, Addr: wireAddr(v.Addr()), NatAddr: wireAddr(c.Addr())},
			} {
				must(t, d.ct6.Update(&k, &v, ebpf.UpdateAny))
			}
			return
		}
		fwd.Addr, fwd.NatAddr = be32(b.Addr()), be32(n.Addr())
		rev.Addr, rev.NatAddr = be32(v.Addr()), be32(c.Addr())
		putCT(t, d, ctKey(client, vip, proto), fwd)
		putCT(t, d, ctKey(backend, nat, proto), rev)
	}
}

// icmpAddrs are the ICMP tables' addresses of one family beside
// tcFamilies': a router on the path, the node's own address, an address
// no flow has, and a source-NATed north-south flow (north to snatVIP and
// snatVIPU, sent to snatBE and snatBEU from snatNode).
type icmpAddrs struct {
	router, node, unknown                               string
	north, snatNode, snatVIP, snatVIPU, snatBE, snatBEU string
}

// icmpKinds are a family's error types and codes: destination
// unreachable and its port unreachable, the packet too big (IPv4's
// "fragmentation needed", a code of destination unreachable), time
// exceeded, and an ICMP message that is no error icmp.h translates.
type icmpKinds struct {
	unreach, portUnreach, tooBig, tooBigCode, timeExceeded, other, otherCode uint8
}

// icmpFamilies are icmpAddrs and icmpKinds per family, in tcFamilies'
// order.
var icmpFamilies = []struct {
	a icmpAddrs
	k icmpKinds
}{
	{icmpAddrs{icmpRouter, icmpNodeAddr, "10.2.3.4:53", northClient, snatNode, snatVIP, snatVIPU, snatBE, snatBEU},
		// An ICMP redirect.
		icmpKinds{icmpDestUnreach, icmpPortUnreach, icmpDestUnreach, icmpFragNeeded, icmpTimeExceeded, 5, 1}},
	{icmpAddrs{"fd00:9::fe", "fd00:1::1", "[fd00:2:3::4]:53", "[2001:db8:1::10]:41000", "[fd00:9::1]:61000",
		"[2001:db8::20]:80", "[2001:db8::20]:53", "[fd00:2:1::2]:8080", "[fd00:2:1::2]:5353"},
		// A parameter problem (RFC 4443 3.4): an error, not one we
		// translate.
		icmpKinds{icmp6DestUnreach, icmp6PortUnreach, icmp6PacketTooBig, 0, icmp6TimeExceeded, 4, 0}},
}

// TestICMPErrors translates ICMP and ICMPv6 errors about translated flows
// back on every path — tc ingress (a local backend's error), tc egress
// (the node's own error to a pod), XDP (another node's or a router's;
// IPv4, the family the uplinks translate: IPv6's rows run them through
// tc, whose code is the same) — for flows translated by tc and for
// hand-planted source-NATed flows, and leaves every other ICMP message
// alone.
func TestICMPErrors(t *testing.T) {
	for i, fam := range tcFamilies {
		t.Run(fam.name, func(t *testing.T) {
			d := setupTableFor(t, fam.addrs)
			runTable(t, d, icmpRows(fam.addrs, icmpFamilies[i].a, icmpFamilies[i].k))
		})
	}
}

// icmpRows are TestICMPErrors' rows for a family: its tables' addresses
// a, its ICMP addresses x and its error kinds k.
func icmpRows(a tcAddrs, x icmpAddrs, k icmpKinds) []pktCase {
	ipv4 := netip.MustParseAddrPort(a.client).Addr().Is4()
	tcpFE, udpFE := fe(a.vipTCP, TCP), fe(a.vipUDP, UDP)
	xl := stats{StatICMPTranslated: 1}
	// Where another node's or a router's error arrives.
	remote := hookXDP
	if !ipv4 {
		remote = hookTC
	}
	tooBig := func(src, dst string, about frame, quoteLen int) frame {
		f := icmpErr(src, dst, k.tooBig, k.tooBigCode, about, quoteLen)
		f.icmpRest = fragMTU
		return f
	}

	// The flows the errors are about, as their first packets left the
	// client (to the service) and reached the backend (translated).
	syn := tcpFrame(a.client, a.vipTCP, tcpSYN, "")
	data := tcpFrame(a.client, a.vipTCP, tcpACK|tcpPSH, "a segment too big for the next hop, odd")
	dataOnWire := data.withAddrs("", a.beTCP)
	udp := udpFrame(a.client3, a.vipUDP, "query")
	udpOnWire := udp.withAddrs("", a.beUDP)
	reply := udpFrame(a.vipUDP, a.client3, "answer") // a reply as the client got it
	replyOnWire := udpFrame(a.beUDP, a.client3, "answer")
	hdr := l3HeaderLen(syn.bytes())

	cl, cl3 := addrOf(a.client), addrOf(a.client3)
	beU, vip := addrOf(a.beUDP), addrOf(a.vipTCP)

	portUnreach := icmpErr(beU, cl3, k.unreach, k.portUnreach, udpOnWire, 0)
	portUnreachOut := icmpErr(vip, cl3, k.unreach, k.portUnreach, udp, 0)
	fullQuote := icmpErr(beU, cl3, k.unreach, k.portUnreach, udpOnWire, quoteFull)
	fullQuoteOut := icmpErr(vip, cl3, k.unreach, k.portUnreach, udp, quoteFull)
	// The client's own error about a reply (its socket is gone) goes back
	// to the backend that sent it.
	aboutReply := icmpErr(cl3, vip, k.unreach, k.portUnreach, reply, 0)
	aboutReplyOut := icmpErr(cl3, beU, k.unreach, k.portUnreach, replyOnWire, 0)
	// The backend's own address quoted, but the error from somewhere else:
	// only the quote changes.
	unknown := icmpErr(beU, cl3, k.unreach, k.portUnreach, udpFrame(a.client3, x.unknown, "q"), 0)
	shortQuote := icmpErr(beU, cl3, k.unreach, k.portUnreach, udpOnWire, hdr+4)
	other := icmpErr(x.router, cl3, k.other, k.otherCode, udpOnWire, 0)

	// Source NAT (north-south): the north client's flow leaves the node
	// as snatNode -> snatBE.
	snatUDP := udpFrame(x.north, x.snatVIPU, "q")
	snatUDPOnWire := udpFrame(x.snatNode, x.snatBEU, "q")
	snatTCP := tcpFrame(x.north, x.snatVIP, tcpACK, "big segment")
	snatTCPOnWire := tcpFrame(x.snatNode, x.snatBE, tcpACK, "big segment")
	snatReply := udpFrame(x.snatVIPU, x.north, "a") // as the north client got it
	snatReplyOnWire := udpFrame(x.snatBEU, x.snatNode, "a")
	out, sn, sb, sv := addrOf(x.north), addrOf(x.snatNode), addrOf(x.snatBE), addrOf(x.snatVIP)

	rows := []pktCase{
		{name: "flow_tcp", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", a.beTCP)), fwd: tcpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "flow_udp", hook: hookTC, in: udp, out: ptr(udpOnWire), fwd: udpFE, newFlow: true, stats: newFlowStats(nil)},

		{name: "port_unreachable_from_local_backend", hook: hookTC, in: portUnreach, out: &portUnreachOut, stats: xl},
		{name: "port_unreachable_from_remote_backend", hook: remote, in: portUnreach, out: &portUnreachOut, stats: xl},
		{name: "whole_datagram_quoted", hook: remote, in: fullQuote, out: &fullQuoteOut, stats: xl},
		{name: "too_big_from_router_keeps_router_source", hook: remote, in: tooBig(x.router, cl, dataOnWire, quoteFull),
			out: ptr(tooBig(x.router, cl, data, quoteFull)), stats: xl},
		{name: "too_big_from_node_to_pod", hook: hookTCEgress, in: tooBig(x.node, cl, dataOnWire, hdr+20+8),
			out: ptr(tooBig(x.node, cl, data, hdr+20+8)), stats: xl},
		{name: "time_exceeded_from_router", hook: remote, in: icmpErr(x.router, cl, k.timeExceeded, 0, dataOnWire, 0),
			out: ptr(icmpErr(x.router, cl, k.timeExceeded, 0, data, 0)), stats: xl},
		{name: "client_error_about_a_reply_goes_to_the_backend", hook: hookTC, in: aboutReply, out: &aboutReplyOut, stats: xl},
		{name: "translated_error_is_not_translated_twice", hook: hookTCEgress, in: portUnreachOut, want: pass},

		{name: "unknown_flow_untouched", hook: remote, in: unknown, want: pass},
		{name: "quote_without_ports_untouched", hook: hookTC, in: shortQuote, want: pass},
		{name: "other_message_untouched", hook: remote, in: other, want: pass},
		{name: "egress_passes_other_traffic", hook: hookTCEgress, in: udpOnWire, want: pass},
	}
	// Last, as the flow it expires is the others' flow.
	last := []pktCase{
		{name: "expired_flow_untouched", hook: remote, in: portUnreach, want: pass,
			before: expireFlow(a.client3, a.vipUDP, a.beUDP, protoUDP)},

		{name: "snat_port_unreachable_from_backend", hook: remote, before: plantSNATFlow(x.north, x.snatVIPU, x.snatBEU, x.snatNode, protoUDP),
			in:  icmpErr(sb, sn, k.unreach, k.portUnreach, snatUDPOnWire, 0),
			out: ptr(icmpErr(sv, out, k.unreach, k.portUnreach, snatUDP, 0)), stats: xl},
		{name: "snat_too_big_from_router", hook: remote, before: plantSNATFlow(x.north, x.snatVIP, x.snatBE, x.snatNode, protoTCP),
			in:  tooBig(x.router, sn, snatTCPOnWire, quoteFull),
			out: ptr(tooBig(x.router, out, snatTCP, quoteFull)), stats: xl},
		{name: "snat_client_error_about_a_reply", hook: remote,
			in:  icmpErr(out, sv, k.unreach, k.portUnreach, snatReply, 0),
			out: ptr(icmpErr(sn, sb, k.unreach, k.portUnreach, snatReplyOnWire, 0)), stats: xl},
	}
	if ipv4 {
		udpNoSum := udpFrame(a.client2, a.vipUDP, "no checksum")
		udpNoSum.noUDPSum = true
		udpNoSumOnWire := udpNoSum.withAddrs("", a.beUDP)
		laterFrag := udpOnWire
		laterFrag.fragOff = 100
		return append(append(rows,
			pktCase{name: "flow_udp_no_checksum", hook: hookTC, in: udpNoSum, out: ptr(udpNoSumOnWire), fwd: udpFE, newFlow: true, stats: newFlowStats(nil)},
			pktCase{name: "quoted_udp_checksum_zero_stays_zero", hook: hookTC, in: icmpErr(beU, addrOf(a.client2), k.unreach, k.portUnreach, udpNoSumOnWire, 0),
				out: ptr(icmpErr(vip, addrOf(a.client2), k.unreach, k.portUnreach, udpNoSum, 0)), stats: xl},
			pktCase{name: "quote_of_a_later_fragment_untouched", hook: remote, in: icmpErr(beU, cl3, k.unreach, k.portUnreach, laterFrag, 0), want: pass}),
			last...)
	}
	// IPv6: a quoted fragment (a first one: the walk ends at its header)
	// and a quote behind the extension headers the parser walks.
	c3, bu := netip.MustParseAddrPort(a.client3), netip.MustParseAddrPort(a.beUDP)
	fragment := ipv6Frame(c3.Addr(), bu.Addr(), 64, []v6Ext{fragmentHeader(0, true)}, protoUDP, udp6(c3.Port(), bu.Port(), "fragment"))
	walked := []v6Ext{routerAlert, destOpts}
	quoteExt := ipv6Frame(c3.Addr(), bu.Addr(), 64, walked, protoUDP, udp6(c3.Port(), bu.Port(), "query"))
	quoteExtOut := ipv6Frame(c3.Addr(), netip.MustParseAddrPort(a.vipUDP).Addr(), 64, walked, protoUDP, udp6(c3.Port(), netip.MustParseAddrPort(a.vipUDP).Port(), "query"))
	return append(append(rows,
		pktCase{name: "quote_of_a_fragment_untouched", hook: remote, in: icmpErr(beU, cl3, k.unreach, k.portUnreach, fragment, quoteFull), want: pass},
		pktCase{name: "quote_behind_extension_headers", hook: hookTC, in: icmpErr(beU, cl3, k.unreach, k.portUnreach, quoteExt, quoteFull),
			out: ptr(icmpErr(vip, cl3, k.unreach, k.portUnreach, quoteExtOut, quoteFull)), stats: xl}),
		last...)
}

// expireFlow plants an expiry a second ago in both entries of the flow
// client -> vip translated to backend, of either family.
func expireFlow(client, vip, backend string, proto uint8) func(t *testing.T, d *Datapath) {
	c, v, b := netip.MustParseAddrPort(client), netip.MustParseAddrPort(vip), netip.MustParseAddrPort(backend)
	if c.Addr().Is4() {
		return setExpires(flowOf(client, vip, backend, proto), -time.Second)
	}
	return func(t *testing.T, d *Datapath) {
		at := nowNS(t) - uint64(time.Second)
		for _, k := range []tcCt6Key{
			{Saddr: wireAddr(c.Addr()), Daddr: wireAddr(v.Addr()), Sport: be16(c.Port()), Dport: be16(v.Port()), Proto: proto},
			{Saddr: wireAddr(b.Addr()), Daddr: wireAddr(c.Addr()), Sport: be16(b.Port()), Dport: be16(c.Port()), Proto: proto},
		} {
			edited := false
			for _, m := range d.ct6Tables() {
				var e tcCt6Value
				if err := m.Lookup(&k, &e); err != nil {
					continue
				}
				e.Ct.Expires = at
				must(t, m.Update(&k, &e, ebpf.UpdateExist))
				edited = true
			}
			if !edited {
				t.Fatalf("no IPv6 conntrack entry %+v", k)
			}
		}
	}
}
