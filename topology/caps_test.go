package topology

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// rangesN returns n distinct /32 prefixes from 10.0.0.0 up.
func rangesN(n int) []netip.Prefix {
	out := make([]netip.Prefix, n)
	a := netip.MustParseAddr("10.0.0.0")
	for i := range out {
		out[i] = netip.PrefixFrom(a, 32)
		a = a.Next()
	}
	return out
}

// TestCapsRefusal: a Service is refused when the source ranges its
// load-balancer IPs carry, or the frontends it claims, are over their
// cap; ranges of a Service without load-balancer IPs take no room and do
// not count; a cap of 0 caps nothing; at the cap is not over it.
func TestCapsRefusal(t *testing.T) {
	caps := Caps{SourceRanges: 4, Frontends: 6}
	lbIP := netip.MustParseAddr("198.51.100.20")
	lb := func(ranges []netip.Prefix, lbIPs int) []Frontend {
		p := ServicePort{Family: v1.IPv4Protocol, Protocol: v1.ProtocolTCP, Port: 80, LoadBalancerSourceRanges: ranges}
		out := []Frontend{{Addr: netip.AddrPortFrom(netip.MustParseAddr("10.96.0.1"), 80), Protocol: v1.ProtocolTCP, Scope: ScopeInternal, Kind: KindClusterIP, Port: p}}
		ip := lbIP
		for range lbIPs {
			for _, s := range []Scope{ScopeInternal, ScopeExternal} {
				out = append(out, Frontend{Addr: netip.AddrPortFrom(ip, 80), Protocol: v1.ProtocolTCP, Scope: s, Kind: KindLoadBalancerIP, Port: p})
			}
			ip = ip.Next()
		}
		return out
	}
	cases := []struct {
		name   string
		caps   Caps
		claims []Frontend
		// want is the refusal; the zero Refusal: none.
		want Refusal
	}{
		{"no claims", caps, nil, Refusal{}},
		{"ranges at the cap", caps, lb(rangesN(4), 1), Refusal{}},
		{"ranges over the cap", caps, lb(rangesN(5), 1), Refusal{Cap: CapSourceRanges, Count: 5, Limit: 4}},
		{"the hostile Service of the issue", DefaultCaps, lb(rangesN(32766), 1), Refusal{Cap: CapSourceRanges, Count: 32766, Limit: 256}},
		{"ranges without load-balancer IPs take no room", caps, lb(rangesN(50), 0), Refusal{}},
		{"no cap on ranges", Caps{Frontends: 6}, lb(rangesN(500), 1), Refusal{}},
		{"frontends at the cap", caps, append(lb(nil, 2), lb(nil, 1)[1:]...), Refusal{}},
		{"frontends over the cap", caps, lb(nil, 3), Refusal{Cap: CapFrontends, Count: 7, Limit: 6}},
		{"ranges are checked first", caps, lb(rangesN(5), 3), Refusal{Cap: CapSourceRanges, Count: 5, Limit: 4}},
		{"no caps", Caps{}, lb(rangesN(500), 100), Refusal{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, refused := tc.caps.Refusal(tc.claims)
			if got != tc.want || refused != (tc.want != Refusal{}) {
				t.Errorf("Refusal = %+v, %v; want %+v", got, refused, tc.want)
			}
		})
	}
}

// TestCapsRefuseWhole: a Service over a cap is refused whole, by
// NodeFrontends (explain) as by State.PlanService (the agent), with a
// warning that names it, the cap and the flag; the other Services keep
// every frontend.
func TestCapsRefuseWhole(t *testing.T) {
	opts := DefaultOptions()
	opts.Caps = Caps{SourceRanges: 2}
	hostile := svcPort("hostile", 1, func(p *ServicePort) {
		p.ClusterIP, p.ExternallyAccessible = netip.MustParseAddr("10.96.0.1"), true
		p.LoadBalancerIPs, p.LoadBalancerSourceRanges = ips("198.51.100.1"), rangesN(3)
	})
	later := svcPort("later", 2, func(p *ServicePort) {
		p.ClusterIP, p.ExternallyAccessible = netip.MustParseAddr("10.96.0.2"), true
		p.LoadBalancerIPs, p.LoadBalancerSourceRanges = ips("198.51.100.2"), rangesN(2)
	})
	var ds []PortDecision
	for _, p := range []ServicePort{hostile, later} {
		eps := []Endpoint{ep(1, "a1", "zone-a")}
		ds = append(ds, PortDecision{Port: p, Endpoints: eps, Decision: Decide(Input{Node: addrNode, Nodes: testNodes, Port: p, Endpoints: eps}, opts)})
	}
	fes, warnings := NodeFrontends(addrNode, ds, opts)
	var got []string
	for _, f := range fes {
		got = append(got, fmt.Sprintf("%s %s %s", f.Addr, f.Scope, f.Port.Service))
	}
	want := []string{"10.96.0.2:80 internal ns/later", "198.51.100.2:80 external ns/later", "198.51.100.2:80 internal ns/later"}
	if !slices.Equal(got, want) {
		t.Errorf("frontends:\n  got  %q\n  want %q", got, want)
	}
	checkWarnings(t, warnings, []string{"ns/hostile: refused: 3 loadBalancerSourceRanges, over the cap of 2 per Service (--max-source-ranges-per-service)"})

	// The agent's plan of each.
	state := NewEmptyState()
	for _, nn := range []types.NamespacedName{hostile.Service, later.Service} {
		svc := &v1.Service{}
		svc.Namespace, svc.Name = nn.Namespace, nn.Name
		svc.Spec.Type = v1.ServiceTypeLoadBalancer
		svc.Spec.ClusterIP = map[string]string{"hostile": "10.96.0.1", "later": "10.96.0.2"}[nn.Name]
		svc.Spec.ClusterIPs = []string{svc.Spec.ClusterIP}
		svc.Spec.Ports = []v1.ServicePort{{Port: 80, Protocol: v1.ProtocolTCP, NodePort: 30080 + int32(len(nn.Name))}}
		svc.Spec.LoadBalancerSourceRanges = map[string][]string{"hostile": {"10.0.0.0/32", "10.0.0.1/32", "10.0.0.2/32"}, "later": {"10.0.0.0/32"}}[nn.Name]
		svc.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: map[string]string{"hostile": "198.51.100.1", "later": "198.51.100.2"}[nn.Name]}}
		state.SetService(svc)
	}
	state.Nodes[addrNode.Name] = addrNode
	if plan := state.PlanService(addrNode, hostile.Service, opts); plan.Refused == nil || plan.Refused.Cap != CapSourceRanges || plan.Claims != nil || plan.HealthChecks != nil {
		t.Errorf("hostile plan: refused %+v, %d claims, %d health checks; want refused over source ranges, none", plan.Refused, len(plan.Claims), len(plan.HealthChecks))
	} else if !slices.ContainsFunc(plan.Warnings, func(w string) bool { return w == "ns/hostile: "+plan.Refused.String() }) {
		t.Errorf("hostile plan warnings %q: none names the refusal", plan.Warnings)
	}
	if plan := state.PlanService(addrNode, later.Service, opts); plan.Refused != nil || len(plan.Claims) == 0 {
		t.Errorf("later plan: refused %+v, %d claims; want served", plan.Refused, len(plan.Claims))
	}
}
