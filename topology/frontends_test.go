package topology

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/internal/portrange"
)

// addrNode is node a1 with an InternalIP, an ExternalIP and an address of
// another type.
var addrNode = Node{Name: "a1", Labels: testNodes["a1"].Labels, Addresses: []NodeAddress{
	{Type: v1.NodeInternalIP, Addr: netip.MustParseAddr("192.168.0.1")},
	{Type: v1.NodeExternalIP, Addr: netip.MustParseAddr("203.0.113.1")},
	{Type: "Other", Addr: netip.MustParseAddr("172.16.0.1")},
}}

func ips(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

func fa(kind FrontendKind, addr string) string { return string(kind) + " " + addr }

func TestExternalFrontends(t *testing.T) {
	cases := []struct {
		name string
		port ServicePort
		opts Options
		// want are "Kind ip:port" in order; warnings are substrings, one
		// per warning.
		want     []string
		warnings []string
	}{
		{name: "ClusterIP only: none", port: clusterPort(nil), opts: DefaultOptions()},
		{name: "externalIPs, LB IPs, then NodePorts on InternalIP and ExternalIP",
			port: func() ServicePort {
				p := clusterPort(nil)
				p.ExternalIPs, p.LoadBalancerIPs, p.NodePort = ips("198.51.100.1"), ips("198.51.100.2"), 30080
				return p
			}(),
			opts: DefaultOptions(),
			want: []string{fa(KindExternalIP, "198.51.100.1:80"), fa(KindLoadBalancerIP, "198.51.100.2:80"), fa(KindNodePort, "192.168.0.1:30080"), fa(KindNodePort, "203.0.113.1:30080")}},
		{name: "--nodeport-addresses selects by prefix, any address type",
			port: func() ServicePort { p := clusterPort(nil); p.NodePort = 30080; return p }(),
			opts: Options{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("172.16.0.0/12"), netip.MustParsePrefix("203.0.113.0/24")}},
			want: []string{fa(KindNodePort, "203.0.113.1:30080"), fa(KindNodePort, "172.16.0.1:30080")}},
		{name: "--nodeport-addresses holding 127.0.0.1: NodePorts on loopback too",
			port: func() ServicePort { p := clusterPort(nil); p.NodePort = 30080; return p }(),
			opts: Options{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("192.168.0.0/16"), netip.MustParsePrefix("127.0.0.0/8")}},
			want: []string{fa(KindNodePort, "192.168.0.1:30080"), fa(KindNodePort, "127.0.0.1:30080")}},
		{name: "--nodeport-addresses 0.0.0.0/0 (kube-proxy's all): every address and loopback",
			port: func() ServicePort { p := clusterPort(nil); p.NodePort = 30080; return p }(),
			opts: Options{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}},
			want: []string{fa(KindNodePort, "192.168.0.1:30080"), fa(KindNodePort, "203.0.113.1:30080"), fa(KindNodePort, "172.16.0.1:30080"), fa(KindNodePort, "127.0.0.1:30080")}},
		{name: "127.0.0.2/32 does not hold 127.0.0.1: no loopback NodePort",
			port: func() ServicePort { p := clusterPort(nil); p.NodePort = 30080; return p }(),
			opts: Options{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")}}},
		{name: "nodePort outside the range: no NodePort, a warning",
			port:     func() ServicePort { p := clusterPort(nil); p.NodePort = 8080; return p }(),
			opts:     DefaultOptions(),
			warnings: []string{"ns/svc: port 80/TCP: nodePort 8080 is outside the node port range 30000-32767: not served"}},
		{name: "zero Options use the default range",
			port:     func() ServicePort { p := clusterPort(nil); p.NodePort = 32768; return p }(),
			warnings: []string{"outside the node port range 30000-32767"}},
		{name: "a custom range admits it",
			port: func() ServicePort { p := clusterPort(nil); p.NodePort = 8080; return p }(),
			opts: Options{NodePortRange: portrange.Range{Min: 8000, Max: 9000}},
			want: []string{fa(KindNodePort, "192.168.0.1:8080"), fa(KindNodePort, "203.0.113.1:8080")}},
		{name: "externalIP and LB IP that are node addresses: left out with warnings",
			port: func() ServicePort {
				p := clusterPort(nil)
				p.ExternalIPs, p.LoadBalancerIPs = ips("192.168.0.1", "198.51.100.1"), ips("172.16.0.1")
				return p
			}(),
			opts: DefaultOptions(),
			want: []string{fa(KindExternalIP, "198.51.100.1:80")},
			warnings: []string{"externalIP 192.168.0.1 is an address of node a1: not served on it",
				"load-balancer IP 172.16.0.1 is an address of node a1"}},
		{name: "the same address as externalIP and LB IP: once, as externalIP",
			port: func() ServicePort {
				p := clusterPort(nil)
				p.ExternalIPs, p.LoadBalancerIPs = ips("198.51.100.1"), ips("198.51.100.1")
				return p
			}(),
			opts: DefaultOptions(),
			want: []string{fa(KindExternalIP, "198.51.100.1:80")}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, warnings := tc.port.ExternalFrontends(addrNode, tc.opts)
			var gs []string
			for _, f := range got {
				gs = append(gs, fa(f.Kind, f.Addr.String()))
			}
			if !slices.Equal(gs, tc.want) {
				t.Errorf("frontends = %q, want %q", gs, tc.want)
			}
			checkWarnings(t, warnings, tc.warnings)
		})
	}
}

