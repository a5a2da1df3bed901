package topology

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func svc(mut func(*v1.Service)) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web"},
		Spec: v1.ServiceSpec{
			Type: v1.ServiceTypeClusterIP, ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10"},
			Ports: []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}},
		},
	}
	if mut != nil {
		mut(s)
	}
	return s
}

func TestServicePorts(t *testing.T) {
	local := v1.ServiceInternalTrafficPolicyLocal
	proxy, vip := v1.LoadBalancerIPModeProxy, v1.LoadBalancerIPModeVIP
	cases := []struct {
		name string
		svc  *v1.Service
		// err is the sentinel the error must wrap; nil means no error.
		err error
		// warnings is the number of warnings.
		warnings int
		// affinity, when set, is every port's session affinity.
		affinity                               *SessionAffinity
		external, internalLocal, externalLocal bool
		lbIPs                                  []string
		ports                                  int
		// clusterIPs are the ports' cluster IPs, in order; nil means
		// 10.96.0.10 for every port.
		clusterIPs []string
	}{
		{name: "plain ClusterIP", svc: svc(nil), ports: 1},
		{name: "ExternalName is not proxied", svc: svc(func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeExternalName }), err: ErrNotProxied},
		{name: "headless is not proxied", svc: svc(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "None", []string{"None"} }), err: ErrNotProxied},
		{name: "IPv6-only is decided in IPv6", svc: svc(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "fd00::10", []string{"fd00::10"} }), ports: 1, clusterIPs: []string{"fd00::10"}},
		{name: "a cluster IP without clusterIPs (hand-written manifests)", svc: svc(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "fd00::10", nil }), ports: 1, clusterIPs: []string{"fd00::10"}},
		{name: "an unusable IPv6 cluster IP: IPv4 still served, with a warning", svc: svc(func(s *v1.Service) { s.Spec.ClusterIPs = []string{"10.96.0.10", "fe80::1"} }), ports: 1, warnings: 1},
		{name: "an unusable cluster IP alone: not served", svc: svc(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "::1", []string{"::1"} }), err: ErrUnusableAddress},
		{name: "a cluster IP that is no address", svc: svc(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "x", []string{"x"} }), err: ErrNoClusterIP},
		{name: "dual-stack IPv6 primary: each port in both families, the primary first", svc: svc(func(s *v1.Service) {
			s.Spec.ClusterIP, s.Spec.ClusterIPs = "fd00::10", []string{"fd00::10", "10.96.0.10"}
			s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "dns", Port: 53, Protocol: v1.ProtocolUDP})
		}), ports: 4, clusterIPs: []string{"fd00::10", "fd00::10", "10.96.0.10", "10.96.0.10"}},
		{name: "no cluster IP is not proxied (kube-proxy's ShouldSkipService)", svc: svc(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "", nil }), err: ErrNotProxied},
		{name: "service-proxy-name naming another proxy is not proxied",
			svc: svc(func(s *v1.Service) { s.Labels = map[string]string{LabelServiceProxyName: "other-proxy"} }), err: ErrNotProxied},
		{name: "service-proxy-name with an empty value is not proxied either (kube-proxy selects on the key)",
			svc: svc(func(s *v1.Service) { s.Labels = map[string]string{LabelServiceProxyName: ""} }), err: ErrNotProxied},
		{name: "other service.kubernetes.io labels do not matter",
			svc: svc(func(s *v1.Service) {
				s.Labels = map[string]string{v1.IsHeadlessService: "", "service.kubernetes.io/other": "x"}
			}), ports: 1},
		{name: "eTP Local ignored when not externally accessible",
			svc:   svc(func(s *v1.Service) { s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal }),
			ports: 1},
		{name: "NodePort with eTP Local",
			svc: svc(func(s *v1.Service) {
				s.Spec.Type, s.Spec.ExternalTrafficPolicy = v1.ServiceTypeNodePort, v1.ServiceExternalTrafficPolicyLocal
				s.Spec.Ports[0].NodePort = 30080
			}),
			external: true, externalLocal: true, ports: 1},
		{name: "any port's nodePort makes every port externally accessible",
			svc: svc(func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "admin", Port: 81, NodePort: 30081})
			}),
			external: true, ports: 2},
		{name: "ClusterIP with externalIPs and eTP Local",
			svc: svc(func(s *v1.Service) {
				s.Spec.ExternalIPs, s.Spec.ExternalTrafficPolicy = []string{"192.0.2.1"}, v1.ServiceExternalTrafficPolicyLocal
			}),
			external: true, externalLocal: true, ports: 1},
		{name: "IPv6 externalIPs do not make an IPv4 port external (as kube-proxy's IPv4 proxier)",
			svc: svc(func(s *v1.Service) {
				s.Spec.ExternalIPs, s.Spec.ExternalTrafficPolicy = []string{"2001:db8::1"}, v1.ServiceExternalTrafficPolicyLocal
			}),
			ports: 1},
		{name: "LB ingress with ipMode Proxy is not external",
			svc: svc(func(s *v1.Service) {
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "192.0.2.2", IPMode: &proxy}}
			}),
			ports: 1},
		{name: "LB ingress with ipMode VIP or unset is external",
			svc: svc(func(s *v1.Service) {
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "192.0.2.2", IPMode: &vip}, {IP: "192.0.2.3"}, {Hostname: "lb.example"}}
			}),
			external: true, lbIPs: []string{"192.0.2.2", "192.0.2.3"}, ports: 1},
		{name: "iTP Local", svc: svc(func(s *v1.Service) { s.Spec.InternalTrafficPolicy = &local }), internalLocal: true, ports: 1},
		{name: "invalid port is dropped, others kept",
			svc: svc(func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "bad", Port: 0})
			}),
			warnings: 1, ports: 1},
		{name: "no affinity by default", svc: svc(nil), affinity: &SessionAffinity{}, ports: 1},
		{name: "ClientIP affinity with the default timeout",
			svc:      svc(func(s *v1.Service) { s.Spec.SessionAffinity = v1.ServiceAffinityClientIP }),
			affinity: &SessionAffinity{ClientIP: true, TimeoutSeconds: 10800}, ports: 1},
		{name: "ClientIP affinity with its timeout",
			svc: svc(func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
				s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](86400)}}
			}),
			affinity: &SessionAffinity{ClientIP: true, TimeoutSeconds: 86400}, ports: 1},
		{name: "ClientIP affinity timeout out of range: default, with a warning",
			svc: svc(func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
				s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](86401)}}
			}),
			affinity: &SessionAffinity{ClientIP: true, TimeoutSeconds: 10800}, warnings: 1, ports: 1},
		{name: "ClientIP affinity timeout 0: default, with a warning",
			svc: svc(func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
				s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](0)}}
			}),
			affinity: &SessionAffinity{ClientIP: true, TimeoutSeconds: 10800}, warnings: 1, ports: 1},
		{name: "unknown affinity type: none, with a warning",
			svc:      svc(func(s *v1.Service) { s.Spec.SessionAffinity = "Cookie" }),
			affinity: &SessionAffinity{}, warnings: 1, ports: 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ports, warnings, err := ServicePorts(tc.svc)
			switch {
			case tc.err == nil && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tc.err != nil && !errors.Is(err, tc.err):
				t.Fatalf("error = %v, want %v", err, tc.err)
			}
			if len(warnings) != tc.warnings {
				t.Errorf("warnings %q, want %d", warnings, tc.warnings)
			}
			if tc.affinity != nil {
				for _, p := range ports {
					if p.Affinity != *tc.affinity {
						t.Errorf("affinity %+v, want %+v", p.Affinity, *tc.affinity)
					}
				}
			}
			if len(ports) != tc.ports {
				t.Fatalf("%d ports, want %d", len(ports), tc.ports)
			}
			for i, p := range ports {
				if p.ExternallyAccessible != tc.external || p.InternalPolicyLocal != tc.internalLocal || p.ExternalPolicyLocal != tc.externalLocal {
					t.Errorf("external=%v iLocal=%v eLocal=%v, want %v %v %v", p.ExternallyAccessible, p.InternalPolicyLocal, p.ExternalPolicyLocal, tc.external, tc.internalLocal, tc.externalLocal)
				}
				want := netip.MustParseAddr("10.96.0.10")
				if tc.clusterIPs != nil {
					want = netip.MustParseAddr(tc.clusterIPs[i])
				}
				if p.ClusterIP != want || p.Family != FamilyOf(want) {
					t.Errorf("port %d: cluster IP %s in %s, want %s", i, p.ClusterIP, p.Family, want)
				}
				var lb []string
				for _, ip := range p.LoadBalancerIPs {
					lb = append(lb, ip.String())
				}
				if !slices.Equal(lb, tc.lbIPs) {
					t.Errorf("LB IPs %v, want %v", lb, tc.lbIPs)
				}
			}
		})
	}
}

