package hintsim

import v1 "k8s.io/api/core/v1"

// Report is the JSON contract of `topolbctl hints simulate -o json`. Field
// names and their meaning are stable; lists are never null and are sorted as
// each field says. Ratios and loads are rounded to 4 decimal places.
type Report struct {
	// Nodes is what the EndpointSlice controller's topology cache learns
	// from the Nodes, shared by every Service.
	Nodes NodeInfo `json:"nodes"`
	// Services holds one entry per Service the controller would add hints
	// to, or whose slices carry hints now, per IP family, sorted by
	// "namespace/name" and then family (IPv4 first).
	Services []Service `json:"services"`
}

// NodeInfo is the topology cache's view of the Nodes: the CPU each zone
// contributes and whether that is enough to allocate hints.
type NodeInfo struct {
	// Sufficient is true when the cache has CPU ratios: every Ready node
	// outside the control plane has a zone label and allocatable CPU, and
	// at least two zones have such nodes. Without them the controller
	// removes the hints of every topology-mode Auto Service.
	Sufficient bool `json:"sufficient"`
	// Reason says why the node information is insufficient, naming the
	// node when one is to blame; "" when sufficient.
	Reason string `json:"reason"`
	// Node is the first node, by name, that lacks a zone label or
	// allocatable CPU; "" if there is none.
	Node string `json:"node"`
	// Zones are the zones of the nodes the cache counts, sorted by name.
	// Nodes without a zone or CPU are left out of every zone.
	Zones []Zone `json:"zones"`
	// Ignored are the nodes the cache leaves out of its capacity
	// calculation, sorted by name.
	Ignored []IgnoredNode `json:"ignored"`
}

// Zone is one zone's share of the cluster's allocatable CPU.
type Zone struct {
	Zone string `json:"zone"`
	// Nodes is the number of nodes counted in the zone.
	Nodes int `json:"nodes"`
	// CPU is the zone's allocatable CPU as a Kubernetes quantity ("8",
	// "7500m").
	CPU string `json:"cpu"`
	// CPURatio is the zone's fraction of the counted CPU, which the
	// controller takes as the zone's share of the traffic; null when the
	// node information is insufficient (the controller then has none).
	CPURatio *float64 `json:"cpuRatio"`
}

// IgnoredNode is a node the topology cache does not count.
type IgnoredNode struct {
	Node string `json:"node"`
	// Reason is one of:
	//   - "control-plane": the node has the
	//     node-role.kubernetes.io/control-plane or .../master label;
	//   - "not Ready": its Ready condition is not True;
	//   - "no Ready condition": it has none (common in hand-written
	//     manifests; the controller treats it as not Ready).
	Reason string `json:"reason"`
}

// Method is how the EndpointSlice controller manages a Service's hints.
type Method string

// The methods, chosen as the v1.37 reconciler chooses them.
const (
	// MethodTopologyCache: the topology-mode annotation is Auto (or the
	// deprecated topology-aware-hints annotation is auto); hints are
	// allocated in proportion to each zone's CPU by the topology cache.
	MethodTopologyCache Method = "TopologyCache"
	// MethodTrafficDistribution: spec.trafficDistribution is PreferClose,
	// PreferSameZone or PreferSameNode (and no Auto annotation); every
	// ready endpoint is hinted for its own zone (and, for PreferSameNode,
	// its own node).
	MethodTrafficDistribution Method = "TrafficDistribution"
	// MethodNone: neither; the controller removes any hints.
	MethodNone Method = "None"
	// MethodUnmanaged: the Service has no selector, so the controller does
	// not manage its slices at all and their hints stay as they are.
	MethodUnmanaged Method = "Unmanaged"
)

