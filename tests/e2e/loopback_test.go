package e2e

import (
	"context"
	"net/netip"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// loopbackServices: "np" is a NodePort Service, TCP and UDP, served by a
// pod on node-a1 and one on node-b1.
func loopbackServices() []testbed.ServiceSpec {
	return []testbed.ServiceSpec{{Name: "np", Type: v1.ServiceTypeNodePort,
		Ports:     []testbed.PortSpec{{Name: "http", Port: 80}, {Name: "echo", Protocol: v1.ProtocolUDP, Port: 53}},
		Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-b1"}}}}
}

// startAgentsWith starts every node's agent with extra flags args, which
// select the decision options opts (what WaitAgents holds the maps to).
func startAgentsWith(t *testing.T, tb *testbed.Testbed, opts topology.Options, args ...string) {
	t.Helper()
	bin := requireAgent(t)
	ctx, cancel := agentsCtx(t)
	defer cancel()
	if _, err := tb.StartAgents(ctx, testbed.AgentOptions{Binary: bin, Verbosity: 2, Args: args, Options: &opts}); err != nil {
		t.Fatal(err)
	}
}

// TestLoopbackNodePort: 127.0.0.1:<nodePort> from node-a1's own processes,
// TCP and UDP, answered by the Service's backends, by topolb (agents with
// --nodeport-addresses 0.0.0.0/0, kube-proxy's "all", no kube-proxy
// anywhere) and, the same checks, by kube-proxy in iptables mode on
// node-a1 (its localhost NodePorts, --nodeport-addresses
// primary,localhost). Each connection's peer (getpeername) is
// 127.0.0.1:<nodePort>, and both backends answer.
func TestLoopbackNodePort(t *testing.T) {
	requireRoot(t)
	t.Run("topolb", func(t *testing.T) {
		spec := demoSpec(t)
		spec.KubeProxy = "none"
		tb := newTestbed(t, spec)
		opts := topology.DefaultOptions()
		opts.NodePortAddresses = []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}
		startAgentsWith(t, tb, opts, "--nodeport-addresses", "0.0.0.0/0")
		apply(t, tb, loopbackServices())
		if err := tb.CheckNoKubeProxy(t.Context()); err != nil {
			t.Fatal(err)
		}
		checkLoopbackNodePort(t, tb)
	})
	t.Run("kube-proxy", func(t *testing.T) {
		kp := kubeProxyBinary(t)
		cluster := kubetest.Start(t)
		tb, ctx := apiserverTestbed(t, demoSpec(t), cluster, loopbackServices())
		if _, err := tb.StartKubeProxy(ctx, "node-a1", testbed.KubeProxyOptions{Binary: kp, Mode: testbed.KubeProxyIPTables,
			NodePortAddresses: "primary,localhost"}); err != nil {
			t.Fatal(err)
		}
		checkLoopbackNodePort(t, tb)
	})
}

// checkLoopbackNodePort sends 40 requests per protocol from node-a1's
// namespace to 127.0.0.1 with np's nodePort: every one answered (the
// client checks the peer is the address it asked for), by both backends
// between them.
func checkLoopbackNodePort(t *testing.T, tb *testbed.Testbed) {
	t.Helper()
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, "node-a1")
	host := tb.Host("node-a1")
	for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
		d := testbed.FindDecision(ds, "np", proto)
		if d == nil || !d.NodePort.IsValid() {
			t.Fatalf("np/%s: no decision with a NodePort: %+v", proto, d)
		}
		target := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), d.NodePort.Port())
		landed := map[string]int{}
		for i := range 40 {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			a, err := host.Request(ctx, proto, target)
			cancel()
			if err != nil {
				t.Fatalf("%s %s, request %d: %v", proto, target, i, err)
			}
			landed[a.Pod]++
		}
		pods := make([]string, 0, len(landed))
		for p := range landed {
			pods = append(pods, p)
		}
		slices.Sort(pods)
		if !slices.Equal(pods, []string{"web-a1", "web-b1"}) {
			t.Errorf("%s %s: answered by %v, want web-a1 and web-b1", proto, target, landed)
		}
		t.Logf("%s %s: %v", proto, target, landed)
	}
}

// TestClusterIPFromOutside: with --cluster-ips-from-outside, a router that
// sends the service range to node-a1 makes its cluster IP reachable from
// the outside client, TCP and UDP, with the Service's backends on node-a1
// and node-b1: the local one sees the client's address, the remote one
// node-a1's (source-translated, so its replies come back through node-a1,
// as kube-proxy masquerades a source outside the cluster CIDR). Without
// the flag the cluster IP is not served from outside (TestClaimsScopes);
// here, with no kube-proxy anywhere, the requests would time out.
func TestClusterIPFromOutside(t *testing.T) {
	requireRoot(t)
	spec, err := testbed.ParseSpec(append(testbed.DemoYAML(), "\noutside: {ingressNode: node-a1, routeServiceRange: true, clients: [{name: ext1}]}\nkubeProxy: none\n"...))
	if err != nil {
		t.Fatal(err)
	}
	tb := newTestbed(t, spec)
	opts := topology.DefaultOptions()
	opts.ClusterIPsFromOutside = true
	startAgentsWith(t, tb, opts, "--cluster-ips-from-outside")
	svcs := []testbed.ServiceSpec{{Name: "web",
		Ports:     []testbed.PortSpec{{Name: "http", Port: 80}, {Name: "echo", Protocol: v1.ProtocolUDP, Port: 53}},
		Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-b1"}}}}
	apply(t, tb, svcs)
	if err := tb.CheckNoKubeProxy(t.Context()); err != nil {
		t.Fatal(err)
	}
	ext := tb.External("ext1")
	nodeA1 := tb.Node("node-a1").WireAddr.Addr()
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, "node-a1")
	for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
		d := testbed.FindDecision(ds, "web", proto)
		if d == nil {
			t.Fatalf("web/%s: no decision", proto)
		}
		landed := map[string]int{}
		for i := range 40 {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			a, err := ext.Request(ctx, proto, d.Frontend)
			cancel()
			if err != nil {
				t.Fatalf("%s %s, request %d: %v", proto, d.Frontend, i, err)
			}
			landed[a.Pod]++
			src, err := netip.ParseAddrPort(a.Client)
			if err != nil {
				t.Fatalf("%s: the backend saw client %q: %v", a.Pod, a.Client, err)
			}
			want := ext.ClientAddr()
			if a.Pod != "web-a1" {
				want = nodeA1
			}
			if src.Addr() != want {
				t.Errorf("%s %s: %s saw the client as %s, want %s", proto, d.Frontend, a.Pod, src.Addr(), want)
			}
		}
		if landed["web-a1"] == 0 || landed["web-b1"] == 0 || len(landed) != 2 {
			t.Errorf("%s %s: answered by %v, want web-a1 and web-b1", proto, d.Frontend, landed)
		}
		t.Logf("%s %s from outside: %v", proto, d.Frontend, landed)
	}
	noChecksumErrors(t, tb)
}
