package topology

import (
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

// dualNode is node a1 in zone-a with an InternalIP and an ExternalIP in
// each family, and a link-local IPv6 address (of another type) that
// NodePorts never use, even under ::/0.
func dualNode(name, zone string) *v1.Node {
	return &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{LabelZone: zone}},
		Status: v1.NodeStatus{Addresses: []v1.NodeAddress{
			{Type: v1.NodeInternalIP, Address: "192.168.0.1"},
			{Type: v1.NodeInternalIP, Address: "fd00:1::1"},
			{Type: v1.NodeExternalIP, Address: "203.0.113.1"},
			{Type: v1.NodeExternalIP, Address: "2001:db8:1::1"},
			{Type: "Other", Address: "fe80::1"},
		}},
	}
}

// familySlice is an EndpointSlice of Service ns/web with port http 8080,
// one endpoint per address, each on node and in zone; hinted, when hint is
// not "", for that zone.
func familySlice(name string, family discovery.AddressType, hint string, eps ...[3]string) *discovery.EndpointSlice {
	s := slice(name, family, []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}})
	for _, e := range eps {
		ep := discovery.Endpoint{Addresses: []string{e[0]}, NodeName: ptr.To(e[1]), Zone: ptr.To(e[2])}
		if hint != "" {
			ep.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: e[2]}}}
		}
		s.Endpoints = append(s.Endpoints, ep)
	}
	return s
}

// TestDualStackDecisions: a dual-stack Service is decided once per family,
// each from its own cluster IP, externalIPs, load-balancer IPs, slices and
// node addresses, as kube-proxy's two proxiers decide it; the hint mode can
// differ by family (the IPv4 slices carry hints, the IPv6 ones do not).
func TestDualStackDecisions(t *testing.T) {
	web := svc(func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeLoadBalancer
		s.Spec.ClusterIP, s.Spec.ClusterIPs = "fd00:10:96::10", []string{"fd00:10:96::10", "10.96.0.10"}
		s.Spec.IPFamilies = []v1.IPFamily{v1.IPv6Protocol, v1.IPv4Protocol}
		s.Spec.Ports[0].NodePort = 30080
		s.Spec.ExternalIPs = []string{"198.51.100.1", "2001:db8:e::1"}
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
		s.Spec.HealthCheckNodePort = 32000
		s.Spec.LoadBalancerSourceRanges = []string{"192.168.0.0/16", "fd00:1::/64"}
		s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "198.51.100.2"}, {IP: "2001:db8:e::2"}}
	})
	state := NewState(
		[]*v1.Node{dualNode("a1", "zone-a"), dualNode("b1", "zone-b")},
		[]*v1.Service{web},
		[]*discovery.EndpointSlice{
			familySlice("web-v4", discovery.AddressTypeIPv4, "hinted",
				[3]string{"10.0.1.1", "a1", "zone-a"}, [3]string{"10.0.2.1", "b1", "zone-b"}),
			familySlice("web-v6", discovery.AddressTypeIPv6, "",
				[3]string{"fd00:244:1::1", "a1", "zone-a"}, [3]string{"fd00:244:2::1", "b1", "zone-b"}, [3]string{"fd00:244:2::2", "b1", "zone-b"}),
		}, nil)
	node, _ := state.Node("a1")
	plan := state.PlanService(node, types.NamespacedName{Namespace: "ns", Name: "web"}, DefaultOptions())
	if len(plan.Warnings) != 0 {
		t.Errorf("warnings %q, want none", plan.Warnings)
	}
	if got := plan.Families(); !slices.Equal(got, Families) {
		t.Fatalf("families %v, want %v", got, Families)
	}
	for _, tc := range []struct {
		family    v1.IPFamily
		clusterIP string
		mode      Mode
		backends  []string
		// external are the external frontends, "Kind ip:port".
		external []string
		// ranges are the LB IP's source ranges; nodePasses whether the
		// node's own processes pass.
		ranges     []string
		nodePasses bool
		localHC    int
	}{
		{family: v1.IPv4Protocol, clusterIP: "10.96.0.10", mode: ModePreferSameZone,
			backends: []string{"10.0.1.1:8080"},
			external: []string{fa(KindExternalIP, "198.51.100.1:80"), fa(KindLoadBalancerIP, "198.51.100.2:80"), fa(KindNodePort, "192.168.0.1:30080"), fa(KindNodePort, "203.0.113.1:30080")},
			ranges:   []string{"192.168.0.0/16", "198.51.100.2/32"}, nodePasses: true, localHC: 1},
		{family: v1.IPv6Protocol, clusterIP: "fd00:10:96::10", mode: ModeNone,
			backends: []string{"[fd00:244:1::1]:8080", "[fd00:244:2::1]:8080", "[fd00:244:2::2]:8080"},
			external: []string{fa(KindExternalIP, "[2001:db8:e::1]:80"), fa(KindLoadBalancerIP, "[2001:db8:e::2]:80"), fa(KindNodePort, "[fd00:1::1]:30080"), fa(KindNodePort, "[2001:db8:1::1]:30080")},
			ranges:   []string{"fd00:1::/64", "2001:db8:e::2/128"}, nodePasses: true, localHC: 1},
	} {
		t.Run(string(tc.family), func(t *testing.T) {
			i := slices.IndexFunc(plan.Ports, func(d PortDecision) bool { return d.Port.Family == tc.family })
			if i < 0 {
				t.Fatalf("no decision in %s", tc.family)
			}
			d := plan.Ports[i]
			if d.Port.ClusterIP != netip.MustParseAddr(tc.clusterIP) || d.Decision.Mode != tc.mode {
				t.Errorf("cluster IP %s, mode %s; want %s, %s (%s)", d.Port.ClusterIP, d.Decision.Mode, tc.clusterIP, tc.mode, d.Decision.Reason)
			}
			var backends []string
			for _, ep := range d.Decision.Backends {
				backends = append(backends, ep.Addr.String())
			}
			if !slices.Equal(backends, tc.backends) {
				t.Errorf("backends %v, want %v", backends, tc.backends)
			}
			ext, _ := d.Port.ExternalFrontends(node, DefaultOptions())
			var got []string
			for _, f := range ext {
				got = append(got, fa(f.Kind, f.Addr.String()))
			}
			if !slices.Equal(got, tc.external) {
				t.Errorf("external frontends %v, want %v", got, tc.external)
			}
			for _, c := range plan.Claims {
				if FamilyOf(c.Addr.Addr()) != c.Port.Family {
					t.Errorf("claim %s of a %s port", c.Addr, c.Port.Family)
				}
				if c.Port.Family != tc.family || c.Kind != KindLoadBalancerIP {
					continue
				}
				ranges, nodePasses := c.SourceRanges(node)
				var rs []string
				for _, p := range ranges {
					rs = append(rs, p.String())
				}
				if !slices.Equal(rs, tc.ranges) || nodePasses != tc.nodePasses {
					t.Errorf("source ranges %v (node passes %v), want %v (%v)", rs, nodePasses, tc.ranges, tc.nodePasses)
				}
			}
			j := slices.IndexFunc(plan.HealthChecks, func(hc HealthCheck) bool { return hc.Family == tc.family })
			if j < 0 || plan.HealthChecks[j] != (HealthCheck{Port: 32000, Family: tc.family, LocalEndpoints: tc.localHC}) {
				t.Errorf("health checks %+v, want port 32000 with %d local endpoints in %s", plan.HealthChecks, tc.localHC, tc.family)
			}
		})
	}
}

