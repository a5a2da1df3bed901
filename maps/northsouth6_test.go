package maps

import (
	"errors"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/topolb/topolb/internal/nettest"
)

// hookUplinkBesideXDP selects, in packet tables, tc_uplink: the tcx
// ingress program beside xdp_lb on an uplink of the XDP path, which
// answers the IPv6 that xdp_lb passes up (rejects, ICMPv6 errors).
const hookUplinkBesideXDP hook = "uplink-beside-xdp"

// The IPv6 half of the forwarding namespace (forward_test.go's picture),
// added by addIPv6:
//
//	pod1 fd00:244:1::10 ── hp1 ┐                  ┌ up0 fd00:250::1/64 ─ node2 ::2 (fd00:244:2::/64), node3 ::3 (fd00:244:3::/64, no neighbour),
//	pod2 fd00:244:1::11 ── hp2 ┤ node (forwarding) │                    router ::fe (2001:db8:113::/64)
//	client fd00:244:1::20 ─ hc ┘                  ├ up1 fd00:251::1/64, MTU 1400 ─ node4 ::2 (2001:db8:18::/64, fd00:244:4::/64)
//	                                              └ other0 (fd00:244:5::/64 on link): an interface topolb is not attached to
const (
	node6       = "fd00:250::1"
	pod16       = "fd00:244:1::10"
	podClient6  = "fd00:244:1::20"
	beNode26    = "fd00:244:2::10"
	beNode36    = "fd00:244:3::10"
	beNode46    = "fd00:244:4::10"
	beOther6    = "fd00:244:5::10"
	outside6    = "2001:db8:113::10"
	outsideUp16 = "2001:db8:18::5"
)

// addIPv6 gives e's node the IPv6 addresses, routes and neighbours of the
// picture above, with IPv6 forwarding on (the FIB answers "forwarding
// disabled" without it, and the flow would go by the stack).
func (e *fwdEnv) addIPv6(t *testing.T) {
	t.Helper()
	must(t, e.node.Sysctl("net.ipv6.conf.all.forwarding", "1"))
	must(t, e.node.AddAddr("up0", node6+"/64"))
	must(t, e.node.AddAddr("up1", "fd00:251::1/64"))
	must(t, e.node.AddRouteDev(pod16+"/128", "hp1", ""))
	must(t, e.node.AddRouteDev("fd00:244:1::11/128", "hp2", ""))
	must(t, e.node.AddRouteDev(podClient6+"/128", "hc", ""))
	for _, r := range []struct{ dst, dev, gw string }{
		{"fd00:244:2::/64", "up0", "fd00:250::2"},
		{"fd00:244:3::/64", "up0", "fd00:250::3"},
		{"2001:db8:113::/64", "up0", "fd00:250::fe"},
		{"2001:db8:18::/64", "up1", "fd00:251::2"},
		{"fd00:244:4::/64", "up1", "fd00:251::2"},
		{"fd00:244:5::/64", "other0", ""},
	} {
		must(t, e.node.AddRouteDev(r.dst, r.dev, r.gw))
	}
	e.neigh(t, "up0", "fd00:250::2", macNode2)
	e.neigh(t, "up0", "fd00:250::fe", macRouter)
	e.neigh(t, "up1", "fd00:251::2", macNode4)
	e.neigh(t, "hp1", pod16, e.mac[pod1])
	e.neigh(t, "hc", podClient6, e.mac[podClient])
}

// ap6 joins an address of either family and a port.
func ap6(addr string, port int) string {
	return netip.AddrPortFrom(netip.MustParseAddr(addr), uint16(port)).String()
}

// ct6Key is the IPv6 conntrack key of a flow's direction from src to dst.
func ct6Key(src, dst string, proto uint8) tcCt6Key {
	s, d := netip.MustParseAddrPort(src), netip.MustParseAddrPort(dst)
	return tcCt6Key{Saddr: wireAddr(s.Addr()), Daddr: wireAddr(d.Addr()), Sport: be16(s.Port()), Dport: be16(d.Port()), Proto: proto}
}

