package scale

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/topolb/topolb/internal/childproc"
	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/internal/netns"
)

var (
	scaleNodes     = flag.String("bench-scale-nodes", "500,1000,5000", "simulated Node counts, one configuration each, comma-separated")
	scaleServices  = flag.Int("bench-scale-services", 10_000, "Services, each with one EndpointSlice")
	scaleEndpoints = flag.Int("bench-scale-endpoints", 10, "endpoints per Service (at most 100, one slice)")
	scaleAgents    = flag.Int("bench-scale-agents", 3, "topolb agents (--datapath=none) run side by side with the kube-proxy")
	scaleAgentArgs = flag.String("bench-scale-agent-args", "", "extra topolb-agent flags, space-separated (for example --node-watch=all, the Node watch before the topology summary)")
	scalePhase     = flag.Duration("bench-scale-phase", time.Minute, "measured phase per configuration, after every process has synced")
	scaleStatus    = flag.Duration("bench-scale-status-period", 10*time.Second, "each Node's status is patched once per period (the kubelet's 10 s status check when every check changes something; 5m is a quiet cluster's nodeStatusReportFrequency)")
	scaleChurn     = flag.Int("bench-scale-churn", 20, "EndpointSlice updates a second of the rolling update")
)

// Goals of issue 33, at goalNodes.
const (
	goalNodes            = 5000
	goalBytesRatio       = 1.2 // per-agent watch bytes/s over kube-proxy's
	goalRSSMB            = 150.0
	goalSyncP99MS        = 20.0
	goalSummaryWritesPS  = 1.0
	summaryConfigMapName = "topolb-topology-summary"
	readyTimeout         = 10 * time.Minute
	kubeProxyMetrics     = "127.0.0.1:10249"
)

// row is one implementation's figures in one configuration, per process
// (the agents' averaged, RSS their largest).
type row struct {
	impl                       string
	eventsPS, bytesPS, cpuMSPS float64
	rssMB, syncP99MS           float64
}

func (r row) String(nodes int) string {
	return fmt.Sprintf("BENCH scale nodes=%d services=%d endpoints=%d impl=%s watch_events_per_s=%.1f watch_bytes_per_s=%.0f cpu_ms_per_s=%.1f rss_mb=%.1f sync_p99_ms=%.1f",
		nodes, *scaleServices, *scaleServices**scaleEndpoints, r.impl, r.eventsPS, r.bytesPS, r.cpuMSPS, r.rssMB, r.syncP99MS)
}

// BenchmarkScale runs, per Node count in -bench-scale-nodes, a fresh
// etcd and kube-apiserver loaded with that many Nodes and
// -bench-scale-services Services (one EndpointSlice of
// -bench-scale-endpoints each), then K topolb agents without a datapath
// (--datapath=none, the agent binary itself) and one kube-proxy in
// nftables mode (in a network namespace of its own), side by side. Once
// all have synced it measures for -bench-scale-phase while every Node's
// status is patched once per -bench-scale-status-period and a rolling
// update replaces endpoints (-bench-scale-churn slice updates a second).
//
// Per process it reports the bytes the apiserver sent it (counted at a
// TCP proxy of its own in front of the apiserver), the watch events
// apportioned from the apiserver's apiserver_watch_events_total (Nodes:
// the agents' share, every event to each agent, less the kube-proxy's own
// Node's; Services and EndpointSlices: split evenly over the K+1
// watchers), CPU and RSS from /proc, and sync p99 (topolb: its
// topolb_event_to_map_seconds; kube-proxy: its
// kubeproxy_sync_proxy_rules_duration_seconds). Verdicts against issue
// 33's goals are printed for every configuration; one not met at
// 5,000 Nodes or more fails the benchmark.
func BenchmarkScale(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root for the kube-proxy's network namespace and nftables")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		b.Skip("kube-proxy's nftables mode needs nft")
	}
	var counts []int
	for _, s := range strings.Split(*scaleNodes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < *scaleAgents+1 {
			b.Fatalf("-bench-scale-nodes: %q is no count above the %d processes", s, *scaleAgents+1)
		}
		counts = append(counts, n)
	}
	if *scaleEndpoints < 1 || *scaleEndpoints > sliceMax {
		b.Fatalf("-bench-scale-endpoints: want 1 to %d", sliceMax)
	}
	agentBin := filepath.Join(b.TempDir(), "topolb-agent")
	build := exec.Command("go", "build", "-o", agentBin, "github.com/topolb/topolb/cmd/topolb-agent")
	if out, err := build.CombinedOutput(); err != nil {
		b.Fatalf("build topolb-agent: %v\n%s", err, out)
	}
	failed := false
	for _, n := range counts {
		rows, verdicts, err := runConfig(b, agentBin, n)
		if err != nil {
			b.Fatalf("nodes=%d: %v", n, err)
		}
		for _, r := range rows {
			fmt.Println(r.String(n))
		}
		for _, v := range verdicts {
			fmt.Printf("BENCH scale nodes=%d goal %s\n", n, v)
			if n >= goalNodes && strings.HasSuffix(v, " not met") {
				failed = true
			}
		}
	}
	if failed {
		b.Fatal("a goal is not met at 5,000 nodes or more")
	}
	b.ReportMetric(0, "ns/op") // the rows above are the result
}

