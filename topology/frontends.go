package topology

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// FrontendKind says how a frontend address belongs to its service port.
type FrontendKind string

// The frontend kinds, in the order CompareClaims ranks them.
const (
	// KindClusterIP is the Service's cluster IP with the service port.
	KindClusterIP FrontendKind = "ClusterIP"
	// KindNodePort is one of this node's addresses with the nodePort.
	KindNodePort FrontendKind = "NodePort"
	// KindLoadBalancerIP is a status.loadBalancer.ingress IP (ipMode not
	// Proxy) with the service port.
	KindLoadBalancerIP FrontendKind = "LoadBalancerIP"
	// KindExternalIP is one of spec.externalIPs with the service port.
	KindExternalIP FrontendKind = "ExternalIP"
)

// Scope is where the traffic a frontend serves comes from. The datapath
// keys its frontends by scope (docs/datapath.md, "Frontends and scopes").
type Scope string

const (
	// ScopeInternal is traffic that starts inside the node: its pods and
	// its host processes.
	ScopeInternal Scope = "internal"
	// ScopeExternal is traffic that arrives on an uplink from outside the
	// node.
	ScopeExternal Scope = "external"
)

// FrontendAddr is an address a service port is reached at, and its kind.
type FrontendAddr struct {
	Addr netip.AddrPort
	Kind FrontendKind
}

// ClusterFrontend returns the cluster IP with the service port. It exists
// in the internal scope only.
func (p ServicePort) ClusterFrontend() FrontendAddr {
	return FrontendAddr{Addr: netip.AddrPortFrom(p.ClusterIP, p.Port), Kind: KindClusterIP}
}

// ExternalFrontends returns the port's frontends that outside traffic can
// reach, in this order: the externalIPs and the load-balancer IPs with the
// service port, then, when the port has a nodePort, node's NodePort
// addresses (Options.NodePortAddresses) with the nodePort, and
// LoopbackNodePortAddr with it when the options serve it. They exist in
// both scopes, but for the loopback one (internal only). A frontend
// listed twice is returned once.
//
// It leaves out, with a warning that starts with the Service's
// "namespace/name: ":
//   - every NodePort frontend when the nodePort is outside
//     Options.NodePortRange;
//   - an externalIP or load-balancer IP that is one of node's addresses: the
//     address is the node's own, and taking it over would capture traffic
//     the node itself serves.
func (p ServicePort) ExternalFrontends(node Node, opts Options) ([]FrontendAddr, []string) {
	var out []FrontendAddr
	var warnings []string
	add := func(fa FrontendAddr) {
		if !slices.ContainsFunc(out, func(o FrontendAddr) bool { return o.Addr == fa.Addr }) {
			out = append(out, fa)
		}
	}
	ofNode := func(ip netip.Addr) bool {
		return slices.ContainsFunc(node.Addresses, func(a NodeAddress) bool { return a.Addr == ip })
	}
	for _, c := range []struct {
		ips  []netip.Addr
		kind FrontendKind
		what string
	}{{p.ExternalIPs, KindExternalIP, "externalIP"}, {p.LoadBalancerIPs, KindLoadBalancerIP, "load-balancer IP"}} {
		for _, ip := range c.ips {
			if ofNode(ip) {
				warnings = append(warnings, fmt.Sprintf("%s: port %s: %s %s is an address of node %s: not served on it (the node keeps its own address)", p.Service, p.displayName(), c.what, ip, node.Name))
				continue
			}
			add(FrontendAddr{Addr: netip.AddrPortFrom(ip, p.Port), Kind: c.kind})
		}
	}
	if p.NodePort != 0 {
		if r := opts.nodePortRange(); !r.Contains(p.NodePort) {
			warnings = append(warnings, fmt.Sprintf("%s: port %s: nodePort %d is outside the node port range %s: not served", p.Service, p.displayName(), p.NodePort, r))
		} else {
			for _, ip := range NodePortAddresses(node, p.Family, opts) {
				add(FrontendAddr{Addr: netip.AddrPortFrom(ip, p.NodePort), Kind: KindNodePort})
			}
			if p.Family == v1.IPv4Protocol && opts.servesLoopbackNodePorts() {
				add(FrontendAddr{Addr: netip.AddrPortFrom(LoopbackNodePortAddr, p.NodePort), Kind: KindNodePort})
			}
		}
	}
	return out, warnings
}

