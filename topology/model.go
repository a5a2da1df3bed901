// Package topology decides, for one node and one service port in one IP
// family, which backends that node may send traffic to, under which policy
// and mode, and why. A dual-stack Service is decided once per family, as
// kube-proxy runs one proxier per family (family.go).
//
// Everything in this package is pure: the decision is a function of its
// inputs (this node, all nodes' labels, one service port, its endpoints and
// options), with no I/O and no globals. The model types are built from
// Kubernetes objects by the functions in build.go, which the agent and
// `topolbctl explain` share, so the two can never disagree.
package topology

import (
	"fmt"
	"net/netip"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/internal/portrange"
)

// Well-known labels and the annotations topolb reads from a Service.
const (
	LabelZone     = v1.LabelTopologyZone   // topology.kubernetes.io/zone
	LabelRegion   = v1.LabelTopologyRegion // topology.kubernetes.io/region
	LabelHostname = v1.LabelHostname       // kubernetes.io/hostname

	// AnnotationTopologyAware set to "false" disables topology for a Service.
	AnnotationTopologyAware = "topolb.io/topology-aware"
	// AnnotationTopologyKeys holds the legacy topologyKeys preference list,
	// comma-separated, for example "kubernetes.io/hostname,topology.kubernetes.io/zone,*".
	AnnotationTopologyKeys = "topolb.io/topology-keys"
	// AnnotationZoneThreshold is the minimum number of usable endpoints the
	// local zone must have before traffic is kept in it.
	AnnotationZoneThreshold = "topolb.io/zone-threshold"
	// AnnotationZoneWeighted set to "true" weights a Service's backends so
	// that each zone keeps the share of its traffic its endpoints can carry
	// (see zoneWeighted in weights.go).
	AnnotationZoneWeighted = "topolb.io/zone-weighted"

	// MaxTopologyKeys is the largest number of keys topology-keys accepts.
	MaxTopologyKeys = 16
)

// Policy names the rule that chose a service port's backends.
type Policy string

// The policies, in the order their annotations take precedence (Hints is the
// default when no annotation applies).
const (
	PolicyDisabled      Policy = "Disabled"
	PolicyTopologyKeys  Policy = "TopologyKeys"
	PolicyZoneThreshold Policy = "ZoneThreshold"
	PolicyZoneWeighted  Policy = "ZoneWeighted"
	PolicyHints         Policy = "Hints"
)

// Mode is the topology mode a policy selected for one node. Under the
// TopologyKeys policy the mode is the matched key, "*" or None.
type Mode string

// The modes shared by all policies.
const (
	ModePreferSameNode Mode = "PreferSameNode"
	ModePreferSameZone Mode = "PreferSameZone"
	ModeNone           Mode = "None"
	ModeAny            Mode = "*"
	// ModeZoneWeighted: the ZoneWeighted policy gives this node's backends
	// unequal weights, or spreads them over several zones but not over
	// every usable endpoint.
	ModeZoneWeighted Mode = "ZoneWeighted"
)

// MaxNodeCPUCores bounds a Node's allocatable CPU: more is taken to be a
// mistake, and the node counts as lacking allocatable CPU.
const MaxNodeCPUCores = 100_000

// Node is what topology decisions read of a node.
type Node struct {
	Name   string
	Labels map[string]string
	// AllocatableMilliCPU is status.allocatable.cpu in millicores, 0 when
	// absent. Values outside 1..MaxNodeCPUCores*1000 (negative, or
	// absurdly large, which are clamped to math.MaxInt64) count as lacking.
	AllocatableMilliCPU int64
	// Ready is the status of the node's Ready condition (True, False,
	// Unknown), "" when it has none.
	Ready v1.ConditionStatus
	// Addresses are the node's IPv4 and IPv6 addresses from
	// status.addresses, in order, with their types; NodePort frontends are
	// chosen among those of the port's family.
	Addresses []NodeAddress
	// Leaving says why the node is leaving the cluster, "" when it is not:
	// it is being deleted (deletionTimestamp), or the cluster autoscaler
	// has tainted it ToBeDeletedTaint. No decision reads it; the proxy
	// health server's /healthz fails for such a node, as kube-proxy's
	// (NodeEligible), so load balancers drain it.
	Leaving string
}

