package topology

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func TestAddrProblem(t *testing.T) {
	for _, tc := range []struct {
		addr, want string
	}{
		{"10.0.0.1", ""},
		{"192.0.2.1", ""},
		{"100.64.0.1", ""},
		{"0.0.0.0", "unspecified"},
		{"0.1.2.3", "in 0.0.0.0/8 (this network)"},
		{"127.0.0.1", "loopback"},
		{"127.255.0.9", "loopback"},
		{"255.255.255.255", "the broadcast address"},
		{"240.0.0.1", "in the reserved 240.0.0.0/4"},
		{"224.0.0.1", "multicast"},
		{"239.255.255.250", "multicast"},
		{"169.254.169.254", "link-local"},
	} {
		if got := AddrProblem(netip.MustParseAddr(tc.addr)); got != tc.want {
			t.Errorf("AddrProblem(%s) = %q, want %q", tc.addr, got, tc.want)
		}
	}
}

func TestServicePortsValidation(t *testing.T) {
	cases := []struct {
		name string
		svc  *v1.Service
		err  error
		// warnings are substrings, one per warning, in order.
		warnings []string
		// ports are "name port/proto"; externalIPs and lbIPs the kept
		// frontend addresses of every port.
		ports              []string
		externalIPs, lbIPs []string
	}{
		{name: "special cluster IP: not proxied",
			svc: svc(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "127.0.0.1", []string{"127.0.0.1"} }),
			err: ErrUnusableAddress},
		{name: "externalIPs: invalid and special ones warned, IPv6 silent, IPv4-mapped kept",
			svc: svc(func(s *v1.Service) {
				s.Spec.ExternalIPs = []string{"192.0.2.1", "not-an-ip", "0.0.0.0", "255.255.255.255", "224.0.0.5", "2001:db8::1", "::ffff:192.0.2.7"}
			}),
			warnings:    []string{`externalIP "not-an-ip" is not an IP address: ignored`, "externalIP 0.0.0.0 is unspecified: ignored", "externalIP 255.255.255.255 is the broadcast address", "externalIP 224.0.0.5 is multicast"},
			ports:       []string{"http 80/TCP"},
			externalIPs: []string{"192.0.2.1", "192.0.2.7"}},
		{name: "load-balancer IPs: special warned, hostname-only silent",
			svc: svc(func(s *v1.Service) {
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "127.0.0.1"}, {IP: "192.0.2.9"}, {Hostname: "lb.example"}, {IP: "x"}}
			}),
			warnings: []string{"load-balancer ingress IP 127.0.0.1 is loopback: ignored", `load-balancer ingress IP "x" is not an IP address`},
			ports:    []string{"http 80/TCP"}, lbIPs: []string{"192.0.2.9"}},
		{name: "two ports on one port/protocol: the first is served",
			svc: svc(func(s *v1.Service) {
				s.Spec.Ports = []v1.ServicePort{{Name: "a", Port: 80, Protocol: v1.ProtocolTCP}, {Name: "b", Port: 80, Protocol: v1.ProtocolTCP}, {Name: "c", Port: 80, Protocol: v1.ProtocolUDP}}
			}),
			warnings: []string{`port "b" (80/TCP) repeats the number or name of port "a" (80/TCP): ignored, the first one is served`},
			ports:    []string{"a 80/TCP", "c 80/UDP"}},
		{name: "two ports with one name and protocol: the first is served",
			svc: svc(func(s *v1.Service) {
				s.Spec.Ports = []v1.ServicePort{{Name: "a", Port: 80}, {Name: "a", Port: 81}}
			}),
			warnings: []string{`port "a" (81/TCP) repeats the number or name of port "a" (80/TCP)`},
			ports:    []string{"a 80/TCP"}},
		{name: "an invalid first port does not shadow a valid second",
			svc: svc(func(s *v1.Service) {
				s.Spec.Ports = []v1.ServicePort{{Name: "a", Port: 0}, {Name: "a", Port: 81}}
			}),
			warnings: []string{`port "a": number 0 out of range`},
			ports:    []string{"a 81/TCP"}},
		{name: "control characters in a port name are escaped in the warning",
			svc: svc(func(s *v1.Service) {
				s.Spec.Ports = []v1.ServicePort{{Name: "x\x1b[31m", Port: 0}}
			}),
			warnings: []string{`port "x\x1b[31m": number 0 out of range`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ports, warnings, err := ServicePorts(tc.svc)
			if (err == nil) != (tc.err == nil) || tc.err != nil && !errors.Is(err, tc.err) {
				t.Fatalf("error = %v, want %v", err, tc.err)
			}
			checkWarnings(t, warnings, tc.warnings)
			var got []string
			for _, p := range ports {
				got = append(got, p.Name+" "+string(rune('0'+p.Port/10))+string(rune('0'+p.Port%10))+"/"+string(p.Protocol))
				if s := addrStrings(p.ExternalIPs); !slices.Equal(s, tc.externalIPs) {
					t.Errorf("externalIPs %v, want %v", s, tc.externalIPs)
				}
				if s := addrStrings(p.LoadBalancerIPs); !slices.Equal(s, tc.lbIPs) {
					t.Errorf("LB IPs %v, want %v", s, tc.lbIPs)
				}
			}
			if !slices.Equal(got, tc.ports) {
				t.Errorf("ports = %q, want %q", got, tc.ports)
			}
		})
	}
}

