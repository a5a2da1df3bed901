package kube

import (
	"reflect"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/topolb/topolb/topology"
)

// TestTrimKeepsWhatDecisionsRead checks that the informers' transform keeps
// every part of a Node the decision engine reads: its addresses (NodePort
// frontends are served on them), allocatable CPU and Ready condition.
func TestTrimKeepsWhatDecisionsRead(t *testing.T) {
	n := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-a1", Labels: map[string]string{topology.LabelZone: "zone-a"},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}},
		Status: v1.NodeStatus{
			Addresses:   []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "10.250.0.2"}, {Type: v1.NodeExternalIP, Address: "192.0.2.2"}},
			Allocatable: v1.ResourceList{v1.ResourceCPU: resource.MustParse("4"), v1.ResourceMemory: resource.MustParse("8Gi")},
			Conditions:  []v1.NodeCondition{{Type: v1.NodeMemoryPressure, Status: v1.ConditionFalse}, {Type: v1.NodeReady, Status: v1.ConditionTrue, Message: "kubelet is posting ready status"}},
			Images:      []v1.ContainerImage{{Names: []string{"registry.example/big:1"}, SizeBytes: 1 << 30}},
		},
	}
	want := topology.NodeFromObject(n, nil)
	if len(want.Addresses) != 2 || want.AllocatableMilliCPU != 4000 || want.Ready != v1.ConditionTrue {
		t.Fatalf("fixture reads as %+v", want)
	}
	out, err := trim(n.DeepCopy())
	if err != nil {
		t.Fatal(err)
	}
	trimmed := out.(*v1.Node)
	if got := topology.NodeFromObject(trimmed, nil); !reflect.DeepEqual(got, want) {
		t.Errorf("after trim the node reads as %+v, want %+v", got, want)
	}
	if len(trimmed.Status.Images) != 0 || len(trimmed.ManagedFields) != 0 || len(trimmed.Status.Conditions) != 1 {
		t.Errorf("trim kept what no decision reads: %+v", trimmed)
	}
}