// ToBeDeletedTaint is the taint the cluster autoscaler puts on a node
// before it deletes it (kube-proxy's healthcheck.ToBeDeletedTaint).
const ToBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"

// NodeAddress is one address of a node and its type (InternalIP,
// ExternalIP, ...).
type NodeAddress struct {
	Type v1.NodeAddressType
	Addr netip.Addr
}

// primaryAddr returns the node's first InternalIP of family, else its
// first ExternalIP of family: the node IP of kube-proxy's proxier of that
// family.
func (n Node) primaryAddr(family v1.IPFamily) (netip.Addr, bool) {
	for _, t := range []v1.NodeAddressType{v1.NodeInternalIP, v1.NodeExternalIP} {
		for _, a := range n.Addresses {
			if a.Type == t && FamilyOf(a.Addr) == family {
				return a.Addr, true
			}
		}
	}
	return netip.Addr{}, false
}

// Zone returns the node's topology.kubernetes.io/zone label, or "".
func (n Node) Zone() string { return n.Labels[LabelZone] }

// hasCPU reports whether the node's allocatable CPU is usable as a weight.
func (n Node) hasCPU() bool {
	return n.AllocatableMilliCPU > 0 && n.AllocatableMilliCPU <= MaxNodeCPUCores*1000
}

// Endpoint is one backend address of a service port, as read from an
// EndpointSlice, with the EndpointSlice API's defaults applied.
type Endpoint struct {
	// Addr is the endpoint's address, of its slice's addressType, and the
	// slice's (target) port.
	Addr netip.AddrPort
	// NodeName is the endpoint's nodeName, "" when unset.
	NodeName string
	// Zone is the endpoint's zone field, "" when unset.
	Zone string
	// Ready, Serving and Terminating are the endpoint's conditions with the
	// API's defaults: nil ready and nil serving mean true, nil terminating
	// means false.
	Ready, Serving, Terminating bool
	// ZoneHints are the zones named in hints.forZones. Nil means the
	// endpoint carries no zone hint (no hints, or an empty forZones).
	ZoneHints []string
	// NodeHints are the nodes named in hints.forNodes. Nil means the
	// endpoint carries no node hint.
	NodeHints []string
}

// servingTerminating reports whether the endpoint may be used as a fallback
// when a set has no ready endpoints.
func (e Endpoint) servingTerminating() bool { return !e.Ready && e.Serving && e.Terminating }

// serving reports whether the endpoint can still serve a flow: it is ready,
// or serving-terminating. A serving endpoint that is not in a backend set is
// draining for it.
func (e Endpoint) serving() bool { return e.Ready || e.servingTerminating() }

// ServicePort is one port of a Service, with everything a decision reads.
type ServicePort struct {
	// Service is the Service's namespace and name.
	Service types.NamespacedName
	// Created is the Service's creationTimestamp; zero when unset (as in
	// hand-written manifests). It decides which Service owns a frontend
	// two of them claim (CompareClaims).
	Created time.Time
	// Index is the port's position in the Service's spec.ports.
	Index int
	// Name is the port's name, "" if unnamed.
	Name string
	// Protocol is TCP, UDP or SCTP.
	Protocol v1.Protocol
	// Port is the service port.
	Port uint16
	// NodePort is the port's nodePort, 0 if none.
	NodePort uint16
	// Family is the IP family this port is decided in: a dual-stack
	// Service has one ServicePort per port and family (ServicePorts), and
	// every address below, the endpoints and the NodePort addresses are of
	// this family.
	Family v1.IPFamily
	// ClusterIP is the Service's cluster IP of Family.
	ClusterIP netip.Addr
	// ExternalIPs are the Service's externalIPs of Family.
	ExternalIPs []netip.Addr
	// LoadBalancerIPs are the load-balancer ingress IPs of Family whose
	// ipMode is not Proxy.
	LoadBalancerIPs []netip.Addr
	// LoadBalancerSourceRanges are the prefixes of Family in
	// spec.loadBalancerSourceRanges, as kube-proxy's proxier of that
	// family takes them (trimmed, masked; nil when there are none or one
	// is /0, which allows everything): the only sources new flows to
	// LoadBalancerIPs may come from (Frontend.SourceRanges).
	LoadBalancerSourceRanges []netip.Prefix
	// ExternallyAccessible is true when any port of the Service has a
	// nodePort, the Service has externalIPs of Family, or it has a
	// load-balancer ingress IP of Family whose ipMode is not Proxy.
	ExternallyAccessible bool
	// InternalPolicyLocal is true when internalTrafficPolicy is Local.
	InternalPolicyLocal bool
	// ExternalPolicyLocal is true when the Service is externally accessible
	// and externalTrafficPolicy is Local.
	ExternalPolicyLocal bool
	// Affinity is the Service's session affinity.
	Affinity SessionAffinity
	// Annotations holds the Service's topolb.io/ annotations only.
	Annotations map[string]string
}