// TestFamiliesOfServices: which families a Service is decided in, and that
// a family's slices feed only that family's decision.
func TestFamiliesOfServices(t *testing.T) {
	v4 := familySlice("v4", discovery.AddressTypeIPv4, "", [3]string{"10.0.1.1", "a1", "zone-a"})
	v6 := familySlice("v6", discovery.AddressTypeIPv6, "", [3]string{"fd00:244:1::1", "a1", "zone-a"})
	fqdn := familySlice("fqdn", discovery.AddressTypeFQDN, "", [3]string{"web.example", "a1", "zone-a"})
	for _, tc := range []struct {
		name       string
		clusterIPs []string
		slices     []*discovery.EndpointSlice
		// want are "family backend..." per decision, in order.
		want     []string
		warnings int
	}{
		{name: "IPv4 only: IPv6 slices are not its", clusterIPs: []string{"10.96.0.10"}, slices: []*discovery.EndpointSlice{v4, v6},
			want: []string{"IPv4 10.0.1.1:8080"}},
		{name: "IPv6 only", clusterIPs: []string{"fd00:10:96::10"}, slices: []*discovery.EndpointSlice{v4, v6},
			want: []string{"IPv6 [fd00:244:1::1]:8080"}},
		{name: "dual stack, IPv4 primary", clusterIPs: []string{"10.96.0.10", "fd00:10:96::10"}, slices: []*discovery.EndpointSlice{v6, v4},
			want: []string{"IPv4 10.0.1.1:8080", "IPv6 [fd00:244:1::1]:8080"}},
		{name: "dual stack without IPv6 slices: IPv6 rejects", clusterIPs: []string{"fd00:10:96::10", "10.96.0.10"}, slices: []*discovery.EndpointSlice{v4},
			want: []string{"IPv4 10.0.1.1:8080", "IPv6"}},
		{name: "FQDN slices are warned about, once", clusterIPs: []string{"10.96.0.10", "fd00:10:96::10"}, slices: []*discovery.EndpointSlice{v4, v6, fqdn},
			want: []string{"IPv4 10.0.1.1:8080", "IPv6 [fd00:244:1::1]:8080"}, warnings: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := svc(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = tc.clusterIPs[0], tc.clusterIPs })
			state := NewState([]*v1.Node{dualNode("a1", "zone-a")}, []*v1.Service{s}, tc.slices, nil)
			ds, warnings := state.DecideService("a1", types.NamespacedName{Namespace: "ns", Name: "web"}, DefaultOptions())
			var got []string
			for _, d := range ds {
				row := string(d.Port.Family)
				for _, ep := range d.Decision.Backends {
					row += " " + ep.Addr.String()
				}
				got = append(got, row)
				if d.Port.Family == v1.IPv6Protocol && len(d.Decision.Backends) == 0 && d.Decision.WhenEmpty != EmptyReject {
					t.Errorf("IPv6 without endpoints: %s, want reject", d.Decision.WhenEmpty)
				}
			}
			if !slices.Equal(got, tc.want) || len(warnings) != tc.warnings {
				t.Errorf("decisions %q, warnings %q; want %q and %d warnings", got, warnings, tc.want, tc.warnings)
			}
		})
	}
}