func addrStrings(as []netip.Addr) []string {
	var out []string
	for _, a := range as {
		out = append(out, a.String())
	}
	return out
}

func TestEndpointsForPortRefusesSpecialAddresses(t *testing.T) {
	tcp := v1.ProtocolTCP
	s := slice("s", discovery.AddressTypeIPv4, []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: &tcp}},
		discovery.Endpoint{Addresses: []string{"10.0.0.1"}},
		discovery.Endpoint{Addresses: []string{"127.0.0.1"}},
		discovery.Endpoint{Addresses: []string{"0.0.0.0"}},
		discovery.Endpoint{Addresses: []string{"169.254.1.1"}},
		discovery.Endpoint{Addresses: []string{"255.255.255.255"}},
	)
	eps, warnings := EndpointsForPort(ServicePort{Family: v1.IPv4Protocol, Name: "http", Protocol: v1.ProtocolTCP}, []*discovery.EndpointSlice{s}, "n1")
	if len(eps) != 1 || eps[0].Addr.String() != "10.0.0.1:8080" {
		t.Errorf("endpoints = %v, want only 10.0.0.1:8080", eps)
	}
	checkWarnings(t, warnings, []string{"127.0.0.1 is loopback: skipped", "0.0.0.0 is unspecified", "169.254.1.1 is link-local", "255.255.255.255 is the broadcast address"})
}

func TestNodeAddressesThatCannotServeNodePorts(t *testing.T) {
	n := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}, Status: v1.NodeStatus{Addresses: []v1.NodeAddress{
		{Type: v1.NodeInternalIP, Address: "127.0.0.1"},
		{Type: v1.NodeInternalIP, Address: "192.168.0.1"},
		{Type: v1.NodeExternalIP, Address: "169.254.0.9"},
		{Type: v1.NodeHostName, Address: "n1"},
		{Type: v1.NodeInternalIP, Address: "fd00::1"},
	}}}
	st := NewState([]*v1.Node{n}, nil, nil, nil)
	node, warnings := st.Node("n1")
	if got := addrStrings(NodePortAddresses(node, v1.IPv4Protocol, DefaultOptions())); !slices.Equal(got, []string{"192.168.0.1"}) {
		t.Errorf("NodePort addresses = %v, want [192.168.0.1]", got)
	}
	if got := addrStrings(NodePortAddresses(node, v1.IPv4Protocol, Options{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}})); !slices.Equal(got, []string{"192.168.0.1"}) {
		t.Errorf("NodePort addresses in 0.0.0.0/0 = %v, want [192.168.0.1]", got)
	}
	want := []string{"node n1: InternalIP 127.0.0.1 is loopback: no NodePorts on it", "node n1: ExternalIP 169.254.0.9 is link-local: no NodePorts on it"}
	if !slices.Equal(warnings, want) {
		t.Errorf("warnings = %q, want %q", warnings, want)
	}
}