// TestSetFor pins which backend set each kind of frontend uses for each
// traffic origin, on a port where the three sets differ: iTP Local, eTP
// Local, zone hints, node a1 (zone-a).
func TestSetFor(t *testing.T) {
	port := clusterPort(nil)
	port.InternalPolicyLocal, port.ExternallyAccessible, port.ExternalPolicyLocal, port.NodePort = true, true, true, 30080
	eps := []Endpoint{
		ep(1, "a1", "zone-a", zones("zone-b")), // local, hinted away
		ep(2, "a2", "zone-a", zones("zone-a")),
		ep(3, "b1", "zone-b", zones("zone-b")),
		ep(4, "a1", "zone-a", terminating(true), zones("zone-a")), // local, serving-terminating
	}
	d := Decide(Input{Node: testNodes["a1"], Nodes: testNodes, Port: port, Endpoints: eps}, DefaultOptions())
	cases := []struct {
		kind  FrontendKind
		scope Scope
		// backends are the last octets; nil means not served.
		backends []int
	}{
		{KindClusterIP, ScopeInternal, []int{1}},      // internal set: local (iTP Local)
		{KindClusterIP, ScopeExternal, nil},           // a cluster IP is not served from outside
		{KindNodePort, ScopeInternal, []int{2}},       // cluster set: zone-a hints
		{KindExternalIP, ScopeInternal, []int{2}},     // cluster set
		{KindLoadBalancerIP, ScopeInternal, []int{2}}, // cluster set
		{KindNodePort, ScopeExternal, []int{1}},       // external set: local (eTP Local)
		{KindExternalIP, ScopeExternal, []int{1}},
		{KindLoadBalancerIP, ScopeExternal, []int{1}},
	}
	for _, tc := range cases {
		set, ok := d.SetFor(tc.kind, tc.scope)
		if ok != (tc.backends != nil) {
			t.Errorf("%s from %s: served %v, want %v", tc.kind, tc.scope, ok, tc.backends != nil)
			continue
		}
		if ok && !slices.Equal(octets(set.Backends), tc.backends) {
			t.Errorf("%s from %s: backends %v, want %v", tc.kind, tc.scope, octets(set.Backends), tc.backends)
		}
		if ok && (len(set.Weights) != len(set.Backends) || set.Draining == nil) {
			t.Errorf("%s from %s: weights %v, draining %v", tc.kind, tc.scope, set.Weights, set.Draining)
		}
	}
	// A port that is not externally accessible serves no external kind.
	plain := Decide(Input{Node: testNodes["a1"], Nodes: testNodes, Port: clusterPort(nil), Endpoints: eps}, DefaultOptions())
	for _, scope := range []Scope{ScopeInternal, ScopeExternal} {
		if _, ok := plain.SetFor(KindExternalIP, scope); ok {
			t.Errorf("not externally accessible: ExternalIP served from %s", scope)
		}
	}
}