// expect6 checks the IPv6 conntrack entry under key as expectEntry checks
// an IPv4 one: x's fields with its addresses in the IPv6 value's.
func (x entry) expect6(key tcCt6Key) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		t.Helper()
		// The shared part, built from x with its addresses left out
		// (zero in an IPv6 entry's ct).
		x4 := x
		x4.addr = ap("0.0.0.0", int(netip.MustParseAddrPort(x.addr).Port()))
		want := tcCt6Value{Addr: wireAddr(netip.MustParseAddrPort(x.addr).Addr())}
		if x.nat != "" {
			n := netip.MustParseAddrPort(x.nat)
			x4.nat = ap("0.0.0.0", int(n.Port()))
			want.NatAddr = wireAddr(n.Addr())
		}
		want.Ct = x4.value(t, d)
		var got tcCt6Value
		err := ebpf.ErrKeyNotExist
		for _, m := range d.ct6Tables() {
			if err = m.Lookup(&key, &got); !errors.Is(err, ebpf.ErrKeyNotExist) {
				break
			}
		}
		if err != nil {
			t.Fatalf("IPv6 conntrack entry %s -> %s: %v", addrPortOf(key.Saddr, key.Sport), addrPortOf(key.Daddr, key.Dport), err)
		}
		if got.Ct.Expires == 0 {
			t.Errorf("entry %s -> %s: no expiry", addrPortOf(key.Saddr, key.Sport), addrPortOf(key.Daddr, key.Dport))
		}
		got.Ct.Expires, got.Ct.Packets, got.Ct.Bytes, got.Ct.TcpNext = 0, 0, 0, 0
		if got != want {
			t.Errorf("entry %s -> %s\n got %+v\nwant %+v", addrPortOf(key.Saddr, key.Sport), addrPortOf(key.Daddr, key.Dport), got, want)
		}
	}
}

// ns6Flows are the frontends TestTCUplinkNorthSouth6 and
// TestXDPNorthSouth6 program, with their clients and, for the
// source-NATed ones, the node's address and port each client's flow
// takes.
type ns6Flows struct {
	feLocal, feRemote, feUDP, feNeigh, feLB Frontend
	cLocal, cRemote, cUDP, cUp1, cNeigh     string
	snatRemote, snatUDP, snatUp1, snatNeigh string
}

// newNS6Flows programs ns6Flows' frontends in d: eTP Local into pod1,
// Cluster to backends on node2 and node3 (no neighbour), UDP, and a
// load-balancer IP into pod1 with a source range.
func newNS6Flows(t *testing.T, d *Datapath) ns6Flows {
	f := ns6Flows{
		feLocal:  extFrontend(ap6(node6, 30080), TCP),
		feRemote: extFrontend(ap6(node6, 30082), TCP),
		feUDP:    extFrontend(ap6(node6, 30053), UDP),
		feNeigh:  extFrontend(ap6(node6, 30083), TCP),
		feLB:     extFrontend(ap6("2001:db8:ff::10", 443), TCP),
		cLocal:   ap6(outside6, 40000), cRemote: ap6(outside6, 41000), cUDP: ap6(outside6, 42000),
		cUp1: ap6(outsideUp16, 44000), cNeigh: ap6(outside6, 45000),
	}
	mustSet(t, d, f.feLocal, local(ap6(pod16, 8080)))
	mustSet(t, d, f.feRemote, be(ap6(beNode26, 8080)))
	mustSet(t, d, f.feUDP, be(ap6(beNode26, 5353)))
	mustSet(t, d, f.feNeigh, be(ap6(beNode36, 8080)))
	mustSetService(t, d, f.feLB, Service{Backends: []Backend{local(ap6(pod16, 8443))},
		SourceRanges: []netip.Prefix{netip.MustParsePrefix("2001:db8:113::/64")}})
	f.snatRemote, f.snatUDP = snat6Of(f.cRemote, f.feRemote, protoTCP), snat6Of(f.cUDP, f.feUDP, protoUDP)
	f.snatUp1, f.snatNeigh = snat6Of(f.cUp1, f.feRemote, protoTCP), snat6Of(f.cNeigh, f.feNeigh, protoTCP)
	return f
}

// remoteEntries expects the two entries of cRemote's flow to feRemote,
// source-NATed towards node2 by up0 (either uplink path writes the
// same).
func (f ns6Flows) remoteEntries(e *fwdEnv) func(t *testing.T, d *Datapath) {
	up0, upMAC0 := e.idx["up0"], e.mac["up0"]
	return both(
		entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: ap6(beNode26, 8080), nat: f.snatRemote, redirect: tcCtRedirectCT_REDIRECT_XDP,
			ifindex: up0, smac: upMAC0, dmac: macNode2, iif: e.idx["up0"], svc: f.feRemote, backendAddr: ap6(beNode26, 8080)}.expect6(ct6Key(f.cRemote, f.feRemote.Addr.String(), protoTCP)),
		entry{dir: tcCtDirCT_REVERSE, state: tcCtStateCT_TCP_SYN_SENT, addr: f.feRemote.Addr.String(), nat: f.cRemote, redirect: tcCtRedirectCT_REDIRECT_XDP,
			ifindex: up0, smac: upMAC0, dmac: macRouter, iif: e.idx["up0"], svc: f.feRemote, backendAddr: ap6(beNode26, 8080)}.expect6(ct6Key(ap6(beNode26, 8080), f.snatRemote, protoTCP)),
	)
}

