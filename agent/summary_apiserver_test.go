package agent

import (
	"context"
	"log/slog"
	"os"
	"reflect"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// TestNodeWatchOwnAgainstAPIServer (issue 33 item 1): against a real
// apiserver, two agents' summary writers elect one through the Lease,
// which writes the topology summary; an agent for node a1 that watches
// its own Node and reads that summary programs a zone-weighted and a
// topology-keys Service exactly as one that watches every Node, before
// and after another node's CPU and labels change.
func TestNodeWatchOwnAgainstAPIServer(t *testing.T) {
	kc := kubetest.Start(t)
	ctx := context.Background()
	c := kc.Client
	const ns = "default"

	for _, n := range []*v1.Node{
		withRack(withCPU(node("a1", "zone-a"), "4"), "r1"),
		withRack(withCPU(node("b1", "zone-b"), "12"), "r1"),
		withRack(withCPU(node("b2", "zone-b"), "4"), "r2"),
	} {
		status := n.Status
		created, err := c.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create node %s: %v", n.Name, err)
		}
		created.Status = status
		if _, err := c.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("node %s status: %v", n.Name, err)
		}
	}
	eps := []endpoint{
		{"10.0.1.1", "a1", "zone-a", "zone-a", true},
		{"10.0.2.1", "b1", "zone-b", "zone-b", true},
		{"10.0.2.2", "b2", "zone-b", "zone-b", true},
	}
	for _, s := range []*v1.Service{
		service("weighted", "10.96.0.11", map[string]string{topology.AnnotationZoneWeighted: "true"}),
		service("keys", "10.96.0.12", map[string]string{topology.AnnotationTopologyKeys: "rack,*"}),
		service("hints", "10.96.0.13", nil),
	} {
		if _, err := c.CoreV1().Services(ns).Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create service %s: %v", s.Name, err)
		}
		if _, err := c.DiscoveryV1().EndpointSlices(ns).Create(ctx, epSlice(s.Name, s.Name+"-1", eps...), metav1.CreateOptions{}); err != nil {
			t.Fatalf("create slice of %s: %v", s.Name, err)
		}
	}

	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	start := func(opts kube.WatchOptions) (*Agent, *fakeDP) {
		dp := newFakeDP()
		a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), Logger: log, NodesFromSummary: opts.Nodes == kube.NodeWatchOwn}, dp)
		tr := kube.NewTracker()
		wg.Add(2)
		go func() {
			defer wg.Done()
			if err := kube.Watch(runCtx, c, tr, opts); err != nil && runCtx.Err() == nil {
				t.Errorf("watch %s: %v", opts.Nodes, err)
			}
		}()
		go func() {
			defer wg.Done()
			a.Run(runCtx, tr, 2*time.Millisecond, 200*time.Millisecond)
		}()
		return a, dp
	}
	own, ownDP := start(kube.WatchOptions{Nodes: kube.NodeWatchOwn, NodeName: "a1", SummaryNamespace: ns})
	_, allDP := start(kube.WatchOptions{Nodes: kube.NodeWatchAll})

	// Two candidates, as two agents of a cluster: one is elected and
	// writes.
	var mu sync.Mutex
	writers := map[string]int{}
	for _, id := range []string{"a1", "b1"} {
		w := &kube.SummaryWriter{
			Client: c, Namespace: ns, Identity: id, LabelKeys: own.SummaryLabelKeys, Log: log,
			MinInterval: 500 * time.Millisecond, Tick: 100 * time.Millisecond,
			OnWrite: func(*topology.Summary) {
				mu.Lock()
				defer mu.Unlock()
				writers[id]++
			},
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.Run(runCtx); err != nil {
				t.Errorf("writer %s: %v", id, err)
			}
		}()
	}

	weighted := tcpFE("10.96.0.11:80")
	// same waits until both agents program the same, with the weighted
	// Service's policy applied (not pending on the summary) and its
	// weights satisfying want.
	same := func(what string, want func(map[string]uint32) bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			o, a := ownDP.Services(), allDP.Services()
			own.mu.RLock()
			pending := len(own.pending)
			own.mu.RUnlock()
			if pending == 0 && len(a) > 0 && reflect.DeepEqual(o, a) && want(weightsOf(a[weighted])) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: own (%d pending) programmed %v\nall programmed %v", what, pending, o, a)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	// b1's 12 of 20 CPUs: zone-b has 4/5 of the demand and 2/3 of the
	// endpoints, so zone-a keeps all its traffic on its one endpoint.
	same("first summary", func(w map[string]uint32) bool { return len(w) == 1 })

	lease, err := c.CoordinationV1().Leases(ns).Get(ctx, kube.SummaryLeaseName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get the summary's lease: %v", err)
	}
	holder := ""
	if lease.Spec.HolderIdentity != nil {
		holder = *lease.Spec.HolderIdentity
	}
	mu.Lock()
	if len(writers) != 1 || writers[holder] == 0 {
		t.Errorf("writes by candidate %v, lease held by %q: want one writer, the holder", writers, holder)
	}
	mu.Unlock()
	cm, err := c.CoreV1().ConfigMaps(ns).Get(ctx, kube.SummaryName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get the summary: %v", err)
	}
	s, err := topology.DecodeSummary([]byte(cm.Data[topology.SummaryDataKey]))
	if err != nil {
		t.Fatal(err)
	}
	if got := s.LabelKeys(); !reflect.DeepEqual(got, []string{"rack"}) {
		t.Errorf("summary's label keys %v, want [rack]", got)
	}

	// b1 shrinks to 1 CPU and moves to rack r2: zone-a's 4/9 of the
	// demand, over its third of the endpoints, spills over, and the rack
	// r1 Service keeps a1's endpoint alone.
	b1, err := c.CoreV1().Nodes().Get(ctx, "b1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b1.Labels["rack"] = "r2"
	if b1, err = c.CoreV1().Nodes().Update(ctx, b1, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("relabel b1: %v", err)
	}
	b1.Status.Allocatable = v1.ResourceList{v1.ResourceCPU: resourceQuantity("1")}
	if _, err := c.CoreV1().Nodes().UpdateStatus(ctx, b1, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("shrink b1: %v", err)
	}
	same("after b1 changed", func(w map[string]uint32) bool { return len(w) == 3 })
	keys := types.NamespacedName{Namespace: ns, Name: "keys"}
	own.mu.RLock()
	ps := own.ports[keys]
	own.mu.RUnlock()
	if len(ps) == 0 || ps[0].policy != topology.PolicyTopologyKeys {
		t.Errorf("keys decided %+v, want TopologyKeys", ps)
	}
}