func TestTopologyKeysMustBeLabelKeys(t *testing.T) {
	for _, tc := range []struct {
		in      string
		wantErr string
	}{
		{in: "kubernetes.io/hostname,example.com/rack-1,zone,*"},
		{in: "kubernetes.io/ hostname", wantErr: `key "kubernetes.io/ hostname" is not a label key`},
		{in: "kubernetes.io/hostname,-rack", wantErr: `key "-rack" is not a label key`},
		{in: "a/b/c", wantErr: "is not a label key"},
		{in: strings.Repeat("k", 64), wantErr: "is not a label key"},
		{in: "bad_prefix!/x", wantErr: "is not a label key"},
	} {
		_, err := ParseTopologyKeys(tc.in)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("ParseTopologyKeys(%q): %v", tc.in, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("ParseTopologyKeys(%q) = %v, want an error containing %q", tc.in, err, tc.wantErr)
		}
	}
	// The annotation is then ignored, with the reason, and Hints applies:
	// no traffic is dropped for a typo.
	d := Decide(Input{Node: testNodes["c1"], Nodes: testNodes, Port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/ hostname"}),
		Endpoints: []Endpoint{ep(1, "a1", "zone-a")}}, DefaultOptions())
	if d.Policy != PolicyHints || len(d.Backends) != 1 || !strings.Contains(d.Reason, "is not a label key") {
		t.Errorf("policy %s, backends %v, reason %q: want Hints, the endpoint, and the reason", d.Policy, octets(d.Backends), d.Reason)
	}
}

func TestReasonsAreBounded(t *testing.T) {
	huge := strings.Repeat("k,", 8) + strings.Repeat("x", 100_000)
	ann := map[string]string{AnnotationTopologyKeys: huge, AnnotationZoneThreshold: huge, AnnotationTopologyAware: huge, AnnotationZoneWeighted: "\x00" + huge}
	// A node without a zone: its (huge) name is in the reason.
	node := Node{Name: strings.Repeat("é", 50_000)}
	d := Decide(Input{Node: node, Nodes: testNodes, Port: clusterPort(ann), Endpoints: []Endpoint{ep(1, node.Name, "zone-a", zones("zone-a"))}}, DefaultOptions())
	if len(d.Reason) > MaxReason {
		t.Errorf("reason is %d bytes, more than %d", len(d.Reason), MaxReason)
	}
	if !utf8.ValidString(d.Reason) || !strings.HasSuffix(d.Reason, "...") {
		t.Errorf("reason is not valid UTF-8 cut with ...: %q", d.Reason[len(d.Reason)-20:])
	}
	if !strings.Contains(d.Reason, `topolb.io/topology-aware "k,k,`) || strings.Contains(d.Reason, strings.Repeat("x", 65)) {
		t.Errorf("annotation values are not quoted within 64 characters: %q", d.Reason[:200])
	}
	if got := quoteBounded("a\x00\x1b[31m"); got != `"a\x00\x1b[31m"` {
		t.Errorf("quoteBounded escapes control characters: got %s", got)
	}
	if got := quoteBounded(strings.Repeat("é", 70)); got != `"`+strings.Repeat("é", 64)+`"...` {
		t.Errorf("quoteBounded cuts on characters: got %s", got)
	}
	short := "ok"
	if boundReason(short) != short {
		t.Errorf("boundReason changed a short reason")
	}
}

// checkWarnings checks that there are as many warnings as wanted and each
// contains its wanted substring, in order.
func checkWarnings(t *testing.T, got, want []string) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("warnings = %q, want %d", got, len(want))
	}
	for i, w := range want {
		if !strings.Contains(got[i], w) {
			t.Errorf("warning %q does not contain %q", got[i], w)
		}
	}
}