// proc is one measured process: its pid, proxy and metrics scraper.
type proc struct {
	name    string
	child   *childproc.Child
	proxy   *countingProxy
	metrics func(ctx context.Context) (metrics, error)
	logPath string
	ns      *netns.NS // kube-proxy's, deleted by stop; nil for agents
}

func (p *proc) stop() {
	if p.child != nil && p.child.Process != nil {
		_ = p.child.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = p.child.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = p.child.Process.Kill()
			<-done
		}
	}
	if p.proxy != nil {
		p.proxy.Close()
	}
	if p.ns != nil {
		_ = p.ns.Delete() // a stale name is removed by the next run's RemoveStale
	}
}

// snapshot is what is read at each end of the phase.
type snapshot struct {
	at    time.Time
	api   metrics
	procs []procStat
	bytes []int64
	sync  []histogram
}

// runConfig measures one Node count.
func runConfig(b *testing.B, agentBin string, nodes int) ([]row, []string, error) {
	ctx := b.Context()
	// Run, not Start: each configuration's cluster goes before the next
	// one starts.
	c, err := kubetest.Run(ctx, kubetest.WithAPIServerFlags("--max-requests-inflight=2000", "--max-mutating-requests-inflight=1000"))
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if err := c.Close(); err != nil {
			b.Errorf("nodes=%d: %v", nodes, err)
		}
	}()
	cfg := rest.CopyConfig(c.Config)
	cfg.QPS, cfg.Burst = 5000, 10000
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("driver client: %w", err)
	}
	d := &driver{client: client, nodes: nodes, services: *scaleServices, eps: *scaleEndpoints}
	apiHTTP, err := rest.HTTPClientFor(c.Config)
	if err != nil {
		return nil, nil, err
	}
	// The apiserver watches some resources itself: what it sends its own
	// watchers while the driver loads (before any agent or kube-proxy
	// runs) counts them, to be taken out of the phase's events.
	loadBefore, err := scrape(ctx, apiHTTP, c.URL+"/metrics")
	if err != nil {
		return nil, nil, err
	}
	start := time.Now()
	if err := d.load(ctx); err != nil {
		return nil, nil, err
	}
	loadAfter, err := scrape(ctx, apiHTTP, c.URL+"/metrics")
	if err != nil {
		return nil, nil, err
	}
	internal := internalWatchers(loadBefore, loadAfter, map[string]float64{
		"nodes":          2 * float64(nodes), // create, then status
		"endpointslices": float64(*scaleServices),
		"services":       float64(*scaleServices),
	})
	b.Logf("nodes=%d: the apiserver's own watchers per resource: %v", nodes, internal)
	b.Logf("nodes=%d: loaded %d nodes, %d services in %v", nodes, nodes, *scaleServices, time.Since(start).Round(time.Second))

	apiURL, err := url.Parse(c.URL)
	if err != nil {
		return nil, nil, err
	}
	var procs []*proc
	defer func() {
		for _, p := range procs {
			p.stop()
		}
	}()
	for k := 1; k <= *scaleAgents; k++ {
		p, err := startAgent(b, c, apiURL.Host, agentBin, nodeName(k))
		if err != nil {
			return nil, nil, err
		}
		procs = append(procs, p)
	}
	kp, err := startKubeProxy(b, c, apiURL.Host, nodeName(0))
	if err != nil {
		return nil, nil, err
	}
	procs = append(procs, kp)
	if err := waitSynced(ctx, procs); err != nil {
		return nil, nil, err
	}
	b.Logf("nodes=%d: all %d processes synced %v after the load", nodes, len(procs), time.Since(start).Round(time.Second))

	take := func() (snapshot, error) {
		s := snapshot{at: time.Now()}
		var err error
		if s.api, err = scrape(ctx, apiHTTP, c.URL+"/metrics"); err != nil {
			return s, err
		}
		for _, p := range procs {
			st, err := readProc(p.child.Process.Pid)
			if err != nil {
				return s, err
			}
			m, err := p.metrics(ctx)
			if err != nil {
				return s, err
			}
			s.procs = append(s.procs, st)
			s.bytes = append(s.bytes, p.proxy.down.Load())
			name := "topolb_event_to_map_seconds"
			if p.name == "kube-proxy" {
				name = "kubeproxy_sync_proxy_rules_duration_seconds"
			}
			s.sync = append(s.sync, m.histogram(name))
		}
		return s, nil
	}
	phaseCtx, endPhase := context.WithTimeout(ctx, *scalePhase)
	defer endPhase()
	before, err := take()
	if err != nil {
		return nil, nil, err
	}
	hbDone, churnDone := make(chan struct{}), make(chan struct{})
	go func() { defer close(hbDone); d.heartbeats(phaseCtx, *scaleStatus) }()
	go func() { defer close(churnDone); d.rollouts(phaseCtx, *scaleChurn) }()
	<-phaseCtx.Done()
	<-hbDone
	<-churnDone
	time.Sleep(2 * time.Second) // the last changes reach the watchers
	after, err := take()
	if err != nil {
		return nil, nil, err
	}
	for _, p := range procs {
		if p.child.Exited() {
			return nil, nil, fmt.Errorf("%s exited during the phase: %w; its log ends:\n%s", p.name, p.child.Wait(), logTail(p.logPath))
		}
	}
	secs := after.at.Sub(before.at).Seconds()
	b.Logf("nodes=%d: driver: %.1f status patches/s (target %.1f), %.1f slice updates/s, %d failed writes %v",
		nodes, float64(d.statusWrites.Load())/secs, float64(nodes)/scaleStatus.Seconds(), float64(d.sliceWrites.Load())/secs,
		d.errors.Load(), d.lastErr.Load())
	return rowsOf(b, nodes, procs, before, after, secs, internal, float64(d.statusWrites.Load())/secs)
}

