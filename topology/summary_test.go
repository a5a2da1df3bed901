package topology

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
)

// summaryNodes is a cluster with every case the summary must carry
// exactly: nodes counted and not (NotReady, no zone), CPU absent and
// invalid, labels a topology key names on some nodes only.
func summaryNodes() map[string]Node {
	T, F, U := v1.ConditionTrue, v1.ConditionFalse, v1.ConditionUnknown
	withLabel := func(n Node, k, v string) Node { n.Labels[k] = v; return n }
	return nodeMap(
		withLabel(cpuNode("a1", "zone-a", 4, T), "rack", "r1"),
		withLabel(cpuNode("a2", "zone-a", 8, U), "rack", "r2"),
		withLabel(cpuNode("b1", "zone-b", 4, ""), "rack", "r1"),
		cpuNode("b2", "zone-b", 16, F),
		cpuNode("c1", "zone-c", 2, T),
		withLabel(cpuNode("nz", "", 4, T), "rack", "r2"),
	)
}

// withoutCPU returns nodes with the named node's CPU set to milli.
func withCPU(nodes map[string]Node, name string, milli int64) map[string]Node {
	out := maps.Clone(nodes)
	n := out[name]
	n.AllocatableMilliCPU = milli
	out[name] = n
	return out
}

// TestSummaryDecidesAsAllNodes decides zone-weighted and topology-keys
// Services once from every Node, as an agent watching all of them does,
// and once from this node and the summary of the others, as an agent with
// --node-watch=own does: the decisions must be the same.
func TestSummaryDecidesAsAllNodes(t *testing.T) {
	eps := []Endpoint{
		ep(1, "a1", "zone-a"), ep(2, "a2", "zone-a"), ep(3, "b1", "zone-b"),
		ep(4, "b2", "zone-b"), ep(5, "c1", "zone-c"), ep(6, "nz", ""), ep(7, "gone", "zone-a"),
	}
	ports := map[string]ServicePort{
		"zone-weighted":     zoneWeightedPort(),
		"keys rack then *":  clusterPort(map[string]string{AnnotationTopologyKeys: "rack,*"}),
		"keys zone, region": clusterPort(map[string]string{AnnotationTopologyKeys: LabelZone + "," + LabelRegion}),
		"keys hostname":     clusterPort(map[string]string{AnnotationTopologyKeys: LabelHostname}),
	}
	keys := []string{LabelHostname, LabelRegion, LabelZone, "rack"}
	cases := []struct {
		name  string
		nodes map[string]Node
	}{
		{name: "mixed cluster", nodes: summaryNodes()},
		{name: "a counted node lacks CPU: demand by node count", nodes: withCPU(summaryNodes(), "c1", 0)},
		{name: "a counted node has invalid CPU", nodes: withCPU(summaryNodes(), "a2", math.MaxInt64)},
		{name: "a node not counted lacks CPU: still by CPU", nodes: withCPU(summaryNodes(), "b2", 0)},
	}
	for _, tc := range cases {
		s, err := BuildSummary(tc.nodes, keys, MaxSummaryBytes)
		if err != nil {
			t.Fatalf("%s: build: %v", tc.name, err)
		}
		// The summary travels encoded.
		b, err := s.Encode()
		if err != nil {
			t.Fatal(err)
		}
		if s, err = DecodeSummary(b); err != nil {
			t.Fatal(err)
		}
		for self := range tc.nodes {
			fromSummary := s.Nodes()
			fromSummary[self] = tc.nodes[self]
			for pname, p := range ports {
				if lacking := s.Lacks(p); lacking != "" {
					t.Fatalf("%s: %s: summary lacks %s", tc.name, pname, lacking)
				}
				all := Decide(Input{Node: tc.nodes[self], Nodes: tc.nodes, Port: p, Endpoints: eps}, DefaultOptions())
				got := Decide(Input{Node: tc.nodes[self], Nodes: fromSummary, Port: p, Endpoints: eps}, DefaultOptions())
				if !reflect.DeepEqual(got, all) {
					t.Errorf("%s: node %s: %s:\n from summary %+v\n from all nodes %+v", tc.name, self, pname, got, all)
				}
			}
		}
	}
}

