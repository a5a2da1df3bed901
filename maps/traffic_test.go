package maps

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/topolb/topolb/internal/nettest"
	"github.com/topolb/topolb/internal/testutil"
)

// node1 and node2 of the real-traffic topology:
//
//	client(10.1.0.2) ── hc ┐                       ┌ hb3 ── b3(10.2.1.2)
//	b1(10.1.1.2) ─── hb1 ──┤ node1 ── w1 ══ w2 ── node2
//	b2(10.1.2.2) ─── hb2 ──┘   (10.9.0.1)  (10.9.0.2)
//
// tc on hc, hb1, hb2 (node1's pod veths) and XDP on w1 (node1's uplink).
type testbed struct {
	node1, node2, client, b1, b2, b3 *nettest.NS
}

// must fails the test on err, or skips it where the kernel lacks a
// feature (testutil.MustOrSkip).
var must = testutil.MustOrSkip

// pod wires a pod namespace to its node: eth0 in the pod, host in the
// node, the node's address subnet.1 and the pod's subnet.2 in a /24, or,
// for an IPv6 subnet (one with a colon), subnet::1 and subnet::2 in a
// /64.
func pod(t *testing.T, node, p *nettest.NS, host, subnet string) {
	t.Helper()
	must(t, nettest.Veth(node, host, p, "eth0"))
	podSubnet(t, node, p, host, subnet)
}

// podSubnet gives the pod p, wired to node by pod, addresses of one more
// subnet as pod does, and a default route of its family.
func podSubnet(t *testing.T, node, p *nettest.NS, host, subnet string) {
	t.Helper()
	gw, podAddr, bits := subnet+".1", subnet+".2", "/24"
	if strings.Contains(subnet, ":") {
		gw, podAddr, bits = subnet+"::1", subnet+"::2", "/64"
	}
	must(t, node.AddAddr(host, gw+bits))
	must(t, p.AddAddr("eth0", podAddr+bits))
	must(t, p.AddRoute("default", gw))
}

func newTestbed(t *testing.T) *testbed {
	if err := nettest.RemoveStale(); err != nil {
		t.Logf("removing stale namespaces: %v", err)
	}
	tb := &testbed{
		node1:  nettest.NewNS(t, "node1"),
		node2:  nettest.NewNS(t, "node2"),
		client: nettest.NewNS(t, "client"),
		b1:     nettest.NewNS(t, "b1"),
		b2:     nettest.NewNS(t, "b2"),
		b3:     nettest.NewNS(t, "b3"),
	}
	for _, n := range []*nettest.NS{tb.node1, tb.node2} {
		must(t, n.Sysctl("net.ipv4.ip_forward", "1"))
		// Reverse-NATed replies arrive with the service address as source
		// on an interface that has no route back to it.
		must(t, n.Sysctl("net.ipv4.conf.all.rp_filter", "0"))
		must(t, n.Sysctl("net.ipv4.conf.default.rp_filter", "0"))
	}
	pod(t, tb.node1, tb.client, "hc", "10.1.0")
	pod(t, tb.node1, tb.b1, "hb1", "10.1.1")
	pod(t, tb.node1, tb.b2, "hb2", "10.1.2")
	pod(t, tb.node2, tb.b3, "hb3", "10.2.1")
	must(t, nettest.Veth(tb.node1, "w1", tb.node2, "w2"))
	must(t, tb.node1.AddAddr("w1", "10.9.0.1/24"))
	must(t, tb.node2.AddAddr("w2", "10.9.0.2/24"))
	must(t, tb.node1.AddRoute("10.2.0.0/16", "10.9.0.2"))
	must(t, tb.node2.AddRoute("10.1.0.0/16", "10.9.0.1"))

	// Pods keep their default offloads and send CHECKSUM_PARTIAL. Every
	// node-side sender computes checksums in software instead, so a
	// receiver verifies (and counts) what the datapath wrote.
	for _, x := range []struct {
		ns     *nettest.NS
		ifname string
	}{{tb.node1, "hc"}, {tb.node1, "hb1"}, {tb.node1, "hb2"}, {tb.node1, "w1"}, {tb.node2, "w2"}, {tb.node2, "hb3"}} {
		must(t, x.ns.SetOffload(x.ifname, "tx", false))
	}
	return tb
}

func (tb *testbed) all() map[string]*nettest.NS {
	return map[string]*nettest.NS{"node1": tb.node1, "node2": tb.node2, "client": tb.client, "b1": tb.b1, "b2": tb.b2, "b3": tb.b3}
}