// svcPort builds a port of Service ns/name created at the given day of
// 2024 (0: no timestamp).
func svcPort(name string, day int, mut func(*ServicePort)) ServicePort {
	p := clusterPort(nil)
	p.Service = types.NamespacedName{Namespace: "ns", Name: name}
	if day > 0 {
		p.Created = time.Date(2024, 1, day, 0, 0, 0, 0, time.UTC)
	}
	if mut != nil {
		mut(&p)
	}
	return p
}

func TestNodeFrontends(t *testing.T) {
	decided := func(ports ...ServicePort) []PortDecision {
		var ds []PortDecision
		for _, p := range ports {
			eps := []Endpoint{ep(int(p.ClusterIP.As4()[3]), "a1", "zone-a")}
			ds = append(ds, PortDecision{Port: p, Endpoints: eps, Decision: Decide(Input{Node: addrNode, Nodes: testNodes, Port: p, Endpoints: eps}, DefaultOptions())})
		}
		return ds
	}
	cip := func(ip string) func(*ServicePort) {
		return func(p *ServicePort) { p.ClusterIP = netip.MustParseAddr(ip) }
	}
	ext := func(ip ...string) func(*ServicePort) {
		return func(p *ServicePort) { p.ExternalIPs, p.ExternallyAccessible = ips(ip...), true }
	}
	both := func(fs ...func(*ServicePort)) func(*ServicePort) {
		return func(p *ServicePort) {
			for _, f := range fs {
				f(p)
			}
		}
	}
	cases := []struct {
		name  string
		ports []ServicePort
		// want are "addr/proto scope kind owner backend-octet" rows in
		// output order.
		want     []string
		warnings []string
	}{
		{name: "cluster IP internal only; external kinds in both scopes",
			ports: []ServicePort{svcPort("a", 1, both(cip("10.96.0.1"), ext("198.51.100.1")))},
			want: []string{"10.96.0.1:80/TCP internal ClusterIP ns/a [1]",
				"198.51.100.1:80/TCP external ExternalIP ns/a [1]", "198.51.100.1:80/TCP internal ExternalIP ns/a [1]"}},
		{name: "two Services on one externalIP: the older keeps it, whatever the input order",
			ports: []ServicePort{svcPort("young", 5, both(cip("10.96.0.2"), ext("198.51.100.1"))), svcPort("old", 1, both(cip("10.96.0.1"), ext("198.51.100.1")))},
			want: []string{"10.96.0.1:80/TCP internal ClusterIP ns/old [1]", "10.96.0.2:80/TCP internal ClusterIP ns/young [2]",
				"198.51.100.1:80/TCP external ExternalIP ns/old [1]", "198.51.100.1:80/TCP internal ExternalIP ns/old [1]"},
			warnings: []string{"ns/young: port 80/TCP: ExternalIP 198.51.100.1:80/TCP is already the ExternalIP of ns/old port 80/TCP: not served for this port"}},
		{name: "same age: namespace/name decides",
			ports: []ServicePort{svcPort("b", 0, both(cip("10.96.0.2"), ext("198.51.100.1"))), svcPort("a", 0, both(cip("10.96.0.1"), ext("198.51.100.1")))},
			want: []string{"10.96.0.1:80/TCP internal ClusterIP ns/a [1]", "10.96.0.2:80/TCP internal ClusterIP ns/b [2]",
				"198.51.100.1:80/TCP external ExternalIP ns/a [1]", "198.51.100.1:80/TCP internal ExternalIP ns/a [1]"},
			warnings: []string{"ns/b: port 80/TCP: ExternalIP 198.51.100.1:80/TCP is already the ExternalIP of ns/a"}},
		{name: "an older Service's externalIP never takes a cluster IP from inside; outside it is the only claim",
			ports: []ServicePort{svcPort("web", 9, cip("10.96.0.1")), svcPort("thief", 1, both(cip("10.96.0.2"), ext("10.96.0.1")))},
			want: []string{"10.96.0.1:80/TCP external ExternalIP ns/thief [2]", "10.96.0.1:80/TCP internal ClusterIP ns/web [1]",
				"10.96.0.2:80/TCP internal ClusterIP ns/thief [2]"},
			warnings: []string{"ns/thief: port 80/TCP: ExternalIP 10.96.0.1:80/TCP is already the ClusterIP of ns/web port 80/TCP: not served for this port from inside the node"}},
		{name: "two ports of one Service on one nodePort: the first port keeps it",
			ports: []ServicePort{
				svcPort("np", 1, func(p *ServicePort) {
					p.ClusterIP, p.Port, p.Index, p.NodePort, p.ExternallyAccessible = netip.MustParseAddr("10.96.0.1"), 81, 1, 30080, true
				}),
				svcPort("np", 1, func(p *ServicePort) {
					p.ClusterIP, p.Index, p.NodePort, p.ExternallyAccessible = netip.MustParseAddr("10.96.0.1"), 0, 30080, true
				}),
			},
			want: []string{"10.96.0.1:80/TCP internal ClusterIP ns/np [1]", "10.96.0.1:81/TCP internal ClusterIP ns/np [1]",
				"192.168.0.1:30080/TCP external NodePort ns/np [1]", "192.168.0.1:30080/TCP internal NodePort ns/np [1]",
				"203.0.113.1:30080/TCP external NodePort ns/np [1]", "203.0.113.1:30080/TCP internal NodePort ns/np [1]"},
			warnings: []string{"ns/np: port 81/TCP: NodePort 192.168.0.1:30080/TCP is already the NodePort of ns/np port 80/TCP",
				"ns/np: port 81/TCP: NodePort 203.0.113.1:30080/TCP is already the NodePort of ns/np port 80/TCP"}},
		{name: "same address, different protocols: no conflict",
			ports: []ServicePort{svcPort("tcp", 1, cip("10.96.0.1")), svcPort("udp", 2, func(p *ServicePort) { p.ClusterIP, p.Protocol = netip.MustParseAddr("10.96.0.1"), v1.ProtocolUDP })},
			want:  []string{"10.96.0.1:80/TCP internal ClusterIP ns/tcp [1]", "10.96.0.1:80/UDP internal ClusterIP ns/udp [1]"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fes, warnings := NodeFrontends(addrNode, decided(tc.ports...), DefaultOptions())
			var got []string
			for _, f := range fes {
				got = append(got, fmt.Sprintf("%s/%s %s %s %s %v", f.Addr, f.Protocol, f.Scope, f.Kind, f.Port.Service, octets(f.Backends)))
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("frontends:\n  got  %q\n  want %q", got, tc.want)
			}
			checkWarnings(t, warnings, tc.warnings)
		})
	}
}

