package agent

import (
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// summaryConfigMap is the topology summary ConfigMap a writer would write
// for nodes and the label keys labelKeys.
func summaryConfigMap(t *testing.T, nodes []*v1.Node, labelKeys []string, written time.Time) *v1.ConfigMap {
	t.Helper()
	model := map[string]topology.Node{}
	for _, n := range nodes {
		model[n.Name] = topology.NodeFromObject(n, nil)
	}
	s, err := topology.BuildSummary(model, labelKeys, topology.MaxSummaryBytes)
	if err != nil {
		t.Fatalf("build summary: %v", err)
	}
	s.Written = written
	b, err := s.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return &v1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "topolb-system", Name: kube.SummaryName},
		Data: map[string]string{topology.SummaryDataKey: string(b)}}
}

// ownAndAll are two agents for node a1 fed the same cluster: all watches
// every Node, own its own and reads the others from the summary.
type ownAndAll struct {
	own, all     *Agent
	ownDP, allDP *fakeDP
	ownT, allT   *kube.Tracker
}

func newOwnAndAll(reg prometheus.Registerer) *ownAndAll {
	o := &ownAndAll{ownDP: newFakeDP(), allDP: newFakeDP(), ownT: kube.NewTracker(), allT: kube.NewTracker()}
	cfg := Config{NodeName: "a1", Options: topology.DefaultOptions(), NodesFromSummary: true}
	if reg != nil {
		cfg.Metrics = NewMetrics(reg)
	}
	o.own = New(cfg, o.ownDP)
	o.all = New(Config{NodeName: "a1", Options: topology.DefaultOptions()}, o.allDP)
	return o
}

// objects records objs in both trackers: Nodes in all's, and in own's only
// a1's.
func (o *ownAndAll) objects(t *testing.T, objs ...any) {
	t.Helper()
	for _, obj := range objs {
		switch obj := obj.(type) {
		case *v1.Node:
			o.allT.NodeChanged(nil, obj)
			if obj.Name == "a1" {
				o.ownT.NodeChanged(nil, obj)
			}
		case *v1.Service:
			o.allT.ServiceChanged(nil, obj)
			o.ownT.ServiceChanged(nil, obj)
		case *v1.ConfigMap:
			o.ownT.SummaryChanged(nil, obj)
		default:
			o.allT.SliceChanged(nil, obj.(*discovery.EndpointSlice))
			o.ownT.SliceChanged(nil, obj.(*discovery.EndpointSlice))
		}
	}
}

// apply applies both trackers' batches and returns how many services
// each decided.
func (o *ownAndAll) apply(t *testing.T) (own, all int) {
	t.Helper()
	ro, ra := o.own.Apply(o.ownT.Drain()), o.all.Apply(o.allT.Drain())
	if len(ro.Errors)+len(ra.Errors) > 0 {
		t.Fatalf("apply: own %v, all %v", ro.Errors, ra.Errors)
	}
	return ro.Services, ra.Services
}

// same fails unless both datapaths hold the same frontends, backends and
// weights, and both agents the same policies and modes.
func (o *ownAndAll) same(t *testing.T, what string) {
	t.Helper()
	if !reflect.DeepEqual(o.ownDP.fes, o.allDP.fes) {
		t.Errorf("%s: own programmed %v, all %v", what, o.ownDP.fes, o.allDP.fes)
	}
	if !reflect.DeepEqual(o.own.ports, o.all.ports) {
		t.Errorf("%s: own decided %+v, all %+v", what, o.own.ports, o.all.ports)
	}
}

func withCPU(n *v1.Node, cpu string) *v1.Node {
	n.Status.Allocatable = v1.ResourceList{v1.ResourceCPU: resourceQuantity(cpu)}
	return n
}

func withRack(n *v1.Node, rack string) *v1.Node {
	n.Labels["rack"] = rack
	return n
}

func notReady(n *v1.Node) *v1.Node {
	n.Status.Conditions = []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionFalse}}
	return n
}