func TestSummaryLacks(t *testing.T) {
	s, err := BuildSummary(summaryNodes(), []string{"rack"}, MaxSummaryBytes)
	if err != nil {
		t.Fatal(err)
	}
	keys := func(v string) ServicePort { return clusterPort(map[string]string{AnnotationTopologyKeys: v}) }
	cases := []struct {
		name    string
		summary *Summary
		port    ServicePort
		// lacks is a substring of Lacks' answer; "" means it lacks nothing.
		lacks string
	}{
		{name: "hints never need it", port: clusterPort(nil)},
		{name: "zone threshold never needs it", port: clusterPort(map[string]string{AnnotationZoneThreshold: "2"})},
		{name: "zone-weighted without a summary", port: zoneWeightedPort(), lacks: "no topology summary"},
		{name: "zone-weighted with one", summary: s, port: zoneWeightedPort()},
		{name: "keys covered", summary: s, port: keys("rack,*")},
		{name: "key not covered", summary: s, port: keys("rack,zone2,*"), lacks: "label zone2"},
		{name: "only * reads nothing", port: keys("*")},
		{name: "internal traffic policy Local reads nothing", port: withITPLocal(zoneWeightedPort())},
	}
	for _, tc := range cases {
		got := tc.summary.Lacks(tc.port)
		if (tc.lacks == "") != (got == "") || !strings.Contains(got, tc.lacks) {
			t.Errorf("%s: Lacks = %q, want %q", tc.name, got, tc.lacks)
		}
	}
}

// TestSummaryLackingDecidesByHints: a port whose policy needs what the
// summary lacks is decided by hints, and the reason says why.
func TestSummaryLackingDecidesByHints(t *testing.T) {
	p := clusterPort(map[string]string{AnnotationTopologyKeys: "rack,*"})
	eps := []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(3, "b1", "zone-b", zones("zone-b"))}
	d := Decide(Input{Node: testNodes["a1"], Port: p, Endpoints: eps, Lacking: "no topology summary has been read"}, DefaultOptions())
	if d.Policy != PolicyHints || d.Mode != ModePreferSameZone {
		t.Errorf("policy %s mode %s, want Hints PreferSameZone", d.Policy, d.Mode)
	}
	if !strings.Contains(d.Reason, "TopologyKeys needs data of other nodes, but no topology summary has been read") {
		t.Errorf("reason %q does not say the summary is missing", d.Reason)
	}
}

func TestBuildSummarySizeBound(t *testing.T) {
	nodes := map[string]Node{}
	for i := range 200 {
		name := fmt.Sprintf("node-%03d", i)
		n := cpuNode(name, fmt.Sprintf("zone-%d", i%3), 4, v1.ConditionTrue)
		n.Labels["big"] = strings.Repeat("x", 60)
		n.Labels["small"] = "s"
		nodes[name] = n
	}
	full, err := BuildSummary(nodes, []string{"big", "small"}, MaxSummaryBytes)
	if err != nil || len(full.Omitted) != 0 {
		t.Fatalf("full summary: omitted %v, err %v", full.Omitted, err)
	}
	size := func(s *Summary) int {
		b, err := s.Encode()
		if err != nil {
			t.Fatal(err)
		}
		return len(b)
	}
	// Room for everything but the big label: it alone is left out.
	bound := size(full) - 1
	s, err := BuildSummary(nodes, []string{"big", "small"}, bound)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(s.Omitted, []string{"big"}) || s.Labels["small"] == nil || size(s) > bound {
		t.Errorf("omitted %v, labels %v, size %d over %d", s.Omitted, slicesKeys(s.Labels), size(s), bound)
	}
	if lacks := s.Lacks(clusterPort(map[string]string{AnnotationTopologyKeys: "big"})); !strings.Contains(lacks, "omitted") {
		t.Errorf("Lacks = %q, want it to say the key was omitted", lacks)
	}
	if _, err := BuildSummary(nodes, nil, 100); !errors.Is(err, ErrSummaryTooLarge) {
		t.Errorf("zones over the bound: err %v, want ErrSummaryTooLarge", err)
	}
}

func slicesKeys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestSummaryEncoding(t *testing.T) {
	s, err := BuildSummary(summaryNodes(), []string{"rack"}, MaxSummaryBytes)
	if err != nil {
		t.Fatal(err)
	}
	later := *s
	later.Written = time.Unix(1e9, 0)
	if !s.SameInputs(&later) {
		t.Error("summaries that differ only in Written differ in inputs")
	}
	// A heartbeat changes nothing a summary holds; a readiness flip does.
	nodes := summaryNodes()
	n := nodes["c1"]
	n.Ready = v1.ConditionFalse
	nodes["c1"] = n
	flipped, err := BuildSummary(nodes, []string{"rack"}, MaxSummaryBytes)
	if err != nil {
		t.Fatal(err)
	}
	if s.SameInputs(flipped) {
		t.Error("a node turning NotReady left the summary's inputs the same")
	}
	b, err := s.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := DecodeSummary([]byte(strings.Replace(string(b), `"version":1`, `"version":2`, 1))); err == nil {
		t.Error("a summary of another version was decoded")
	}
	if _, err := DecodeSummary([]byte("not json")); err == nil {
		t.Error("garbage was decoded")
	}
}
