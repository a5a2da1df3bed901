package e2e

import (
	"encoding/json"
	"net"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// hostServices are the Services the host-client tests reach, dual stack:
// one behind a cluster IP only, one behind every external kind (NodePort
// on each node's address, an external IP, a load-balancer IP), both with
// zone hints, so node-a1's and node-b1's processes have different
// permitted sets that mix a backend on their own node with ones on other
// nodes.
func hostServices() []testbed.ServiceSpec {
	ports := []testbed.PortSpec{{Name: "http", Port: 80}, {Name: "echo", Protocol: v1.ProtocolUDP, Port: 53}}
	all := []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-a2"}, {Pod: "web-b1"}, {Pod: "web-b2"}, {Pod: "web-c1"}, {Pod: "web-c2"}}
	return []testbed.ServiceSpec{
		{Name: "web", IPFamilies: bothFamilies, Hints: testbed.HintsZone, Ports: ports, Endpoints: all},
		{Name: "lb", IPFamilies: bothFamilies, Type: v1.ServiceTypeLoadBalancer, ExternalIPs: addrsIn(externalIPs, bothFamilies),
			LoadBalancerIPs: addrsIn(lbIPs, bothFamilies), Hints: testbed.HintsZone, Ports: ports, Endpoints: all},
	}
}

// TestHostClients balances processes of the nodes' own network namespaces
// (host network) with topolb alone (no kube-proxy anywhere): from node-a1
// and node-b1, to a cluster IP, the node's NodePort, an external IP and a
// load-balancer IP, over TCP and connected UDP, every request lands on the
// backends the node's decision permits (a local one and remote ones), and
// every connection's peer (getpeername) is the address it connected to.
// Unconnected UDP sockets get their answers from the service address.
// Both nodes' socket hooks are attached to the one cgroup root, so a
// landing outside a node's own set would show one node translating the
// other's sockets. The testbed and the Services are dual stack, and every
// check runs in each IP family in turn (the IPv6 socket hooks: connect6,
// sendmsg6, recvmsg6, getpeername6).
func TestHostClients(t *testing.T) {
	requireRoot(t)
	for _, dp := range datapaths {
		t.Run(dp.name, func(t *testing.T) {
			spec := dualStackSpec(t)
			spec.Services = hostServices()
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			apply(t, tb, hostServices())
			if err := tb.CheckNoKubeProxy(t.Context()); err != nil {
				t.Fatal(err)
			}
			inEachFamily(t, tb, topology.ScopeInternal, func(t *testing.T, family v1.IPFamily) {
				hostClientsIn(t, tb, family)
			})
			noChecksumErrors(t, tb)
		})
	}
}

// hostClientsIn is TestHostClients's traffic and checks in family.
func hostClientsIn(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
	kinds := map[string]bool{}
	for _, node := range []string{"node-a1", "node-b1"} {
		for _, svc := range []string{"web", "lb"} {
			landings, err := tb.MeasureHost(t.Context(), node, svc, testbed.MeasureOptions{Requests: 60, Families: []v1.IPFamily{family}})
			if err != nil {
				t.Fatal(err)
			}
			for _, l := range landings {
				label := node + " " + string(l.Decision.Protocol) + " " + l.Target.Kind + " " + l.Target.Addr.String()
				if l.Decision.Family != family || l.Target.Addr.Addr().Is4() != (family == v1.IPv4Protocol) {
					t.Errorf("%s: measured in %s, want %s", label, l.Decision.Family, family)
				}
				if len(l.Decision.Backends) == 0 {
					t.Errorf("%s: the decision permits no backend: the test needs some", label)
				}
				for _, p := range l.Problems() {
					t.Errorf("%s: %s", label, p)
				}
				kinds[l.Target.Kind] = true
				t.Logf("%s: landed %v, failed %d", label, l.Tally.Landed, l.Tally.Failed)
			}
		}
		checkLocalAndRemote(t, tb, node, "web", family)
		unconnectedUDP(t, tb, node, "web", family)
	}
	for _, k := range []string{"ClusterIP", "NodePort", "ExternalIP"} {
		if !kinds[k] {
			t.Errorf("no %s frontend was measured in %s", k, family)
		}
	}
}

// checkLocalAndRemote fails unless node's permitted set for service's TCP
// port in family ("": the Service's first) has a backend on node itself
// and one elsewhere: both kinds must be measured.
func checkLocalAndRemote(t *testing.T, tb *testbed.Testbed, node, service string, family v1.IPFamily) {
	t.Helper()
	d := decisionOnOf(t, tb, node, service, v1.ProtocolTCP, family)
	local, remote := 0, 0
	for _, b := range d.Backends {
		if tb.Pod(b).Node.Name == node {
			local++
		} else {
			remote++
		}
	}
	if local == 0 || remote == 0 {
		t.Errorf("%s on %s permits %v: want a local and a remote backend", service, node, d.Backends)
	}
}

// unconnectedUDP sends datagrams from unconnected sockets of node's own
// namespace to service's UDP cluster IP: every answer must come from the
// service address and from a permitted backend, in family.
func unconnectedUDP(t *testing.T, tb *testbed.Testbed, node, service string, family v1.IPFamily) {
	t.Helper()
	d := decisionOnOf(t, tb, node, service, v1.ProtocolUDP, family)
	network, wildcard := "udp4", "0.0.0.0:0"
	if family == v1.IPv6Protocol {
		network, wildcard = "udp6", "[::]:0"
	}
	const n = 30
	got := map[string]int{}
	buf := make([]byte, 2048)
	for i := 0; i < n; i++ {
		c, err := tb.Node(node).NS.ListenPacket(network, wildcard)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.WriteTo([]byte("who are you?"), net.UDPAddrFromAddrPort(d.Frontend)); err != nil {
			c.Close()
			t.Fatalf("%s: sendto %s: %v", node, d.Frontend, err)
		}
		m, from, err := c.ReadFrom(buf)
		c.Close()
		if err != nil {
			t.Fatalf("%s: datagram %d to %s: %v", node, i, d.Frontend, err)
		}
		if src := from.(*net.UDPAddr).AddrPort(); src != d.Frontend {
			t.Errorf("%s: answer from %s, want the service address %s", node, src, d.Frontend)
		}
		var a testbed.Answer
		if err := json.Unmarshal(buf[:m], &a); err != nil {
			t.Fatalf("%s: bad answer %q: %v", node, buf[:m], err)
		}
		got[a.Pod]++
	}
	for p := range got {
		if !slices.Contains(d.Backends, p) {
			t.Errorf("%s: unconnected UDP landed on %s, outside %v", node, p, d.Backends)
		}
	}
	t.Logf("%s: unconnected UDP to %s landed %v", node, d.Frontend, got)
}

// decisionOnOf returns node's decision for service's proto port in family
// ("": the Service's first) on the objects last applied, and fails the
// test when there is none.
func decisionOnOf(t *testing.T, tb *testbed.Testbed, node, service string, proto v1.Protocol, family v1.IPFamily) *testbed.Decision {
	t.Helper()
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, node)
	d := testbed.FindDecisionOf(ds, service, proto, family)
	if d == nil {
		t.Fatalf("no %s %s decision for %s on %s", family, proto, service, node)
	}
	return d
}