// LoopbackNodePortAddr is the loopback address NodePorts are served on to
// the node's own processes when Options.NodePortAddresses holds it, as
// kube-proxy's iptables mode serves localhost NodePorts. Only this
// address of 127.0.0.0/8, which localhost resolves to: a frontend is one
// address. Internal scope only: a packet to a loopback address never
// arrives on an uplink.
var LoopbackNodePortAddr = netip.AddrFrom4([4]byte{127, 0, 0, 1})

// servesLoopbackNodePorts reports whether NodePorts are served on
// LoopbackNodePortAddr.
func (o Options) servesLoopbackNodePorts() bool {
	return slices.ContainsFunc(o.NodePortAddresses, func(p netip.Prefix) bool { return p.Contains(LoopbackNodePortAddr) })
}

// NodePortAddresses returns the addresses of node in family that NodePorts
// are served on: with no prefix of family in Options.NodePortAddresses,
// its InternalIP and ExternalIP addresses of family; otherwise every
// address of node inside one of those prefixes (kube-proxy's
// NewNodePortAddresses filters the flag's CIDRs by family the same way).
// In node's order, each once; never an address AddrProblem refuses
// (State.Node warns about those).
func NodePortAddresses(node Node, family v1.IPFamily, opts Options) []netip.Addr {
	var prefixes []netip.Prefix
	for _, p := range opts.NodePortAddresses {
		if FamilyOf(p.Addr()) == family {
			prefixes = append(prefixes, p)
		}
	}
	var out []netip.Addr
	for _, a := range node.Addresses {
		if FamilyOf(a.Addr) != family || AddrProblem(a.Addr) != "" {
			continue
		}
		var ok bool
		if len(prefixes) == 0 {
			ok = a.Type == v1.NodeInternalIP || a.Type == v1.NodeExternalIP
		} else {
			ok = slices.ContainsFunc(prefixes, func(p netip.Prefix) bool { return p.Contains(a.Addr) })
		}
		if ok && !slices.Contains(out, a.Addr) {
			out = append(out, a.Addr)
		}
	}
	return out
}

// BackendSet is one backend set of a decision.
type BackendSet struct {
	// Backends are the endpoints new flows may go to. Never nil.
	Backends []Endpoint
	// Weights[i] is the fraction of new flows for Backends[i]; positive,
	// summing to 1. Never nil.
	Weights []float64
	// Draining are the serving endpoints not in Backends: established
	// flows keep them, new flows never go to them. Never nil.
	Draining []Endpoint
	// WhenEmpty is what happens to new flows when Backends is empty
	// (Decision.WhenEmpty).
	WhenEmpty EmptyAction
}

// SetFor returns the backend set that traffic from scope to a frontend of
// kind uses, and false when such traffic is not served at all (a cluster IP
// from outside, or an external kind on a port that is not externally
// accessible):
//   - a cluster IP from inside the node: the internal set (Backends, by
//     internalTrafficPolicy);
//   - an external frontend from inside the node: the cluster set, whatever
//     the traffic policies, as kube-proxy does (its nftables proxier's
//     external chain sends pod-originated and locally-originated traffic to
//     the cluster policy chain: "short-circuit pod traffic", "short-circuit
//     local traffic");
//   - an external frontend from outside: the external set
//     (ExternalBackends, by externalTrafficPolicy).
func (d Decision) SetFor(kind FrontendKind, scope Scope) (BackendSet, bool) {
	switch {
	case kind == KindClusterIP && scope == ScopeInternal:
		return BackendSet{Backends: d.Backends, Weights: d.Weights, Draining: d.Draining, WhenEmpty: d.WhenEmpty}, true
	case kind == KindClusterIP, d.ExternalBackends == nil:
		// ExternalBackends is nil exactly when the port is not externally
		// accessible.
		return BackendSet{}, false
	case scope == ScopeInternal:
		// Externally accessible ports always use the cluster set.
		return BackendSet{Backends: d.ClusterBackends, Weights: d.ClusterWeights, Draining: d.ClusterDraining, WhenEmpty: d.WhenEmpty}, true
	}
	return BackendSet{Backends: d.ExternalBackends, Weights: d.ExternalWeights, Draining: d.ExternalDraining, WhenEmpty: d.WhenEmpty}, true
}