// SessionAffinity is a Service's sessionAffinity and its timeout.
type SessionAffinity struct {
	// ClientIP is true for sessionAffinity ClientIP: every new flow of one
	// client IP to the port goes to the same backend while that backend is
	// active and the affinity has not expired.
	ClientIP bool
	// TimeoutSeconds is sessionAffinityConfig.clientIP.timeoutSeconds
	// (default 10800, 1..86400); 0 without affinity.
	TimeoutSeconds int32
}

// UsesClusterEndpoints reports whether any traffic to the port is routed to
// the cluster-wide endpoint set: internal traffic with a Cluster policy, or
// any external traffic (even with externalTrafficPolicy Local, as kube-proxy
// does for short-circuited traffic).
func (p ServicePort) UsesClusterEndpoints() bool {
	return !p.InternalPolicyLocal || p.ExternallyAccessible
}

// UsesLocalEndpoints reports whether any traffic to the port is routed only
// to endpoints on this node.
func (p ServicePort) UsesLocalEndpoints() bool {
	return p.InternalPolicyLocal || p.ExternalPolicyLocal
}

// Frontends returns the cluster IP, the externalIPs and the load-balancer
// IPs, each with the service port, cluster IP first.
//
// Deprecated: it leaves out NodePorts and does not say which frontend uses
// which backend set; use ClusterFrontend, ExternalFrontends and
// NodeFrontends (frontends.go).
func (p ServicePort) Frontends() []netip.AddrPort {
	out := []netip.AddrPort{netip.AddrPortFrom(p.ClusterIP, p.Port)}
	for _, ip := range p.ExternalIPs {
		out = append(out, netip.AddrPortFrom(ip, p.Port))
	}
	for _, ip := range p.LoadBalancerIPs {
		out = append(out, netip.AddrPortFrom(ip, p.Port))
	}
	return out
}

// Decision is the outcome for one node and one service port.
type Decision struct {
	// Policy is the rule that chose the cluster set.
	Policy Policy
	// Mode is the topology mode the policy selected for this node.
	Mode Mode
	// Reason explains the mode in words, for people.
	Reason string
	// Backends are the endpoints internal traffic (to the cluster IP) may go
	// to: the local set under internalTrafficPolicy Local, else the cluster
	// set. Never nil; empty means traffic is dropped.
	Backends []Endpoint
	// Weights[i] is the fraction of this node's new internal flows that go
	// to Backends[i]. The weights are positive and sum to 1; never nil,
	// empty when Backends is. Only the ZoneWeighted policy makes them
	// unequal.
	Weights []float64
	// ExternalBackends are the endpoints external traffic may go to: the
	// local set under externalTrafficPolicy Local, else the cluster set. Nil
	// when the port is not externally accessible.
	ExternalBackends []Endpoint
	// ExternalWeights are the weights of ExternalBackends, as Weights are of
	// Backends; nil exactly when ExternalBackends is.
	ExternalWeights []float64
	// Draining are the serving endpoints (ready, or serving-terminating)
	// that are not in Backends: new flows never go to them, but a flow
	// already established with one keeps it. Never nil.
	Draining []Endpoint
	// ExternalDraining are the serving endpoints not in ExternalBackends;
	// nil exactly when ExternalBackends is.
	ExternalDraining []Endpoint
	// ClusterBackends are the cluster set: the endpoints the policy chose
	// for this node, which internal traffic uses under internalTrafficPolicy
	// Cluster, external traffic under externalTrafficPolicy Cluster, and
	// traffic from inside the node to an external frontend always (as
	// kube-proxy short-circuits it). Nil when the port never uses it
	// (internalTrafficPolicy Local and not externally accessible).
	ClusterBackends []Endpoint
	// ClusterWeights and ClusterDraining are to ClusterBackends what
	// Weights and Draining are to Backends; nil exactly when
	// ClusterBackends is.
	ClusterWeights  []float64
	ClusterDraining []Endpoint
	// WhenEmpty is what happens to a new flow that one of the port's sets
	// has no backend for: EmptyReject when the port has no usable endpoint
	// anywhere (none ready, none serving-terminating), EmptyDrop when it
	// has some but this node's policy deliberately leaves the set empty
	// (traffic policy Local without a local endpoint, topology-keys without
	// a match), as kube-proxy does. Always set; it matters only for an
	// empty set.
	WhenEmpty EmptyAction
}