// internalWatchers is, per resource, the watch events the apiserver sent
// between before and after for each of the writes made: how many watchers
// of its own it has (rounded).
func internalWatchers(before, after metrics, writes map[string]float64) map[string]float64 {
	out := map[string]float64{}
	b := before.by("apiserver_watch_events_total", "resource")
	for res, v := range after.by("apiserver_watch_events_total", "resource") {
		if w := writes[res]; w > 0 {
			out[res] = math.Round((v - b[res]) / w)
		}
	}
	return out
}

// rowsOf turns the two snapshots into rows and verdicts.
func rowsOf(b *testing.B, nodes int, procs []*proc, before, after snapshot, secs float64, internal map[string]float64, statusPS float64) ([]row, []string, error) {
	events := map[string]float64{}
	for res, v := range after.api.by("apiserver_watch_events_total", "resource") {
		events[res] = (v - before.api.by("apiserver_watch_events_total", "resource")[res]) / secs
	}
	sizes := map[string]float64{}
	for res, v := range after.api.by("apiserver_watch_events_sizes_sum", "resource") {
		sizes[res] = (v - before.api.by("apiserver_watch_events_sizes_sum", "resource")[res]) / secs
	}
	b.Logf("nodes=%d: apiserver watch events/s by resource %v; bytes/s %v", nodes, round(events), round(sizes))
	k := float64(len(procs) - 1)
	// The events of the processes measured, per resource: the phase's
	// less the apiserver's own watchers' (each receives every change:
	// the changes a second times their number, a change being what one
	// watcher of everything receives: its events over the watchers).
	ours := func(res string, watchers float64) float64 {
		changes := events[res] / (watchers + internal[res])
		return events[res] - internal[res]*changes
	}
	// Services and EndpointSlices: the K agents and the kube-proxy watch
	// them alike. Nodes: kube-proxy watches its own, which changes once
	// a status period; the agents share the rest (statusPS: the status
	// patches a second the driver made).
	kpNode := 1 / scaleStatus.Seconds()
	shared := (ours("services", k+1) + ours("endpointslices", k+1)) / (k + 1)
	nodeEvents := events["nodes"] - internal["nodes"]*statusPS
	agentEvents := shared + math.Max(0, nodeEvents-kpNode)/k
	var agent, kp row
	agent.impl, kp.impl = "topolb", "kube-proxy"
	agent.eventsPS, kp.eventsPS = agentEvents, shared+kpNode
	for i, p := range procs {
		r := &agent
		if p.name == "kube-proxy" {
			r = &kp
		}
		share := 1.0
		if r == &agent {
			share = 1 / k
		}
		r.bytesPS += share * float64(after.bytes[i]-before.bytes[i]) / secs
		r.cpuMSPS += share * float64((after.procs[i].cpu - before.procs[i].cpu).Milliseconds()) / secs
		r.rssMB = math.Max(r.rssMB, float64(after.procs[i].rss)/(1<<20))
		r.syncP99MS = math.Max(r.syncP99MS, 1000*after.sync[i].minus(before.sync[i]).quantile(0.99))
	}
	summaryWrites := 0.0
	for _, verb := range []string{"CREATE", "UPDATE", "PATCH", "APPLY"} {
		m := map[string]string{"resource": "configmaps", "verb": verb}
		summaryWrites += after.api.sum("apiserver_request_total", m) - before.api.sum("apiserver_request_total", m)
	}
	summaryWrites /= secs
	verdict := func(what string, value, limit float64) string {
		v := "met"
		if math.IsNaN(value) || value > limit {
			v = "not met"
		}
		return fmt.Sprintf("%s %.2f ≤ %.2f %s", what, value, limit, v)
	}
	verdicts := []string{
		verdict("agent_watch_bytes_over_kube_proxy", agent.bytesPS/kp.bytesPS, goalBytesRatio),
		verdict("agent_rss_mb", agent.rssMB, goalRSSMB),
		verdict("agent_cpu_over_kube_proxy", agent.cpuMSPS/kp.cpuMSPS, 1),
		verdict("agent_sync_p99_ms", agent.syncP99MS, goalSyncP99MS),
		// The ConfigMap writes of the run: only the summary writer makes
		// any; without one, 0.
		verdict("summary_writes_per_s("+summaryConfigMapName+")", summaryWrites, goalSummaryWritesPS),
	}
	return []row{agent, kp}, verdicts, nil
}

