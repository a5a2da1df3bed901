package main

import (
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/topolb/topolb/topology"
)

// TestExplainSummaryWarnings: explain from a cluster warns about every
// port whose policy needs data of other nodes the topology summary lacks,
// and once when there is no summary or it is out of date; a hints-only
// cluster never needs one.
func TestExplainSummaryWarnings(t *testing.T) {
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "a1", Labels: map[string]string{topology.LabelZone: "zone-a", "rack": "r1"}}}
	svc := func(name string, ann map[string]string) *v1.Service {
		return &v1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, Annotations: ann},
			Spec: v1.ServiceSpec{ClusterIP: "10.96.0.1", ClusterIPs: []string{"10.96.0.1"}, Ports: []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}}}}
	}
	keys := svc("keys", map[string]string{topology.AnnotationTopologyKeys: "rack,*"})
	hints := svc("hints", nil)
	now := time.Now()
	summary := func(labelKeys []string, written time.Time) *topology.Summary {
		s, err := topology.BuildSummary(map[string]topology.Node{"a1": topology.NodeFromObject(node, nil)}, labelKeys, topology.MaxSummaryBytes)
		if err != nil {
			t.Fatal(err)
		}
		s.Written = written
		return s
	}
	for _, tt := range []struct {
		name     string
		services []*v1.Service
		read     *summaryRead
		// want are substrings of the warnings, one each, in order; nil:
		// no warning.
		want []string
	}{
		{name: "hints never need it", services: []*v1.Service{hints}, read: &summaryRead{note: "not found", now: now}},
		{name: "no summary", services: []*v1.Service{keys, hints}, read: &summaryRead{note: "configmaps not found", now: now},
			want: []string{"no topology summary (configmaps not found)"}},
		{name: "covered", services: []*v1.Service{keys}, read: &summaryRead{summary: summary([]string{"rack"}, now), now: now}},
		{name: "key not covered", services: []*v1.Service{keys}, read: &summaryRead{summary: summary(nil, now), now: now},
			want: []string{"default/keys port http (IPv4): the topology summary lacks other nodes' label rack: agents with --node-watch=own decide it by hints"}},
		{name: "stale", services: []*v1.Service{keys}, read: &summaryRead{summary: summary([]string{"rack"}, now.Add(-time.Hour)), now: now},
			want: []string{"the topology summary was last written 1h0m0s ago"}},
	} {
		state := topology.NewState([]*v1.Node{node}, tt.services, nil, nil)
		ds, _ := state.DecideNode("a1", topology.DefaultOptions())
		got := tt.read.warnings(ds, nil)
		if len(got) != len(tt.want) {
			t.Errorf("%s: warnings %q, want %q", tt.name, got, tt.want)
			continue
		}
		for i := range got {
			if !strings.Contains(got[i], tt.want[i]) {
				t.Errorf("%s: warning %q, want one containing %q", tt.name, got[i], tt.want[i])
			}
		}
	}
}