func slice(name string, addrType discovery.AddressType, ports []discovery.EndpointPort, eps ...discovery.Endpoint) *discovery.EndpointSlice {
	return &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: map[string]string{discovery.LabelServiceName: "web"}},
		AddressType: addrType, Ports: ports, Endpoints: eps,
	}
}

func TestEndpointsForPort(t *testing.T) {
	tcp, udp := v1.ProtocolTCP, v1.ProtocolUDP
	httpPort := []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: &tcp}}
	port := ServicePort{Family: v1.IPv4Protocol, Name: "http", Protocol: v1.ProtocolTCP, Port: 80}
	cases := []struct {
		name   string
		port   ServicePort
		slices []*discovery.EndpointSlice
		// want are "addr ready local" strings; empty and nil both mean none.
		want     []string
		warnings int
	}{
		{name: "conditions default: nil ready and serving are true",
			slices: []*discovery.EndpointSlice{slice("s1", discovery.AddressTypeIPv4, httpPort, discovery.Endpoint{Addresses: []string{"10.0.0.1"}, NodeName: ptr.To("n1")})},
			want:   []string{"10.0.0.1:8080 ready local"}},
		{name: "port must match name and protocol",
			slices: []*discovery.EndpointSlice{
				slice("s1", discovery.AddressTypeIPv4, []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: &udp}}, discovery.Endpoint{Addresses: []string{"10.0.0.1"}}),
				slice("s2", discovery.AddressTypeIPv4, []discovery.EndpointPort{{Name: ptr.To("other"), Port: ptr.To[int32](8080), Protocol: &tcp}}, discovery.Endpoint{Addresses: []string{"10.0.0.2"}}),
			}},
		{name: "nil protocol is TCP, nil port number skips the slice",
			slices: []*discovery.EndpointSlice{
				slice("s1", discovery.AddressTypeIPv4, []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080)}}, discovery.Endpoint{Addresses: []string{"10.0.0.1"}}),
				slice("s2", discovery.AddressTypeIPv4, []discovery.EndpointPort{{Name: ptr.To("http"), Protocol: &tcp}}, discovery.Endpoint{Addresses: []string{"10.0.0.2"}}),
			},
			want: []string{"10.0.0.1:8080 ready remote"}},
		{name: "unnamed service port matches nil slice port name",
			port:   ServicePort{Family: v1.IPv4Protocol, Name: "", Protocol: v1.ProtocolTCP, Port: 80},
			slices: []*discovery.EndpointSlice{slice("s1", discovery.AddressTypeIPv4, []discovery.EndpointPort{{Port: ptr.To[int32](9090)}}, discovery.Endpoint{Addresses: []string{"10.0.0.1"}})},
			want:   []string{"10.0.0.1:9090 ready remote"}},
		{name: "IPv6 slices are the IPv6 port's; FQDN slices are skipped with a warning",
			slices: []*discovery.EndpointSlice{
				slice("s1", discovery.AddressTypeIPv6, httpPort, discovery.Endpoint{Addresses: []string{"fd00::1"}}),
				slice("s2", discovery.AddressTypeFQDN, httpPort, discovery.Endpoint{Addresses: []string{"a.example"}}),
			},
			warnings: 1},
		{name: "IPv6 port: its family's slices only, addresses of the other family or IPv4-mapped warned",
			port: ServicePort{Family: v1.IPv6Protocol, Name: "http", Protocol: v1.ProtocolTCP, Port: 80},
			slices: []*discovery.EndpointSlice{
				slice("s1", discovery.AddressTypeIPv4, httpPort, discovery.Endpoint{Addresses: []string{"10.0.0.1"}}),
				slice("s2", discovery.AddressTypeIPv6, httpPort,
					discovery.Endpoint{Addresses: []string{"fd00::1"}, NodeName: ptr.To("n1")},
					discovery.Endpoint{Addresses: []string{"10.0.0.2"}},
					discovery.Endpoint{Addresses: []string{"::ffff:10.0.0.3"}},
					discovery.Endpoint{Addresses: []string{"fe80::1"}},
				),
			},
			want: []string{"[fd00::1]:8080 ready local"}, warnings: 3},
		{name: "only the first address counts; bad or missing addresses warn",
			slices: []*discovery.EndpointSlice{slice("s1", discovery.AddressTypeIPv4, httpPort,
				discovery.Endpoint{Addresses: []string{"10.0.0.1", "10.0.0.9"}},
				discovery.Endpoint{Addresses: []string{"bogus"}},
				discovery.Endpoint{Addresses: nil},
				discovery.Endpoint{Addresses: []string{"fd00::1"}},
			)},
			want: []string{"10.0.0.1:8080 ready remote"}, warnings: 3},
		{name: "duplicates across slices: ready copy wins over unready",
			slices: []*discovery.EndpointSlice{
				slice("a", discovery.AddressTypeIPv4, httpPort, discovery.Endpoint{Addresses: []string{"10.0.0.1"}, Conditions: discovery.EndpointConditions{Ready: ptr.To(false)}, NodeName: ptr.To("n1")}),
				slice("b", discovery.AddressTypeIPv4, httpPort, discovery.Endpoint{Addresses: []string{"10.0.0.1"}, NodeName: ptr.To("n2")}),
			},
			want: []string{"10.0.0.1:8080 ready remote"}},
		{name: "duplicates across slices: local copy wins when readiness ties",
			slices: []*discovery.EndpointSlice{
				slice("a", discovery.AddressTypeIPv4, httpPort, discovery.Endpoint{Addresses: []string{"10.0.0.1"}, NodeName: ptr.To("n2")}),
				slice("b", discovery.AddressTypeIPv4, httpPort, discovery.Endpoint{Addresses: []string{"10.0.0.1"}, NodeName: ptr.To("n1")}),
			},
			want: []string{"10.0.0.1:8080 ready local"}},
		{name: "duplicates: unready local loses to ready remote",
			slices: []*discovery.EndpointSlice{
				slice("a", discovery.AddressTypeIPv4, httpPort, discovery.Endpoint{Addresses: []string{"10.0.0.1"}, NodeName: ptr.To("n2")}),
				slice("b", discovery.AddressTypeIPv4, httpPort, discovery.Endpoint{Addresses: []string{"10.0.0.1"}, NodeName: ptr.To("n1"), Conditions: discovery.EndpointConditions{Ready: ptr.To(false)}}),
			},
			want: []string{"10.0.0.1:8080 ready remote"}},
		{name: "same IP on two ports counts twice",
			slices: []*discovery.EndpointSlice{
				slice("a", discovery.AddressTypeIPv4, httpPort, discovery.Endpoint{Addresses: []string{"10.0.0.1"}}),
				slice("b", discovery.AddressTypeIPv4, []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8081), Protocol: &tcp}}, discovery.Endpoint{Addresses: []string{"10.0.0.1"}}),
			},
			want: []string{"10.0.0.1:8080 ready remote", "10.0.0.1:8081 ready remote"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := port
			if tc.port.Protocol != "" {
				p = tc.port
			}
			eps, warnings := EndpointsForPort(p, tc.slices, "n1")
			var got []string
			for _, e := range eps {
				r, l := "unready", "remote"
				if e.Ready {
					r = "ready"
				}
				if e.NodeName == "n1" {
					l = "local"
				}
				got = append(got, e.Addr.String()+" "+r+" "+l)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("endpoints = %q, want %q", got, tc.want)
			}
			if len(warnings) != tc.warnings {
				t.Errorf("warnings = %q, want %d", warnings, tc.warnings)
			}
		})
	}
}