func round(m map[string]float64) map[string]float64 {
	out := map[string]float64{}
	for k, v := range m {
		if v != 0 {
			out[k] = math.Round(v*10) / 10
		}
	}
	return out
}

// kubeconfigVia writes a kubeconfig that reaches c at proxyAddr (the
// certificate still names the apiserver's own address).
func kubeconfigVia(c *kubetest.Cluster, dir, name, proxyAddr string) (string, error) {
	u, err := url.Parse(c.URL)
	if err != nil {
		return "", err
	}
	kc := clientcmdapi.NewConfig()
	kc.Clusters["scale"] = &clientcmdapi.Cluster{Server: "https://" + proxyAddr, CertificateAuthorityData: c.Config.CAData, TLSServerName: u.Hostname()}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: c.Token}
	kc.Contexts["scale"] = &clientcmdapi.Context{Cluster: "scale", AuthInfo: "admin"}
	kc.CurrentContext = "scale"
	path := filepath.Join(dir, name+".kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return "", fmt.Errorf("write kubeconfig for %s: %w", name, err)
	}
	return path, nil
}

// freeAddr is a free 127.0.0.1 port a moment ago.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

func startChild(name string, logPath string, argv ...string) (*childproc.Child, error) {
	log, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = log, log
	child, err := childproc.Start(cmd)
	log.Close() // the child holds its own descriptor
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	return child, nil
}