// EmptyAction is what the datapath does with a new flow for which a set has
// no backend.
type EmptyAction string

const (
	// EmptyReject answers at once: a TCP reset, or ICMP port unreachable,
	// as kube-proxy rejects connections to Services without endpoints.
	EmptyReject EmptyAction = "reject"
	// EmptyDrop drops the packet silently, as kube-proxy does when a
	// traffic policy leaves a node without endpoints.
	EmptyDrop EmptyAction = "drop"
)

// Options are the switches a decision honors. They are arguments, never
// globals, so a test or a simulation can flip them per call.
type Options struct {
	// PreferSameTrafficDistribution enables node hints (hints.forNodes), as
	// kube-proxy's feature gate of that name does.
	PreferSameTrafficDistribution bool
	// NodePortAddresses, when not empty, selects the node addresses
	// NodePorts are served on, per family as kube-proxy's
	// --nodeport-addresses: in a family with prefixes of that family,
	// the node's addresses inside any of them; in a family without, the
	// node's InternalIP and ExternalIP addresses of that family, as when
	// it is empty. A prefix that holds LoopbackNodePortAddr also serves
	// IPv4 NodePorts there to the node's own processes (kube-proxy's
	// localhost NodePorts, IPv4 only).
	NodePortAddresses []netip.Prefix
	// ClusterIPsFromOutside serves cluster IPs to traffic that arrives on
	// an uplink (a router that sends the service CIDR to nodes), with the
	// internal backend set, as kube-proxy serves a cluster IP to any
	// packet that reaches the node. Off: cluster IPs are served from
	// inside the node only.
	ClusterIPsFromOutside bool
	// NodePortRange is the range of valid nodePorts (the apiserver's
	// --service-node-port-range); a nodePort outside it is not served. The
	// zero value means DefaultNodePortRange.
	NodePortRange portrange.Range
	// Caps bound what one Service may take of the node's datapath
	// tables; a Service over one is refused whole (Caps). The zero value
	// caps nothing.
	Caps Caps
}

// DefaultNodePortRange is the apiserver's default --service-node-port-range.
var DefaultNodePortRange = portrange.Range{Min: 30000, Max: 32767}

// nodePortRange returns the range in force.
func (o Options) nodePortRange() portrange.Range {
	if o.NodePortRange == (portrange.Range{}) {
		return DefaultNodePortRange
	}
	return o.NodePortRange
}

// DefaultOptions returns the options kube-proxy v1.37 runs with.
func DefaultOptions() Options {
	return Options{PreferSameTrafficDistribution: true, NodePortRange: DefaultNodePortRange, Caps: DefaultCaps}
}

// ParseNodePortAddresses parses the CIDRs of --nodeport-addresses (the
// agent's and explain's flag, as kube-proxy's), masked; nil for none.
func ParseNodePortAddresses(cidrs []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range cidrs {
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			return nil, fmt.Errorf("--nodeport-addresses %q: %w", s, err)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}