func TestEndpointHintsAndConditions(t *testing.T) {
	tcp := v1.ProtocolTCP
	s := slice("s", discovery.AddressTypeIPv4, []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: &tcp}},
		discovery.Endpoint{Addresses: []string{"10.0.0.1"}, Zone: ptr.To("zone-a"), NodeName: ptr.To("n1"),
			Conditions: discovery.EndpointConditions{Ready: ptr.To(false), Serving: ptr.To(true), Terminating: ptr.To(true)},
			Hints:      &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: "zone-a"}, {Name: "zone-b"}}, ForNodes: []discovery.ForNode{{Name: "n1"}}}},
		discovery.Endpoint{Addresses: []string{"10.0.0.2"}, Hints: &discovery.EndpointHints{}},
	)
	eps, _ := EndpointsForPort(ServicePort{Family: v1.IPv4Protocol, Name: "http", Protocol: v1.ProtocolTCP}, []*discovery.EndpointSlice{s}, "n1")
	if len(eps) != 2 {
		t.Fatalf("got %d endpoints", len(eps))
	}
	e := eps[0]
	if e.Ready || !e.Serving || !e.Terminating || e.Zone != "zone-a" || e.NodeName != "n1" {
		t.Errorf("conditions/zone/node wrong: %+v", e)
	}
	if !slices.Equal(e.ZoneHints, []string{"zone-a", "zone-b"}) || !slices.Equal(e.NodeHints, []string{"n1"}) {
		t.Errorf("hints wrong: %+v", e)
	}
	if eps[1].ZoneHints != nil || eps[1].NodeHints != nil {
		t.Errorf("empty hints must be nil: %+v", eps[1])
	}
}