// TestNodePortAddressesPerFamily: --nodeport-addresses is split by family,
// as kube-proxy's NewNodePortAddresses does: a family without a prefix of
// its own serves on its InternalIP and ExternalIP addresses.
func TestNodePortAddressesPerFamily(t *testing.T) {
	node := NodeFromObject(dualNode("a1", "zone-a"), nil)
	prefixes := func(ss ...string) Options {
		var o Options
		for _, s := range ss {
			o.NodePortAddresses = append(o.NodePortAddresses, netip.MustParsePrefix(s))
		}
		return o
	}
	for _, tc := range []struct {
		name       string
		opts       Options
		ipv4, ipv6 []string
	}{
		{"default: InternalIP and ExternalIP of each family, never link-local", Options{},
			[]string{"192.168.0.1", "203.0.113.1"}, []string{"fd00:1::1", "2001:db8:1::1"}},
		{"IPv4 prefixes only: IPv6 keeps its default", prefixes("192.168.0.0/16"),
			[]string{"192.168.0.1"}, []string{"fd00:1::1", "2001:db8:1::1"}},
		{"IPv6 prefixes only: IPv4 keeps its default", prefixes("2001:db8::/32"),
			[]string{"192.168.0.1", "203.0.113.1"}, []string{"2001:db8:1::1"}},
		{"both", prefixes("203.0.113.0/24", "fd00::/8"),
			[]string{"203.0.113.1"}, []string{"fd00:1::1"}},
		{"::/0 is every IPv6 address, but not a refused one", prefixes("::/0"),
			[]string{"192.168.0.1", "203.0.113.1"}, []string{"fd00:1::1", "2001:db8:1::1"}},
		{"a prefix matching nothing: no NodePorts in its family", prefixes("fd99::/16"),
			[]string{"192.168.0.1", "203.0.113.1"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for family, want := range map[v1.IPFamily][]string{v1.IPv4Protocol: tc.ipv4, v1.IPv6Protocol: tc.ipv6} {
				if got := addrStrings(NodePortAddresses(node, family, tc.opts)); !slices.Equal(got, want) {
					t.Errorf("%s: %v, want %v", family, got, want)
				}
			}
		})
	}
	// Localhost NodePorts are IPv4's only, as kube-proxy's.
	p := clusterPort(nil)
	p.Family, p.ClusterIP, p.NodePort = v1.IPv6Protocol, netip.MustParseAddr("fd00:10:96::10"), 30080
	ext, _ := p.ExternalFrontends(node, prefixes("0.0.0.0/0", "::/0"))
	for _, f := range ext {
		if f.Addr.Addr().IsLoopback() || FamilyOf(f.Addr.Addr()) != v1.IPv6Protocol {
			t.Errorf("IPv6 port serves %s", f.Addr)
		}
	}
	if len(ext) != 2 {
		t.Errorf("IPv6 NodePorts %v, want the 2 IPv6 addresses", ext)
	}
}

