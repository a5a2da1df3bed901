package kube

import (
	"reflect"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"

	"github.com/topolb/topolb/topology"
)

// TestTrimKeepsTheModel: the informers' transform may drop anything but
// what the decision engine reads: the model built from a trimmed object
// equals the model built from the whole one.
func TestTrimKeepsTheModel(t *testing.T) {
	created := metav1.NewTime(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	node := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{topology.LabelZone: "a", "rack": "r1"},
			Annotations: map[string]string{"big": "x"}, ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}},
		Spec: v1.NodeSpec{Taints: []v1.Taint{{Key: "other", Effect: v1.TaintEffectNoSchedule},
			{Key: topology.ToBeDeletedTaint, Value: "1700000000", Effect: v1.TaintEffectNoSchedule}}},
		Status: v1.NodeStatus{
			Allocatable: v1.ResourceList{v1.ResourceCPU: resource.MustParse("3500m"), v1.ResourceMemory: resource.MustParse("8Gi")},
			Conditions: []v1.NodeCondition{
				{Type: v1.NodeMemoryPressure, Status: v1.ConditionFalse},
				{Type: v1.NodeReady, Status: v1.ConditionTrue, LastHeartbeatTime: metav1.Now()},
			},
			Addresses: []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "10.0.0.1"}, {Type: v1.NodeExternalIP, Address: "203.0.113.1"}, {Type: v1.NodeHostName, Address: "n1"}},
			Images:    []v1.ContainerImage{{Names: []string{"big"}}},
		},
	}
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "ns", CreationTimestamp: created,
			Annotations: map[string]string{topology.AnnotationZoneWeighted: "true", "other": "y"}},
		Spec: v1.ServiceSpec{Type: v1.ServiceTypeLoadBalancer, ClusterIP: "10.96.0.1", ClusterIPs: []string{"10.96.0.1"},
			ExternalIPs: []string{"198.51.100.1"}, ExternalTrafficPolicy: v1.ServiceExternalTrafficPolicyLocal, HealthCheckNodePort: 32000,
			SessionAffinity: v1.ServiceAffinityClientIP,
			Ports:           []v1.ServicePort{{Name: "http", Port: 80, NodePort: 30080, Protocol: v1.ProtocolTCP}}},
		Status: v1.ServiceStatus{LoadBalancer: v1.LoadBalancerStatus{Ingress: []v1.LoadBalancerIngress{{IP: "198.51.100.2"}}}},
	}
	es := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "web-1", Namespace: "ns", Labels: map[string]string{discovery.LabelServiceName: "web"}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}},
		Endpoints: []discovery.Endpoint{{Addresses: []string{"10.1.0.1"}, NodeName: ptr.To("n1"), Zone: ptr.To("a"),
			Hints: &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: "a"}}}}},
	}
	model := func(n *v1.Node, s *v1.Service, e *discovery.EndpointSlice) any {
		ports, warnings, err := topology.ServicePorts(s)
		var eps [][]topology.Endpoint
		for _, p := range ports {
			ep, _ := topology.EndpointsForPort(p, []*discovery.EndpointSlice{e}, n.Name)
			eps = append(eps, ep)
		}
		var hcs []any
		for _, family := range topology.Families {
			hc, hcOK := topology.ServiceHealthCheck(s, []*discovery.EndpointSlice{e}, n.Name, family)
			hcs = append(hcs, hc, hcOK)
		}
		return []any{topology.NodeFromObject(n, nil), ports, warnings, err, eps, hcs}
	}
	labelled := svc.DeepCopy()
	labelled.Labels = map[string]string{topology.LabelServiceProxyName: "other", "app": "web"}
	for _, s := range []*v1.Service{svc, labelled} {
		whole := model(node.DeepCopy(), s.DeepCopy(), es.DeepCopy())
		tn, _ := trim(node.DeepCopy())
		ts, _ := trim(s.DeepCopy())
		te, _ := trim(es.DeepCopy())
		trimmed := model(tn.(*v1.Node), ts.(*v1.Service), te.(*discovery.EndpointSlice))
		if !reflect.DeepEqual(whole, trimmed) {
			t.Errorf("the model differs after trim:\n whole   %+v\n trimmed %+v", whole, trimmed)
		}
	}
	deleting := node.DeepCopy()
	deleting.DeletionTimestamp, deleting.Spec.Taints = &created, nil
	td, _ := trim(deleting.DeepCopy())
	if got := topology.NodeFromObject(td.(*v1.Node), nil); !reflect.DeepEqual(got, topology.NodeFromObject(deleting, nil)) || got.Leaving == "" {
		t.Errorf("trim lost the deletion timestamp: %+v", got)
	}
	tn, _ := trim(node.DeepCopy())
	if n := tn.(*v1.Node); len(n.Status.Images) != 0 || n.ManagedFields != nil || n.Status.Conditions[0].LastHeartbeatTime != (metav1.Time{}) {
		t.Errorf("trim kept what no decision reads: %+v", n)
	}
}

// TestWatchSelectors: the watches' selectors parse and select what
// topology.SkipReason proxies, for the label and headless cases kube-proxy
// filters on the watch.
func TestWatchSelectors(t *testing.T) {
	label, field := ServiceSelectors()
	ls, err := labels.Parse(label)
	if err != nil {
		t.Fatalf("service label selector %q: %v", label, err)
	}
	fs, err := fields.ParseSelector(field)
	if err != nil {
		t.Fatalf("service field selector %q: %v", field, err)
	}
	es, err := labels.Parse(SliceSelector())
	if err != nil {
		t.Fatalf("slice label selector %q: %v", SliceSelector(), err)
	}
	cases := []struct {
		name      string
		labels    map[string]string
		clusterIP string
		want      bool
	}{
		{"plain", nil, "10.96.0.1", true},
		{"other labels", map[string]string{"app": "web", v1.IsHeadlessService: ""}, "10.96.0.1", true},
		{"service-proxy-name", map[string]string{topology.LabelServiceProxyName: "other"}, "10.96.0.1", false},
		{"service-proxy-name empty", map[string]string{topology.LabelServiceProxyName: ""}, "10.96.0.1", false},
		{"headless", nil, v1.ClusterIPNone, false},
	}
	for _, tc := range cases {
		got := ls.Matches(labels.Set(tc.labels)) && fs.Matches(fields.Set{"spec.clusterIP": tc.clusterIP})
		if got != tc.want {
			t.Errorf("%s: watched %v, want %v", tc.name, got, tc.want)
		}
		svc := &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "s", Namespace: "ns", Labels: tc.labels},
			Spec: v1.ServiceSpec{ClusterIP: tc.clusterIP, Ports: []v1.ServicePort{{Port: 80}}}}
		if proxied := topology.SkipReason(svc) == ""; proxied != tc.want {
			t.Errorf("%s: SkipReason proxies %v, the watch %v", tc.name, proxied, tc.want)
		}
	}
	if es.Matches(labels.Set{v1.IsHeadlessService: ""}) || !es.Matches(labels.Set{discovery.LabelServiceName: "web"}) {
		t.Errorf("slice selector %q: wants headless slices out, others in", SliceSelector())
	}
}
