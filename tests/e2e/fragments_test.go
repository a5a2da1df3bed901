package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"strconv"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/tools/testbed"
)

// bigUDP sends one 4,000-byte datagram from a new socket in ns to target
// (of either family) and returns the answer, which must come from
// target: the testbed's backends answer a datagram that large with a
// padded answer at least as large (testbed.Answer.Pad), so both
// directions travel in fragments over the testbed's 1,500-byte MTUs.
func bigUDP(ctx context.Context, ns *testbed.NS, target netip.AddrPort) (testbed.Answer, error) {
	const size = 4000
	network, local := "udp4", "0.0.0.0:0"
	if target.Addr().Is6() {
		network, local = "udp6", "[::]:0"
	}
	c, err := ns.ListenPacket(network, local)
	if err != nil {
		return testbed.Answer{}, err
	}
	defer c.Close()
	if deadline, ok := ctx.Deadline(); ok {
		if err := c.SetDeadline(deadline); err != nil {
			return testbed.Answer{}, err
		}
	}
	if _, err := c.WriteTo(make([]byte, size), net.UDPAddrFromAddrPort(target)); err != nil {
		return testbed.Answer{}, err
	}
	buf := make([]byte, 1<<16)
	n, from, err := c.ReadFrom(buf)
	if err != nil {
		return testbed.Answer{}, err
	}
	if src := from.(*net.UDPAddr).AddrPort(); src != target {
		return testbed.Answer{}, fmt.Errorf("answered from %s, not %s", src, target)
	}
	var a testbed.Answer
	if err := json.Unmarshal(buf[:n], &a); err != nil {
		return testbed.Answer{}, fmt.Errorf("answer of %d bytes: %w", n, err)
	}
	if a.Received != size || n < size {
		return a, fmt.Errorf("%s received %d bytes of %d, answered %d", a.Pod, a.Received, size, n)
	}
	return a, nil
}