// TestAddrProblemIPv6: the IPv6 addresses no frontend or backend may be.
func TestAddrProblemIPv6(t *testing.T) {
	for addr, want := range map[string]string{
		"fd00::1":          "",
		"2001:db8::1":      "",
		"::":               "unspecified",
		"::1":              "loopback",
		"ff02::1":          "multicast",
		"fe80::1":          "link-local",
		"fe80::1%eth0":     "scoped to a zone",
		"::ffff:10.0.0.1":  "IPv4-mapped",
		"::ffff:127.0.0.1": "IPv4-mapped",
	} {
		if got := AddrProblem(netip.MustParseAddr(addr)); got != want {
			t.Errorf("AddrProblem(%s) = %q, want %q", addr, got, want)
		}
	}
}

// TestSourceRangesPerFamily: each family takes its own
// loadBalancerSourceRanges, a /0 opening only its own family.
func TestSourceRangesPerFamily(t *testing.T) {
	for _, tc := range []struct {
		name       string
		ranges     []string
		ipv4, ipv6 []string
	}{
		{"both families", []string{"10.0.0.0/8", "fd00::/8"}, []string{"10.0.0.0/8"}, []string{"fd00::/8"}},
		{"IPv4 /0 opens IPv4 only", []string{"0.0.0.0/0", "fd00::/8"}, nil, []string{"fd00::/8"}},
		{"IPv6 /0 opens IPv6 only", []string{"10.0.0.0/8", "::/0"}, []string{"10.0.0.0/8"}, nil},
		{"IPv4-mapped counts as IPv4", []string{"::ffff:10.1.0.0/112"}, []string{"10.1.0.0/16"}, nil},
		{"IPv6 masked", []string{" fd00:1::7/64 "}, nil, []string{"fd00:1::/64"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := svc(func(s *v1.Service) {
				s.Spec.ClusterIPs = []string{"10.96.0.10", "fd00:10:96::10"}
				s.Spec.LoadBalancerSourceRanges = tc.ranges
			})
			ports, warnings, err := ServicePorts(s)
			if err != nil || len(ports) != 2 || len(warnings) != 0 {
				t.Fatalf("ServicePorts: %v, %d ports, warnings %q", err, len(ports), warnings)
			}
			for _, p := range ports {
				want := map[v1.IPFamily][]string{v1.IPv4Protocol: tc.ipv4, v1.IPv6Protocol: tc.ipv6}[p.Family]
				var got []string
				for _, r := range p.LoadBalancerSourceRanges {
					got = append(got, r.String())
				}
				if !slices.Equal(got, want) {
					t.Errorf("%s: %v, want %v", p.Family, got, want)
				}
			}
		})
	}
}

// TestReportFamilies: the report names each port's and frontend's family.
func TestReportFamilies(t *testing.T) {
	s := svc(func(s *v1.Service) { s.Spec.ClusterIPs = []string{"10.96.0.10", "fd00:10:96::10"} })
	state := NewState([]*v1.Node{dualNode("a1", "zone-a")}, []*v1.Service{s}, nil, nil)
	ds, _ := state.DecideNode("a1", DefaultOptions())
	node, _ := state.Node("a1")
	r := NewReport(node, ds)
	if len(r.Services) != 2 || r.Services[0].Family != v1.IPv4Protocol || r.Services[1].Family != v1.IPv6Protocol {
		t.Fatalf("services %+v, want the port in IPv4 then IPv6", r.Services)
	}
	if r.Services[1].Frontends[0] != "[fd00:10:96::10]:80" {
		t.Errorf("IPv6 frontends %v", r.Services[1].Frontends)
	}
	for _, f := range r.Frontends {
		if addr := netip.MustParseAddrPort(f.Address); FamilyOf(addr.Addr()) != f.Family {
			t.Errorf("frontend %s reported in %s", f.Address, f.Family)
		}
	}
}

// TestParseNodePortAddresses: --nodeport-addresses takes CIDRs of both
// families, masked, and refuses what is not a CIDR.
func TestParseNodePortAddresses(t *testing.T) {
	got, err := ParseNodePortAddresses([]string{"10.0.0.7/8", " fd00:1::9/64 ", "::/0"})
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00:1::/64"), netip.MustParsePrefix("::/0")}
	if !slices.Equal(got, want) {
		t.Errorf("parsed %v, want %v", got, want)
	}
	for _, bad := range []string{"fd00::1", "fd00::/129", "10.0.0.0"} {
		if _, err := ParseNodePortAddresses([]string{bad}); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
