package kube

import (
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/topology"
)

func svcObj(rv, ip string, ann map[string]string) *v1.Service {
	return &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", ResourceVersion: rv, Annotations: ann},
		Spec:       v1.ServiceSpec{ClusterIP: ip},
	}
}

func TestTrackerDropsNoOps(t *testing.T) {
	nn := types.NamespacedName{Namespace: "ns", Name: "web"}
	cases := []struct {
		name   string
		events func(tr *Tracker)
		// want is the batch's entry for ns/web: absent (no change), or
		// the current object (nil for a delete).
		present bool
		wantIP  string
		deleted bool
	}{
		{name: "add then delete cancels out", events: func(tr *Tracker) {
			tr.ServiceChanged(nil, svcObj("1", "10.96.0.1", nil))
			tr.ServiceChanged(svcObj("1", "10.96.0.1", nil), nil)
		}},
		{name: "update of fields topolb does not read is dropped", events: func(tr *Tracker) {
			tr.ServiceChanged(svcObj("1", "10.96.0.1", map[string]string{"other": "a"}), svcObj("2", "10.96.0.1", map[string]string{"other": "b"}))
		}},
		{name: "a topolb annotation is read", present: true, wantIP: "10.96.0.1", events: func(tr *Tracker) {
			tr.ServiceChanged(svcObj("1", "10.96.0.1", nil), svcObj("2", "10.96.0.1", map[string]string{"topolb.io/zone-threshold": "2"}))
		}},
		{name: "gaining the service-proxy-name label is read", present: true, wantIP: "10.96.0.1", events: func(tr *Tracker) {
			labelled := svcObj("2", "10.96.0.1", nil)
			labelled.Labels = map[string]string{topology.LabelServiceProxyName: ""}
			tr.ServiceChanged(svcObj("1", "10.96.0.1", nil), labelled)
		}},
		{name: "other labels are not read", events: func(tr *Tracker) {
			labelled := svcObj("2", "10.96.0.1", nil)
			labelled.Labels = map[string]string{"app": "web"}
			tr.ServiceChanged(svcObj("1", "10.96.0.1", nil), labelled)
		}},
		{name: "change and change back cancel out", events: func(tr *Tracker) {
			tr.ServiceChanged(svcObj("1", "10.96.0.1", nil), svcObj("2", "10.96.0.2", nil))
			tr.ServiceChanged(svcObj("2", "10.96.0.2", nil), svcObj("3", "10.96.0.1", nil))
		}},
		{name: "add then update keeps the latest", present: true, wantIP: "10.96.0.3", events: func(tr *Tracker) {
			tr.ServiceChanged(nil, svcObj("1", "10.96.0.1", nil))
			tr.ServiceChanged(svcObj("1", "10.96.0.1", nil), svcObj("2", "10.96.0.3", nil))
		}},
		{name: "delete", present: true, deleted: true, events: func(tr *Tracker) {
			tr.ServiceChanged(svcObj("1", "10.96.0.1", nil), nil)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr := NewTracker()
			tc.events(tr)
			b := tr.Drain()
			cur, ok := b.Services[nn]
			switch {
			case ok != tc.present:
				t.Fatalf("present = %v, want %v (batch %+v)", ok, tc.present, b)
			case !ok:
				if !b.Empty() {
					t.Errorf("batch not empty: %+v", b)
				}
			case tc.deleted && cur != nil:
				t.Errorf("want a delete, got %+v", cur)
			case !tc.deleted && (cur == nil || cur.Spec.ClusterIP != tc.wantIP):
				t.Errorf("current = %+v, want cluster IP %s", cur, tc.wantIP)
			}
			if again := tr.Drain(); !again.Empty() {
				t.Errorf("second drain not empty: %+v", again)
			}
		})
	}
}

