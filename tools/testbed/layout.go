package testbed

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// Interface names inside the testbed.
const (
	// UplinkName is a node's wire interface, its only uplink: the device
	// of its default route.
	UplinkName = "eth0"
	// PodIfName is a pod's interface.
	PodIfName = "eth0"
	// BridgeName is the switch in the fabric namespace.
	BridgeName = "br0"
	// ExternalIfName is an outside client's interface.
	ExternalIfName = "eth0"
)

// ManagedBy is the endpointslice.kubernetes.io/managed-by value of the
// EndpointSlices the testbed writes.
const ManagedBy = "testbed.topolb.io"

// Layout is a spec's addressing plan: which node and pod gets which
// addresses and interface names. It is a pure function of the spec, so
// manifests can be generated without creating anything.
type Layout struct {
	Spec *Spec
	// Nodes are in spec order.
	Nodes []*Node
	// Pods are in spec order.
	Pods []*Pod
	// FabricAddr is the switch's address on the wire: every node's default
	// gateway.
	FabricAddr netip.Prefix
	// FabricAddr6 is the switch's IPv6 address on the wire (dual stack
	// only; invalid otherwise): every node's IPv6 default gateway.
	FabricAddr6 netip.Prefix
	// Router is the outside network's router; nil without an outside
	// network.
	Router *Router
	// Externals are the clients outside the cluster, in spec order.
	Externals []*External

	nodes     map[string]*Node
	pods      map[string]*Pod
	byIP      map[netip.Addr]*Pod
	externals map[string]*External
}

// Router joins the outside network to the wire. It routes the outside
// subnet to its clients (one veth each, named RouterIf, wired like pods)
// and every external and load-balancer IP to the ingress node.
type Router struct {
	// WireAddr is its address on the wire (a port of the switch).
	WireAddr netip.Prefix
	// Gateway is its address on every client veth: the clients' default
	// gateway, the .1 of Subnet.
	Gateway netip.Addr
	// Subnet is the outside network.
	Subnet netip.Prefix
	// Ingress is the node external and load-balancer IPs are routed to.
	Ingress *Node
	// WireAddr6, Gateway6 and Subnet6 are the IPv6 twins of WireAddr,
	// Gateway and Subnet (dual stack only; invalid otherwise).
	WireAddr6 netip.Prefix
	Gateway6  netip.Addr
	Subnet6   netip.Prefix

	// NS is the router's namespace; nil until the testbed is up.
	NS *NS
}

// External is a client outside the cluster: a namespace behind the
// router, wired like a pod (a /32 on ExternalIfName, default route via
// the router's Gateway).
type External struct {
	Name string
	// Addr is its address in the outside subnet.
	Addr netip.Addr
	// Addr6 is its address in the outside IPv6 subnet (dual stack only;
	// invalid otherwise).
	Addr6 netip.Addr
	// RouterIf is its veth's name in the router's namespace; the client's
	// frames arrive there.
	RouterIf string
	Router   *Router

	// NS is the client's namespace; nil until the testbed is up.
	NS *NS
}

// Node is one node of the testbed.
type Node struct {
	Name string
	Zone string
	// Index is the node's 1-based position in the spec.
	Index int
	CPU   string
	// Labels are every label of the Node object.
	Labels map[string]string
	// PodCIDR is the node's /24; Gateway (its .1) is the address of every
	// host-side pod veth, and pods route through it.
	PodCIDR netip.Prefix
	Gateway netip.Addr
	// WireAddr is the node's address on the wire (UplinkName), and its
	// InternalIP in the Node object: its NodePorts are reached there.
	WireAddr netip.Prefix
	// PodCIDR6, Gateway6 and WireAddr6 are the IPv6 twins of PodCIDR,
	// Gateway and WireAddr (dual stack only; invalid otherwise): a /64,
	// its ::1, and the node's second InternalIP.
	PodCIDR6  netip.Prefix
	Gateway6  netip.Addr
	WireAddr6 netip.Prefix
	// WireMTU is the MTU of its wire and switch port; 0 for the default.
	WireMTU int
	// Netfilter is the netfilter state set up in its namespace.
	Netfilter NetfilterSpec
	Pods      []*Pod

	// NS is the node's network namespace; nil until the testbed is up.
	NS *NS
}

