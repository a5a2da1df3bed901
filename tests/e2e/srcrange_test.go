package e2e

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	topolbagent "github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// sourceRangesSpec is the dual-stack demo testbed with two clients
// outside, whose traffic enters at node-a1.
func sourceRangesSpec(t *testing.T, kubeProxy string) *testbed.Spec {
	t.Helper()
	spec, err := testbed.ParseSpec(append(testbed.DemoYAML(), "\ndualStack: true\noutside: {ingressNode: node-a1, clients: [{name: ext1}, {name: ext2}]}\nkubeProxy: "+kubeProxy+"\n"...))
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// sourceRangesLBIPs are the load-balancer IPs of "lb", one per family.
var sourceRangesLBIPs = map[v1.IPFamily]netip.Addr{
	v1.IPv4Protocol: netip.MustParseAddr("198.51.100.9"),
	v1.IPv6Protocol: netip.MustParseAddr("2001:db8:100::9"),
}

// sourceRangesServices: "lb" is a dual-stack LoadBalancer Service whose
// loadBalancerSourceRanges hold only allowed's addresses (ext1's, a
// prefix of each family); a nil allowed leaves it open.
func sourceRangesServices(allowed testbed.Client) []testbed.ServiceSpec {
	lb := testbed.ServiceSpec{Name: "lb", Type: v1.ServiceTypeLoadBalancer, IPFamilies: bothFamilies,
		Ports:     []testbed.PortSpec{{Name: "http", Port: 80}},
		Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-b1"}}}
	for _, family := range topology.Families {
		lb.LoadBalancerIPs = append(lb.LoadBalancerIPs, sourceRangesLBIPs[family].String())
		if allowed != nil {
			a := allowed.ClientAddrOf(family)
			lb.LoadBalancerSourceRanges = append(lb.LoadBalancerSourceRanges, netip.PrefixFrom(a, a.BitLen()).String())
		}
	}
	return []testbed.ServiceSpec{lb}
}

// TestSourceRanges: a load-balancer IP with loadBalancerSourceRanges, with
// real TCP on the testbed, answered by topolb (no kube-proxy anywhere) and,
// the same checks, by kube-proxy (nftables, on node-a1 alone): the outside
// client inside the ranges is answered, the other is dropped at the
// load-balancer IP but reaches the NodePort (ranges do not apply to it), a
// pod of node-a1 outside the ranges is dropped, and a process of node-a1,
// whose address no range holds, is refused: with EPERM at once by topolb's
// socket hook, by a timeout with kube-proxy (its OUTPUT rule drops the
// SYNs). The Service is dual stack, with a load-balancer IP and a range
// of each family, and every check runs in both families on one testbed.
func TestSourceRanges(t *testing.T) {
	requireRoot(t)
	t.Run("topolb", func(t *testing.T) {
		tb := newTestbed(t, sourceRangesSpec(t, "none"))
		withAgents.start(t, tb)
		apply(t, tb, sourceRangesServices(tb.External("ext1")))
		if err := tb.CheckNoKubeProxy(t.Context()); err != nil {
			t.Fatal(err)
		}
		served := programmedFamilies(t, tb)
		for _, family := range topology.Families {
			t.Run(string(family), func(t *testing.T) {
				checkSourceRanges(t, tb, family, syscall.EPERM, served)
			})
		}
		noChecksumErrors(t, tb)
	})
	t.Run("kube-proxy", func(t *testing.T) {
		kp := kubeProxyBinary(t)
		cluster := kubetest.Start(t, kubetest.WithDualStackServices())
		tb, ctx := apiserverTestbed(t, sourceRangesSpec(t, ""), cluster, sourceRangesServices(nil))
		if _, err := tb.Apply(ctx, sourceRangesServices(tb.External("ext1"))); err != nil {
			t.Fatal(err)
		}
		k, err := tb.StartKubeProxy(ctx, "node-a1", testbed.KubeProxyOptions{Binary: kp, Mode: testbed.KubeProxyNFTables})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := k.EnsureTopology(ctx); err != nil {
			t.Fatal(err)
		}
		// kube-proxy runs a proxier per family: it serves both everywhere.
		everywhere := topolbagent.ScopeFamilies{}
		for _, scope := range topolbagent.Scopes {
			everywhere[scope] = topology.Families
		}
		for _, family := range topology.Families {
			t.Run(string(family), func(t *testing.T) {
				checkSourceRanges(t, tb, family, context.DeadlineExceeded, everywhere)
			})
		}
	})
}

// checkSourceRanges runs the checks of TestSourceRanges on tb in family;
// hostRefusal is how node-a1's own connect must fail; a check in a scope
// where the datapath does not serve family (served) is skipped.
func checkSourceRanges(t *testing.T, tb *testbed.Testbed, family v1.IPFamily, hostRefusal error, served topolbagent.ScopeFamilies) {
	t.Helper()
	d := decisionOnOf(t, tb, "node-a1", "lb", v1.ProtocolTCP, family)
	lbIP := netip.AddrPortFrom(sourceRangesLBIPs[family], 80)
	if !d.NodePort.IsValid() || !slices.ContainsFunc(d.External, func(e netip.AddrPort) bool { return e == lbIP }) {
		t.Fatalf("no %s decision with a NodePort and the LB IP %s for lb: %+v", family, lbIP, d)
	}
	for _, c := range []struct {
		client testbed.Client
		target netip.AddrPort
		// scope is where the client reaches the frontend from.
		scope topology.Scope
		// want is nil for an answer, else the error the request must end
		// with (a timeout: dropped).
		want error
	}{
		{tb.External("ext1"), lbIP, topology.ScopeExternal, nil},
		{tb.External("ext2"), lbIP, topology.ScopeExternal, context.DeadlineExceeded},
		{tb.External("ext2"), d.NodePort, topology.ScopeExternal, nil},
		{tb.Pod("client"), lbIP, topology.ScopeInternal, context.DeadlineExceeded},
		{tb.Host("node-a1"), lbIP, topology.ScopeInternal, hostRefusal},
	} {
		t.Run(c.client.ClientName()+"->"+c.target.String(), func(t *testing.T) {
			if !served.Programs(family, c.scope) {
				skipUnserved(t, family, c.scope, served)
			}
			var err error
			deadline := time.Now().Add(10 * time.Second)
			for {
				// The datapath may still be catching up with the ranges:
				// retry a wrong outcome for a while.
				ctx, cancel := context.WithTimeout(t.Context(), time.Second)
				_, err = c.client.Request(ctx, v1.ProtocolTCP, c.target)
				cancel()
				if outcome(err, c.want) || time.Now().After(deadline) {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			if !outcome(err, c.want) {
				t.Fatalf("%v, want %v", err, c.want)
			}
			t.Logf("%v", err)
		})
	}
}

// outcome reports whether err is what want asks for: nil, a timeout, or
// that error.
func outcome(err, want error) bool {
	var ne net.Error
	switch {
	case want == nil:
		return err == nil
	case errors.Is(want, context.DeadlineExceeded):
		return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
	default:
		return errors.Is(err, want)
	}
}