// attachNode1 loads a datapath pinned at pin into node1 and attaches it:
// tc on the pod veths hc, hb1 and hb2, XDP on the uplink w1 (its frames to
// the pods are handed over to tc_uplink; nothing is sent back out of w1
// with XDP_TX here).
func (tb *testbed) attachNode1(t *testing.T, pin string) *Datapath {
	t.Helper()
	return tb.attachNode1Mode(t, pin, TCAttachAuto)
}

// attachNode1Mode is attachNode1 with the tc programs attached as mode
// says.
func (tb *testbed) attachNode1Mode(t *testing.T, pin string, mode TCAttach) *Datapath {
	t.Helper()
	d := newDatapath(t, Options{PinPath: pin, NetNS: tb.node1.Path, UplinkPath: UplinkXDP, TCAttach: mode})
	for _, ifname := range []string{"hc", "hb1", "hb2"} {
		must(t, d.AttachPod(ifname))
	}
	must(t, d.AttachUplink("w1"))
	return d
}

// noChecksumErrors fails the test for every namespace whose stack counted
// a TCP or UDP checksum error: the node-side senders compute checksums in
// software, so a wrong one was written by the datapath.
func (tb *testbed) noChecksumErrors(t *testing.T) {
	t.Helper()
	for name, ns := range tb.all() {
		ce, err := ns.ChecksumErrors()
		if err != nil {
			t.Fatal(err)
		}
		if ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v", name, ce)
		}
	}
}

// httpGets makes n requests, each on a new connection, and counts answers.
func httpGets(t *testing.T, from *nettest.NS, url string, n int) map[string]int {
	t.Helper()
	c := from.HTTPClient(5 * time.Second)
	got := make(map[string]int)
	for i := 0; i < n; i++ {
		resp, err := c.Get(url)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		got[string(body)]++
	}
	return got
}

// udpQueries sends n datagrams, each from a new socket (a new flow), and
// checks every answer comes from the service address. The sockets stay
// open until it returns, so the kernel gives each its own port and the n
// flows are n, not fewer when a closed socket's port comes up again.
func udpQueries(t *testing.T, from *nettest.NS, vip string, n int) map[string]int {
	t.Helper()
	to := net.UDPAddrFromAddrPort(netip.MustParseAddrPort(vip))
	got := make(map[string]int)
	buf := make([]byte, 512)
	for i := 0; i < n; i++ {
		network, any := "udp4", "0.0.0.0:0"
		if to.AddrPort().Addr().Is6() {
			network, any = "udp6", "[::]:0"
		}
		c, err := from.ListenPacket(network, any)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		var name string
		for attempt := 0; attempt < 3 && name == ""; attempt++ {
			if _, err := c.WriteTo([]byte(fmt.Sprintf("query %d", i)), to); err != nil {
				t.Fatal(err)
			}
			c.SetReadDeadline(time.Now().Add(time.Second))
			n, src, err := c.ReadFrom(buf)
			if err != nil {
				continue
			}
			if srcAP := src.(*net.UDPAddr).AddrPort(); srcAP.String() != vip {
				t.Fatalf("query %d answered from %s, not the service address %s", i, srcAP, vip)
			}
			name = string(buf[:n])
		}
		if name == "" {
			t.Fatalf("query %d: no answer", i)
		}
		got[name]++
	}
	return got
}