// Pod is one pod of the testbed.
type Pod struct {
	Name string
	Node *Node
	Role Role
	// Addr is the pod's address (a /32 on PodIfName).
	Addr netip.Addr
	// Addr6 is the pod's IPv6 address (a /128 on PodIfName; dual stack
	// only, invalid otherwise).
	Addr6 netip.Addr
	// HostVeth is the name of the pod's veth in the node namespace; its
	// alias is the pod's name.
	HostVeth string

	// NS is the pod's network namespace; nil until the testbed is up.
	NS *NS
}

// AddrOf returns the pod's address of family, invalid when it has none.
func (p *Pod) AddrOf(family v1.IPFamily) netip.Addr { return pick(family, p.Addr, p.Addr6) }

// pick returns v6 for IPv6, v4 otherwise.
func pick[T any](family v1.IPFamily, v4, v6 T) T {
	if family == v1.IPv6Protocol {
		return v6
	}
	return v4
}

// Zone returns the pod's node's zone.
func (p *Pod) Zone() string { return p.Node.Zone }

// NewLayout plans the addresses of a validated spec.
func NewLayout(s *Spec) (*Layout, error) {
	podCIDR, err := netip.ParsePrefix(s.PodCIDR)
	if err != nil || !podCIDR.Addr().Is4() || podCIDR.Bits() > 16 {
		return nil, fmt.Errorf("podCIDR %q: want an IPv4 prefix of /16 or shorter", s.PodCIDR)
	}
	wire, err := netip.ParsePrefix(s.WireCIDR)
	if err != nil || !wire.Addr().Is4() || wire.Bits() != 24 {
		return nil, fmt.Errorf("wireCIDR %q: want an IPv4 /24", s.WireCIDR)
	}
	podCIDR, wire = podCIDR.Masked(), wire.Masked()
	pod6, wire6 := netip.MustParsePrefix(DefaultPodCIDR6), netip.MustParsePrefix(DefaultWireCIDR6)
	l := &Layout{
		Spec:       s,
		FabricAddr: netip.PrefixFrom(nth(wire.Addr(), 1), 24),
		nodes:      map[string]*Node{},
		pods:       map[string]*Pod{},
		byIP:       map[netip.Addr]*Pod{},
		externals:  map[string]*External{},
	}
	if s.DualStack {
		l.FabricAddr6 = netip.PrefixFrom(nth(wire6.Addr(), 1), wire6.Bits())
	}
	idx := 0
	for _, z := range s.Zones {
		for _, ns := range z.Nodes {
			idx++
			if idx > 250 {
				return nil, fmt.Errorf("more than 250 nodes")
			}
			base := podCIDR.Addr().As4()
			base[2] = byte(idx)
			cidr := netip.PrefixFrom(netip.AddrFrom4(base), 24)
			n := &Node{
				Name:      ns.Name,
				Zone:      z.Name,
				Index:     idx,
				CPU:       ns.CPU,
				Labels:    map[string]string{topology.LabelZone: z.Name, topology.LabelHostname: ns.Name},
				PodCIDR:   cidr,
				Gateway:   nth(cidr.Addr(), 1),
				WireAddr:  netip.PrefixFrom(nth(wire.Addr(), 1+idx), 24),
				WireMTU:   ns.WireMTU,
				Netfilter: ns.Netfilter,
			}
			if s.DualStack {
				b := pod6.Addr().As16()
				b[6], b[7] = byte(idx>>8), byte(idx)
				n.PodCIDR6 = netip.PrefixFrom(netip.AddrFrom16(b), 64)
				n.Gateway6 = nth(n.PodCIDR6.Addr(), 1)
				n.WireAddr6 = netip.PrefixFrom(nth(wire6.Addr(), 1+idx), wire6.Bits())
			}
			for k, v := range ns.Labels {
				n.Labels[k] = v
			}
			if len(ns.Pods) > 250 {
				return nil, fmt.Errorf("node %s: more than 250 pods", ns.Name)
			}
			for pi, ps := range ns.Pods {
				p := &Pod{
					Name:     ps.Name,
					Node:     n,
					Role:     ps.Role,
					Addr:     nth(cidr.Addr(), 2+pi),
					HostVeth: fmt.Sprintf("veth%d", pi),
				}
				if s.DualStack {
					p.Addr6 = nth(n.PodCIDR6.Addr(), 2+pi)
					l.byIP[p.Addr6] = p
				}
				n.Pods = append(n.Pods, p)
				l.Pods = append(l.Pods, p)
				l.pods[p.Name] = p
				l.byIP[p.Addr] = p
			}
			l.Nodes = append(l.Nodes, n)
			l.nodes[n.Name] = n
		}
	}
	if err := l.planOutside(wire); err != nil {
		return nil, err
	}
	return l, nil
}