// TestCompareClaimsIsATotalOrder checks that the order does not depend on
// the order claims arrive in, which is what lets an agent that learns them
// one by one agree with explain.
func TestCompareClaimsIsATotalOrder(t *testing.T) {
	claims := []Frontend{
		{Kind: KindExternalIP, Port: svcPort("a", 1, nil)},
		{Kind: KindExternalIP, Port: svcPort("b", 1, nil)},
		{Kind: KindExternalIP, Port: svcPort("a", 0, nil)},
		{Kind: KindLoadBalancerIP, Port: svcPort("z", 9, nil)},
		{Kind: KindNodePort, Port: svcPort("z", 9, nil)},
		{Kind: KindClusterIP, Port: svcPort("z", 9, nil)},
		{Kind: KindExternalIP, Port: svcPort("a", 1, func(p *ServicePort) { p.Index = 1 })},
		{Kind: KindExternalIP, Port: svcPort("a", 1, func(p *ServicePort) { p.Service.Namespace = "aa" })},
	}
	want := []string{"ClusterIP ns/z", "NodePort ns/z", "LoadBalancerIP ns/z", "ExternalIP ns/a", "ExternalIP aa/a", "ExternalIP ns/a", "ExternalIP ns/a#1", "ExternalIP ns/b"}
	render := func(fs []Frontend) []string {
		var out []string
		for _, f := range fs {
			s := fmt.Sprintf("%s %s", f.Kind, f.Port.Service)
			if f.Port.Index > 0 {
				s += fmt.Sprintf("#%d", f.Port.Index)
			}
			out = append(out, s)
		}
		return out
	}
	for i := range claims {
		// Rotate the input; the sorted order must not change.
		in := append(slices.Clone(claims[i:]), claims[:i]...)
		slices.Reverse(in[1:])
		slices.SortStableFunc(in, compareFrontends)
		if got := render(in); !slices.Equal(got, want) {
			t.Fatalf("rotation %d: order %q, want %q", i, got, want)
		}
	}
}