// TestAgentNodeWatchOwnDecidesAsAll (issue 33 item 4): an agent that
// watches its own Node and reads the others from the topology summary
// programs zone-weighted, topology-keys, zone-threshold and hints
// Services exactly as one that watches every Node, on the same inputs
// and after the same change; and a summary whose change matters to no
// Service decides nothing again.
func TestAgentNodeWatchOwnDecidesAsAll(t *testing.T) {
	services := []any{
		service("weighted", "10.96.0.1", map[string]string{topology.AnnotationZoneWeighted: "true"}),
		service("keys", "10.96.0.2", map[string]string{topology.AnnotationTopologyKeys: "rack,*"}),
		service("threshold", "10.96.0.3", map[string]string{topology.AnnotationZoneThreshold: "1"}),
		service("hints", "10.96.0.4", nil),
	}
	eps := []endpoint{
		{"10.0.1.1", "a1", "zone-a", "zone-a", true},
		{"10.0.2.1", "b1", "zone-b", "zone-b", true},
		{"10.0.2.2", "b2", "zone-b", "zone-b", true},
		{"10.0.3.1", "c1", "zone-c", "zone-c", true},
	}
	for _, name := range []string{"weighted", "keys", "threshold", "hints"} {
		services = append(services, epSlice(name, name+"-1", eps...))
	}
	// cluster returns the Nodes; changed, the same after the row's change.
	type cluster func() []*v1.Node
	base := func() []*v1.Node {
		return []*v1.Node{
			withRack(withCPU(node("a1", "zone-a"), "4"), "r1"),
			withRack(withCPU(node("b1", "zone-b"), "4"), "r1"),
			withRack(withCPU(node("b2", "zone-b"), "8"), "r2"),
			withCPU(node("c1", "zone-c"), "2"),
		}
	}
	for _, tt := range []struct {
		name  string
		nodes cluster
		// change changes one Node other than a1; decided is how many
		// Services read what it changes (own must decide no more).
		change  func(*v1.Node) *v1.Node
		changed string
		decided int
	}{
		{name: "another zone grows", nodes: base, changed: "b2", change: func(n *v1.Node) *v1.Node { return withCPU(n, "32") }, decided: 1},
		{name: "a node leaves the rack", nodes: base, changed: "b1", change: func(n *v1.Node) *v1.Node { return withRack(n, "r2") }, decided: 1},
		{name: "a node is not ready", nodes: base, changed: "c1", change: notReady, decided: 1},
		{name: "a node's label no Service reads", nodes: base, changed: "b1", change: func(n *v1.Node) *v1.Node { n.Labels["team"] = "x"; return n }, decided: 0},
		{name: "a node without CPU", nodes: func() []*v1.Node {
			ns := base()
			ns[3].Status.Allocatable = nil
			return ns
		}, changed: "b1", change: func(n *v1.Node) *v1.Node { return withCPU(n, "1") }, decided: 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			o := newOwnAndAll(nil)
			nodes := tt.nodes()
			o.objects(t, services...)
			for _, n := range nodes {
				o.objects(t, n)
			}
			// The writer summarizes for the label keys the agents'
			// Services name.
			o.ownT.Resync()
			o.allT.Resync()
			o.apply(t)
			keys := o.own.SummaryLabelKeys()
			if !slices.Equal(keys, []string{"rack"}) {
				t.Fatalf("label keys %v, want [rack]", keys)
			}
			o.ownT.SummaryChanged(nil, summaryConfigMap(t, nodes, keys, time.Now()))
			o.apply(t)
			o.same(t, "first summary")

			i := slices.IndexFunc(nodes, func(n *v1.Node) bool { return n.Name == tt.changed })
			prev := nodes[i].DeepCopy()
			nodes[i] = tt.change(nodes[i].DeepCopy())
			o.allT.NodeChanged(prev, nodes[i])
			o.ownT.SummaryChanged(nil, summaryConfigMap(t, nodes, keys, time.Now().Add(time.Second)))
			own, all := o.apply(t)
			o.same(t, "after the change")
			if own != tt.decided || all != tt.decided {
				t.Errorf("the change decided %d services with own, %d with all; want %d", own, all, tt.decided)
			}
		})
	}
}