// Service is the simulation of one Service's hints.
type Service struct {
	// Service is "namespace/name".
	Service string `json:"service"`
	// Family is the IP family simulated: the controller reconciles each
	// address type's slices on its own, so a dual-stack Service is
	// reported once per family, each with its own hints.
	Family v1.IPFamily `json:"family"`
	// Method is how the controller manages the Service's hints.
	Method Method `json:"method"`
	// Trigger is the annotation or field that asks for hints, such as
	// "service.kubernetes.io/topology-mode=Auto" or
	// "trafficDistribution=PreferClose"; "" when none does. An Unmanaged
	// Service keeps the trigger it would have had with a selector.
	Trigger string `json:"trigger"`
	// HintsEnabled is true when the controller would leave at least one
	// ready endpoint with a hint.
	HintsEnabled bool `json:"hintsEnabled"`
	// DisabledReason is the message of the TopologyAwareHintsDisabled
	// event the controller would record, exactly as the topology cache
	// words it; "" when it records none.
	DisabledReason string `json:"disabledReason"`
	// DisabledDetail names what DisabledReason does not: the node without
	// a zone or CPU, the endpoint without a zone; "" when there is nothing
	// to add.
	DisabledDetail string `json:"disabledDetail"`
	// ReadyEndpoints counts the ready endpoints of the Service's slices
	// of Family (a nil ready condition counts as ready).
	ReadyEndpoints int `json:"readyEndpoints"`
	// Zones are the zones of the cluster, of the endpoints and of their
	// hints, sorted by name.
	Zones []ServiceZone `json:"zones"`
	// Endpoints are every endpoint of the Service's slices of Family,
	// sorted by slice name and then in slice order.
	Endpoints []Endpoint `json:"endpoints"`
	// Notes explain the result, for people.
	Notes []string `json:"notes"`
	// Warnings name current hints that differ from the controller's and
	// zones whose endpoints would be overloaded by the current hints.
	Warnings []string `json:"warnings"`
}

// ServiceZone is one zone of one Service: its traffic share, its endpoints,
// the hints for it now and from the controller, and the load its endpoints
// would carry if the current hints were followed.
type ServiceZone struct {
	Zone string `json:"zone"`
	// CPURatio is the zone's share of the traffic (see Zone.CPURatio).
	CPURatio *float64 `json:"cpuRatio"`
	// Endpoints counts the ready endpoints whose zone is this zone.
	Endpoints int `json:"endpoints"`
	// CurrentHints counts the ready endpoints hinted for this zone now.
	CurrentHints int `json:"currentHints"`
	// Allocation counts the ready endpoints the controller would hint for
	// this zone.
	Allocation int `json:"allocation"`
	// ExpectedLoad is the highest expected load, relative to an even
	// share, among the ready endpoints currently hinted for this zone, if
	// every node routes by the current hints as kube-proxy does; null when
	// no endpoint is hinted for the zone or the load cannot be estimated.
	ExpectedLoad *float64 `json:"expectedLoad"`
	// Overloaded is true when ExpectedLoad exceeds 1.2, the controller's
	// own overload threshold.
	Overloaded bool `json:"overloaded"`
	// ZoneWeightedShare is the fraction of the new flows of this zone's
	// nodes that topolb's ZoneWeighted policy would keep in the zone; null
	// when no node of the zone sends traffic in the model or there is no
	// estimate.
	ZoneWeightedShare *float64 `json:"zoneWeightedShare"`
	// ZoneWeightedLoad is the highest expected load, relative to an even
	// share, among the ready endpoints whose zone is this zone, if every
	// node routes by the ZoneWeighted policy; null when the zone has no
	// ready endpoint or there is no estimate.
	ZoneWeightedLoad *float64 `json:"zoneWeightedLoad"`
}

// Endpoint is one endpoint of one slice, with its hints now and after the
// controller's next sync.
type Endpoint struct {
	// Address is the endpoint's first address, "" if it has none.
	Address string `json:"address"`
	// Slice is the name of the EndpointSlice holding the endpoint.
	Slice string `json:"slice"`
	// Zone and Node are the endpoint's zone and nodeName, "" when unset.
	Zone string `json:"zone"`
	Node string `json:"node"`
	// Ready is the endpoint's ready condition, nil counting as true.
	Ready bool `json:"ready"`
	// CurrentHints are the hints the slice carries now.
	CurrentHints Hints `json:"currentHints"`
	// ControllerHints are the hints the controller would leave.
	ControllerHints Hints `json:"controllerHints"`
	// Changed is true when ControllerHints differ from CurrentHints.
	Changed bool `json:"changed"`
	// ExpectedLoad is the traffic the endpoint would receive, relative to
	// an even share (1.0), if every node routes by the current hints;
	// null for endpoints that are not ready or when the load cannot be
	// estimated.
	ExpectedLoad *float64 `json:"expectedLoad"`
	// Overloaded is true when ExpectedLoad exceeds 1.2.
	Overloaded bool `json:"overloaded"`
	// ZoneWeightedLoad is the traffic the endpoint would receive, relative
	// to an even share, if every node routes by topolb's ZoneWeighted
	// policy; null for endpoints that are not ready or when there is no
	// estimate.
	ZoneWeightedLoad *float64 `json:"zoneWeightedLoad"`
}

// Hints are an endpoint's hints.forZones and hints.forNodes names, in slice
// order; empty (never null) when there are none.
type Hints struct {
	Zones []string `json:"zones"`
	Nodes []string `json:"nodes"`
}