// TestSkipReason: the reason names kube-proxy's first filter that skips the
// Service, in kube-proxy's order (label selector, field selector,
// ShouldSkipService).
func TestSkipReason(t *testing.T) {
	cases := []struct {
		name string
		svc  *v1.Service
		// want is a prefix of the reason; "" means proxied.
		want string
	}{
		{name: "proxied", svc: svc(nil), want: ""},
		{name: "label before headless", svc: svc(func(s *v1.Service) {
			s.Labels = map[string]string{LabelServiceProxyName: "cilium"}
			s.Spec.ClusterIP = v1.ClusterIPNone
		}), want: `labelled service.kubernetes.io/service-proxy-name="cilium"`},
		{name: "headless", svc: svc(func(s *v1.Service) { s.Spec.ClusterIP = v1.ClusterIPNone }), want: "headless"},
		{name: "no cluster IP before ExternalName", svc: svc(func(s *v1.Service) {
			s.Spec.ClusterIP, s.Spec.Type = "", v1.ServiceTypeExternalName
		}), want: "no cluster IP"},
		{name: "ExternalName with a stale cluster IP", svc: svc(func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeExternalName }), want: "type ExternalName"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := SkipReason(tc.svc)
			if tc.want == "" && got != "" || !strings.HasPrefix(got, tc.want) {
				t.Errorf("SkipReason = %q, want %q...", got, tc.want)
			}
		})
	}
}