// TestAgentWithoutSummary: before any summary, a zone-weighted Service is
// decided by hints, says so and is counted pending, while a hints Service
// never needs one; a summary decides it as all Nodes do; when the
// summary's ConfigMap goes, its last inputs stay in force and the reason
// says so; a refresh that changes nothing decides nothing again.
func TestAgentWithoutSummary(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	o := newOwnAndAll(reg)
	nodes := []*v1.Node{withCPU(node("a1", "zone-a"), "4"), withCPU(node("b1", "zone-b"), "12")}
	eps := []endpoint{{"10.0.1.1", "a1", "zone-a", "zone-a", true}, {"10.0.2.1", "b1", "zone-b", "zone-b", true}, {"10.0.2.2", "b1", "zone-b", "zone-b", true}}
	o.objects(t, service("weighted", "10.96.0.1", map[string]string{topology.AnnotationZoneWeighted: "true"}), epSlice("weighted", "w-1", eps...),
		service("hints", "10.96.0.2", nil), epSlice("hints", "h-1", eps...))
	for _, n := range nodes {
		o.objects(t, n)
	}
	o.ownT.Resync()
	o.allT.Resync()
	o.apply(t)
	weighted := types.NamespacedName{Namespace: "default", Name: "weighted"}
	reason := func() string {
		ds, _ := o.own.state.DecideService("a1", weighted, o.own.cfg.Options)
		return ds[0].Decision.Reason
	}
	if p := o.own.ports[weighted][0]; p.policy != topology.PolicyHints || !o.own.pending[weighted] {
		t.Errorf("without a summary: policy %s pending %v, want Hints, pending", p.policy, o.own.pending[weighted])
	}
	if r := reason(); !strings.Contains(r, "no topology summary has been read") {
		t.Errorf("reason %q does not say no summary has been read", r)
	}
	if got := testutil.ToFloat64(o.own.cfg.Metrics.SummaryPending); got != 1 {
		t.Errorf("pending services %v, want 1", got)
	}
	if n, err := testutil.GatherAndCount(reg, "topolb_topology_summary_age_seconds"); err != nil || n != 0 {
		t.Errorf("summary age series before a summary: %d, %v; want none", n, err)
	}

	written := time.Now().Add(-time.Minute)
	cm := summaryConfigMap(t, nodes, nil, written)
	o.ownT.SummaryChanged(nil, cm)
	if own, _ := o.apply(t); own != 1 {
		t.Errorf("the first summary decided %d services, want 1 (hints never needs it)", own)
	}
	o.same(t, "with the summary")
	if got := testutil.ToFloat64(o.own.cfg.Metrics.SummaryPending); got != 0 {
		t.Errorf("pending services %v, want 0", got)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "topolb_topology_summary_age_seconds" {
			if age := mf.GetMetric()[0].GetGauge().GetValue(); age < 59 || age > 120 {
				t.Errorf("summary age %v s, want about 60", age)
			}
		}
	}

	// The writer rewrites an unchanged summary: nothing to decide.
	o.ownT.SummaryChanged(cm, summaryConfigMap(t, nodes, nil, written.Add(5*time.Minute)))
	if own, _ := o.apply(t); own != 0 {
		t.Errorf("a refresh decided %d services, want 0", own)
	}

	before := maps.Clone(o.ownDP.fes)
	o.ownT.SummaryChanged(cm, nil)
	if own, _ := o.apply(t); own != 1 {
		t.Errorf("the summary's deletion decided %d services, want 1", own)
	}
	if !reflect.DeepEqual(o.ownDP.fes, before) {
		t.Errorf("without the summary's ConfigMap the datapath changed: %v, was %v", o.ownDP.fes, before)
	}
	if r := reason(); !strings.Contains(r, "was deleted: deciding from its last known inputs") {
		t.Errorf("reason %q does not say the summary was deleted and its last inputs are used", r)
	}
}