// remoteRows are the rows of cRemote's flow to feRemote through the
// uplink's hook h (tc_uplink_lb or xdp_lb), each with verdict ret: the
// SYN source-NATed towards node2, its reply back to the client, and the
// client's next segment, which promotes the flow.
func (f ns6Flows) remoteRows(e *fwdEnv, h hook, ret uint32) []pktCase {
	upMAC0 := e.mac["up0"]
	syn := tcpFrame(f.cRemote, f.feRemote.Addr.String(), tcpSYN, "")
	reply := tcpFrame(ap6(beNode26, 8080), f.snatRemote, tcpSYN|tcpACK, "")
	ack := tcpFrame(f.cRemote, f.feRemote.Addr.String(), tcpACK, "GET / odd")
	return []pktCase{
		{name: "cluster_remote_backend_snat", hook: h, env: e, iif: "up0", in: syn,
			out: ptr(syn.withAddrs(f.snatRemote, ap6(beNode26, 8080)).forwarded(upMAC0, macNode2)), ret: ret,
			fwd: f.feRemote, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2},
			after: f.remoteEntries(e)},
		{name: "cluster_remote_reply_back_to_the_client", hook: h, env: e, iif: "up0", in: reply,
			out: ptr(reply.withAddrs(f.feRemote.Addr.String(), f.cRemote).forwarded(upMAC0, macRouter)), ret: ret,
			stats: stats{StatReverseNAT: 1}},
		{name: "cluster_remote_established_hit", hook: h, env: e, iif: "up0", in: ack,
			out: ptr(ack.withAddrs(f.snatRemote, ap6(beNode26, 8080)).forwarded(upMAC0, macNode2)), ret: ret, fwd: f.feRemote,
			stats: stats{StatConntrackPromoted: 1}},
	}
}

// snat6Of is the node's IPv6 address and the first SNAT port of client's
// flow to f.
func snat6Of(client string, f Frontend, proto uint8) string {
	return ap6(node6, int(snatPortOf(netip.MustParseAddrPort(client), f.Addr, proto, 0, DefaultSNATPorts)))
}

