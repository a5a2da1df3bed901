package topology

import (
	"math"
	"math/big"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// cpuNode builds a node in zone with cpu cores allocatable and a Ready
// condition status ("" for none).
func cpuNode(name, zone string, cores int64, ready v1.ConditionStatus) Node {
	labels := map[string]string{LabelHostname: name}
	if zone != "" {
		labels[LabelZone] = zone
	}
	return Node{Name: name, Labels: labels, AllocatableMilliCPU: cores * 1000, Ready: ready}
}

func nodeMap(ns ...Node) map[string]Node {
	m := make(map[string]Node, len(ns))
	for _, n := range ns {
		m[n.Name] = n
	}
	return m
}

func zoneWeightedPort() ServicePort {
	return clusterPort(map[string]string{AnnotationZoneWeighted: "true"})
}

// rat parses "2/3" or "1"; the test's expected weights are exact.
func rat(t *testing.T, s string) float64 {
	t.Helper()
	r, ok := new(big.Rat).SetString(s)
	if !ok {
		t.Fatalf("bad rational %q", s)
	}
	f, _ := r.Float64()
	return f
}

func TestZoneWeighted(t *testing.T) {
	T := v1.ConditionTrue
	// equalAB: one node per zone, equal CPU.
	equalAB := nodeMap(cpuNode("a1", "zone-a", 4, T), cpuNode("b1", "zone-b", 4, T))
	threeZones := nodeMap(cpuNode("a1", "zone-a", 4, T), cpuNode("b1", "zone-b", 4, T), cpuNode("c1", "zone-c", 4, T))
	cases := []struct {
		name  string
		nodes map[string]Node
		node  string
		port  ServicePort // zero: zoneWeightedPort()
		eps   []Endpoint
		mode  Mode
		// weights maps the last octet of every internal backend to its
		// exact weight; a usable endpoint missing from it must not be a
		// backend.
		weights map[int]string
		// external, when non-nil, is the same for the external set.
		external map[int]string
		reason   string
	}{
		{name: "issue example: zone-a node keeps 2/3 and spills 1/6 to each zone-b endpoint", nodes: equalAB, node: "a1",
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b")},
			mode:    ModeZoneWeighted,
			weights: map[int]string{1: "2/3", 2: "1/6", 3: "1/6"},
			reason:  "zone-a has 1 of 3 ready endpoints (33.3%) and 50% of the demand by allocatable CPU: keeps 66.7% of new flows in zone-a, spills 33.3% to zone-b"},
		{name: "issue example: zone-b node keeps everything, 1/2 each", nodes: equalAB, node: "b1",
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b")},
			mode:    ModePreferSameZone,
			weights: map[int]string{2: "1/2", 3: "1/2"},
			reason:  "keeps all new flows in zone-b"},
		{name: "demand follows CPU, not node count", node: "b1",
			nodes: nodeMap(cpuNode("a1", "zone-a", 2, T), cpuNode("a2", "zone-a", 2, T), cpuNode("b1", "zone-b", 12, T)),
			// D_a = 1/4, D_b = 3/4; S_a = S_b = 1/2: zone-b keeps 2/3.
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			mode:    ModeZoneWeighted,
			weights: map[int]string{1: "1/3", 2: "2/3"},
			reason:  "75% of the demand by allocatable CPU"},
		{name: "a node without CPU turns the measure into node counts", node: "b1",
			nodes: nodeMap(cpuNode("a1", "zone-a", 2, T), cpuNode("a2", "zone-a", 0, T), cpuNode("b1", "zone-b", 12, T)),
			// D_a = 2/3, D_b = 1/3; S_b = 1/2 ≥ D_b: keep all.
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			mode:    ModePreferSameZone,
			weights: map[int]string{2: "1"},
			reason:  "by node count (node a2 has no allocatable CPU)"},
		{name: "negative CPU counts as lacking", node: "a1",
			nodes: nodeMap(cpuNode("a1", "zone-a", 4, T), cpuNode("b1", "zone-b", -4, T)),
			eps:   []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			mode:  ModePreferSameZone, weights: map[int]string{1: "1"},
			reason: "node b1 has invalid allocatable CPU -4000m"},
		{name: "Ready=False nodes are not demand; Unknown and absent are", node: "a1",
			nodes: nodeMap(cpuNode("a1", "zone-a", 4, v1.ConditionUnknown), cpuNode("b1", "zone-b", 4, ""), cpuNode("b2", "zone-b", 4, v1.ConditionFalse)),
			// D_a = D_b = 1/2 (b2 not counted); S_a = 1/4: keep 1/2.
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b"), ep(4, "b2", "zone-b")},
			mode:    ModeZoneWeighted,
			weights: map[int]string{1: "1/2", 2: "1/6", 3: "1/6", 4: "1/6"}},
		{name: "node without a zone: equal shares", nodes: equalAB, node: "nz",
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b")},
			mode:    ModeNone,
			weights: map[int]string{1: "1/3", 2: "1/3", 3: "1/3"},
			reason:  "node nz has no topology.kubernetes.io/zone label: equal shares over 3 ready endpoints"},
		{name: "zone without a counted node: equal shares", node: "c1",
			nodes:   nodeMap(cpuNode("a1", "zone-a", 4, T), cpuNode("c1", "zone-c", 4, v1.ConditionFalse)),
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "c1", "zone-c")},
			mode:    ModeNone,
			weights: map[int]string{1: "1/2", 2: "1/2"},
			reason:  "zone-c has no Node with a zone label that is not Ready=False"},
		{name: "no endpoint in this zone: everything spills by surplus", node: "a1",
			nodes: nodeMap(cpuNode("a1", "zone-a", 4, T), cpuNode("b1", "zone-b", 2, T), cpuNode("c1", "zone-c", 2, T)),
			// D = 1/2, 1/4, 1/4; S_b = 1/3, S_c = 2/3; surplus 1/12 and
			// 5/12: zone-b gets 1/6 (1/12 each), zone-c 5/6 (5/24 each).
			eps:     []Endpoint{ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b"), ep(4, "c1", "zone-c"), ep(5, "c1", "zone-c"), ep(6, "c1", "zone-c"), ep(7, "c1", "zone-c")},
			mode:    ModeZoneWeighted,
			weights: map[int]string{2: "1/12", 3: "1/12", 4: "5/24", 5: "5/24", 6: "5/24", 7: "5/24"},
			reason:  "keeps 0% of new flows in zone-a, spills 16.7% to zone-b, 83.3% to zone-c"},
		{name: "a zone without surplus gets no spill", nodes: threeZones, node: "a1",
			// S = 1/6, 1/6, 4/6 against 1/3 each: only zone-c has room.
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "c1", "zone-c"), ep(4, "c1", "zone-c"), ep(5, "c1", "zone-c"), ep(6, "c1", "zone-c")},
			mode:    ModeZoneWeighted,
			weights: map[int]string{1: "1/2", 3: "1/8", 4: "1/8", 5: "1/8", 6: "1/8"}},
		{name: "a zone with exactly its demand gets no spill, not a weight of 0", nodes: threeZones, node: "a1",
			// S_b = 1/3 = D_b: surplus 0; zone-c has 1/3 of surplus.
			eps:     []Endpoint{ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b"), ep(4, "c1", "zone-c"), ep(5, "c1", "zone-c"), ep(6, "c1", "zone-c"), ep(7, "c1", "zone-c")},
			mode:    ModeZoneWeighted,
			weights: map[int]string{4: "1/4", 5: "1/4", 6: "1/4", 7: "1/4"}},
		{name: "endpoints without a zone are a group with no demand", nodes: equalAB, node: "a1",
			// S_a = 1/4, S_b = 1/4, S_"" = 1/2 (surplus 1/2), zone-b
			// surplus 0: zone-a keeps 1/2, the rest goes to the zone-less.
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "x", ""), ep(4, "y", "")},
			mode:    ModeZoneWeighted,
			weights: map[int]string{1: "1/2", 3: "1/4", 4: "1/4"},
			reason:  "to endpoints without a zone"},
		{name: "all endpoints in this zone: equal shares, mode None", nodes: equalAB, node: "a1",
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "a1", "zone-a")},
			mode:    ModeNone,
			weights: map[int]string{1: "1/2", 2: "1/2"}},
		{name: "equal demand and supply: each zone keeps its own", nodes: threeZones, node: "a1",
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "c1", "zone-c")},
			mode:    ModePreferSameZone,
			weights: map[int]string{1: "1"}},
		{name: "a spill that comes out even is equal shares, mode None", node: "a1",
			// Only zone-a has demand: it keeps S_a = 1/3 and spills 2/3
			// to zone-b, whose endpoints get 1/3 each too.
			nodes:   nodeMap(cpuNode("a1", "zone-a", 4, T)),
			eps:     []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b")},
			mode:    ModeNone,
			weights: map[int]string{1: "1/3", 2: "1/3", 3: "1/3"},
			reason:  "the result is equal shares"},
		{name: "serving-terminating endpoints when none is ready", nodes: equalAB, node: "a1",
			eps:     []Endpoint{ep(1, "a1", "zone-a", terminating(true)), ep(2, "b1", "zone-b", terminating(true)), ep(3, "b1", "zone-b", terminating(true)), ep(4, "a1", "zone-a", unready)},
			mode:    ModeZoneWeighted,
			weights: map[int]string{1: "2/3", 2: "1/6", 3: "1/6"}},
		{name: "no usable endpoint: no backends", nodes: equalAB, node: "a1",
			eps:  []Endpoint{ep(1, "a1", "zone-a", unready)},
			mode: ModeNone, weights: map[int]string{}},
		{name: "iTP Local keeps its rule: local endpoints, equal shares", nodes: equalAB, node: "a1",
			port: func() ServicePort { p := zoneWeightedPort(); p.InternalPolicyLocal = true; return p }(),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "a1", "zone-a"), ep(3, "b1", "zone-b")},
			mode: ModeNone, weights: map[int]string{1: "1/2", 2: "1/2"}},
		{name: "eTP Local: external local and equal, internal weighted", nodes: equalAB, node: "a1",
			port: func() ServicePort {
				p := zoneWeightedPort()
				p.NodePort, p.ExternallyAccessible, p.ExternalPolicyLocal = 30080, true, true
				return p
			}(),
			eps:      []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b")},
			mode:     ModeZoneWeighted,
			weights:  map[int]string{1: "2/3", 2: "1/6", 3: "1/6"},
			external: map[int]string{1: "1"}},
		{name: "eTP Cluster: external uses the weighted cluster set", nodes: equalAB, node: "a1",
			port: func() ServicePort {
				p := zoneWeightedPort()
				p.NodePort, p.ExternallyAccessible = 30080, true
				return p
			}(),
			eps:      []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b")},
			mode:     ModeZoneWeighted,
			weights:  map[int]string{1: "2/3", 2: "1/6", 3: "1/6"},
			external: map[int]string{1: "2/3", 2: "1/6", 3: "1/6"}},
		{name: "zone-threshold takes precedence", nodes: equalAB, node: "a1",
			port: clusterPort(map[string]string{AnnotationZoneWeighted: "true", AnnotationZoneThreshold: "1"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b")},
			mode: ModePreferSameZone, weights: map[int]string{1: "1"}},
		{name: "invalid value is ignored with a reason", nodes: equalAB, node: "a1",
			port: clusterPort(map[string]string{AnnotationZoneWeighted: "yes"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			mode: ModeNone, weights: map[int]string{1: "1/2", 2: "1/2"},
			reason: `ignoring invalid topolb.io/zone-weighted "yes" (want true)`},
		{name: "other policies get equal shares", nodes: equalAB, node: "a1",
			port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "a1", "zone-a", zones("zone-a")), ep(3, "b1", "zone-b", zones("zone-b"))},
			mode: ModePreferSameZone, weights: map[int]string{1: "1/2", 2: "1/2"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			nodes := tc.nodes
			node, ok := nodes[tc.node]
			if !ok {
				node = testNodes[tc.node]
			}
			port := tc.port
			if port.Port == 0 {
				port = zoneWeightedPort()
			}
			d := Decide(Input{Node: node, Nodes: nodes, Port: port, Endpoints: tc.eps}, DefaultOptions())
			if d.Mode != tc.mode {
				t.Errorf("mode = %s, want %s (reason %q)", d.Mode, tc.mode, d.Reason)
			}
			if !strings.Contains(d.Reason, tc.reason) {
				t.Errorf("reason %q does not contain %q", d.Reason, tc.reason)
			}
			checkWeights(t, "internal", d.Backends, d.Weights, tc.weights)
			if tc.external != nil {
				checkWeights(t, "external", d.ExternalBackends, d.ExternalWeights, tc.external)
			}
		})
	}
}

