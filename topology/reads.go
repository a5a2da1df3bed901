package topology

import "slices"

// NodeReads says what a port's decision and frontends on one node read of
// the Nodes, so that whoever keeps decisions up to date (the agent) knows
// which Node changes require deciding the port again. It is derived from
// the same policy choice Decide makes, so the two cannot drift apart:
//
//	policy          this node                 other nodes
//	Hints           zone label                nothing
//	Disabled        nothing                   nothing
//	TopologyKeys    the keys' labels          the keys' labels (of endpoints' nodes)
//	ZoneThreshold   zone label                nothing
//	ZoneWeighted    zone label; and, of every node, zone label, allocatable CPU, Ready
//
// A port whose traffic never uses the cluster set (internalTrafficPolicy
// Local, not externally accessible) reads nothing of the policy. Every
// port reads this node's name (constant), and a port with a nodePort reads
// this node's addresses (NodePort frontends).
type NodeReads struct {
	// SelfLabels are the label keys of this node the decision reads.
	SelfLabels []string
	// SelfAddresses is true when the port's frontends read this node's
	// addresses.
	SelfAddresses bool
	// OtherLabels are the label keys the decision reads on the nodes of
	// the port's endpoints (TopologyKeys).
	OtherLabels []string
	// Capacity is true when the decision reads every node's zone label,
	// allocatable CPU and Ready condition (ZoneWeighted's Demand).
	Capacity bool
}

// Reads returns what the port's decision and frontends read of the Nodes.
func (p ServicePort) Reads() NodeReads {
	// NodePort frontends and the node's pass through source ranges
	// (Frontend.SourceRanges) read this node's addresses.
	r := NodeReads{SelfAddresses: p.NodePort != 0 || len(p.LoadBalancerSourceRanges) > 0 && len(p.LoadBalancerIPs) > 0}
	if !p.UsesClusterEndpoints() {
		return r
	}
	policy, choice, _ := choosePolicy(p.Annotations)
	switch policy {
	case PolicyHints, PolicyZoneThreshold:
		r.SelfLabels = []string{LabelZone}
	case PolicyTopologyKeys:
		for _, k := range choice.keys {
			if k != "*" {
				r.SelfLabels = append(r.SelfLabels, k)
			}
		}
		r.OtherLabels = r.SelfLabels
	case PolicyZoneWeighted:
		r.SelfLabels = []string{LabelZone}
		r.Capacity = true
	}
	return r
}

// Affected reports whether a change of one Node from old to new can change
// the port's decision or frontends on this node. self says whether the
// changed Node is this node; nil stands for a Node that does not exist
// (added: old is nil; deleted: new is nil), which reads as a Node without
// labels, CPU, readiness or addresses, as Decide treats an unknown node.
func (r NodeReads) Affected(self bool, old, new *Node) bool {
	var o, n Node
	if old != nil {
		o = *old
	}
	if new != nil {
		n = *new
	}
	if r.Capacity && demandOf(o) != demandOf(n) {
		return true
	}
	keys := r.OtherLabels
	if self {
		keys = r.SelfLabels
		if r.SelfAddresses && !slices.Equal(o.Addresses, n.Addresses) {
			return true
		}
	}
	for _, k := range keys {
		ov, oOK := o.Labels[k]
		nv, nOK := n.Labels[k]
		if oOK != nOK || ov != nv {
			return true
		}
	}
	return false
}

// demandFacts are what ZoneDemand reads of one node.
type demandFacts struct {
	counted bool
	zone    string
	cpu     int64
	hasCPU  bool
}

func demandOf(n Node) demandFacts {
	if !countsForDemand(n) {
		return demandFacts{}
	}
	return demandFacts{counted: true, zone: n.Zone(), cpu: n.AllocatableMilliCPU, hasCPU: n.hasCPU()}
}
