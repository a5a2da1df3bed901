package maps

import (
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/topolb/topolb/internal/nettest"
)

// dualStack adds IPv6 to the testbed, beside its IPv4 and mirroring it:
//
//	client(fd00:10:0::2) ── hc ┐                         ┌ hb3 ── b3(fd00:20:1::2)
//	b1(fd00:10:1::2) ─── hb1 ──┤ node1 ── w1 ══ w2 ── node2
//	b2(fd00:10:2::2) ─── hb2 ──┘   (fd00:9::1)  (fd00:9::2)
//
// Both nodes forward IPv6 and route the other's pod prefix.
func (tb *testbed) dualStack(t *testing.T) {
	t.Helper()
	for _, n := range []*nettest.NS{tb.node1, tb.node2} {
		must(t, n.Sysctl("net.ipv6.conf.all.forwarding", "1"))
	}
	podSubnet(t, tb.node1, tb.client, "hc", "fd00:10:0")
	podSubnet(t, tb.node1, tb.b1, "hb1", "fd00:10:1")
	podSubnet(t, tb.node1, tb.b2, "hb2", "fd00:10:2")
	podSubnet(t, tb.node2, tb.b3, "hb3", "fd00:20:1")
	must(t, tb.node1.AddAddr("w1", "fd00:9::1/64"))
	must(t, tb.node2.AddAddr("w2", "fd00:9::2/64"))
	must(t, tb.node1.AddRoute("fd00:20::/32", "fd00:9::2"))
	must(t, tb.node2.AddRoute("fd00:10::/32", "fd00:9::1"))
}

// TestRealTrafficIPv6 runs HTTP and UDP over IPv6 from a pod to an IPv6
// ClusterIP through the pod-veth hook: the client's packets are
// translated to the backends on its veth (tc_lb) and forwarded (fwd.h).
// The local backends' replies are translated back to the frontend on
// their veths; those of the backend on another node on the uplink they
// arrive on (tc_uplink, tc_lb6).
// Every answer must come from the frontend's address, with no checksum
// error anywhere.
func TestRealTrafficIPv6(t *testing.T) {
	requirePrivileges(t)
	if err := nettest.RemoveStale(); err != nil {
		t.Logf("removing stale namespaces: %v", err)
	}
	node, node2, client := nettest.NewNS(t, "node6"), nettest.NewNS(t, "node26"), nettest.NewNS(t, "client6")
	b1, b2, b3 := nettest.NewNS(t, "b16"), nettest.NewNS(t, "b26"), nettest.NewNS(t, "b36")
	for _, n := range []*nettest.NS{node, node2} {
		must(t, n.Sysctl("net.ipv6.conf.all.forwarding", "1"))
	}
	pod(t, node, client, "hc", "fd00:10:0")
	pod(t, node, b1, "hb1", "fd00:10:1")
	pod(t, node, b2, "hb2", "fd00:10:2")
	pod(t, node2, b3, "hb3", "fd00:20:1")
	must(t, nettest.Veth(node, "w1", node2, "w2"))
	must(t, node.AddAddr("w1", "fd00:9::1/64"))
	must(t, node2.AddAddr("w2", "fd00:9::2/64"))
	must(t, node.AddRoute("fd00:20::/32", "fd00:9::2"))
	must(t, node2.AddRoute("fd00:10::/32", "fd00:9::1"))
	// Node-side senders compute checksums in software, so a receiver
	// verifies what the datapath wrote (pods keep CHECKSUM_PARTIAL).
	for _, x := range []struct {
		ns     *nettest.NS
		ifname string
	}{{node, "hc"}, {node, "hb1"}, {node, "hb2"}, {node, "w1"}, {node2, "w2"}, {node2, "hb3"}} {
		must(t, x.ns.SetOffload(x.ifname, "tx", false))
	}
	d := newDatapath(t, Options{PinPath: filepath.Join(bpffs(t), "topolb"), NetNS: node.Path})
	for _, ifname := range []string{"hc", "hb1", "hb2"} {
		must(t, d.AttachPod(ifname))
	}
	must(t, d.AttachUplink("w1"))
	for name, ns := range map[string]*nettest.NS{"b1": b1, "b2": b2, "b3": b3} {
		ns.ServeHTTPName(t, "[::]:8080", name)
		ns.ServeUDPName(t, "[::]:5353", name)
	}
	const vipHTTP, vipDNS = "[fd00:96::10]:80", "[fd00:96::10]:53"
	backends := func(port uint16) []Backend {
		return []Backend{
			{Addr: netip.AddrPortFrom(netip.MustParseAddr("fd00:10:1::2"), port), NodeLocal: true},
			{Addr: netip.AddrPortFrom(netip.MustParseAddr("fd00:10:2::2"), port), NodeLocal: true},
			{Addr: netip.AddrPortFrom(netip.MustParseAddr("fd00:20:1::2"), port)},
		}
	}
	mustSet(t, d, fe(vipHTTP, TCP), backends(8080)...)
	mustSet(t, d, fe(vipDNS, UDP), backends(5353)...)

	const n = 100
	httpGot := httpGets(t, client, "http://"+vipHTTP+"/", n)
	udpGot := udpQueries(t, client, vipDNS, n)
	t.Logf("HTTP answers per backend: %v; UDP: %v", httpGot, udpGot)
	for _, name := range []string{"b1", "b2", "b3"} {
		if httpGot[name] == 0 || udpGot[name] == 0 {
			t.Errorf("backend %s never answered (HTTP %v, UDP %v)", name, httpGot, udpGot)
		}
	}
	for name, ns := range map[string]*nettest.NS{"node": node, "node2": node2, "client": client, "b1": b1, "b2": b2, "b3": b3} {
		ce, err := ns.ChecksumErrors()
		if err != nil {
			t.Fatal(err)
		}
		if ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v", name, ce)
		}
	}
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Drops != (Drops{}) {
		t.Errorf("drops: %+v", c.Drops)
	}
	// Every request counted in its frontend, from the IPv6 conntrack
	// entries (a UDP query may reuse an earlier one's port, and flow), and
	// every answer translated back.
	if c.Frontends[fe(vipHTTP, TCP)].Flows < n || c.Frontends[fe(vipDNS, UDP)].Packets < n || c.ReverseNAT < 2*n {
		t.Errorf("counters too low: %+v", c)
	}
}