// Frontend is one frontend a node programs: a (address:port, protocol,
// scope) key, the service port that owns it, and the backend set it uses.
type Frontend struct {
	Addr     netip.AddrPort
	Protocol v1.Protocol
	Scope    Scope
	Kind     FrontendKind
	// Port is the service port that owns the frontend; its Affinity is
	// the frontend's session affinity.
	Port ServicePort
	// BackendSet is what new and established flows to the frontend use.
	BackendSet
}

// SourceRanges returns the only sources new flows to f may come from, nil
// for any, and whether the node's own processes pass, as kube-proxy
// enforces loadBalancerSourceRanges: on load-balancer IPs only (not on
// NodePorts, externalIPs or cluster IPs), in both scopes. The node passes
// when a range holds its primary address in the port's family (its first
// InternalIP, else its first ExternalIP, as kube-proxy's node IP); the load-balancer IPs
// themselves are then allowed sources too (kube-proxy's allowFromNode: a
// node's request to a VIP it holds locally loops back from the VIP).
func (f Frontend) SourceRanges(node Node) (ranges []netip.Prefix, nodePasses bool) {
	rs := f.Port.LoadBalancerSourceRanges
	if f.Kind != KindLoadBalancerIP || len(rs) == 0 {
		return nil, false
	}
	primary, ok := node.primaryAddr(f.Port.Family)
	nodePasses = ok && slices.ContainsFunc(rs, func(p netip.Prefix) bool { return p.Contains(primary) })
	ranges = slices.Clone(rs)
	if nodePasses {
		for _, ip := range f.Port.LoadBalancerIPs {
			if p := netip.PrefixFrom(ip, ip.BitLen()); !slices.Contains(ranges, p) {
				ranges = append(ranges, p)
			}
		}
	}
	return ranges, nodePasses
}

// Key identifies a frontend in the datapath: two claims on one Key are a
// conflict.
type Key struct {
	Addr     netip.AddrPort
	Protocol v1.Protocol
	Scope    Scope
}

// Key returns the frontend's key.
func (f Frontend) Key() Key { return Key{Addr: f.Addr, Protocol: f.Protocol, Scope: f.Scope} }

// kindRank orders kinds for CompareClaims: addresses the apiserver
// allocates uniquely (cluster IPs, nodePorts) before load-balancer IPs set
// by controllers, before externalIPs any Service author may write.
var kindRank = map[FrontendKind]int{KindClusterIP: 0, KindNodePort: 1, KindLoadBalancerIP: 2, KindExternalIP: 3}

// Claim is what ranks a claim on a frontend (CompareClaims): its kind and
// the identity of the service port that makes it. It is small, so an agent
// can remember who owns each frontend without holding its backends.
type Claim struct {
	Kind    FrontendKind
	Service types.NamespacedName
	Created time.Time
	Index   int
	// Port is the port's name, for messages.
	Port string
}

// Claim returns the frontend's claim.
func (f Frontend) Claim() Claim {
	return Claim{Kind: f.Kind, Service: f.Port.Service, Created: f.Port.Created, Index: f.Port.Index, Port: f.Port.displayName()}
}

// CompareClaims orders two claims on the same frontend Key: negative when a
// owns it before b. The order is total and depends only on the claims, so
// `topolbctl explain` (which sees every claim at once) and an agent that
// learns them one by one agree on the owner:
//  1. the kind: ClusterIP, NodePort, LoadBalancerIP, ExternalIP (so an
//     externalIP can never take over another Service's cluster IP);
//  2. the older Service (creationTimestamp; unset counts as oldest);
//  3. namespace, then name;
//  4. the port's position in spec.ports.
func CompareClaims(a, b Claim) int {
	return cmp.Or(
		cmp.Compare(kindRank[a.Kind], kindRank[b.Kind]),
		a.Created.Compare(b.Created),
		cmp.Compare(a.Service.Namespace, b.Service.Namespace),
		cmp.Compare(a.Service.Name, b.Service.Name),
		cmp.Compare(a.Index, b.Index),
	)
}

// compareFrontends is CompareClaims on two frontends' claims.
func compareFrontends(a, b Frontend) int { return CompareClaims(a.Claim(), b.Claim()) }