// TestNodeLeaving: a node is leaving when kube-proxy's NodeEligible says it
// is not eligible: being deleted, or tainted by the cluster autoscaler
// (any value, any effect).
func TestNodeLeaving(t *testing.T) {
	now := metav1.Now()
	cases := []struct {
		name string
		node v1.Node
		want string
	}{
		{"plain", v1.Node{}, ""},
		{"other taints", v1.Node{Spec: v1.NodeSpec{Taints: []v1.Taint{{Key: "node.kubernetes.io/unschedulable", Effect: v1.TaintEffectNoSchedule}}}}, ""},
		{"autoscaler taint", v1.Node{Spec: v1.NodeSpec{Taints: []v1.Taint{{Key: ToBeDeletedTaint, Value: "1700000000", Effect: v1.TaintEffectNoSchedule}}}}, "tainted " + ToBeDeletedTaint},
		{"autoscaler taint, PreferNoSchedule", v1.Node{Spec: v1.NodeSpec{Taints: []v1.Taint{{Key: ToBeDeletedTaint, Effect: v1.TaintEffectPreferNoSchedule}}}}, "tainted " + ToBeDeletedTaint},
		{"being deleted", v1.Node{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}}, "being deleted"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.node.Name = "n1"
			if got := NodeFromObject(&tc.node, nil).Leaving; got != tc.want {
				t.Errorf("Leaving = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestLoadBalancerSourceRanges: the ranges as kube-proxy's IPv4 proxier
// takes them.
func TestLoadBalancerSourceRanges(t *testing.T) {
	cases := []struct {
		name   string
		ranges []string
		// want are the prefixes; nil: every source.
		want     []string
		warnings int
	}{
		{"none", nil, nil, 0},
		{"trimmed and masked", []string{" 10.0.0.0/8 ", "192.0.2.7/24"}, []string{"10.0.0.0/8", "192.0.2.0/24"}, 0},
		{"IPv6 ranges are the IPv6 proxier's", []string{"2001:db8::/32", "203.0.113.0/24"}, []string{"203.0.113.0/24"}, 0},
		{"only IPv6: no IPv4 restriction", []string{"2001:db8::/32"}, nil, 0},
		{"a /0 allows everything", []string{"203.0.113.0/24", "0.0.0.0/0"}, nil, 0},
		{"duplicates once", []string{"203.0.113.0/24", "203.0.113.9/24"}, []string{"203.0.113.0/24"}, 0},
		{"not a prefix: warned and left out", []string{"203.0.113.1", "198.51.100.0/24"}, []string{"198.51.100.0/24"}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ports, warnings, err := ServicePorts(svc(func(s *v1.Service) { s.Spec.LoadBalancerSourceRanges = tc.ranges }))
			if err != nil || len(ports) != 1 {
				t.Fatalf("ServicePorts: %v, %d ports", err, len(ports))
			}
			var got []string
			for _, p := range ports[0].LoadBalancerSourceRanges {
				got = append(got, p.String())
			}
			if !slices.Equal(got, tc.want) || len(warnings) != tc.warnings {
				t.Errorf("ranges %v, warnings %q; want %v and %d warnings", got, warnings, tc.want, tc.warnings)
			}
		})
	}
}
