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
// and returns the answer, which must come from target: the testbed's
// backends answer a datagram that large with a padded answer at least as
// large (testbed.Answer.Pad), so both directions travel in fragments over
// the testbed's 1,500-byte MTUs.
func bigUDP(ctx context.Context, ns *testbed.NS, target netip.AddrPort) (testbed.Answer, error) {
	const size = 4000
	c, err := ns.ListenPacket("udp4", "0.0.0.0:0")
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