// startAgent runs topolb-agent --datapath=none for node through a
// counting proxy of its own.
func startAgent(b *testing.B, c *kubetest.Cluster, apiHost, bin, node string) (*proc, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &proc{name: "topolb-agent/" + node, proxy: newCountingProxy(ln, apiHost), logPath: filepath.Join(c.Dir, "agent-"+node+".log")}
	kc, err := kubeconfigVia(c, c.Dir, node, p.proxy.Addr())
	if err != nil {
		p.stop()
		return nil, err
	}
	metricsAddr, err := freeAddr()
	if err != nil {
		p.stop()
		return nil, err
	}
	args := []string{bin, "--datapath=none", "--node-name=" + node, "--kubeconfig=" + kc,
		"--metrics-address=" + metricsAddr, "--health-address=", "--healthz-bind-address=",
		"--health-check-node-ports=false", "--summary-namespace=default"}
	args = append(args, strings.Fields(*scaleAgentArgs)...)
	if p.child, err = startChild(p.name, p.logPath, args...); err != nil {
		p.stop()
		return nil, err
	}
	h := &http.Client{Timeout: 30 * time.Second}
	p.metrics = func(ctx context.Context) (metrics, error) { return scrape(ctx, h, "http://"+metricsAddr+"/metrics") }
	return p, nil
}

// startKubeProxy runs kube-proxy (nftables) for node in a network
// namespace of its own, reaching the apiserver through a counting proxy
// listening on the namespace's loopback.
func startKubeProxy(b *testing.B, c *kubetest.Cluster, apiHost, node string) (*proc, error) {
	if err := netns.RemoveStale("tlbscale-"); err != nil {
		return nil, err
	}
	ns, err := netns.Create(fmt.Sprintf("tlbscale-%d-kp", os.Getpid()))
	if err != nil {
		return nil, err
	}
	ln, err := ns.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, errors.Join(err, ns.Delete())
	}
	p := &proc{name: "kube-proxy", proxy: newCountingProxy(ln, apiHost), logPath: filepath.Join(c.Dir, "kube-proxy.log"), ns: ns}
	kc, err := kubeconfigVia(c, c.Dir, "kube-proxy", p.proxy.Addr())
	if err != nil {
		p.stop()
		return nil, err
	}
	// nsenter execs kube-proxy: the pid is kube-proxy's.
	if p.child, err = startChild(p.name, p.logPath, "nsenter", "--net="+ns.Path, c.Bin("kube-proxy"),
		"--kubeconfig="+kc, "--hostname-override="+node, "--proxy-mode=nftables",
		"--cluster-cidr=10.128.0.0/9", "--conntrack-max-per-core=0", "--nodeport-addresses=primary",
		"--healthz-bind-address=127.0.0.1:10256", "--metrics-bind-address="+kubeProxyMetrics); err != nil {
		p.stop()
		return nil, err
	}
	h := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: ns.DialContext, DisableKeepAlives: true}}
	p.metrics = func(ctx context.Context) (metrics, error) {
		return scrape(ctx, h, "http://"+kubeProxyMetrics+"/metrics")
	}
	return p, nil
}

// waitSynced waits until every agent reports its first full sync
// (topolb_sync_duration_seconds_count > 0) and kube-proxy its first rules
// (kubeproxy_sync_proxy_rules_last_timestamp_seconds > 0).
func waitSynced(ctx context.Context, procs []*proc) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	for _, p := range procs {
		for {
			m, err := p.metrics(ctx)
			if err == nil {
				if p.name == "kube-proxy" && m.sum("kubeproxy_sync_proxy_rules_last_timestamp_seconds", nil) > 0 {
					break
				}
				if p.name != "kube-proxy" && m.sum("topolb_sync_duration_seconds_count", nil) > 0 {
					break
				}
			}
			if p.child.Exited() {
				return fmt.Errorf("%s exited before it synced: %w; its log ends:\n%s", p.name, p.child.Wait(), logTail(p.logPath))
			}
			select {
			case <-ctx.Done():
				return errors.Join(fmt.Errorf("%s not synced: %w; its log ends:\n%s", p.name, ctx.Err(), logTail(p.logPath)), err)
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
	return nil
}

// logTail is the end of a process's log, for errors: the cluster's
// directory, which holds it, goes with the cluster.
func logTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-20):], "\n")
}