// ipForwarded reads a namespace's Ip ForwDatagrams: packets its stack
// routed from one interface to another.
func ipForwarded(t *testing.T, ns *nettest.NS) uint64 {
	t.Helper()
	s, err := ns.SNMP()
	if err != nil {
		t.Fatal(err)
	}
	v, err := s.Counter("Ip", "ForwDatagrams")
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestRealTraffic runs HTTP and UDP through node1's datapath, with its
// tc programs attached as tcx links and as tc clsact filters, then
// restarts it and detaches a pod.
func TestRealTraffic(t *testing.T) {
	requirePrivileges(t)
	inEachTCAttach(t, testRealTraffic)
}

func testRealTraffic(t *testing.T, mode TCAttach) {
	pin := filepath.Join(bpffs(t), "topolb")
	tb := newTestbed(t)
	d := tb.attachNode1Mode(t, pin, mode)
	if got := tcxFeature(t, d).Path; got != string(mode) {
		t.Errorf("tcx links path %q, want %q", got, mode)
	}

	for name, ns := range map[string]*nettest.NS{"b1": tb.b1, "b2": tb.b2, "b3": tb.b3} {
		ns.ServeHTTPName(t, ":8080", name)
		ns.ServeUDPName(t, ":5353", name)
	}
	const vipHTTP, vipDNS = "10.96.0.10:80", "10.96.0.10:53"
	backends := func(port int) []Backend {
		return []Backend{
			{Addr: netip.MustParseAddrPort(fmt.Sprintf("10.1.1.2:%d", port)), NodeLocal: true, ZoneLocal: true},
			{Addr: netip.MustParseAddrPort(fmt.Sprintf("10.1.2.2:%d", port)), NodeLocal: true, ZoneLocal: true},
			{Addr: netip.MustParseAddrPort(fmt.Sprintf("10.2.1.2:%d", port)), ZoneLocal: true},
		}
	}
	mustSet(t, d, fe(vipHTTP, TCP), backends(8080)...)
	mustSet(t, d, fe(vipDNS, UDP), backends(5353)...)
	if got, err := d.Attached(); err != nil || !slices.Equal(got, []string{"hb1", "hb2", "hc", "w1"}) {
		t.Fatalf("Attached = %v, %v", got, err)
	}

	const n = 200
	forwBefore := ipForwarded(t, tb.node1)
	httpGot := httpGets(t, tb.client, "http://"+vipHTTP+"/", n)
	udpGot := udpQueries(t, tb.client, vipDNS, n)
	t.Logf("HTTP answers per backend: %v; UDP: %v", httpGot, udpGot)
	for _, name := range []string{"b1", "b2", "b3"} {
		if httpGot[name] == 0 || udpGot[name] == 0 {
			t.Errorf("backend %s never answered (HTTP %v, UDP %v)", name, httpGot, udpGot)
		}
	}

	tb.noChecksumErrors(t)
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Drops != (Drops{}) {
		t.Errorf("drops: %+v", c.Drops)
	}
	if c.ReverseNAT == 0 || c.Frontends[fe(vipHTTP, TCP)].Packets < n || c.Frontends[fe(vipDNS, UDP)].Packets < n {
		t.Errorf("counters too low: %+v", c)
	}
	// Every flow bypassed the host stack: into local backends and back
	// into the client with bpf_redirect_peer, to b3 out of w1 (its next
	// hop's MAC known after the first packets, or resolved by the
	// kernel), with no packet falling back.
	for _, s := range []Stat{StatFwdStack, StatFwdFallbackMTU, StatFwdFallbackTTL, StatFwdFallbackMeta} {
		if c.Stats[s] != 0 {
			t.Errorf("%s = %d, want 0", s, c.Stats[s])
		}
	}
	if c.Stats[StatFwdPeer] < 2*n || c.Stats[StatFwdL2]+c.Stats[StatFwdNeigh] == 0 {
		t.Errorf("forwarding paths: peer %d, l2 %d, neigh %d", c.Stats[StatFwdPeer], c.Stats[StatFwdL2], c.Stats[StatFwdNeigh])
	}
	// The kernel agrees: node1's stack forwarded none of it (b3's
	// replies were delivered by tc_uplink, not routed).
	if got := ipForwarded(t, tb.node1) - forwBefore; got != 0 {
		t.Errorf("node1's stack forwarded %d datagrams (Ip ForwDatagrams), want 0", got)
	}
	t.Logf("counters: %+v", c)

	// A restarted agent re-adopts maps and links: traffic keeps flowing
	// and re-attaching updates the pinned links instead of failing.
	t.Run("restart", func(t *testing.T) {
		// One owner at a time: the old process lets go of the pin path
		// before the new one takes it.
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		d2, err := Load(Options{PinPath: pin, NetNS: tb.node1.Path, MaxFrontends: 1024, MaxBackends: 4096, MaxConntrack: 4096, UplinkPath: UplinkXDP, TCAttach: mode})
		if err != nil {
			t.Fatal(err)
		}
		defer d2.Close()
		for _, ifname := range []string{"hc", "hb1", "hb2"} {
			must(t, d2.AttachPod(ifname))
		}
		must(t, d2.AttachUplink("w1"))
		if got := httpGets(t, tb.client, "http://"+vipHTTP+"/", 20); len(got) == 0 {
			t.Error("no answers after restart")
		}
		udpQueries(t, tb.client, vipDNS, 20)
		must(t, d2.Detach("hb2"))
		must(t, d2.Detach("hb2"))
		if got, err := d2.Attached(); err != nil || !slices.Equal(got, []string{"hb1", "hc", "w1"}) {
			t.Errorf("Attached after Detach = %v, %v", got, err)
		}
	})

	for name, ns := range tb.all() {
		if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
		}
	}
	if _, err := os.Stat(filepath.Join(pin, "links")); err != nil {
		t.Errorf("links dir: %v", err)
	}
}