func checkWeights(t *testing.T, set string, eps []Endpoint, ws []float64, want map[int]string) {
	t.Helper()
	if len(eps) != len(ws) {
		t.Fatalf("%s: %d backends but %d weights", set, len(eps), len(ws))
	}
	got := map[int]float64{}
	for i, e := range eps {
		got[int(e.Addr.Addr().As4()[3])] = ws[i]
	}
	if len(got) != len(want) {
		t.Errorf("%s: backends %v, want %v", set, got, want)
	}
	for octet, w := range want {
		g, ok := got[octet]
		if !ok {
			t.Errorf("%s: backend .%d missing (got %v)", set, octet, got)
			continue
		}
		if math.Abs(g-rat(t, w)) > 1e-12 {
			t.Errorf("%s: weight of .%d = %v, want %s", set, octet, g, w)
		}
	}
}

func TestZoneDemand(t *testing.T) {
	T := v1.ConditionTrue
	d := ZoneDemand(nodeMap(cpuNode("a1", "zone-a", 4, T), cpuNode("a2", "zone-a", 2, T), cpuNode("b1", "zone-b", 4, v1.ConditionFalse), cpuNode("nz", "", 8, T)))
	if d.ByNodeCount || d.Total != 6000 || d.Zone["zone-a"] != 6000 || len(d.Zone) != 1 {
		t.Errorf("CPU demand = %+v, want zone-a 6000m of 6000m", d)
	}
	d = ZoneDemand(nodeMap(cpuNode("a1", "zone-a", 4, T), cpuNode("b2", "zone-b", 0, T), cpuNode("b1", "zone-b", 0, T), cpuNode("c1", "zone-c", 0, v1.ConditionFalse)))
	if !d.ByNodeCount || d.Total != 3 || d.Zone["zone-b"] != 2 || d.Lacking != "node b1 has no allocatable CPU" {
		t.Errorf("count demand = %+v, want 3 nodes, zone-b 2, lacking names b1", d)
	}
	if d := ZoneDemand(nil); d.Total != 0 || d.Zone == nil {
		t.Errorf("empty demand = %+v", d)
	}
	big := cpuNode("a1", "zone-a", 0, T)
	big.AllocatableMilliCPU = (MaxNodeCPUCores + 1) * 1000
	if d := ZoneDemand(nodeMap(big, cpuNode("b1", "zone-b", 4, T))); !d.ByNodeCount {
		t.Errorf("absurd CPU should count as lacking: %+v", d)
	}
}

// TestEqualWeights: weights count as equal within float rounding of exact
// fractions, and unequal from well below the datapath's finest share (a
// millionth).
func TestEqualWeights(t *testing.T) {
	third := 1.0 / 3
	for _, tc := range []struct {
		name string
		ws   []float64
		want bool
	}{
		{"none", nil, true},
		{"one", []float64{1}, true},
		{"thirds", []float64{third, third, 1 - 2*third}, true},
		{"rounding apart", []float64{0.5, 0.5 + 1e-12}, true},
		{"a ten-millionth apart", []float64{0.5, 0.5 + 1e-7}, false},
		{"zone-weighted", []float64{2.0 / 3, 1.0 / 6, 1.0 / 6}, false},
	} {
		if got := EqualWeights(tc.ws); got != tc.want {
			t.Errorf("%s: EqualWeights(%v) = %v, want %v", tc.name, tc.ws, got, tc.want)
		}
	}
}
