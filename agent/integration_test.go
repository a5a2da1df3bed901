package agent

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/internal/nettest"
	"github.com/topolb/topolb/internal/testutil"
	"github.com/topolb/topolb/kube"
	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// integration is one agent for node "a1", running against a real
// kube-apiserver and a real datapath attached in a network namespace:
//
//	client(10.1.0.2) ── hc ┐
//	b1(10.1.1.2) ─────── hb1 ┤ node (tc on hc, hb1, hb2)
//	b2(10.1.2.2) ─────── hb2 ┘
//
// The EndpointSlices place b1 on node a1 (zone-a) and b2 on node b2
// (zone-b); where the pods really are does not matter to the decision.
type integration struct {
	t       *testing.T
	kc      *kubetest.Cluster
	client  kubernetes.Interface
	dp      *dpmaps.Datapath
	agent   *Agent
	nodeNS  *nettest.NS
	podNS   map[string]*nettest.NS
	cancel  context.CancelFunc
	stopped chan struct{}
}

func startIntegration(t *testing.T) *integration {
	nettest.RequireRoot(t)
	kc := kubetest.Start(t)
	if err := nettest.RemoveStale(); err != nil {
		t.Logf("remove stale namespaces: %v", err)
	}
	it := &integration{t: t, kc: kc, client: kc.Client, podNS: map[string]*nettest.NS{}}
	it.nodeNS = nettest.NewNS(t, "agent-node")
	must(t, it.nodeNS.Sysctl("net.ipv4.ip_forward", "1"))
	must(t, it.nodeNS.Sysctl("net.ipv4.conf.all.rp_filter", "0"))
	for i, name := range []string{"client", "b1", "b2"} {
		ns := nettest.NewNS(t, name)
		host := "h" + name[:1] + name[1:]
		if name == "client" {
			host = "hc"
		}
		subnet := fmt.Sprintf("10.1.%d", i)
		must(t, nettest.Veth(it.nodeNS, host, ns, "eth0"))
		must(t, it.nodeNS.AddAddr(host, subnet+".1/24"))
		must(t, ns.AddAddr("eth0", subnet+".2/24"))
		must(t, ns.AddRoute("default", subnet+".1"))
		must(t, it.nodeNS.SetOffload(host, "tx", false))
		it.podNS[name] = ns
	}
	it.podNS["b1"].ServeHTTPName(t, "10.1.1.2:8080", "b1")
	it.podNS["b2"].ServeHTTPName(t, "10.1.2.2:8080", "b2")

	bpffs := t.TempDir()
	if err := unix.Mount("bpf", bpffs, "bpf", 0, "mode=0700"); err != nil {
		t.Skipf("cannot mount bpffs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(bpffs, unix.MNT_DETACH) })
	dp, err := dpmaps.Load(dpmaps.Options{PinPath: filepath.Join(bpffs, "topolb"), MaxFrontends: 1024, MaxBackends: 4096, MaxConntrack: 4096, NetNS: it.nodeNS.Path})
	if err != nil {
		t.Fatalf("load datapath: %v", err)
	}
	t.Cleanup(func() {
		dp.Unpin()
		dp.Close()
	})
	for _, host := range []string{"hc", "hb1", "hb2"} {
		must(t, dp.AttachPod(host))
	}
	it.dp = dp
	return it
}

// run starts the agent's informers and loop; it stops in t.Cleanup.
func (it *integration) run() {
	ctx, cancel := context.WithCancel(context.Background())
	it.cancel, it.stopped = cancel, make(chan struct{})
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	it.agent = New(Config{NodeName: "a1", Options: topology.DefaultOptions(), Logger: log, Events: NewKubeEvents(it.client, "a1")}, it.dp)
	tr := kube.NewTracker()
	go func() {
		if err := kube.Watch(ctx, it.client, tr, kube.WatchOptions{Nodes: kube.NodeWatchAll}); err != nil && ctx.Err() == nil {
			it.t.Errorf("watch: %v", err)
		}
	}()
	go func() {
		defer close(it.stopped)
		it.agent.Run(ctx, tr, 2*time.Millisecond, 200*time.Millisecond)
	}()
	it.t.Cleanup(func() {
		cancel()
		<-it.stopped
	})
}

// expectExplained waits until the datapath holds exactly what `explain`
// decides for node a1 from the apiserver's current objects.
func (it *integration) expectExplained(what string) map[string][]string {
	it.t.Helper()
	return it.expectExplainedWithin(what, 10*time.Second)
}

func (it *integration) expectExplainedWithin(what string, timeout time.Duration) map[string][]string {
	it.t.Helper()
	var want, got map[string][]string
	deadline := time.Now().Add(timeout)
	for {
		objs, err := kube.ListObjects(context.Background(), it.client)
		if err != nil {
			it.t.Fatalf("%s: list: %v", what, err)
		}
		ds, _ := objs.State(nil).DecideNode("a1", topology.DefaultOptions())
		n, _ := objs.State(nil).Node("a1")
		want = map[string][]string{}
		for _, f := range topology.NewReport(n, ds).Frontends {
			if key, ok := ReportKey(f); ok {
				want[key] = f.Backends
			}
		}
		got = programmedBackends(it.t, it.dp)
		if maps.EqualFunc(got, want, slices.Equal) && it.agent != nil && it.agent.Synced() {
			return got
		}
		if time.Now().After(deadline) {
			it.t.Fatalf("%s: maps hold %v, explain decides %v", what, got, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// landings makes n HTTP requests from the client to the service and counts
// the answering backends; failures are counted under "error".
func (it *integration) landings(n int) map[string]int {
	c := it.podNS["client"].HTTPClient(2 * time.Second)
	got := map[string]int{}
	for range n {
		resp, err := c.Get("http://10.96.0.10/")
		if err != nil {
			got["error"]++
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		got[string(body)]++
	}
	return got
}

func (it *integration) apply(obj any) {
	it.t.Helper()
	ctx := context.Background()
	var err error
	switch o := obj.(type) {
	case *v1.Node:
		_, err = it.client.CoreV1().Nodes().Update(ctx, o, metav1.UpdateOptions{})
		if err != nil {
			_, err = it.client.CoreV1().Nodes().Create(ctx, o, metav1.CreateOptions{})
		}
	case *v1.Service:
		cur, gerr := it.client.CoreV1().Services(o.Namespace).Get(ctx, o.Name, metav1.GetOptions{})
		if gerr == nil {
			o.ResourceVersion = cur.ResourceVersion
			_, err = it.client.CoreV1().Services(o.Namespace).Update(ctx, o, metav1.UpdateOptions{})
		} else {
			_, err = it.client.CoreV1().Services(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		}
	case *discovery.EndpointSlice:
		cur, gerr := it.client.DiscoveryV1().EndpointSlices(o.Namespace).Get(ctx, o.Name, metav1.GetOptions{})
		if gerr == nil {
			o.ResourceVersion = cur.ResourceVersion
			_, err = it.client.DiscoveryV1().EndpointSlices(o.Namespace).Update(ctx, o, metav1.UpdateOptions{})
		} else {
			_, err = it.client.DiscoveryV1().EndpointSlices(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		}
	}
	if err != nil {
		it.t.Fatalf("apply %T: %v", obj, err)
	}
}

func webSlice(hintB2 string) *discovery.EndpointSlice {
	s := epSlice("web", "web-1",
		endpoint{"10.1.1.2", "a1", "zone-a", "zone-a", true},
		endpoint{"10.1.2.2", "b2", "zone-b", hintB2, true})
	s.Labels[discovery.LabelManagedBy] = "topolb-tests"
	return s
}

func webService() *v1.Service {
	s := service("web", "10.96.0.10", nil)
	s.Spec.Ports = []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}}
	return s
}

func TestIntegrationAgainstAPIServer(t *testing.T) {
	it := startIntegration(t)
	it.apply(node("a1", "zone-a"))
	it.apply(node("b2", "zone-b"))
	it.apply(webService())
	it.apply(webSlice("zone-b"))
	it.run()

	it.expectExplained("complete zone hints")
	if got := it.landings(20); got["b1"] != 20 {
		t.Errorf("complete zone hints: landings %v, want all 20 on b1 (zone-a)", got)
	}

	// One endpoint losing its hint: hints are ignored for the whole service.
	it.apply(webSlice(""))
	it.expectExplained("missing hint")
	if got := it.landings(40); got["b1"] == 0 || got["b2"] == 0 || got["error"] > 0 {
		t.Errorf("missing hint: landings %v, want both backends", got)
	}

	// This node moving to zone-b moves its traffic there.
	it.apply(webSlice("zone-b"))
	it.apply(node("a1", "zone-b"))
	got := it.expectExplained("node moved to zone-b")
	if !slices.Equal(got["10.96.0.10:80/TCP"], []string{"10.1.2.2:8080"}) {
		t.Errorf("node moved to zone-b: programmed %v", got)
	}
	if got := it.landings(20); got["b2"] != 20 {
		t.Errorf("node moved to zone-b: landings %v, want all on b2", got)
	}
	it.apply(node("a1", "zone-a"))
	it.expectExplained("node back in zone-a")

	// A second service with internalTrafficPolicy Local, then deletions.
	local := v1.ServiceInternalTrafficPolicyLocal
	api := service("api", "10.96.0.11", nil)
	api.Spec.InternalTrafficPolicy = &local
	it.apply(api)
	apiSlice := epSlice("api", "api-1", endpoint{"10.1.1.2", "a1", "zone-a", "", true}, endpoint{"10.1.2.2", "b2", "zone-b", "", true})
	it.apply(apiSlice)
	got = it.expectExplained("iTP Local service")
	if !slices.Equal(got["10.96.0.11:80/TCP"], []string{"10.1.1.2:8080"}) {
		t.Errorf("iTP Local: programmed %v", got)
	}
	ctx := context.Background()
	must(t, it.client.DiscoveryV1().EndpointSlices("default").Delete(ctx, "api-1", metav1.DeleteOptions{}))
	got = it.expectExplained("slice deleted")
	if bes, ok := got["10.96.0.11:80/TCP"]; !ok || len(bes) != 0 {
		t.Errorf("slice deleted: want the frontend with no backends (drop), got %v", got)
	}
	must(t, it.client.CoreV1().Services("default").Delete(ctx, "api", metav1.DeleteOptions{}))
	got = it.expectExplained("service deleted")
	if _, ok := got["10.96.0.11:80/TCP"]; ok {
		t.Errorf("service deleted: frontend still programmed")
	}
	must(t, it.client.CoreV1().Nodes().Delete(ctx, "a1", metav1.DeleteOptions{}))
	it.expectExplained("own node deleted")
	it.apply(node("a1", "zone-a"))
	it.expectExplained("own node recreated")

	// A Service labelled for another proxy leaves the watch (kube-proxy's
	// label selector, applied by the apiserver): its frontends go; they
	// come back with the label removed. A headless Service is never
	// watched.
	labelled := webService()
	labelled.Labels = map[string]string{topology.LabelServiceProxyName: "other-proxy"}
	it.apply(labelled)
	headless := service("headless", v1.ClusterIPNone, nil)
	headless.Spec.ClusterIPs = []string{v1.ClusterIPNone}
	it.apply(headless)
	got = it.expectExplained("service labelled for another proxy")
	if _, ok := got["10.96.0.10:80/TCP"]; ok {
		t.Errorf("service labelled for another proxy: still programmed %v", got)
	}
	st := it.agent.State()
	for _, p := range st.Services {
		if p.Service == "default/web" || p.Service == "default/headless" {
			t.Errorf("the agent decides %s, which its watch excludes", p.Service)
		}
	}
	if len(st.Skipped) != 0 {
		t.Errorf("the agent holds Services its watch excludes: skipped %v", st.Skipped)
	}
	it.apply(webService())
	got = it.expectExplained("label removed")
	if _, ok := got["10.96.0.10:80/TCP"]; !ok {
		t.Errorf("label removed: not programmed again: %v", got)
	}

	// Mode change events reach the Service (aggregated by the recorder).
	deadline := time.Now().Add(10 * time.Second)
	for {
		evs, err := it.client.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=web,reason=" + ReasonModeChanged})
		if err == nil && len(evs.Items) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s event on default/web: %v", ReasonModeChanged, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestIntegrationAPIServerOutage stops the apiserver while traffic flows:
// traffic keeps flowing on the last state, and once the apiserver is back a
// change made then is applied.
func TestIntegrationAPIServerOutage(t *testing.T) {
	outage := 30 * time.Second
	if testing.Short() {
		outage = 5 * time.Second
	}
	it := startIntegration(t)
	it.apply(node("a1", "zone-a"))
	it.apply(node("b2", "zone-b"))
	it.apply(webService())
	it.apply(webSlice("zone-b"))
	it.run()
	before := it.expectExplained("before outage")

	must(t, it.kc.Stop())
	failed, total := 0, 0
	for end := time.Now().Add(outage); time.Now().Before(end); {
		got := it.landings(10)
		failed += got["error"] + got["b2"]
		total += 10
		time.Sleep(50 * time.Millisecond)
	}
	if failed > 0 {
		t.Errorf("during the outage %d of %d requests failed or left the zone", failed, total)
	}
	if got := programmedBackends(t, it.dp)["10.96.0.10:80/TCP"]; !slices.Equal(got, before["10.96.0.10:80/TCP"]) {
		t.Errorf("maps changed during the outage: %v, before %v", got, before)
	}
	t.Logf("outage %s: %d requests, all on the last state", outage, total)

	must(t, it.kc.Restart())
	it.apply(webSlice(""))
	// client-go's reflectors back off exponentially while the apiserver is
	// away (800 ms doubling to 30 s, with up to 100% jitter), so allow for
	// one full backoff period.
	back := time.Now()
	got := it.expectExplainedWithin("change after the outage", 90*time.Second)
	t.Logf("change after the outage applied %s after the apiserver came back", time.Since(back).Round(time.Millisecond))
	if len(got["10.96.0.10:80/TCP"]) != 2 {
		t.Errorf("change after the outage not applied: %v", got)
	}
}

var must = testutil.Must

// programmedBackends reads every frontend's active backends back from the
// kernel maps, keyed as DebugState.Programmed.
func programmedBackends(t testing.TB, dp *dpmaps.Datapath) map[string][]string {
	t.Helper()
	prog, err := dp.Programmed()
	if err != nil {
		t.Fatalf("read the maps back: %v", err)
	}
	out := map[string][]string{}
	for fe, ps := range prog {
		bes := []string{}
		for _, b := range ps.Backends {
			if !b.Draining {
				bes = append(bes, b.Addr.String())
			}
		}
		slices.Sort(bes)
		out[fe.String()] = bes
	}
	return out
}