func TestTrackerSignalsOncePerBatch(t *testing.T) {
	tr := NewTracker()
	tr.ServiceChanged(nil, svcObj("1", "10.96.0.1", nil))
	tr.NodeChanged(nil, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}})
	select {
	case <-tr.Notify():
	case <-time.After(time.Second):
		t.Fatal("no notification")
	}
	select {
	case <-tr.Notify():
		t.Fatal("two notifications for one batch")
	default:
	}
	b := tr.Drain()
	if len(b.Services) != 1 || len(b.Nodes) != 1 || b.Since.IsZero() || b.Resync {
		t.Errorf("batch %+v", b)
	}
	tr.Resync()
	if b := tr.Drain(); !b.Resync || b.Empty() {
		t.Errorf("resync not drained: %+v", b)
	}
}

func TestTrackerOldestPending(t *testing.T) {
	tr := NewTracker()
	clock := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	tr.now = func() time.Time { return clock }
	if got := tr.OldestPending(); !got.IsZero() {
		t.Fatalf("empty tracker: pending since %v", got)
	}
	first := clock
	tr.ServiceChanged(nil, svcObj("1", "10.96.0.1", nil))
	clock = clock.Add(time.Minute)
	tr.ServiceChanged(svcObj("1", "10.96.0.1", nil), svcObj("2", "10.96.0.2", nil))
	if got := tr.OldestPending(); !got.Equal(first) {
		t.Errorf("pending since %v, want the first change's %v", got, first)
	}
	// A change that cancels the only pending one leaves nothing pending,
	// and the next change starts the clock again.
	tr.ServiceChanged(svcObj("2", "10.96.0.2", nil), nil)
	if got := tr.OldestPending(); !got.IsZero() {
		t.Errorf("after cancelling: pending since %v", got)
	}
	clock = clock.Add(time.Minute)
	tr.NodeChanged(nil, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}})
	if got := tr.OldestPending(); !got.Equal(clock) {
		t.Errorf("pending since %v, want %v", got, clock)
	}
	tr.Drain()
	if got := tr.OldestPending(); !got.IsZero() {
		t.Errorf("after drain: pending since %v", got)
	}
	tr.Resync()
	if got := tr.OldestPending(); !got.Equal(clock) {
		t.Errorf("resync pending since %v, want %v", got, clock)
	}
}

// TestTrackerNodeChanges: a Node change is kept exactly when it touches what
// the decision engine reads of a Node.
func TestTrackerNodeChanges(t *testing.T) {
	base := func() *v1.Node {
		return &v1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: "n1", ResourceVersion: "1", Labels: map[string]string{"topology.kubernetes.io/zone": "a"}},
			Status: v1.NodeStatus{
				Allocatable: v1.ResourceList{v1.ResourceCPU: resource.MustParse("4")},
				Conditions:  []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue}},
				Addresses:   []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "10.0.0.1"}},
			},
		}
	}
	for _, tc := range []struct {
		name   string
		change func(n *v1.Node)
		kept   bool
	}{
		{"heartbeat only", func(n *v1.Node) { n.ResourceVersion = "2"; n.Status.Conditions[0].LastHeartbeatTime = metav1.Now() }, false},
		{"zone label", func(n *v1.Node) { n.Labels["topology.kubernetes.io/zone"] = "b" }, true},
		{"allocatable CPU", func(n *v1.Node) { n.Status.Allocatable[v1.ResourceCPU] = resource.MustParse("8") }, true},
		{"not ready", func(n *v1.Node) { n.Status.Conditions[0].Status = v1.ConditionFalse }, true},
		{"address", func(n *v1.Node) { n.Status.Addresses[0].Address = "10.0.0.2" }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := NewTracker()
			cur := base()
			tc.change(cur)
			tr.NodeChanged(base(), cur)
			if _, kept := tr.Drain().Nodes["n1"]; kept != tc.kept {
				t.Errorf("change kept = %v, want %v", kept, tc.kept)
			}
		})
	}
}
