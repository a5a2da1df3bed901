package hintsim

import (
	"fmt"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// Labels that keep a node out of the topology cache's capacity calculation
// (topologycache.hasExcludedLabels).
var excludedLabels = []string{
	"node-role.kubernetes.io/control-plane",
	"node-role.kubernetes.io/master",
}

// source is a node that, in the cache's model, originates traffic in
// proportion to its allocatable CPU.
type source struct {
	name      string
	cpuMillis int64
}

// nodeInfo walks the nodes, sorted by name, the way
// topologycache.TopologyCache.SetNodes does, and says what the cache makes of
// them. The cache only logs why node information is insufficient; this
// walk names the first node to blame. It also returns the traffic sources
// (the counted nodes) and their total CPU in millicores; both are empty when
// the information is insufficient.
func nodeInfo(nodes []*v1.Node) (NodeInfo, []source, int64) {
	info := NodeInfo{Zones: []Zone{}, Ignored: []IgnoredNode{}}
	cpuByZone := map[string]*resource.Quantity{}
	nodesByZone := map[string]int{}
	var sources []source
	var total int64
	for _, n := range nodes {
		if hasExcludedLabel(n.Labels) {
			info.Ignored = append(info.Ignored, IgnoredNode{Node: n.Name, Reason: "control-plane"})
			continue
		}
		if ready, known := nodeReady(n); !ready {
			reason := "not Ready"
			if !known {
				reason = "no Ready condition"
			}
			info.Ignored = append(info.Ignored, IgnoredNode{Node: n.Name, Reason: reason})
			continue
		}
		zone, hasZone := n.Labels[v1.LabelTopologyZone]
		cpu := n.Status.Allocatable.Cpu()
		var problem string
		switch {
		case !hasZone:
			problem = fmt.Sprintf("node %s has no %s label", n.Name, v1.LabelTopologyZone)
		case zone == "":
			problem = fmt.Sprintf("node %s has an empty %s label", n.Name, v1.LabelTopologyZone)
		case cpu.IsZero():
			problem = fmt.Sprintf("node %s has no allocatable CPU", n.Name)
		}
		if problem != "" {
			// The cache stops at the first such node; keep walking only
			// to list the ignored ones.
			if info.Node == "" {
				info.Node, info.Reason = n.Name, problem
			}
			continue
		}
		if q, ok := cpuByZone[zone]; ok {
			q.Add(*cpu)
		} else {
			c := cpu.DeepCopy()
			cpuByZone[zone] = &c
		}
		nodesByZone[zone]++
		sources = append(sources, source{name: n.Name, cpuMillis: cpu.MilliValue()})
		total += cpu.MilliValue()
	}

	zones := make([]string, 0, len(cpuByZone))
	for z := range cpuByZone {
		zones = append(zones, z)
	}
	sort.Strings(zones)
	switch {
	case info.Node != "":
	case total == 0:
		info.Reason = "no Ready node outside the control plane has a zone and allocatable CPU"
	case len(zones) < 2:
		info.Reason = fmt.Sprintf("fewer than 2 zones: only %s has Ready nodes outside the control plane", strings.Join(zones, ""))
	default:
		info.Sufficient = true
	}
	for _, z := range zones {
		zi := Zone{Zone: z, Nodes: nodesByZone[z], CPU: cpuByZone[z].String()}
		if info.Sufficient {
			zi.CPURatio = ratio(cpuByZone[z].MilliValue(), total)
		}
		info.Zones = append(info.Zones, zi)
	}
	if !info.Sufficient {
		return info, nil, 0
	}
	return info, sources, total
}

func hasExcludedLabel(labels map[string]string) bool {
	for _, l := range excludedLabels {
		if _, ok := labels[l]; ok {
			return true
		}
	}
	return false
}

// nodeReady mirrors the cache: a node is ready only with a Ready condition
// whose status is True; a node without one is not. known is false when the
// node has no Ready condition at all.
func nodeReady(n *v1.Node) (ready, known bool) {
	for _, c := range n.Status.Conditions {
		if c.Type == v1.NodeReady {
			return c.Status == v1.ConditionTrue, true
		}
	}
	return false, false
}

func ratio(part, total int64) *float64 {
	r := round4(float64(part) / float64(total))
	return &r
}