// eventCount reads a topolb_datapath_events_total counter from a metrics
// page.
func eventCount(t *testing.T, metrics, event string) uint64 {
	t.Helper()
	m := regexp.MustCompile(`(?m)^topolb_datapath_events_total\{event="` + event + `"\} (\d+)$`).FindStringSubmatch(metrics)
	if m == nil {
		t.Fatalf("no topolb_datapath_events_total{event=%q} in the metrics", event)
	}
	v, err := strconv.ParseUint(m[1], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestFragmentedUDP sends 4,000-byte UDP datagrams, which the senders
// fragment over the testbed's 1,500-byte MTUs, to a Service with a
// backend on node-a1 and one on node-b1, with topolb alone: from the
// client pod on node-a1 to its cluster IP (tc on the pod's veth), and from
// the outside client to its load-balancer IP, which the router sends to
// node-a1 (the uplink's path; to node-b1's backend source-translated).
// Every datagram reaches a backend whole, and its fragmented answer reaches
// the client whole from the address it asked; both backends answer; and
// node-a1's datapath counts followed fragments and none passed
// untranslated.
func TestFragmentedUDP(t *testing.T) {
	requireRoot(t)
	spec, err := testbed.ParseSpec(append(testbed.DemoYAML(), "\noutside: {ingressNode: node-a1, clients: [{name: ext1}]}\nkubeProxy: none\n"...))
	if err != nil {
		t.Fatal(err)
	}
	tb := newTestbed(t, spec)
	withAgents.start(t, tb)
	lbIP := "198.51.100.9"
	svcs := []testbed.ServiceSpec{{Name: "big", Type: v1.ServiceTypeLoadBalancer, LoadBalancerIPs: []string{lbIP},
		Ports:     []testbed.PortSpec{{Name: "echo", Protocol: v1.ProtocolUDP, Port: 53}},
		Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-b1"}}}}
	apply(t, tb, svcs)
	if err := tb.CheckNoKubeProxy(t.Context()); err != nil {
		t.Fatal(err)
	}
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, "node-a1")
	d := testbed.FindDecision(ds, "big", v1.ProtocolUDP)
	if d == nil {
		t.Fatal("no decision for big")
	}
	for _, c := range []struct {
		name   string
		ns     *testbed.NS
		target netip.AddrPort
	}{
		{"client pod to the cluster IP", tb.Pod("client").NS, d.Frontend},
		{"outside client to the load-balancer IP", tb.External("ext1").NS, netip.AddrPortFrom(netip.MustParseAddr(lbIP), 53)},
	} {
		landed := map[string]int{}
		for i := range 30 {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			a, err := bigUDP(ctx, c.ns, c.target)
			cancel()
			if err != nil {
				t.Fatalf("%s %s, datagram %d: %v", c.name, c.target, i, err)
			}
			landed[a.Pod]++
		}
		if landed["web-a1"] == 0 || landed["web-b1"] == 0 {
			t.Errorf("%s %s: answered by %v, want web-a1 and web-b1", c.name, c.target, landed)
		}
		t.Logf("%s %s: %v", c.name, c.target, landed)
	}
	metrics, err := tb.Agent("node-a1").Metrics(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// 60 datagrams, each with a fragmented answer: the first fragments
	// of both, and at least two later fragments each, translated by
	// node-a1 (node-b1's answers come back to it: source-translated, or
	// to its own pod).
	first, followed, passed := eventCount(t, metrics, "fragment_first"), eventCount(t, metrics, "fragment_followed"), eventCount(t, metrics, "fragment")
	t.Logf("node-a1: fragment_first %d, fragment_followed %d, fragment %d", first, followed, passed)
	if first < 120 || followed < 240 || passed != 0 {
		t.Errorf("node-a1's fragment counters: first %d (want at least 120), followed %d (at least 240), passed untranslated %d (want 0)", first, followed, passed)
	}
	noChecksumErrors(t, tb)
}

// TestFragmentedUDP6 is TestFragmentedUDP in IPv6, on a dual-stack
// testbed with an IPv6-only Service: 4,000-byte datagrams from the
// client pod to its IPv6 cluster IP, and from the outside client to its
// IPv6 load-balancer IP and to node-a1's IPv6 NodePort, each fragmented
// by its sender behind fragment headers. Before IPv6 fragments were
// translated none was answered, and the pod's left node-a1 untranslated
// towards its gateway. Every datagram reaches a backend whole and its
// fragmented answer the client from the address it asked; node-a1
// counts followed fragments, none passed untranslated and none dropped
// as unparsed.
func TestFragmentedUDP6(t *testing.T) {
	requireRoot(t)
	spec, err := testbed.ParseSpec(append(testbed.DemoYAML(), "\ndualStack: true\noutside: {ingressNode: node-a1, clients: [{name: ext1}]}\nkubeProxy: none\n"...))
	if err != nil {
		t.Fatal(err)
	}
	tb := newTestbed(t, spec)
	withAgents.start(t, tb)
	lbIP := netip.MustParseAddr("fd00:198:51:100::9")
	svcs := []testbed.ServiceSpec{{Name: "big6", Type: v1.ServiceTypeLoadBalancer, IPFamilies: []v1.IPFamily{v1.IPv6Protocol},
		LoadBalancerIPs: []string{lbIP.String()},
		Ports:           []testbed.PortSpec{{Name: "echo", Protocol: v1.ProtocolUDP, Port: 53}},
		Endpoints:       []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-b1"}}}}
	apply(t, tb, svcs)
	if err := tb.CheckNoKubeProxy(t.Context()); err != nil {
		t.Fatal(err)
	}
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, "node-a1")
	d := testbed.FindDecisionOf(ds, "big6", v1.ProtocolUDP, v1.IPv6Protocol)
	if d == nil || !d.NodePort.IsValid() {
		t.Fatalf("no IPv6 decision with a NodePort for big6: %+v", d)
	}
	cases := []struct {
		name   string
		ns     *testbed.NS
		target netip.AddrPort
	}{
		{"client pod to the cluster IP", tb.Pod("client").NS, d.Frontend},
		{"outside client to the load-balancer IP", tb.External("ext1").NS, netip.AddrPortFrom(lbIP, 53)},
		{"outside client to node-a1's NodePort", tb.External("ext1").NS, d.NodePort},
	}
	for _, c := range cases {
		landed := map[string]int{}
		for i := range 30 {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			a, err := bigUDP(ctx, c.ns, c.target)
			cancel()
			if err != nil {
				t.Fatalf("%s %s, datagram %d: %v", c.name, c.target, i, err)
			}
			landed[a.Pod]++
		}
		if landed["web-a1"] == 0 || landed["web-b1"] == 0 {
			t.Errorf("%s %s: answered by %v, want web-a1 and web-b1", c.name, c.target, landed)
		}
		t.Logf("%s %s: %v", c.name, c.target, landed)
	}
	metrics, err := tb.Agent("node-a1").Metrics(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// 90 datagrams, each with a fragmented answer (TestFragmentedUDP says
	// why node-a1 sees both).
	n := uint64(len(cases) * 30)
	first, followed := eventCount(t, metrics, "fragment_first"), eventCount(t, metrics, "fragment_followed")
	passed, unparsed := eventCount(t, metrics, "fragment"), eventCount(t, metrics, "drop_unparsed")
	t.Logf("node-a1: fragment_first %d, fragment_followed %d, fragment %d, drop_unparsed %d", first, followed, passed, unparsed)
	if first < 2*n || followed < 4*n || passed != 0 || unparsed != 0 {
		t.Errorf("node-a1's fragment counters: first %d (want at least %d), followed %d (at least %d), passed untranslated %d, dropped unparsed %d (want 0)",
			first, 2*n, followed, 4*n, passed, unparsed)
	}
	noChecksumErrors(t, tb)
}