// TestTCUplinkNorthSouth6 runs IPv6 north-south through the uplinks' tc
// programs, in the forwarding namespace with its IPv6 half: a NodePort
// with externalTrafficPolicy Local (DNAT into the pod, bpf_redirect_peer)
// and its reply from the pod through tc_lb (out of the uplink with the
// router's MAC); Cluster with a remote backend (DNAT and SNAT to the
// node's IPv6 address with the IPv4 port allocator's port, out of the
// uplink with the next hop's MACs), its reply and established packets,
// UDP, a client behind the other uplink, an unknown next hop
// (bpf_redirect_neigh) and the next packet once it is known (the MACs
// written, the entry updated), the hop limit expiring on a source-NATed packet
// (dropped, not a martian); and a load-balancer IP with IPv6 source
// ranges (the XDP path's twin is TestXDPNorthSouth6). Every output is
// checked byte for byte with its checksums, every conntrack entry field
// by field.
func TestTCUplinkNorthSouth6(t *testing.T) {
	e := newFwdEnvFamilies(t, Options{UplinkPath: UplinkTC}, true)
	d := e.d
	up0, upMAC0 := e.idx["up0"], e.mac["up0"]
	f := newNS6Flows(t, d)
	feLocal, feRemote, feUDP, feNeigh, feLB := f.feLocal, f.feRemote, f.feUDP, f.feNeigh, f.feLB
	cLocal, cUDP, cUp1, cNeigh := f.cLocal, f.cUDP, f.cUp1, f.cNeigh
	snatUDP, snatUp1, snatNeigh := f.snatUDP, f.snatUp1, f.snatNeigh

	localSyn := tcpFrame(cLocal, feLocal.Addr.String(), tcpSYN, "")
	localReply := tcpFrame(ap6(pod16, 8080), cLocal, tcpSYN|tcpACK, "")
	udpQ := udpFrame(cUDP, feUDP.Addr.String(), "query")
	udpA := udpFrame(ap6(beNode26, 5353), snatUDP, "answer!")
	up1Syn := tcpFrame(cUp1, feRemote.Addr.String(), tcpSYN, "")
	neighSyn := tcpFrame(cNeigh, feNeigh.Addr.String(), tcpSYN, "")
	neighAck := tcpFrame(cNeigh, feNeigh.Addr.String(), tcpACK, "again")
	hopLimit1 := tcpFrame(ap6(outside6, 47000), feRemote.Addr.String(), tcpSYN, "")
	hopLimit1.ttl = 1
	lbSyn := tcpFrame(ap6(outside6, 48000), feLB.Addr.String(), tcpSYN, "")
	lbDenied := tcpFrame(ap6("2001:db8:114::10", 48000), feLB.Addr.String(), tcpSYN, "")

	newSNAT := stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2}
	intoPod1 := stats{StatConntrackCreated: 1, StatFwdPeer: 1, StatFwdL2: 1}
	rows := []pktCase{
		{name: "nodeport_etp_local_syn_into_the_pod_redirect_peer", hook: hookUplinkTC, env: e, iif: "up0", in: localSyn,
			out: ptr(localSyn.withAddrs("", ap6(pod16, 8080)).forwarded(e.mac["hp1"], e.mac[pod1])), ret: tcRedirect,
			fwd: feLocal, newFlow: true, stats: intoPod1,
			after: both(
				entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: ap6(pod16, 8080), redirect: tcCtRedirectCT_REDIRECT_PEER,
					ifindex: e.idx["hp1"], smac: e.mac["hp1"], dmac: e.mac[pod1], iif: e.idx["up0"], svc: feLocal, backendAddr: ap6(pod16, 8080)}.expect6(ct6Key(cLocal, feLocal.Addr.String(), protoTCP)),
				entry{dir: tcCtDirCT_REVERSE, state: tcCtStateCT_TCP_SYN_SENT, addr: feLocal.Addr.String(), redirect: tcCtRedirectCT_REDIRECT_XDP,
					ifindex: up0, smac: upMAC0, dmac: macRouter, iif: e.idx["hp1"], svc: feLocal, backendAddr: ap6(pod16, 8080)}.expect6(ct6Key(ap6(pod16, 8080), cLocal, protoTCP)),
			)},
		{name: "etp_local_reply_from_the_pod_out_of_the_uplink", hook: hookTC, env: e, iif: "hp1", in: localReply,
			out: ptr(localReply.withAddrs(feLocal.Addr.String(), cLocal).forwarded(upMAC0, macRouter)), ret: tcRedirect,
			stats: stats{StatReverseNAT: 1}},
	}
	rows = append(rows, f.remoteRows(e, hookUplinkTC, tcRedirect)...)
	rows = append(rows, []pktCase{
		{name: "udp_snat", hook: hookUplinkTC, env: e, iif: "up0", in: udpQ,
			out: ptr(udpQ.withAddrs(snatUDP, ap6(beNode26, 5353)).forwarded(upMAC0, macNode2)), ret: tcRedirect,
			fwd: feUDP, newFlow: true, stats: newSNAT},
		{name: "udp_snat_reply", hook: hookUplinkTC, env: e, iif: "up0", in: udpA,
			out: ptr(udpA.withAddrs(feUDP.Addr.String(), cUDP).forwarded(upMAC0, macRouter)), ret: tcRedirect,
			stats: stats{StatReverseNAT: 1}},
		{name: "snat_to_another_uplink", hook: hookUplinkTC, env: e, iif: "up1", in: up1Syn,
			out: ptr(up1Syn.withAddrs(snatUp1, ap6(beNode26, 8080)).forwarded(upMAC0, macNode2)), ret: tcRedirect,
			fwd: feRemote, newFlow: true, stats: newSNAT,
			after: entry{dir: tcCtDirCT_REVERSE, state: tcCtStateCT_TCP_SYN_SENT, addr: feRemote.Addr.String(), nat: cUp1, redirect: tcCtRedirectCT_REDIRECT_XDP,
				ifindex: e.idx["up1"], smac: e.mac["up1"], dmac: macNode4, iif: e.idx["up0"], svc: feRemote, backendAddr: ap6(beNode26, 8080)}.expect6(ct6Key(ap6(beNode26, 8080), snatUp1, protoTCP))},
		{name: "snat_next_hop_unknown_redirect_neigh", hook: hookUplinkTC, env: e, iif: "up0", in: neighSyn,
			out: ptr(neighSyn.withAddrs(snatNeigh, ap6(beNode36, 8080)).forwarded(macA, macB)), ret: tcRedirect,
			fwd: feNeigh, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdNeigh: 1, StatFwdL2: 1}},
		{name: "next_hop_learnt_later_used_by_the_next_packet", hook: hookUplinkTC, env: e, iif: "up0", in: neighAck,
			before: func(t *testing.T, d *Datapath) { e.neigh(t, "up0", "fd00:250::3", macNode3) },
			out:    ptr(neighAck.withAddrs(snatNeigh, ap6(beNode36, 8080)).forwarded(upMAC0, macNode3)), ret: tcRedirect, fwd: feNeigh,
			after: entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: ap6(beNode36, 8080), nat: snatNeigh, redirect: tcCtRedirectCT_REDIRECT_XDP,
				ifindex: up0, smac: upMAC0, dmac: macNode3, iif: e.idx["up0"], svc: feNeigh, backendAddr: ap6(beNode36, 8080)}.expect6(ct6Key(cNeigh, feNeigh.Addr.String(), protoTCP))},
		{name: "snat_hop_limit_expiring_dropped_not_a_martian", hook: hookUplinkTC, env: e, iif: "up0", in: hopLimit1, ret: tcShot,
			fwd: feRemote, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2, StatDropSNATFallback: 1}},
		{name: "lb_ip_from_a_source_range_into_the_pod", hook: hookUplinkTC, env: e, iif: "up0", in: lbSyn,
			out: ptr(lbSyn.withAddrs("", ap6(pod16, 8443)).forwarded(e.mac["hp1"], e.mac[pod1])), ret: tcRedirect,
			fwd: feLB, newFlow: true, stats: intoPod1},
		{name: "lb_ip_from_outside_its_source_ranges_dropped", hook: hookUplinkTC, env: e, iif: "up0", in: lbDenied, ret: tcShot,
			stats: stats{StatDropSourceRange: 1}},
		{name: "not_a_frontend_passes_untouched", hook: hookUplinkTC, env: e, iif: "up0",
			in: tcpFrame(ap6(outside6, 48001), ap6(node6, 22), tcpSYN, "")},
	}...)
	runTable(t, d, rows)
}

