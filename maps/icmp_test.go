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
// (flow_create, bpf/flow.h) creates for a flow client -> vip sent to backend
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

// TestICMPErrors translates ICMP errors about translated flows back on
// every path — tc ingress (a local backend's error), tc egress (the node's
// own error to a pod), XDP (another node's or a router's) — for flows
// translated by tc and for hand-planted source-NATed flows, and leaves
// every other ICMP message alone.
func TestICMPErrors(t *testing.T) {
	d := setupTable(t)
	tcpFE, udpFE := fe(vipTCP, TCP), fe(vipUDP, UDP)
	xl := stats{StatICMPTranslated: 1}

	// The flows the errors are about, as their first packets left the
	// client (to the service) and reached the backend (translated).
	syn := tcpFrame(client, vipTCP, tcpSYN, "")
	data := tcpFrame(client, vipTCP, tcpACK|tcpPSH, "a segment too big for the next hop, odd")
	dataOnWire := data.withAddrs("", beTCP)
	udp := udpFrame(client3, vipUDP, "query")
	udpOnWire := udp.withAddrs("", beUDP)
	udpNoSum := udpFrame(client2, vipUDP, "no checksum")
	udpNoSum.noUDPSum = true
	udpNoSumOnWire := udpNoSum.withAddrs("", beUDP)
	reply := udpFrame(vipUDP, client3, "answer") // a reply as the client got it
	replyOnWire := udpFrame(beUDP, client3, "answer")

	cl, cl3 := addrOf(client), addrOf(client3)
	beU, vip := addrOf(beUDP), addrOf(vipTCP)

	portUnreach := icmpErr(beU, cl3, icmpDestUnreach, icmpPortUnreach, udpOnWire, 0)
	portUnreachOut := icmpErr(vip, cl3, icmpDestUnreach, icmpPortUnreach, udp, 0)
	fullQuote := icmpErr(beU, cl3, icmpDestUnreach, icmpPortUnreach, udpOnWire, quoteFull)
	fullQuoteOut := icmpErr(vip, cl3, icmpDestUnreach, icmpPortUnreach, udp, quoteFull)
	noSum := icmpErr(beU, addrOf(client2), icmpDestUnreach, icmpPortUnreach, udpNoSumOnWire, 0)
	noSumOut := icmpErr(vip, addrOf(client2), icmpDestUnreach, icmpPortUnreach, udpNoSum, 0)
	fragRouter := icmpErr(icmpRouter, cl, icmpDestUnreach, icmpFragNeeded, dataOnWire, quoteFull)
	fragRouter.icmpRest = fragMTU
	fragRouterOut := icmpErr(icmpRouter, cl, icmpDestUnreach, icmpFragNeeded, data, quoteFull)
	fragRouterOut.icmpRest = fragMTU
	fragNode := icmpErr(icmpNodeAddr, cl, icmpDestUnreach, icmpFragNeeded, dataOnWire, 20+20+8)
	fragNode.icmpRest = fragMTU
	fragNodeOut := icmpErr(icmpNodeAddr, cl, icmpDestUnreach, icmpFragNeeded, data, 20+20+8)
	fragNodeOut.icmpRest = fragMTU
	ttl := icmpErr(icmpRouter, cl, icmpTimeExceeded, 0, dataOnWire, 0)
	ttlOut := icmpErr(icmpRouter, cl, icmpTimeExceeded, 0, data, 0)
	// The client's own error about a reply (its socket is gone) goes back
	// to the backend that sent it.
	aboutReply := icmpErr(cl3, vip, icmpDestUnreach, icmpPortUnreach, reply, 0)
	aboutReplyOut := icmpErr(cl3, beU, icmpDestUnreach, icmpPortUnreach, replyOnWire, 0)
	// The backend's own address quoted, but the error from somewhere else:
	// only the quote changes.
	unknown := icmpErr(beU, cl3, icmpDestUnreach, icmpPortUnreach, udpFrame(client3, "10.2.3.4:53", "q"), 0)
	shortQuote := icmpErr(beU, cl3, icmpDestUnreach, icmpPortUnreach, udpOnWire, 20+4)
	laterFrag := udpOnWire
	laterFrag.fragOff = 100
	fragQuote := icmpErr(beU, cl3, icmpDestUnreach, icmpPortUnreach, laterFrag, 0)
	redirect := icmpErr(icmpRouter, cl3, 5, 1, udpOnWire, 0) // ICMP redirect: not an error we translate

	// Source NAT (north-south): the northClient client's flow leaves the node
	// as snatNode -> snatBE.
	snatUDP := udpFrame(northClient, snatVIPU, "q")
	snatUDPOnWire := udpFrame(snatNode, snatBEU, "q")
	snatTCP := tcpFrame(northClient, snatVIP, tcpACK, "big segment")
	snatTCPOnWire := tcpFrame(snatNode, snatBE, tcpACK, "big segment")
	snatReply := udpFrame(snatVIPU, northClient, "a") // as the northClient client got it
	snatReplyOnWire := udpFrame(snatBEU, snatNode, "a")
	out, sn, sb, sv := addrOf(northClient), addrOf(snatNode), addrOf(snatBE), addrOf(snatVIP)

	rows := []pktCase{
		{name: "flow_tcp", hook: hookTC, in: syn, out: ptr(syn.withAddrs("", beTCP)), fwd: tcpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "flow_udp", hook: hookTC, in: udp, out: ptr(udpOnWire), fwd: udpFE, newFlow: true, stats: newFlowStats(nil)},
		{name: "flow_udp_no_checksum", hook: hookTC, in: udpNoSum, out: ptr(udpNoSumOnWire), fwd: udpFE, newFlow: true, stats: newFlowStats(nil)},

		{name: "port_unreachable_from_local_backend", hook: hookTC, in: portUnreach, out: &portUnreachOut, stats: xl},
		{name: "port_unreachable_from_remote_backend", hook: hookXDP, in: portUnreach, out: &portUnreachOut, stats: xl},
		{name: "whole_datagram_quoted", hook: hookXDP, in: fullQuote, out: &fullQuoteOut, stats: xl},
		{name: "quoted_udp_checksum_zero_stays_zero", hook: hookTC, in: noSum, out: &noSumOut, stats: xl},
		{name: "frag_needed_from_router_keeps_router_source", hook: hookXDP, in: fragRouter, out: &fragRouterOut, stats: xl},
		{name: "frag_needed_from_node_to_pod", hook: hookTCEgress, in: fragNode, out: &fragNodeOut, stats: xl},
		{name: "time_exceeded_from_router", hook: hookXDP, in: ttl, out: &ttlOut, stats: xl},
		{name: "client_error_about_a_reply_goes_to_the_backend", hook: hookTC, in: aboutReply, out: &aboutReplyOut, stats: xl},
		{name: "translated_error_is_not_translated_twice", hook: hookTCEgress, in: portUnreachOut, want: pass},

		{name: "unknown_flow_untouched", hook: hookXDP, in: unknown, want: pass},
		{name: "quote_without_ports_untouched", hook: hookTC, in: shortQuote, want: pass},
		{name: "quote_of_a_later_fragment_untouched", hook: hookXDP, in: fragQuote, want: pass},
		{name: "redirect_untouched", hook: hookXDP, in: redirect, want: pass},
		{name: "egress_passes_other_traffic", hook: hookTCEgress, in: udpOnWire, want: pass},
		{name: "expired_flow_untouched", hook: hookXDP, in: portUnreach, want: pass,
			before: setExpires(flowOf(client3, vipUDP, beUDP, protoUDP), -time.Second)},

		{name: "snat_port_unreachable_from_backend", hook: hookXDP, before: plantSNATFlow(northClient, snatVIPU, snatBEU, snatNode, protoUDP),
			in:  icmpErr(sb, sn, icmpDestUnreach, icmpPortUnreach, snatUDPOnWire, 0),
			out: ptr(icmpErr(sv, out, icmpDestUnreach, icmpPortUnreach, snatUDP, 0)), stats: xl},
		{name: "snat_frag_needed_from_router", hook: hookXDP, before: plantSNATFlow(northClient, snatVIP, snatBE, snatNode, protoTCP),
			in:  icmpErr(icmpRouter, sn, icmpDestUnreach, icmpFragNeeded, snatTCPOnWire, quoteFull),
			out: ptr(icmpErr(icmpRouter, out, icmpDestUnreach, icmpFragNeeded, snatTCP, quoteFull)), stats: xl},
		{name: "snat_client_error_about_a_reply", hook: hookXDP,
			in:  icmpErr(out, sv, icmpDestUnreach, icmpPortUnreach, snatReply, 0),
			out: ptr(icmpErr(sn, sb, icmpDestUnreach, icmpPortUnreach, snatReplyOnWire, 0)), stats: xl},
	}
	runTable(t, d, rows)
}