func TestReads(t *testing.T) {
	cases := []struct {
		name string
		port ServicePort
		want NodeReads
	}{
		{name: "Hints: this node's zone", port: clusterPort(nil), want: NodeReads{SelfLabels: []string{LabelZone}}},
		{name: "Disabled: nothing", port: clusterPort(map[string]string{AnnotationTopologyAware: "false"}), want: NodeReads{}},
		{name: "TopologyKeys: its keys on both sides, not *", port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname,topology.kubernetes.io/region,*"}),
			want: NodeReads{SelfLabels: []string{LabelHostname, LabelRegion}, OtherLabels: []string{LabelHostname, LabelRegion}}},
		{name: "invalid TopologyKeys falls to the next policy", port: clusterPort(map[string]string{AnnotationTopologyKeys: "*,a", AnnotationZoneWeighted: "true"}),
			want: NodeReads{SelfLabels: []string{LabelZone}, Capacity: true}},
		{name: "ZoneThreshold: zone", port: clusterPort(map[string]string{AnnotationZoneThreshold: "2"}), want: NodeReads{SelfLabels: []string{LabelZone}}},
		{name: "ZoneWeighted: zone and every node's capacity", port: zoneWeightedPort(), want: NodeReads{SelfLabels: []string{LabelZone}, Capacity: true}},
		{name: "NodePort: this node's addresses", port: withNodePort(clusterPort(nil), false), want: NodeReads{SelfLabels: []string{LabelZone}, SelfAddresses: true}},
		{name: "iTP Local, not external: no policy reads", port: withITPLocal(zoneWeightedPort()), want: NodeReads{}},
		{name: "iTP Local with a nodePort: the policy applies to external frontends", port: withNodePort(withITPLocal(zoneWeightedPort()), false),
			want: NodeReads{SelfLabels: []string{LabelZone}, SelfAddresses: true, Capacity: true}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.port.Reads()
			if !slices.Equal(got.SelfLabels, tc.want.SelfLabels) || !slices.Equal(got.OtherLabels, tc.want.OtherLabels) ||
				got.SelfAddresses != tc.want.SelfAddresses || got.Capacity != tc.want.Capacity {
				t.Errorf("Reads = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestReadsAffected(t *testing.T) {
	base := Node{Name: "b1", Labels: map[string]string{LabelZone: "zone-b", LabelHostname: "b1", "other": "x"}, AllocatableMilliCPU: 4000, Ready: v1.ConditionTrue,
		Addresses: []NodeAddress{{Type: v1.NodeInternalIP, Addr: netip.MustParseAddr("192.168.0.2")}}}
	change := func(f func(*Node)) *Node {
		n := base
		n.Labels = map[string]string{}
		for k, v := range base.Labels {
			n.Labels[k] = v
		}
		n.Addresses = slices.Clone(base.Addresses)
		f(&n)
		return &n
	}
	hints := clusterPort(nil).Reads()
	keys := clusterPort(map[string]string{AnnotationTopologyKeys: LabelHostname}).Reads()
	weighted := zoneWeightedPort().Reads()
	nodePort := func() NodeReads {
		p := clusterPort(nil)
		p.NodePort, p.ExternallyAccessible = 30080, true
		return p.Reads()
	}()
	cases := []struct {
		name     string
		reads    NodeReads
		self     bool
		old, new *Node
		want     bool
	}{
		{name: "hints: this node's zone changes", reads: hints, self: true, old: &base, new: change(func(n *Node) { n.Labels[LabelZone] = "zone-c" }), want: true},
		{name: "hints: this node's other label changes", reads: hints, self: true, old: &base, new: change(func(n *Node) { n.Labels["other"] = "y" })},
		{name: "hints: another node's zone changes", reads: hints, old: &base, new: change(func(n *Node) { n.Labels[LabelZone] = "zone-c" })},
		{name: "hints: another node's CPU changes", reads: hints, old: &base, new: change(func(n *Node) { n.AllocatableMilliCPU = 8000 })},
		{name: "keys: another node's key label changes", reads: keys, old: &base, new: change(func(n *Node) { n.Labels[LabelHostname] = "b2" }), want: true},
		{name: "keys: another node appears", reads: keys, old: nil, new: &base, want: true},
		{name: "keys: another node without the key appears", reads: keys, old: nil, new: change(func(n *Node) { delete(n.Labels, LabelHostname) })},
		{name: "keys: another node's zone changes", reads: keys, old: &base, new: change(func(n *Node) { n.Labels[LabelZone] = "zone-c" })},
		{name: "weighted: another node's CPU changes", reads: weighted, old: &base, new: change(func(n *Node) { n.AllocatableMilliCPU = 8000 }), want: true},
		{name: "weighted: another node turns Ready=False", reads: weighted, old: &base, new: change(func(n *Node) { n.Ready = v1.ConditionFalse }), want: true},
		{name: "weighted: True to Unknown changes nothing", reads: weighted, old: &base, new: change(func(n *Node) { n.Ready = v1.ConditionUnknown })},
		{name: "weighted: another node's zone changes", reads: weighted, old: &base, new: change(func(n *Node) { n.Labels[LabelZone] = "zone-c" }), want: true},
		{name: "weighted: a node is deleted", reads: weighted, old: &base, new: nil, want: true},
		{name: "weighted: a zone-less node comes and goes", reads: weighted, old: nil, new: change(func(n *Node) { delete(n.Labels, LabelZone) })},
		{name: "weighted: another node's hostname label", reads: weighted, old: &base, new: change(func(n *Node) { n.Labels[LabelHostname] = "x" })},
		{name: "nodePort: this node's addresses change", reads: nodePort, self: true, old: &base, new: change(func(n *Node) { n.Addresses[0].Addr = netip.MustParseAddr("192.168.0.3") }), want: true},
		{name: "nodePort: another node's addresses change", reads: nodePort, old: &base, new: change(func(n *Node) { n.Addresses = nil })},
		{name: "no nodePort: this node's addresses change", reads: hints, self: true, old: &base, new: change(func(n *Node) { n.Addresses = nil })},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.reads.Affected(tc.self, tc.old, tc.new); got != tc.want {
				t.Errorf("Affected = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestFrontendSourceRanges: source ranges apply to load-balancer IPs only,
// and the node's processes pass when a range holds the node's primary
// address, which also allows the load-balancer IPs as sources (kube-proxy's
// allowFromNode).
func TestFrontendSourceRanges(t *testing.T) {
	ranges := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("203.0.113.0/24")}
	lbIP := netip.MustParseAddr("198.51.100.20")
	port := ServicePort{Family: v1.IPv4Protocol, LoadBalancerIPs: []netip.Addr{lbIP}, LoadBalancerSourceRanges: ranges}
	node := func(addrs ...NodeAddress) Node { return Node{Name: "n1", Addresses: addrs} }
	internal := func(a string) NodeAddress { return NodeAddress{Type: v1.NodeInternalIP, Addr: netip.MustParseAddr(a)} }
	external := func(a string) NodeAddress { return NodeAddress{Type: v1.NodeExternalIP, Addr: netip.MustParseAddr(a)} }
	cases := []struct {
		name string
		kind FrontendKind
		node Node
		// want are the ranges; nil: any source.
		want       []netip.Prefix
		nodePasses bool
	}{
		{"NodePort: not restricted", KindNodePort, node(internal("10.0.0.5")), nil, false},
		{"externalIP: not restricted", KindExternalIP, node(internal("10.0.0.5")), nil, false},
		{"cluster IP: not restricted", KindClusterIP, node(internal("10.0.0.5")), nil, false},
		{"LB IP, node inside a range", KindLoadBalancerIP, node(internal("10.0.0.5")), append(slices.Clone(ranges), netip.PrefixFrom(lbIP, 32)), true},
		{"LB IP, node outside", KindLoadBalancerIP, node(internal("10.9.0.5")), ranges, false},
		{"LB IP, the primary address is the first InternalIP", KindLoadBalancerIP, node(external("203.0.113.5"), internal("10.9.0.5")), ranges, false},
		{"LB IP, ExternalIP when no InternalIP", KindLoadBalancerIP, node(external("203.0.113.5")), append(slices.Clone(ranges), netip.PrefixFrom(lbIP, 32)), true},
		{"LB IP, node without addresses", KindLoadBalancerIP, node(), ranges, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, nodePasses := Frontend{Kind: tc.kind, Port: port}.SourceRanges(tc.node)
			if !slices.Equal(got, tc.want) || nodePasses != tc.nodePasses {
				t.Errorf("SourceRanges = %v, %v; want %v, %v", got, nodePasses, tc.want, tc.nodePasses)
			}
		})
	}
	if got, _ := (Frontend{Kind: KindLoadBalancerIP, Port: ServicePort{Family: v1.IPv4Protocol, LoadBalancerIPs: []netip.Addr{lbIP}}}).SourceRanges(node(internal("10.0.0.5"))); got != nil {
		t.Errorf("no ranges: %v, want nil (any source)", got)
	}
}

// TestClaimsScopes: the loopback NodePort is claimed from inside the node
// only; the cluster IP from outside too, with the internal set, only with
// ClusterIPsFromOutside.
func TestClaimsScopes(t *testing.T) {
	p := clusterPort(nil)
	p.ExternallyAccessible, p.NodePort = true, 30080
	eps := []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")}
	d := PortDecision{Port: p, Endpoints: eps, Decision: Decide(Input{Node: addrNode, Nodes: testNodes, Port: p, Endpoints: eps}, DefaultOptions())}
	loopback := netip.AddrPortFrom(LoopbackNodePortAddr, 30080)
	all := []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}
	for _, tc := range []struct {
		name string
		opts Options
		// want are the scopes each address is claimed in.
		want map[netip.AddrPort][]Scope
	}{
		{name: "default", opts: DefaultOptions(), want: map[netip.AddrPort][]Scope{
			p.ClusterFrontend().Addr:                     {ScopeInternal},
			netip.MustParseAddrPort("192.168.0.1:30080"): {ScopeInternal, ScopeExternal},
			netip.MustParseAddrPort("203.0.113.1:30080"): {ScopeInternal, ScopeExternal},
		}},
		{name: "loopback NodePort: internal only", opts: Options{NodePortAddresses: all}, want: map[netip.AddrPort][]Scope{
			p.ClusterFrontend().Addr:                     {ScopeInternal},
			netip.MustParseAddrPort("192.168.0.1:30080"): {ScopeInternal, ScopeExternal},
			netip.MustParseAddrPort("203.0.113.1:30080"): {ScopeInternal, ScopeExternal},
			netip.MustParseAddrPort("172.16.0.1:30080"):  {ScopeInternal, ScopeExternal},
			loopback: {ScopeInternal},
		}},
		{name: "cluster IPs from outside", opts: Options{ClusterIPsFromOutside: true}, want: map[netip.AddrPort][]Scope{
			p.ClusterFrontend().Addr:                     {ScopeInternal, ScopeExternal},
			netip.MustParseAddrPort("192.168.0.1:30080"): {ScopeInternal, ScopeExternal},
			netip.MustParseAddrPort("203.0.113.1:30080"): {ScopeInternal, ScopeExternal},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			claims, _ := Claims(addrNode, d, tc.opts)
			got := map[netip.AddrPort][]Scope{}
			for _, c := range claims {
				got[c.Addr] = append(got[c.Addr], c.Scope)
				if c.Kind == KindClusterIP && c.Scope == ScopeExternal {
					internal, _ := d.Decision.SetFor(KindClusterIP, ScopeInternal)
					if !slices.Equal(octets(c.Backends), octets(internal.Backends)) {
						t.Errorf("cluster IP from outside: backends %v, want the internal set %v", octets(c.Backends), octets(internal.Backends))
					}
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("claims %v, want %v", got, tc.want)
			}
		})
	}
}