// planOutside addresses the router and the outside clients.
func (l *Layout) planOutside(wire netip.Prefix) error {
	o := l.Spec.Outside
	if o == nil {
		return nil
	}
	subnet, err := netip.ParsePrefix(o.CIDR)
	if err != nil {
		return fmt.Errorf("outside: cidr %q: %w", o.CIDR, err)
	}
	subnet = subnet.Masked()
	routerAddr := nth(wire.Addr(), 254)
	if o.RouterAddr != "" {
		if routerAddr, err = netip.ParseAddr(o.RouterAddr); err != nil {
			return fmt.Errorf("outside: routerAddr %q: %w", o.RouterAddr, err)
		}
	}
	if !wire.Contains(routerAddr) || routerAddr == l.FabricAddr.Addr() || routerAddr == wire.Addr() || routerAddr == nth(wire.Addr(), 255) {
		return fmt.Errorf("outside: routerAddr %s: want a free host address of the wire %s", routerAddr, wire)
	}
	for _, n := range l.Nodes {
		if n.WireAddr.Addr() == routerAddr {
			return fmt.Errorf("outside: routerAddr %s is node %s's address", routerAddr, n.Name)
		}
	}
	l.Router = &Router{
		WireAddr: netip.PrefixFrom(routerAddr, wire.Bits()),
		Gateway:  nth(subnet.Addr(), 1),
		Subnet:   subnet,
		Ingress:  l.nodes[o.IngressNode],
	}
	if l.Router.Ingress == nil {
		return fmt.Errorf("outside: ingressNode %q is not a node", o.IngressNode)
	}
	if l.Spec.DualStack {
		r := l.Router
		r.Subnet6 = netip.MustParsePrefix(DefaultOutsideCIDR6)
		r.Gateway6 = nth(r.Subnet6.Addr(), 1)
		r.WireAddr6 = netip.PrefixFrom(nth(l.FabricAddr6.Masked().Addr(), 0xfe), l.FabricAddr6.Bits())
	}
	for i, c := range o.Clients {
		e := &External{Name: c.Name, Addr: nth(subnet.Addr(), 10+i), RouterIf: fmt.Sprintf("x%d", i), Router: l.Router}
		if l.Spec.DualStack {
			e.Addr6 = nth(l.Router.Subnet6.Addr(), 10+i)
		}
		l.Externals = append(l.Externals, e)
		l.externals[e.Name] = e
	}
	return nil
}

// External returns the named outside client, or nil.
func (l *Layout) External(name string) *External { return l.externals[name] }

