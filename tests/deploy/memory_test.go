package deploy

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/internal/nettest"
)

var memoryServices = flag.Int("memory-services", memoryGoalServices,
	"services (each with one port and three endpoints) TestAgentMemory creates; the memory goal is checked only at 10000 or more")

// The sizing goal: at most memoryGoal resident memory at memoryGoalServices
// services.
const (
	memoryGoal         = 150 << 20
	memoryGoalServices = 10_000
)

// TestAgentMemory runs the agent as deploy/ does (the DaemonSet's
// capabilities and GOMEMLIMIT, the ConfigMap's map sizes, informers on a
// real apiserver) with -memory-services Services and their EndpointSlices,
// waits until all are programmed, scrapes /metrics and /debug/state once,
// and measures what the DaemonSet's memory limit must hold: the agent's
// peak resident memory, and the BPF maps' memory, which the kernel charges
// to the memory cgroup of the agent that created them. Every Service must
// be programmed with exactly the backend its zone hints give this node, and
// nothing else may be. It fails if peak memory plus maps exceeds the limit,
// or, at 10,000 services or more, if the resident memory exceeds the
// 150 MB goal.
//
//	go test ./tests/deploy -run AgentMemory -v -args -memory-services=1000   # quicker, goal not checked
func TestAgentMemory(t *testing.T) {
	nettest.RequireRoot(t)
	requireDatapathKernel(t)
	c := kubetest.Start(t)
	_, ctr := agentDaemonSet(t)
	listed := manifestCapabilities(t, ctr)
	cfg := agentConfig(t)
	limit, ok := ctr.Resources.Limits[v1.ResourceMemory]
	if !ok {
		t.Fatal("deploy/daemonset.yaml: no memory limit")
	}
	var env []string
	if v, ok := envValue(ctr, "GOMEMLIMIT"); ok {
		env = append(env, "GOMEMLIMIT="+v)
	}
	// The DaemonSet gives the agent its namespace (POD_NAMESPACE, for the
	// topology summary and its Lease); here it is one the apiserver has.
	if !slices.ContainsFunc(ctr.Env, func(e v1.EnvVar) bool {
		return e.Name == "POD_NAMESPACE" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.namespace"
	}) {
		t.Fatal("deploy/daemonset.yaml: no POD_NAMESPACE from metadata.namespace")
	}
	env = append(env, "POD_NAMESPACE=default")
	agentBin := agentBinary(t)

	n := *memoryServices
	start := time.Now()
	want := createServices(t, c, n)
	t.Logf("created %d services and endpointslices in %s", n, time.Since(start).Round(time.Millisecond))

	node := newCapsNode(t)
	kubeconfig := relayAPIServer(t, c, node.ns)
	p := startRestricted(t, node.ns, agentBin, listed, env, []string{
		"--node-name=node-a", "--kubeconfig=" + kubeconfig, "--bpffs=" + node.pinPath,
		"--health-address=" + agent.DefaultHealthAddress, "--metrics-address=" + agent.DefaultMetricsAddress,
		"--max-frontends=" + strconv.FormatUint(configUint(t, cfg, "TOPOLB_MAX_FRONTENDS"), 10),
		"--max-backends=" + strconv.FormatUint(configUint(t, cfg, "TOPOLB_MAX_BACKENDS"), 10),
		"--max-conntrack=" + strconv.FormatUint(configUint(t, cfg, "TOPOLB_MAX_CONNTRACK"), 10),
	})
	start = time.Now()
	if err := p.waitReady(t, 5*time.Minute); err != nil {
		t.Fatalf("agent: %v\nstderr:\n%s", err, tail(p.stderr.String(), 20))
	}
	client := node.ns.HTTPClient(30 * time.Second)
	// The apiserver's own default/kubernetes Service is a frontend too.
	wantFrontends := len(want) + 1
	deadline := time.Now().Add(5 * time.Minute)
	for {
		got, err := frontendsMetric(client)
		if err == nil && got == wantFrontends {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("programmed frontends = %d (%v), want %d\nstderr:\n%s", got, err, wantFrontends, tail(p.stderr.String(), 20))
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("all %d frontends programmed %s after start", wantFrontends, time.Since(start).Round(time.Millisecond))
	programmed := programmedFrontends(t, client)
	for fe, backends := range want {
		if got, ok := programmed[fe]; !ok {
			t.Errorf("frontend %s is not programmed", fe)
		} else if !slices.Equal(got, backends) {
			t.Errorf("frontend %s: programmed %v, want %v", fe, got, backends)
		}
	}
	if len(programmed) != wantFrontends {
		t.Errorf("/debug/state lists %d programmed frontends, want %d", len(programmed), wantFrontends)
	}
	resp, err := client.Get("http://" + agent.DefaultMetricsAddress + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	size, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("GET /metrics: %d bytes", size)

	pid := strconv.Itoa(p.cmd.Process.Pid)
	hwm := procStatusBytes(t, pid, "VmHWM")
	rss := procStatusBytes(t, pid, "VmRSS")
	mapsMem := mapMemlock(t, pid)
	total := hwm + mapsMem
	t.Logf("services=%d rss=%s peak_rss=%s bpf_maps=%s (%d possible CPUs) peak_total=%s limit=%s",
		n, mib(rss), mib(hwm), mib(mapsMem), possibleCPUs(t), mib(total), limit.String())
	if err := p.stop(10 * time.Second); err != nil {
		t.Errorf("agent did not stop cleanly: %v", err)
	}
	if total > limit.Value() {
		t.Errorf("peak resident memory plus BPF maps (%s) exceeds the DaemonSet's memory limit %s", mib(total), limit.String())
	}
	switch {
	case n < memoryGoalServices:
		t.Logf("memory goal not checked: %d services, the goal is at %d", n, memoryGoalServices)
	case hwm > memoryGoal:
		t.Errorf("peak resident memory %s at %d services exceeds the goal of %s: verdict=not met", mib(hwm), n, mib(memoryGoal))
	default:
		t.Logf("peak resident memory %s at %d services, goal %s: verdict=met", mib(hwm), n, mib(memoryGoal))
	}
}

// programmedFrontends reads the programmed frontends and their backends
// from the agent's /debug/state.
func programmedFrontends(t *testing.T, client *http.Client) map[string][]string {
	t.Helper()
	resp, err := client.Get("http://" + agent.DefaultHealthAddress + "/debug/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /debug/state: %s", resp.Status)
	}
	var st struct {
		Programmed map[string][]string `json:"programmed"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatalf("decode /debug/state: %v", err)
	}
	return st.Programmed
}

func mib(b int64) string { return fmt.Sprintf("%.1fMiB", float64(b)/(1<<20)) }

// createServices creates three nodes in three zones and n Services, each
// with one EndpointSlice of three zone-hinted endpoints, and returns what
// node-a must program: by frontend ("clusterIP:80/TCP"), its zone-a
// endpoint.
func createServices(t *testing.T, c *kubetest.Cluster, n int) map[string][]string {
	t.Helper()
	cfg := *c.Config
	cfg.QPS, cfg.Burst = 2000, 2000
	client, err := kubernetes.NewForConfig(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	zones := []string{"zone-a", "zone-b", "zone-c"}
	for i, z := range zones {
		node := &v1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: "node-" + z[len(z)-1:], Labels: map[string]string{
				"topology.kubernetes.io/zone": z, "kubernetes.io/hostname": "node-" + z[len(z)-1:]}},
			Status: v1.NodeStatus{Allocatable: v1.ResourceList{v1.ResourceCPU: resource.MustParse("4")}},
		}
		if _, err := client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create node %d: %v", i, err)
		}
	}
	work := make(chan int)
	errs := make(chan error, 1)
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for i := range work {
				if err := createService(ctx, client, i, zones); err != nil {
					select {
					case errs <- err:
					default:
					}
				}
			}
		})
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	list, err := client.CoreV1().Services("default").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{}
	for _, svc := range list.Items {
		i, err := strconv.Atoi(strings.TrimPrefix(svc.Name, "svc-"))
		if err != nil {
			continue // default/kubernetes
		}
		want[svc.Spec.ClusterIP+":80/TCP"] = []string{serviceEndpoint(i, 0) + ":8080"}
	}
	if len(want) != n {
		t.Fatalf("the apiserver lists %d of the %d services created", len(want), n)
	}
	return want
}

// serviceEndpoint is the address of endpoint k (zone k) of service i:
// one /30 per service in 10.128.0.0/9.
func serviceEndpoint(i, k int) string {
	return fmt.Sprintf("10.%d.%d.%d", 128+i>>14, (i>>6)&255, (i&63)<<2|k)
}

func createService(ctx context.Context, client kubernetes.Interface, i int, zones []string) error {
	name := fmt.Sprintf("svc-%05d", i)
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: v1.ServiceSpec{Ports: []v1.ServicePort{{
			Name: "http", Port: 80, Protocol: v1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)}}},
	}
	if _, err := client.CoreV1().Services("default").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create service %s: %w", name, err)
	}
	port, proto, portName := int32(8080), v1.ProtocolTCP, "http"
	slice := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-1", Namespace: "default",
			Labels: map[string]string{discovery.LabelServiceName: name}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: &portName, Port: &port, Protocol: &proto}},
	}
	for k, z := range zones {
		node := "node-" + z[len(z)-1:]
		slice.Endpoints = append(slice.Endpoints, discovery.Endpoint{
			Addresses: []string{serviceEndpoint(i, k)},
			NodeName:  &node,
			Zone:      &z,
			Hints:     &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: z}}},
		})
	}
	if _, err := client.DiscoveryV1().EndpointSlices("default").Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create endpointslice %s: %w", slice.Name, err)
	}
	return nil
}

// relayAPIServer forwards 127.0.0.1:6443 inside ns (a new namespace cannot
// reach the host's loopback) to the apiserver and returns a kubeconfig that
// uses it.
func relayAPIServer(t *testing.T, c *kubetest.Cluster, ns *nettest.NS) string {
	t.Helper()
	u, err := url.Parse(c.URL)
	if err != nil {
		t.Fatal(err)
	}
	l, err := ns.Listen("tcp4", "127.0.0.1:6443")
	if err != nil {
		t.Fatalf("relay listener: %v", err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		l.Close()
		wg.Wait()
	})
	wg.Go(func() {
		var conns sync.WaitGroup
		defer conns.Wait()
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			conns.Go(func() {
				defer in.Close()
				out, err := net.Dial("tcp", u.Host)
				if err != nil {
					return
				}
				defer out.Close()
				go func() {
					_, _ = io.Copy(out, in)
					out.(*net.TCPConn).CloseWrite()
				}()
				_, _ = io.Copy(in, out)
			})
		}
	})
	kc, err := clientcmd.LoadFromFile(c.KubeconfigPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, cl := range kc.Clusters {
		cl.Server = "https://127.0.0.1:6443"
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// frontendsMetric reads topolb_map_entries{map="frontends"}.
func frontendsMetric(client *http.Client) (int, error) {
	resp, err := client.Get("http://" + agent.DefaultMetricsAddress + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), `topolb_map_entries{map="frontends"} `); ok {
			f, err := strconv.ParseFloat(v, 64)
			return int(f), err
		}
	}
	return 0, fmt.Errorf("no topolb_map_entries{map=\"frontends\"} in /metrics: %v", sc.Err())
}

// procStatusBytes reads a "kB" field of /proc/<pid>/status in bytes.
func procStatusBytes(t testing.TB, pid, field string) int64 {
	t.Helper()
	v := strings.TrimSuffix(procStatusField(t, pid, field), " kB")
	kb, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	if err != nil {
		t.Fatalf("%s of %s: %v", field, pid, err)
	}
	return kb << 10
}

// mapMemlock sums the kernel's memory accounting ("memlock" in fdinfo) of
// the distinct BPF maps the process holds.
func mapMemlock(t testing.TB, pid string) int64 {
	t.Helper()
	fds, err := os.ReadDir(filepath.Join("/proc", pid, "fdinfo"))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	var total int64
	for _, fd := range fds {
		b, err := os.ReadFile(filepath.Join("/proc", pid, "fdinfo", fd.Name()))
		if err != nil {
			continue
		}
		fields := map[string]string{}
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok {
				fields[k] = strings.TrimSpace(v)
			}
		}
		id, isMap := fields["map_id"]
		if !isMap || seen[id] {
			continue
		}
		seen[id] = true
		m, _ := strconv.ParseInt(fields["memlock"], 10, 64)
		total += m
	}
	if len(seen) == 0 {
		t.Fatalf("process %s holds no BPF maps", pid)
	}
	return total
}

// possibleCPUs is the number of CPUs per-CPU maps allocate for.
func possibleCPUs(t testing.TB) int {
	t.Helper()
	b, err := os.ReadFile("/sys/devices/system/cpu/possible")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range strings.Split(strings.TrimSpace(string(b)), ",") {
		lo, hi, found := strings.Cut(r, "-")
		a, _ := strconv.Atoi(lo)
		z := a
		if found {
			z, _ = strconv.Atoi(hi)
		}
		n += z - a + 1
	}
	return n
}
