package e2e

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/tools/testbed"
)

// refusedWithin is how fast a connection to a Service without any usable
// endpoint must be refused (issue 12).
const refusedWithin = 100 * time.Millisecond

// refusal opens a flow from client to target and asks once, and returns
// how long it took to be refused (ECONNREFUSED: a TCP reset, an ICMP port
// unreachable, or a socket hook refusing the call), or an error saying
// what happened instead.
func refusal(ctx context.Context, client testbed.Client, proto v1.Protocol, target netip.AddrPort) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	start := time.Now()
	c, err := client.Open(ctx, proto, target)
	if err == nil {
		_, err = c.Ask(ctx)
		c.Close()
	}
	took := time.Since(start)
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return took, nil
	case err == nil:
		return took, errors.New("answered")
	default:
		return took, err
	}
}

// checkRefused fails the test unless a flow from client to target is
// refused within refusedWithin.
func checkRefused(t *testing.T, client testbed.Client, proto v1.Protocol, target netip.AddrPort) {
	t.Helper()
	took, err := refusal(t.Context(), client, proto, target)
	label := string(proto) + " " + client.ClientName() + " -> " + target.String()
	if err != nil {
		t.Errorf("%s: not refused after %s: %v", label, took, err)
		return
	}
	t.Logf("%s: refused after %s", label, took)
	if took > refusedWithin {
		t.Errorf("%s: refused after %s, want within %s", label, took, refusedWithin)
	}
}

// rejectServices: "empty" has no endpoint at all (refused), "nolocal"
// has one, on node-b1, under externalTrafficPolicy Local, so outside
// traffic arriving at node-a1 is dropped by policy, as kube-proxy drops it.
func rejectServices() []testbed.ServiceSpec {
	ports := []testbed.PortSpec{{Name: "http", Port: 80}, {Name: "echo", Protocol: v1.ProtocolUDP, Port: 53}}
	return []testbed.ServiceSpec{
		{Name: "empty", Type: v1.ServiceTypeLoadBalancer, LoadBalancerIPs: []string{"198.51.100.9"}, Ports: ports},
		{Name: "nolocal", Type: v1.ServiceTypeNodePort, ExternalTrafficPolicy: "Local", Ports: ports,
			Endpoints: []testbed.EndpointSpec{{Pod: "web-b1"}}},
	}
}

// TestRejectEmptyService refuses new connections to a Service without any
// usable endpoint, with no kube-proxy anywhere, within 100 ms, over TCP
// and UDP: from a pod (tc answers with a reset or port unreachable), from
// a process of the node itself (the socket hook fails the call), and from
// a client outside the cluster through node-a1's NodePort and the
// load-balancer IP (XDP answers). A Service that leaves node-a1 without a
// backend by policy keeps dropping: the outside client times out.
func TestRejectEmptyService(t *testing.T) {
	requireRoot(t)
	for _, dp := range datapaths {
		t.Run(dp.name, func(t *testing.T) {
			spec, err := testbed.ParseSpec(append(testbed.DemoYAML(), "\noutside: {ingressNode: node-a1, clients: [{name: ext1}]}\nkubeProxy: none\n"...))
			if err != nil {
				t.Fatal(err)
			}
			spec.Services = rejectServices()
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			apply(t, tb, rejectServices())
			if err := tb.CheckNoKubeProxy(t.Context()); err != nil {
				t.Fatal(err)
			}
			objs, _ := tb.Current()
			ds, _ := tb.Decide(objs, "node-a1")
			ext := tb.External("ext1")
			for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
				d := testbed.FindDecision(ds, "empty", proto)
				if d == nil || !d.NodePort.IsValid() || len(d.External) < 2 {
					t.Fatalf("no %s decision with a NodePort and the LB IP for empty: %+v", proto, d)
				}
				for _, c := range []struct {
					client testbed.Client
					target netip.AddrPort
				}{
					{tb.Pod("client"), d.Frontend},
					{tb.Host("node-a1"), d.Frontend},
					{tb.Host("node-a1"), d.NodePort},
					{ext, d.NodePort},
					{ext, d.External[len(d.External)-1]},
				} {
					checkRefused(t, c.client, proto, c.target)
				}
				// Dropped by policy: no answer at all.
				nl := testbed.FindDecision(ds, "nolocal", proto)
				if nl == nil || len(nl.ExternalBackends) != 0 {
					t.Fatalf("nolocal: node-a1 should have no external backend: %+v", nl)
				}
				took, err := refusal(t.Context(), ext, proto, nl.NodePort)
				var ne net.Error
				if !errors.As(err, &ne) || !ne.Timeout() {
					t.Errorf("%s outside -> %s (externalTrafficPolicy Local, no local endpoint): %v after %s, want a timeout (dropped)", proto, nl.NodePort, err, took)
				}
			}
			noChecksumErrors(t, tb)
		})
	}
}