// TestXDPNorthSouth6 runs IPv6 north-south through xdp_lb, which balances
// IPv6 as it does IPv4 (TestXDPNorthSouth): a NodePort with
// externalTrafficPolicy Local (DNAT, handed to tc_uplink for the pod) and
// its established packets; Cluster with a remote backend (DNAT and SNAT
// to the node's IPv6 address, XDP_TX with the next hop's MACs), the
// reply of the source-NATed flow and its established packets, UDP, a
// client behind the other uplink (XDP_REDIRECT); and each fallback: a
// next hop without a MAC (handed to tc_uplink, which resolves it), learnt
// later (XDP_TX), a hop limit expiring (up the stack, or dropped for a
// source-NATed packet, whose source is the node's), a reply larger than
// the egress MTU (up the stack, which answers "packet too big"), and a
// source range's drop. Outputs byte for byte with their checksums,
// entries field by field.
func TestXDPNorthSouth6(t *testing.T) {
	e := newFwdEnvFamilies(t, Options{}, true)
	d := e.d
	up0, upMAC0 := e.idx["up0"], e.mac["up0"]
	f := newNS6Flows(t, d)
	feLocal, feRemote, feUDP, feNeigh, feLB := f.feLocal, f.feRemote, f.feUDP, f.feNeigh, f.feLB
	cLocal, cRemote, cUDP, cUp1, cNeigh := f.cLocal, f.cRemote, f.cUDP, f.cUp1, f.cNeigh
	snatRemote, snatUDP, snatUp1, snatNeigh := f.snatRemote, f.snatUDP, f.snatUp1, f.snatNeigh
	cTTL := ap6(outside6, 47000)
	snatTTL := snat6Of(cTTL, feRemote, protoTCP)

	localSyn := tcpFrame(cLocal, feLocal.Addr.String(), tcpSYN, "")
	localAck := tcpFrame(cLocal, feLocal.Addr.String(), tcpACK, "GET / odd")
	localTTL := tcpFrame(ap6(outside6, 40009), feLocal.Addr.String(), tcpSYN, "")
	localTTL.ttl = 1
	replyData := tcpFrame(ap6(beNode26, 8080), snatRemote, tcpACK, "HTTP/1.1 200 OK, odd")
	udpQ := udpFrame(cUDP, feUDP.Addr.String(), "query")
	udpA := udpFrame(ap6(beNode26, 5353), snatUDP, "answer!")
	up1Syn := tcpFrame(cUp1, feRemote.Addr.String(), tcpSYN, "")
	// 1450 bytes at L3, beyond up1's MTU of 1400.
	bigReply := tcpFrame(ap6(beNode26, 8080), snatUp1, tcpACK, strings.Repeat("x", 1450-40-20))
	neighSyn := tcpFrame(cNeigh, feNeigh.Addr.String(), tcpSYN, "")
	neighAck := tcpFrame(cNeigh, feNeigh.Addr.String(), tcpACK, "again")
	hopLimit1 := tcpFrame(cTTL, feRemote.Addr.String(), tcpSYN, "")
	hopLimit1.ttl = 1
	lbDenied := tcpFrame(ap6("2001:db8:114::10", 48000), feLB.Addr.String(), tcpSYN, "")

	newSNAT := stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2}
	intoPod1 := stats{StatConntrackCreated: 1, StatFwdPeer: 1, StatFwdL2: 1}
	toPod1 := handoff(tcCtRedirectCT_REDIRECT_PEER, e.idx["hp1"], e.mac[pod1], e.mac["hp1"], 0)
	rows := []pktCase{
		{name: "etp_local_syn_into_the_pod_through_tc_uplink", hook: hookXDP, env: e, iif: "up0", in: localSyn,
			out: ptr(localSyn.withAddrs("", ap6(pod16, 8080))), ret: xdpPass, meta: toPod1,
			fwd: feLocal, newFlow: true, stats: intoPod1,
			after: entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: ap6(pod16, 8080), redirect: tcCtRedirectCT_REDIRECT_PEER,
				ifindex: e.idx["hp1"], smac: e.mac["hp1"], dmac: e.mac[pod1], iif: e.idx["up0"], svc: feLocal, backendAddr: ap6(pod16, 8080)}.expect6(ct6Key(cLocal, feLocal.Addr.String(), protoTCP))},
		{name: "etp_local_established_hit_through_tc_uplink", hook: hookXDP, env: e, iif: "up0", in: localAck,
			out: ptr(localAck.withAddrs("", ap6(pod16, 8080))), ret: xdpPass, meta: toPod1, fwd: feLocal},
		{name: "etp_local_hop_limit_expiring_goes_up_the_stack", hook: hookXDP, env: e, iif: "up0", in: localTTL,
			out: ptr(localTTL.withAddrs("", ap6(pod16, 8080))), ret: xdpPass,
			fwd: feLocal, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdPeer: 1, StatFwdL2: 1, StatFwdFallbackTTL: 1}},
	}
	// XDP_TX both ways, the client's next segment promoting the flow.
	rows = append(rows, f.remoteRows(e, hookXDP, xdpTX)...)
	rows = append(rows, []pktCase{
		{name: "snat_promoted_entry", hook: hookXDP, env: e, iif: "up0", in: replyData,
			out: ptr(replyData.withAddrs(feRemote.Addr.String(), cRemote).forwarded(upMAC0, macRouter)), ret: xdpTX,
			stats: stats{StatReverseNAT: 1},
			before: entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_ESTABLISHED, addr: ap6(beNode26, 8080), nat: snatRemote,
				flags: tcCtFlagCT_F_SNAT | tcCtFlagCT_F_REPLIED | tcCtFlagCT_F_ASSURED, redirect: tcCtRedirectCT_REDIRECT_XDP,
				ifindex: up0, smac: upMAC0, dmac: macNode2, iif: e.idx["up0"], svc: feRemote, backendAddr: ap6(beNode26, 8080)}.expect6(ct6Key(cRemote, feRemote.Addr.String(), protoTCP))},
		{name: "udp_snat", hook: hookXDP, env: e, iif: "up0", in: udpQ,
			out: ptr(udpQ.withAddrs(snatUDP, ap6(beNode26, 5353)).forwarded(upMAC0, macNode2)), ret: xdpTX,
			fwd: feUDP, newFlow: true, stats: newSNAT},
		{name: "udp_snat_reply", hook: hookXDP, env: e, iif: "up0", in: udpA,
			out: ptr(udpA.withAddrs(feUDP.Addr.String(), cUDP).forwarded(upMAC0, macRouter)), ret: xdpTX,
			stats: stats{StatReverseNAT: 1}},
		{name: "snat_from_another_uplink_xdp_redirect", hook: hookXDP, env: e, iif: "up1", in: up1Syn,
			out: ptr(up1Syn.withAddrs(snatUp1, ap6(beNode26, 8080)).forwarded(upMAC0, macNode2)), ret: xdpRedirect,
			fwd: feRemote, newFlow: true, stats: newSNAT},
		{name: "reply_beyond_the_egress_mtu_goes_up_the_stack", hook: hookXDP, env: e, iif: "up0", in: bigReply,
			out: ptr(bigReply.withAddrs(feRemote.Addr.String(), cUp1)), ret: xdpPass,
			stats: stats{StatReverseNAT: 1, StatFwdFallbackMTU: 1}},
		{name: "snat_next_hop_unknown_handed_to_tc_uplink", hook: hookXDP, env: e, iif: "up0", in: neighSyn,
			out: ptr(neighSyn.withAddrs(snatNeigh, ap6(beNode36, 8080))), ret: xdpPass,
			meta: handoff(tcCtRedirectCT_REDIRECT_NEIGH, up0, [6]byte{}, [6]byte{}, uint8(tcFwdMetaFlagFWD_META_F_NO_STACK)),
			fwd:  feNeigh, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdNeigh: 1, StatFwdL2: 1}},
		{name: "next_hop_learnt_then_xdp_tx", hook: hookXDP, env: e, iif: "up0", in: neighAck,
			before: func(t *testing.T, d *Datapath) { e.neigh(t, "up0", "fd00:250::3", macNode3) },
			out:    ptr(neighAck.withAddrs(snatNeigh, ap6(beNode36, 8080)).forwarded(upMAC0, macNode3)), ret: xdpTX, fwd: feNeigh,
			after: entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: ap6(beNode36, 8080), nat: snatNeigh, redirect: tcCtRedirectCT_REDIRECT_XDP,
				ifindex: up0, smac: upMAC0, dmac: macNode3, iif: e.idx["up0"], svc: feNeigh, backendAddr: ap6(beNode36, 8080)}.expect6(ct6Key(cNeigh, feNeigh.Addr.String(), protoTCP))},
		{name: "snat_hop_limit_expiring_dropped_not_a_martian", hook: hookXDP, env: e, iif: "up0", in: hopLimit1, ret: xdpDrop,
			fwd: feRemote, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2, StatDropSNATFallback: 1},
			after: func(t *testing.T, d *Datapath) {
				entry{dir: tcCtDirCT_REVERSE, state: tcCtStateCT_TCP_SYN_SENT, addr: feRemote.Addr.String(), nat: cTTL, redirect: tcCtRedirectCT_REDIRECT_XDP,
					ifindex: up0, smac: upMAC0, dmac: macRouter, iif: e.idx["up0"], svc: feRemote, backendAddr: ap6(beNode26, 8080)}.expect6(ct6Key(ap6(beNode26, 8080), snatTTL, protoTCP))(t, d)
			}},
		{name: "lb_ip_from_outside_its_source_ranges_dropped", hook: hookXDP, env: e, iif: "up0", in: lbDenied, ret: xdpDrop,
			stats: stats{StatDropSourceRange: 1}},
		{name: "not_a_frontend_passes_untouched", hook: hookXDP, env: e, iif: "up0",
			in: tcpFrame(ap6(outside6, 48001), ap6(node6, 22), tcpSYN, ""), ret: xdpPass},
	}...)
	runTable(t, d, rows)
}