// Claims returns every frontend a node's decision for one port asks for,
// before conflicts with other ports are resolved: the cluster IP in the
// internal scope (and, with Options.ClusterIPsFromOutside, in the external
// scope with the internal set), and each external frontend in both scopes
// (the loopback NodePort in the internal one), each with the backend set
// SetFor gives. The warnings are ExternalFrontends'.
func Claims(node Node, d PortDecision, opts Options) ([]Frontend, []string) {
	ext, warnings := d.Port.ExternalFrontends(node, opts)
	addrs := append([]FrontendAddr{d.Port.ClusterFrontend()}, ext...)
	var out []Frontend
	for _, fa := range addrs {
		for _, scope := range []Scope{ScopeInternal, ScopeExternal} {
			set, ok := d.Decision.SetFor(fa.Kind, scope)
			if fa.Kind == KindClusterIP && scope == ScopeExternal && opts.ClusterIPsFromOutside {
				// As kube-proxy's cluster IP chain serves any packet
				// that reaches it: with the internal set.
				set, ok = d.Decision.SetFor(fa.Kind, ScopeInternal)
			}
			if !ok || (scope == ScopeExternal && fa.Addr.Addr().IsLoopback()) {
				continue
			}
			out = append(out, Frontend{Addr: fa.Addr, Protocol: d.Port.Protocol, Scope: scope, Kind: fa.Kind, Port: d.Port, BackendSet: set})
		}
	}
	return out, warnings
}

// NodeFrontends turns a node's decisions into the frontends to program on
// it: every claim of every port (Claims), with each conflict resolved by
// CompareClaims — the first claim owns the frontend, the others are left
// out with a warning. The result is sorted by address, protocol and scope;
// it includes every protocol (the datapath skips what it cannot balance).
//
// A Service over one of opts.Caps claims nothing, with a warning.
//
// Every warning starts with the "namespace/name: " of the Service it is
// about (the one that loses something), so callers can pick a Service's.
func NodeFrontends(node Node, ds []PortDecision, opts Options) ([]Frontend, []string) {
	var warnings []string
	byService := map[types.NamespacedName][]Frontend{}
	for _, d := range ds {
		claims, w := Claims(node, d, opts)
		warnings = append(warnings, w...)
		byService[d.Port.Service] = append(byService[d.Port.Service], claims...)
	}
	// A Service over a cap claims nothing (Caps), as State.PlanService
	// plans it for the agent.
	byKey := map[Key][]Frontend{}
	for nn, claims := range byService {
		if r, refused := opts.Caps.Refusal(claims); refused {
			warnings = append(warnings, fmt.Sprintf("%s: %s", nn, r))
			continue
		}
		for _, c := range claims {
			byKey[c.Key()] = append(byKey[c.Key()], c)
		}
	}
	// lostScopes collects, per losing claim (the port and address), the
	// scopes it lost in and to whom, so that one warning covers both.
	type loss struct {
		claim Frontend
		owner Frontend
	}
	lostScopes := map[string][]loss{}
	out := make([]Frontend, 0, len(byKey))
	for _, claims := range byKey {
		slices.SortFunc(claims, compareFrontends)
		out = append(out, claims[0])
		for _, lost := range claims[1:] {
			id := fmt.Sprintf("%s\x00%d\x00%s\x00%s", lost.Port.Service, lost.Port.Index, lost.Addr, lost.Protocol)
			lostScopes[id] = append(lostScopes[id], loss{claim: lost, owner: claims[0]})
		}
	}
	for _, ls := range lostScopes {
		slices.SortFunc(ls, func(a, b loss) int { return cmp.Compare(a.claim.Scope, b.claim.Scope) })
		lost, owner := ls[0].claim, ls[0].owner
		where := ""
		if len(ls) == 1 && lost.Kind != KindClusterIP {
			where = map[Scope]string{ScopeInternal: " from inside the node", ScopeExternal: " from outside"}[lost.Scope]
		}
		warnings = append(warnings, fmt.Sprintf("%s: port %s: %s %s/%s is already the %s of %s port %s: not served for this port%s",
			lost.Port.Service, lost.Port.displayName(), lost.Kind, lost.Addr, lost.Protocol, owner.Kind, owner.Port.Service, owner.Port.displayName(), where))
	}
	slices.SortFunc(out, func(a, b Frontend) int {
		return cmp.Or(a.Addr.Compare(b.Addr), cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Scope, b.Scope))
	})
	slices.Sort(warnings)
	return out, warnings
}

// displayName renders the port for messages: its name, or its number and
// protocol when it has none.
func (p ServicePort) displayName() string {
	if p.Name != "" {
		return p.Name
	}
	return fmt.Sprintf("%d/%s", p.Port, p.Protocol)
}