// nth returns base + n; an IPv6 base is counted in its last 32 bits.
func nth(base netip.Addr, n int) netip.Addr {
	if base.Is6() {
		b := base.As16()
		v := uint32(b[12])<<24 | uint32(b[13])<<16 | uint32(b[14])<<8 | uint32(b[15])
		v += uint32(n)
		b[12], b[13], b[14], b[15] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
		return netip.AddrFrom16(b)
	}
	b := base.As4()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	v += uint32(n)
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// Node returns the named node, or nil.
func (l *Layout) Node(name string) *Node { return l.nodes[name] }

// Pod returns the named pod, or nil.
func (l *Layout) Pod(name string) *Pod { return l.pods[name] }

// PodByAddr returns the pod with address a, or nil.
func (l *Layout) PodByAddr(a netip.Addr) *Pod { return l.byIP[a] }

// Clients returns the client pods, in spec order.
func (l *Layout) Clients() []*Pod {
	var out []*Pod
	for _, p := range l.Pods {
		if p.Role == RoleClient {
			out = append(out, p)
		}
	}
	return out
}

// Objects returns the Nodes of the layout and the Services and
// EndpointSlices of svcs, as a cluster would hold them.
func (l *Layout) Objects(svcs []ServiceSpec) (*kube.Objects, error) {
	svcs, err := l.Spec.CompleteServices(svcs)
	if err != nil {
		return nil, err
	}
	objs := &kube.Objects{}
	for _, n := range l.Nodes {
		objs.Nodes = append(objs.Nodes, l.nodeObject(n))
	}
	for _, svc := range svcs {
		s, eps, err := l.serviceObjects(svc)
		if err != nil {
			return nil, err
		}
		objs.Services = append(objs.Services, s)
		objs.Slices = append(objs.Slices, eps...)
	}
	return objs, nil
}

func (l *Layout) nodeObject(n *Node) *v1.Node {
	labels := make(map[string]string, len(n.Labels))
	for k, v := range n.Labels {
		labels[k] = v
	}
	cpu := resource.MustParse(n.CPU)
	cidrs := []string{n.PodCIDR.String()}
	addrs := []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: n.WireAddr.Addr().String()}}
	if n.PodCIDR6.IsValid() {
		cidrs = append(cidrs, n.PodCIDR6.String())
		addrs = append(addrs, v1.NodeAddress{Type: v1.NodeInternalIP, Address: n.WireAddr6.Addr().String()})
	}
	return &v1.Node{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Node"},
		ObjectMeta: metav1.ObjectMeta{Name: n.Name, Labels: labels},
		Spec:       v1.NodeSpec{PodCIDR: n.PodCIDR.String(), PodCIDRs: cidrs},
		Status: v1.NodeStatus{
			Allocatable: v1.ResourceList{v1.ResourceCPU: cpu},
			Capacity:    v1.ResourceList{v1.ResourceCPU: cpu},
			Conditions:  []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue}},
			Addresses:   addrs,
		},
	}
}

// serviceObjects returns the Service of svc and its EndpointSlices, one
// per family in the order of its ipFamilies: the IPv4 one is named
// "<name>-testbed", the IPv6 one "<name>-testbed-v6".
func (l *Layout) serviceObjects(svc ServiceSpec) (*v1.Service, []*discovery.EndpointSlice, error) {
	var clusterIPs []string
	for _, f := range svc.IPFamilies {
		clusterIPs = append(clusterIPs, pick(f, svc.ClusterIP, svc.ClusterIPv6))
	}
	policy := v1.IPFamilyPolicySingleStack
	if len(svc.IPFamilies) > 1 {
		policy = v1.IPFamilyPolicyRequireDualStack
	}
	s := &v1.Service{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: metav1.ObjectMeta{
			Name:        svc.Name,
			Namespace:   svc.Namespace,
			Annotations: copyMap(svc.Annotations),
			Labels:      copyMap(svc.Labels),
		},
		Spec: v1.ServiceSpec{
			Type:                svc.Type,
			ClusterIP:           clusterIPs[0],
			ClusterIPs:          clusterIPs,
			IPFamilies:          slices.Clone(svc.IPFamilies),
			IPFamilyPolicy:      &policy,
			ExternalIPs:         slices.Clone(svc.ExternalIPs),
			HealthCheckNodePort: svc.HealthCheckNodePort,

			LoadBalancerSourceRanges: slices.Clone(svc.LoadBalancerSourceRanges),
		},
	}
	if s.Spec.Type == "" {
		s.Spec.Type = v1.ServiceTypeClusterIP
	}
	if svc.ExternalTrafficPolicy != "" {
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicy(svc.ExternalTrafficPolicy)
	}
	if svc.SessionAffinity != "" {
		s.Spec.SessionAffinity = v1.ServiceAffinity(svc.SessionAffinity)
	}
	if svc.SessionAffinity == string(v1.ServiceAffinityClientIP) {
		timeout := svc.SessionAffinityTimeout
		s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: &timeout}}
	}
	for _, ip := range svc.LoadBalancerIPs {
		s.Status.LoadBalancer.Ingress = append(s.Status.LoadBalancer.Ingress, v1.LoadBalancerIngress{IP: ip})
	}
	if svc.TrafficDistribution != "" {
		td := svc.TrafficDistribution
		s.Spec.TrafficDistribution = &td
	}
	if svc.InternalTrafficPolicy != "" {
		p := v1.ServiceInternalTrafficPolicy(svc.InternalTrafficPolicy)
		s.Spec.InternalTrafficPolicy = &p
	}
	for _, p := range svc.Ports {
		s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{
			Name:       p.Name,
			Protocol:   p.Protocol,
			Port:       p.Port,
			TargetPort: intstr.FromInt32(p.TargetPort),
			NodePort:   p.NodePort,
		})
	}
	var out []*discovery.EndpointSlice
	for _, f := range svc.IPFamilies {
		es, err := l.endpointSlice(svc, f)
		if err != nil {
			return nil, nil, err
		}
		out = append(out, es)
	}
	return s, out, nil
}