// TestUplinkDeliversIPv6 sends real HTTP and UDP over IPv6 from outside
// through a veth uplink, on each path: tc (its peer without NAPI, the
// client's packets CHECKSUM_PARTIAL) and XDP (its peer with an XDP
// program; xdp_lb balances IPv6, XDP_TX out of the uplink, or handed to
// tc_uplink for the pod). To NodePorts on the node's IPv6 address whose
// backend is on another node (on the wire: source-NATed to the node's
// address, out of the uplink and back) and whose backend is a pod of the
// node with externalTrafficPolicy Local (into the pod, its replies out
// of the uplink). Every answer must come from the backend the frontend
// names, by the frontend's address, with no checksum error and no drop
// anywhere; on the XDP path the uplink's XDP_TX count shows xdp_lb
// forwarded the established packets itself.
func TestUplinkDeliversIPv6(t *testing.T) {
	for _, c := range []struct {
		name   string
		path   UplinkPath
		peer   uplinkPeer
		txCsum bool
	}{
		{name: "tc_plain_peer_partial_checksums", path: UplinkTC, peer: peerPlain, txCsum: true},
		{name: "xdp_peer_with_xdp", path: UplinkXDP, peer: peerXDP},
	} {
		t.Run(c.name, func(t *testing.T) {
			requirePrivileges(t)
			if err := nettest.RemoveStale(); err != nil {
				t.Logf("removing stale namespaces: %v", err)
			}
			node, wire, p := nettest.NewNS(t, "up6-node"), nettest.NewNS(t, "up6-wire"), nettest.NewNS(t, "up6-pod")
			must(t, node.Sysctl("net.ipv6.conf.all.forwarding", "1"))
			must(t, nettest.Veth(node, "up0", wire, "w0"))
			must(t, node.AddAddr("up0", node6+"/64"))
			must(t, wire.AddAddr("w0", "fd00:250::9/64"))
			must(t, wire.AddAddr("w0", "fd00:250::2/64"))
			pod(t, node, p, "hp", "fd00:244:1")
			// Node-side senders compute checksums in software, so a
			// receiver verifies what the datapath wrote.
			must(t, node.SetOffload("up0", "tx", false))
			must(t, node.SetOffload("hp", "tx", false))
			must(t, wire.SetOffload("w0", "tx", c.txCsum))
			must(t, wire.SetGRO("w0", false))
			if c.peer == peerXDP {
				xdpPassOn(t, wire, "w0")
			}
			wire.ServeHTTPName(t, "[fd00:250::2]:8080", "remote")
			wire.ServeUDPName(t, "[fd00:250::2]:5353", "remote")
			p.ServeHTTPName(t, "[::]:8080", "pod")
			p.ServeUDPName(t, "[::]:5353", "pod")

			d := newDatapath(t, Options{PinPath: filepath.Join(bpffs(t), "topolb"), NetNS: node.Path, UplinkPath: c.path})
			must(t, d.AttachPod("hp"))
			must(t, d.AttachUplink("up0"))
			if st := uplinkPath(t, d); st.Path != string(c.path) {
				t.Fatalf("up0's path %q, want %q", st.Path, c.path)
			}
			podAddr := "fd00:244:1::2"
			for _, f := range []struct {
				fe Frontend
				b  Backend
			}{
				{extFrontend(ap6(node6, 30082), TCP), be("[fd00:250::2]:8080")},
				{extFrontend(ap6(node6, 30053), UDP), be("[fd00:250::2]:5353")},
				{extFrontend(ap6(node6, 30080), TCP), local(ap6(podAddr, 8080))},
				{extFrontend(ap6(node6, 30054), UDP), local(ap6(podAddr, 5353))},
			} {
				mustSet(t, d, f.fe, f.b)
			}

			xdpTXBefore := xdpTransmitted(t, node, "up0")
			const n = 20
			for _, q := range []struct {
				frontend, want string
				udp            bool
			}{
				{ap6(node6, 30082), "remote", false},
				{ap6(node6, 30053), "remote", true},
				{ap6(node6, 30080), "pod", false},
				{ap6(node6, 30054), "pod", true},
			} {
				var got map[string]int
				if q.udp {
					got = udpQueries(t, wire, q.frontend, n)
				} else {
					got = httpGets(t, wire, "http://"+q.frontend+"/", n)
				}
				if got[q.want] != n {
					t.Errorf("%s: answers %v, want %d from %s", q.frontend, got, n, q.want)
				}
			}
			cnt, err := d.Counters()
			must(t, err)
			if cnt.Stats[StatSNATFlows] < 2*n {
				t.Errorf("%d flows source-NATed, want at least %d", cnt.Stats[StatSNATFlows], 2*n)
			}
			if cnt.Drops != (Drops{}) {
				t.Errorf("drops: %+v", cnt.Drops)
			}
			// On the XDP path, xdp_lb sends the source-NATed flows'
			// packets back out of up0 itself (XDP_TX), both ways: more
			// than their 2n first packets, so established packets and
			// replies are among them. The tc path never transmits from
			// XDP.
			xdpTX := xdpTransmitted(t, node, "up0") - xdpTXBefore
			t.Logf("XDP_TX on up0: %d frames", xdpTX)
			if c.path == UplinkXDP && xdpTX < 4*n {
				t.Errorf("XDP_TX on up0: %d frames, want at least %d (established IPv6 forwarded by XDP)", xdpTX, 4*n)
			}
			if c.path == UplinkTC && xdpTX != 0 {
				t.Errorf("XDP_TX on up0: %d frames on the tc path, want 0", xdpTX)
			}
			for name, ns := range map[string]*nettest.NS{"node": node, "wire": wire, "pod": p} {
				if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
					t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
				}
			}
		})
	}
}

// xdpTransmitted is how many frames XDP sent back out of ifname in ns
// (XDP_TX), over its receive queues (the veth's driver statistics).
func xdpTransmitted(t *testing.T, ns *nettest.NS, ifname string) uint64 {
	t.Helper()
	stats, err := ns.NICStats(ifname)
	must(t, err)
	var sum uint64
	found := false
	for name, v := range stats {
		if strings.HasPrefix(name, "rx_queue_") && strings.HasSuffix(name, "_xdp_tx") {
			sum += v
			found = true
		}
	}
	if !found {
		t.Fatalf("%s has no XDP_TX counter: %v", ifname, stats)
	}
	return sum
}
