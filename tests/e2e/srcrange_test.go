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

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/tools/testbed"
)

// sourceRangesSpec is the demo testbed with two clients outside, whose
// traffic enters at node-a1.
func sourceRangesSpec(t *testing.T, kubeProxy string) *testbed.Spec {
	t.Helper()
	spec, err := testbed.ParseSpec(append(testbed.DemoYAML(), "\noutside: {ingressNode: node-a1, clients: [{name: ext1}, {name: ext2}]}\nkubeProxy: "+kubeProxy+"\n"...))
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// sourceRangesServices: "lb" is a LoadBalancer Service whose
// loadBalancerSourceRanges hold only allowed (ext1's address); nil
// allowed leaves it open.
func sourceRangesServices(allowed *netip.Addr) []testbed.ServiceSpec {
	lb := testbed.ServiceSpec{Name: "lb", Type: v1.ServiceTypeLoadBalancer, LoadBalancerIPs: []string{"198.51.100.9"},
		Ports:     []testbed.PortSpec{{Name: "http", Port: 80}},
		Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-b1"}}}
	if allowed != nil {
		lb.LoadBalancerSourceRanges = []string{netip.PrefixFrom(*allowed, 32).String()}
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
// SYNs).
func TestSourceRanges(t *testing.T) {
	requireRoot(t)
	t.Run("topolb", func(t *testing.T) {
		tb := newTestbed(t, sourceRangesSpec(t, "none"))
		withAgents.start(t, tb)
		ext1 := tb.External("ext1").ClientAddr()
		apply(t, tb, sourceRangesServices(&ext1))
		if err := tb.CheckNoKubeProxy(t.Context()); err != nil {
			t.Fatal(err)
		}
		checkSourceRanges(t, tb, syscall.EPERM)
		noChecksumErrors(t, tb)
	})
	t.Run("kube-proxy", func(t *testing.T) {
		kp := kubeProxyBinary(t)
		cluster := kubetest.Start(t)
		tb, ctx := apiserverTestbed(t, sourceRangesSpec(t, ""), cluster, sourceRangesServices(nil))
		ext1 := tb.External("ext1").ClientAddr()
		if _, err := tb.Apply(ctx, sourceRangesServices(&ext1)); err != nil {
			t.Fatal(err)
		}
		k, err := tb.StartKubeProxy(ctx, "node-a1", testbed.KubeProxyOptions{Binary: kp, Mode: testbed.KubeProxyNFTables})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := k.EnsureTopology(ctx); err != nil {
			t.Fatal(err)
		}
		checkSourceRanges(t, tb, context.DeadlineExceeded)
	})
}

// checkSourceRanges runs the checks of TestSourceRanges on tb; hostRefusal
// is how node-a1's own connect must fail.
func checkSourceRanges(t *testing.T, tb *testbed.Testbed, hostRefusal error) {
	t.Helper()
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, "node-a1")
	d := testbed.FindDecision(ds, "lb", v1.ProtocolTCP)
	if d == nil || !d.NodePort.IsValid() || len(d.External) == 0 {
		t.Fatalf("no decision with a NodePort and the LB IP for lb: %+v", d)
	}
	lbIP := netip.AddrPortFrom(netip.MustParseAddr("198.51.100.9"), 80)
	for _, c := range []struct {
		client testbed.Client
		target netip.AddrPort
		// want is nil for an answer, else the error the request must end
		// with (a timeout: dropped).
		want error
	}{
		{tb.External("ext1"), lbIP, nil},
		{tb.External("ext2"), lbIP, context.DeadlineExceeded},
		{tb.External("ext2"), d.NodePort, nil},
		{tb.Pod("client"), lbIP, context.DeadlineExceeded},
		{tb.Host("node-a1"), lbIP, hostRefusal},
	} {
		label := c.client.ClientName() + " -> " + c.target.String()
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
			t.Errorf("%s: %v, want %v", label, err, c.want)
			continue
		}
		t.Logf("%s: %v", label, err)
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