// endpointSlice returns the EndpointSlice of svc's endpoints in family.
func (l *Layout) endpointSlice(svc ServiceSpec, family v1.IPFamily) (*discovery.EndpointSlice, error) {
	es := &discovery.EndpointSlice{
		TypeMeta: metav1.TypeMeta{APIVersion: "discovery.k8s.io/v1", Kind: "EndpointSlice"},
		ObjectMeta: metav1.ObjectMeta{
			Name:      svc.Name + pick(family, "-testbed", "-testbed-v6"),
			Namespace: svc.Namespace,
			Labels: map[string]string{
				discovery.LabelServiceName: svc.Name,
				discovery.LabelManagedBy:   ManagedBy,
			},
		},
		AddressType: discovery.AddressType(family),
		Endpoints:   []discovery.Endpoint{},
	}
	for _, p := range svc.Ports {
		name, proto, port := p.Name, p.Protocol, p.TargetPort
		es.Ports = append(es.Ports, discovery.EndpointPort{Name: &name, Protocol: &proto, Port: &port})
	}
	for _, e := range svc.Endpoints {
		if e.Families != nil && !slices.Contains(e.Families, family) {
			continue
		}
		pod := l.pods[e.Pod]
		if pod == nil || pod.Role != RoleBackend {
			return nil, fmt.Errorf("service %s: endpoint %q is not a backend pod", svc.Key(), e.Pod)
		}
		addr := pod.AddrOf(family)
		if !addr.IsValid() {
			return nil, fmt.Errorf("service %s: pod %s has no %s address (not a dual-stack testbed)", svc.Key(), pod.Name, family)
		}
		node, zone := pod.Node.Name, pod.Node.Zone
		ep := discovery.Endpoint{
			Addresses:  []string{addr.String()},
			Conditions: conditions(e.Condition),
			NodeName:   &node,
			Zone:       &zone,
			TargetRef:  &v1.ObjectReference{Kind: "Pod", Namespace: svc.Namespace, Name: pod.Name},
		}
		hints := e.Hints
		if hints == "" {
			hints = svc.Hints
		}
		switch {
		case e.ForZones != nil || e.ForNodes != nil:
			ep.Hints = &discovery.EndpointHints{}
			for _, z := range e.ForZones {
				ep.Hints.ForZones = append(ep.Hints.ForZones, discovery.ForZone{Name: z})
			}
			for _, n := range e.ForNodes {
				ep.Hints.ForNodes = append(ep.Hints.ForNodes, discovery.ForNode{Name: n})
			}
		case hints == HintsZone:
			ep.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: zone}}}
		case hints == HintsNode:
			ep.Hints = &discovery.EndpointHints{
				ForZones: []discovery.ForZone{{Name: zone}},
				ForNodes: []discovery.ForNode{{Name: node}},
			}
		}
		es.Endpoints = append(es.Endpoints, ep)
	}
	return es, nil
}

func conditions(c Condition) discovery.EndpointConditions {
	b := func(v bool) *bool { return &v }
	switch c {
	case Terminating:
		return discovery.EndpointConditions{Ready: b(false), Serving: b(true), Terminating: b(true)}
	case NotReady:
		return discovery.EndpointConditions{Ready: b(false), Serving: b(false), Terminating: b(false)}
	}
	return discovery.EndpointConditions{Ready: b(true), Serving: b(true), Terminating: b(false)}
}

func copyMap(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// PodNames maps endpoint addresses ("ip:port") to pod names, sorted;
// addresses of no pod are kept as they are.
func (l *Layout) PodNames(addrs []string) []string {
	out := make([]string, 0, len(addrs))
	for _, a := range addrs {
		name := a
		if ap, err := netip.ParseAddrPort(a); err == nil {
			if p := l.byIP[ap.Addr()]; p != nil {
				name = p.Name
			}
		}
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}
