package e2e

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/tools/testbed"
)

var (
	benchScales   = flag.String("bench-e2e-services", "10,1000,10000", "service counts BenchmarkE2E measures at")
	benchImpls    = flag.String("bench-e2e-impls", "topolb,kube-proxy-nft,kube-proxy-ipt", "implementations BenchmarkE2E measures")
	benchRounds   = flag.Int("bench-e2e-rounds", 5, "interleaved rounds of every measurement per implementation and scale (at least 2, for a confidence interval)")
	benchDuration = flag.Duration("bench-e2e-wrk", 3*time.Second, "length of each wrk run")
	benchNodeN    = flag.Int("bench-e2e-node-frames", 1_000_000, "datagrams of each node-local flood (node_pps, node_ns_pps)")
	benchOnly     = flag.String("bench-e2e-metrics", "", "metrics BenchmarkE2E measures, comma-separated (default all; wrk's four and each rate with its CPU cost are measured together)")
)

// Implementations compared by BenchmarkE2E.
const (
	implTopolb = "topolb"
	implNFT    = "kube-proxy-nft"
	implIPT    = "kube-proxy-ipt"
	// implFloor is not an implementation: testbed.RedirectFloor, the
	// least any proxy on the pod veth's tc hook does for the node_pps
	// flood, measured on topolb's testbed right after topolb's own
	// node_pps flood in each round (ahead of topolb's programs, which
	// then see none of the flood). Its rates against nftables' are the
	// most a tc-hook proxy can reach on that path.
	implFloor = "floor"
)

// nodeMetrics are node_pps's group, the metrics implFloor is measured for.
var nodeMetrics = []string{"node_pps", "node_cpu_ns_per_pkt", "node_flood_cpu_ns_per_pkt"}

// floorKey is where round puts implFloor's value of metric.
func floorKey(metric string) string { return implFloor + ":" + metric }

// The benchmark's Services, on the demo testbed (client on node-a1,
// zone-a) with an outside client ext1 behind a router:
//   - fast: TCP 80 to nginx on 8088 in web-a1 and web-a2; zone hints over
//     endpoints in every zone, so the client's permitted set is zone-a's
//     two (only those run nginx: a proxy ignoring hints fails requests).
//   - flip-<impl>: one backend, swapped between web-a1 and web-a2 to time
//     updates; one per implementation, so no implementation's update is
//     another's.
//   - sink: UDP to port 9 of web-b1 (node-b1), where nothing listens: the
//     pod-to-remote flood; the backend counts arrivals as Udp NoPorts (Udp6
//     NoPorts). Dual stack: the same flood in IPv6 to its IPv6 cluster IP.
//   - ns: NodePort UDP 30909 to web-b1's port 9 (the outside flood, through
//     node-a1's NodePort to a backend on another node), and NodePort UDP
//     30953 to the echo port, to see whether NodePorts are balanced.
var (
	fastVIP    = netip.MustParseAddrPort("10.96.0.40:80")
	fastVIP6   = netip.MustParseAddrPort("[fd00:10:96::28]:80")
	sinkVIP    = netip.MustParseAddrPort("10.96.0.30:9")
	sinkVIP6   = netip.MustParseAddrPort("[fd00:10:96::1e]:9")
	flipVIPs   = map[string]netip.AddrPort{implTopolb: netip.MustParseAddrPort("10.96.0.21:80"), implNFT: netip.MustParseAddrPort("10.96.0.22:80"), implIPT: netip.MustParseAddrPort("10.96.0.23:80")}
	nsSinkPort = uint16(30909)
	nsEchoPort = uint16(30953)
)

// nginxPort is where the fast backends' nginx listens.
const nginxPort = 8088

// benchSpec is the demo testbed, dual stack (for pps_ipv6), with an
// outside client whose traffic enters at node-a1, the client's node.
func benchSpec(b testing.TB) *testbed.Spec {
	b.Helper()
	spec := demoSpec(b)
	spec.Outside.IngressNode = "node-a1"
	spec.DualStack = true
	return spec
}

func benchServices(web testbed.ServiceSpec, flipTo map[string]string) []testbed.ServiceSpec {
	zoneHinted := []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-a2"}, {Pod: "web-b1"}, {Pod: "web-c1"}}
	out := []testbed.ServiceSpec{
		web,
		{Name: "fast", ClusterIP: fastVIP.Addr().String(), Hints: testbed.HintsZone, Endpoints: zoneHinted,
			Ports: []testbed.PortSpec{{Name: "http", Port: int32(fastVIP.Port()), TargetPort: nginxPort}}},
		{Name: "sink", ClusterIP: sinkVIP.Addr().String(), ClusterIPv6: sinkVIP6.Addr().String(), IPFamilies: bothFamilies, Endpoints: []testbed.EndpointSpec{{Pod: "web-b1"}},
			Ports: []testbed.PortSpec{{Name: "sink", Protocol: v1.ProtocolUDP, Port: 9, TargetPort: 9}}},
		{Name: "ns", ClusterIP: "10.96.0.31", Type: v1.ServiceTypeNodePort, Endpoints: []testbed.EndpointSpec{{Pod: "web-b1"}},
			Ports: []testbed.PortSpec{
				{Name: "sink", Protocol: v1.ProtocolUDP, Port: 9, TargetPort: 9, NodePort: int32(nsSinkPort)},
				{Name: "echo", Protocol: v1.ProtocolUDP, Port: 53, NodePort: int32(nsEchoPort)},
			}},
	}
	for _, impl := range []string{implTopolb, implNFT, implIPT} {
		out = append(out, flipService(impl, flipTo[impl]))
	}
	return out
}

func flipService(impl, to string) testbed.ServiceSpec {
	if to == "" {
		to = "web-a1"
	}
	vip := flipVIPs[impl]
	return testbed.ServiceSpec{Name: "flip-" + impl, ClusterIP: vip.Addr().String(),
		Ports: []testbed.PortSpec{{Name: "http", Port: int32(vip.Port())}}, Endpoints: []testbed.EndpointSpec{{Pod: to}}}
}

// Metrics, in the order they are printed.
var benchMetrics = []string{"requests_per_s", "p50_ms", "p99_ms", "cpu_us_per_req", "pps", "pps_ipv6", "ns_pps",
	"node_pps", "node_cpu_ns_per_pkt", "node_flood_cpu_ns_per_pkt",
	"node_ns_pps", "node_ns_cpu_ns_per_pkt", "node_ns_flood_cpu_ns_per_pkt", "update_ms"}

// Metrics measured together: asking for one measures all.
var benchGroups = [][]string{
	{"requests_per_s", "p50_ms", "p99_ms", "cpu_us_per_req"},
	nodeMetrics,
	{"node_ns_pps", "node_ns_cpu_ns_per_pkt", "node_ns_flood_cpu_ns_per_pkt"},
}

// selectedMetrics returns the metrics -bench-e2e-metrics asks for, in
// benchMetrics order, with their groups.
func selectedMetrics() ([]string, error) {
	if *benchOnly == "" {
		return benchMetrics, nil
	}
	asked := map[string]bool{}
	for _, m := range strings.Split(*benchOnly, ",") {
		m = strings.TrimSpace(m)
		if !slices.Contains(benchMetrics, m) {
			return nil, fmt.Errorf("-bench-e2e-metrics: unknown metric %q (known: %s)", m, strings.Join(benchMetrics, ","))
		}
		asked[m] = true
		for _, g := range benchGroups {
			if slices.Contains(g, m) {
				for _, o := range g {
					asked[o] = true
				}
			}
		}
	}
	var out []string
	for _, m := range benchMetrics {
		if asked[m] {
			out = append(out, m)
		}
	}
	return out, nil
}

// BenchmarkE2E compares topolb with kube-proxy in nftables and iptables
// mode at 10, 1,000 and 10,000 Services, all watching one real
// kube-apiserver with both service ranges. Each implementation runs alone on the client's node of
// its own testbed; the three testbeds are up at once, and the
// implementations not being measured are paused (SIGSTOP), so rounds are
// interleaved (round r measures every implementation once, in an order
// rotated per round) without one implementation's work landing in
// another's measurement. Per round and implementation:
//
//   - requests_per_s, p50_ms, p99_ms: wrk (one thread, 16 connections,
//     "Connection: close": a new TCP connection per request) from the
//     client pod to the fast Service, served by nginx in the backend pods;
//   - cpu_us_per_req: busy CPU time of the whole machine (/proc/stat: user,
//     nice, system, irq, softirq, steal) during the wrk run, per request;
//   - pps: 200,000 UDP datagrams from the client pod to a Service whose
//     backend is on another node, injected with live-frame XDP test runs
//     (testbed.Pod.FloodUDP), at least 90% of which must arrive;
//   - pps_ipv6: the same in IPv6, to the Service's IPv6 cluster IP (the
//     testbed and the apiserver are dual stack; kube-proxy runs a proxier
//     per family);
//   - ns_pps: the same from the outside client, through the router, to
//     node-a1's NodePort of a Service whose backend is on another node
//     (the whole north-south path); skipped, with the reason printed, for
//     an implementation whose NodePort does not answer;
//   - node_pps, node_cpu_ns_per_pkt, node_flood_cpu_ns_per_pkt: the
//     client node alone (issue 23): 1,000,000 datagrams
//     (-bench-e2e-node-frames) injected as pps does, counted and dropped
//     by a testbed.WireSink on node-a1's switch port as they leave the
//     node, where at least 90% must arrive translated to web-b1 and none
//     untranslated; neither the bridge nor node-b1 is on the path. Its
//     cost per datagram, in ns: the machine's busy CPU time during the
//     flood (as cpu_us_per_req; whatever else the machine ran is in it),
//     and the flood's own CPU time (testbed.FloodResult.CPU: the
//     injecting thread's, in whose system call the kernel takes every
//     frame through node-a1, and ksoftirqd's), which no other load on the
//     machine skews. Both include the injection and the sink, the same
//     for every implementation. In topolb's turn of each round the same
//     flood runs again through testbed.RedirectFloor (impl=floor: match,
//     DNAT, checksums, MACs, bpf_redirect, nothing else), the rate no
//     proxy on the pod veth's tc hook can pass here;
//   - node_ns_pps, node_ns_cpu_ns_per_pkt, node_ns_flood_cpu_ns_per_pkt:
//     the same from outside, injected into node-a1's uplink as the wire
//     delivers frames (testbed.Testbed.FloodWire: no router, no bridge),
//     to its NodePort; skipped as ns_pps is;
//   - update_ms: from an EndpointSlice update (the implementation's own
//     one-backend Service swapped to the other pod) to the first new
//     connection answered by the new pod.
//
// It prints, per scale, implementation and metric, the mean over the
// rounds with its 95% confidence interval (Student's t), and the mean of
// the per-round ratios to kube-proxy nftables with its interval:
//
//	BENCH e2e impl=<...> services=<n> metric=<...> value=<mean> ci95=<±> ratio_vs_nftables=<mean> ratio_ci95=<±> verdict=<met|not met|n/a>
//
// and, per implementation that measured both floods, the mean of the
// per-round ratios of its IPv6 rate to its IPv4 one:
//
//	BENCH e2e impl=<...> services=<n> ratio=pps_ipv6/pps value=<mean> ci95=<±>
//
// topolb's node_pps group over the floor's, round by round:
//
//	BENCH e2e impl=topolb services=<n> metric=<...> ratio_vs_floor=<mean> ratio_ci95=<±>
//
// and a GOAL line per goal, followed, for node_pps's goals, by a CEILING
// line: the goal judged on the floor's figures (whether any tc-hook proxy
// could meet it on this machine). A goal is met only when the whole confidence
// interval of its ratio is on the right side. Run it with `make
// bench-e2e`.
func BenchmarkE2E(b *testing.B) {
	if testing.Short() {
		b.Skip("long benchmark")
	}
	requireRoot(b)
	agentBin := requireAgent(b)
	kp := kubeProxyBinary(b)
	for _, tool := range []string{"wrk", "nginx"} {
		if _, err := exec.LookPath(tool); err != nil {
			b.Fatalf("%s: %v (make deps installs it)", tool, err)
		}
	}
	if *benchRounds < 2 {
		b.Fatalf("-bench-e2e-rounds %d: a confidence interval needs at least 2", *benchRounds)
	}
	metrics, err := selectedMetrics()
	if err != nil {
		b.Fatal(err)
	}
	impls := strings.Split(*benchImpls, ",")
	for _, impl := range impls {
		if _, ok := flipVIPs[impl]; !ok {
			b.Fatalf("-bench-e2e-impls: unknown implementation %q", impl)
		}
	}
	cluster := kubetest.Start(b, kubetest.WithDualStackServices())
	cfg := rest.CopyConfig(cluster.Config)
	cfg.QPS, cfg.Burst = 2000, 4000
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		b.Fatal(err)
	}
	spec := benchSpec(b)
	layout, err := testbed.NewLayout(spec)
	if err != nil {
		b.Fatal(err)
	}
	var all []result
	filler := 0
	for _, s := range strings.Split(*benchScales, ",") {
		total, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			b.Fatalf("-bench-e2e-services: %v", err)
		}
		// The bench Services, with default/kubernetes, are eight.
		want := max(total-8, 0)
		t0 := time.Now()
		if err := createFiller(b.Context(), client, layout, filler, want); err != nil {
			b.Fatal(err)
		}
		if want > filler {
			b.Logf("created %d filler Services and EndpointSlices in %v", want-filler, time.Since(t0).Round(time.Millisecond))
			filler = want
		}
		rs := benchScale(b, cluster.Config, spec, impls, metrics, agentBin, kp, total)
		printResults(rs)
		all = append(all, rs...)
	}
	printGoals(all)
}

// sample is one metric's values over the rounds, in round order (NaN for
// a round that could not measure it).
type sample []float64

// result is one implementation's samples at one scale.
type result struct {
	impl     string
	services int
	samples  map[string]sample
	// skipped says why a metric was not measured.
	skipped map[string]string
}

// benchBed is one implementation on its own testbed.
type benchBed struct {
	impl string
	tb   *testbed.Testbed
	// proc is the implementation's process, paused between its rounds.
	proc *testbed.Process
	// nsSkip is why ns_pps is not measured ("" when it is).
	nsSkip string
	// flipTo is the pod its flip Service points at now.
	flipTo string
}

// benchScale sets up one testbed per implementation, measures them in
// interleaved rounds and tears them down.
func benchScale(b *testing.B, cfg *rest.Config, spec *testbed.Spec, impls, metrics []string, agentBin, kp string, services int) []result {
	b.Helper()
	ctx, cancel := context.WithTimeout(b.Context(), 20*time.Minute)
	defer cancel()
	var beds []*benchBed
	defer func() {
		for _, bed := range beds {
			if err := bed.tb.Close(); err != nil {
				b.Errorf("%s: teardown: %v", bed.impl, err)
			}
		}
	}()
	for _, impl := range impls {
		bed := setupBed(ctx, b, cfg, spec, impl, agentBin, kp, services)
		beds = append(beds, bed)
		if err := bed.proc.Pause(); err != nil {
			b.Fatal(err)
		}
	}
	results := make([]result, len(beds))
	// floor is implFloor's result, measured with topolb's rounds.
	var floor *result
	if slices.Contains(impls, implTopolb) && slices.Contains(metrics, "node_pps") {
		floor = &result{impl: implFloor, services: services, samples: map[string]sample{}, skipped: map[string]string{}}
	}
	for i, bed := range beds {
		results[i] = result{impl: bed.impl, services: services, samples: map[string]sample{}, skipped: map[string]string{}}
		if bed.nsSkip != "" {
			for _, m := range nodePortMetrics {
				if slices.Contains(metrics, m) {
					results[i].skipped[m] = bed.nsSkip
				}
			}
		}
	}
	for r := 0; r < *benchRounds; r++ {
		for k := range beds {
			i := (k + r) % len(beds)
			bed := beds[i]
			if err := bed.proc.Resume(); err != nil {
				b.Fatal(err)
			}
			if err := bed.converge(ctx); err != nil {
				b.Fatalf("%s, %d services, round %d: %v", bed.impl, services, r+1, err)
			}
			m := bed.round(ctx, b, services, metrics)
			if err := bed.proc.Pause(); err != nil {
				b.Fatal(err)
			}
			for _, metric := range metrics {
				v, ok := m[metric]
				if !ok {
					v = math.NaN()
				}
				results[i].samples[metric] = append(results[i].samples[metric], v)
			}
			if floor != nil && bed.impl == implTopolb {
				for _, metric := range nodeMetrics {
					v, ok := m[floorKey(metric)]
					if !ok {
						v = math.NaN()
					}
					floor.samples[metric] = append(floor.samples[metric], v)
				}
			}
		}
	}
	if floor != nil {
		results = append(results, *floor)
	}
	return results
}

// setupBed brings up a testbed with the implementation on the client's
// node, checks that the bench Services land where the decisions say, starts
// nginx in the fast Service's backends and finds out whether NodePorts
// answer.
func setupBed(ctx context.Context, b *testing.B, cfg *rest.Config, spec *testbed.Spec, impl, agentBin, kp string, services int) *benchBed {
	b.Helper()
	tb, err := testbed.New(ctx, spec, testbed.Options{})
	if err != nil {
		b.Fatal(err)
	}
	// Also when setting up fails half-way (Close is idempotent).
	b.Cleanup(func() { tb.Close() })
	bed := &benchBed{impl: impl, tb: tb, flipTo: "web-a1"}
	web := service(b, spec, "zone-hints", "web")
	if err := tb.ConnectAPIServer(ctx, cfg); err != nil {
		b.Fatal(err)
	}
	if _, err := tb.Apply(ctx, benchServices(web, nil)); err != nil {
		b.Fatal(err)
	}
	node := tb.Pod("client").Node.Name
	t0 := time.Now()
	switch impl {
	case implTopolb:
		a, err := tb.StartAgent(ctx, node, testbed.AgentOptions{Binary: agentBin, MaxFrontends: 32768, MaxBackends: 131072})
		if err == nil {
			err = a.WaitReady(ctx)
		}
		if err == nil {
			err = tb.WaitAgents(ctx, 5*time.Minute)
		}
		if err != nil {
			b.Fatal(err)
		}
		bed.proc = a.Process
	case implNFT, implIPT:
		mode := testbed.KubeProxyNFTables
		if impl == implIPT {
			mode = testbed.KubeProxyIPTables
		}
		k, err := tb.StartKubeProxy(ctx, node, testbed.KubeProxyOptions{Binary: kp, Mode: mode})
		if err != nil {
			b.Fatal(err)
		}
		if needed, err := k.EnsureTopology(ctx); err != nil {
			b.Fatal(err)
		} else if needed {
			b.Logf("%s, %d services: kube-proxy missed its zone at start (its startup race); relabelled the node", impl, services)
		}
		bed.proc = k.Process
	}
	for _, pod := range []string{"web-a1", "web-a2"} {
		if err := startNginx(ctx, tb, tb.Pod(pod)); err != nil {
			b.Fatal(err)
		}
	}
	if err := bed.converge(ctx); err != nil {
		b.Fatalf("%s, %d services: %v", impl, services, err)
	}
	// Ready means the measured Services answer from where they should.
	client := tb.Pod("client")
	landings, err := tb.Measure(ctx, client, "web", testbed.MeasureOptions{Requests: 60})
	if err != nil {
		b.Fatalf("%s, %d services: %v", impl, services, err)
	}
	for _, l := range landings {
		for _, p := range l.Problems() {
			b.Errorf("%s, %d services: web %s: %s", impl, services, l.Decision.Protocol, p)
		}
	}
	fast := testbed.Summarize(client, client.Send(ctx, testbed.Load{Proto: v1.ProtocolTCP, Target: fastVIP, Count: 60}))
	if got := fast.Backends(); fast.Failed > 0 || !slices.Equal(got, []string{"web-a1", "web-a2"}) {
		b.Fatalf("%s, %d services: fast landed on %v, %d failed (%v); want exactly web-a1 and web-a2", impl, services, got, fast.Failed, fast.Errors)
	}
	bed.nsSkip = nodePortSkip(ctx, tb)
	if bed.nsSkip != "" && impl != implTopolb {
		b.Fatalf("%s, %d services: %s", impl, services, bed.nsSkip)
	}
	if bed.nsSkip != "" {
		for _, m := range nodePortMetrics {
			fmt.Printf("BENCH e2e impl=%s services=%d metric=%s skipped: %s\n", impl, services, m, bed.nsSkip)
		}
	}
	b.Logf("%s ready with %d services in %v", impl, services, time.Since(t0).Round(time.Millisecond))
	return bed
}

// nodePortSkip asks the ns Service's echo NodePort on the client's node
// from the outside client and returns why ns_pps cannot be measured, ""
// when it answers.
func nodePortSkip(ctx context.Context, tb *testbed.Testbed) string {
	target := netip.AddrPortFrom(tb.Pod("client").Node.WireAddr.Addr(), nsEchoPort)
	var err error
	for range 3 {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		var a testbed.Answer
		a, err = tb.External("ext1").Request(rctx, v1.ProtocolUDP, target)
		cancel()
		if err == nil && a.Pod == "web-b1" {
			return ""
		}
		if err == nil {
			err = fmt.Errorf("answered by %s, not web-b1", a.Pod)
		}
	}
	return fmt.Sprintf("the outside client gets no answer from NodePort %s (%v): the datapath does not balance NodePorts", target, err)
}

// converge waits until the implementation has caught up with what changed
// while it was paused: topolb's agent agrees with DecideNode; kube-proxy
// sends the client to its flip Service's current backend and has had its
// one-second minimum sync period to settle.
func (bed *benchBed) converge(ctx context.Context) error {
	if bed.impl == implTopolb {
		// The flips, its own and other testbeds', went to the apiserver
		// directly.
		if _, err := bed.tb.Refresh(ctx); err != nil {
			return err
		}
		return bed.tb.WaitAgents(ctx, 2*time.Minute)
	}
	client := bed.tb.Pod("client")
	deadline := time.Now().Add(2 * time.Minute)
	for {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		a, err := client.Request(rctx, v1.ProtocolTCP, flipVIPs[bed.impl])
		cancel()
		if err == nil && a.Pod == bed.flipTo {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("flip-%s does not answer from %s (%v, %q)", bed.impl, bed.flipTo, err, a.Pod)
		}
		time.Sleep(50 * time.Millisecond)
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(1200 * time.Millisecond):
		return nil
	}
}

// nodePortMetrics are measured through node-a1's NodePort: not for an
// implementation whose NodePort does not answer (benchBed.nsSkip).
var nodePortMetrics = []string{"ns_pps", "node_ns_pps"}

// round measures every metric once.
func (bed *benchBed) round(ctx context.Context, b *testing.B, services int, metrics []string) map[string]float64 {
	b.Helper()
	out := map[string]float64{}
	label := fmt.Sprintf("%s, %d services", bed.impl, services)
	measure := func(metric string) bool {
		return slices.Contains(metrics, metric) && (bed.nsSkip == "" || !slices.Contains(nodePortMetrics, metric))
	}
	client := bed.tb.Pod("client")
	if measure("requests_per_s") {
		w, err := runWrk(ctx, client, fastVIP, *benchDuration)
		if err != nil {
			b.Fatalf("%s: %v", label, err)
		}
		out["requests_per_s"], out["p50_ms"], out["p99_ms"], out["cpu_us_per_req"] = w.rate, w.p50ms, w.p99ms, w.cpuUSPerReq
	}

	backend := bed.tb.Pod("web-b1")
	ext := bed.tb.External("ext1")
	nodePort := netip.AddrPortFrom(client.Node.WireAddr.Addr(), nsSinkPort)
	const frames = 200_000
	for _, f := range []struct {
		metric string
		flood  func() (testbed.FloodResult, error)
	}{
		{"pps", func() (testbed.FloodResult, error) { return client.FloodUDP(sinkVIP, frames) }},
		{"pps_ipv6", func() (testbed.FloodResult, error) { return client.FloodUDP(sinkVIP6, frames) }},
		{"ns_pps", func() (testbed.FloodResult, error) { return ext.FloodUDP(nodePort, frames) }},
	} {
		if !measure(f.metric) {
			continue
		}
		res, err := testbed.CountArrivals(backend.NS, f.flood)
		if err != nil {
			b.Fatalf("%s: %s: %v", label, f.metric, err)
		}
		if err := checkArrivals(res, frames); err != nil {
			b.Errorf("%s: %s: %v: the rate does not count", label, f.metric, err)
			continue
		}
		out[f.metric] = res.PPS
	}

	// The node-local floods: the sink on node-a1's switch port takes what
	// leaves for web-b1's port 9, and counts what leaves untranslated.
	want := netip.AddrPortFrom(backend.Addr, sinkVIP.Port())
	// The floor (implFloor) runs the node_pps flood again in topolb's
	// turn, right after topolb's, through a RedirectFloor put first on
	// the client's veth for that flood only.
	floor := func() (io.Closer, error) { return client.AttachRedirectFloor(sinkVIP, backend, want.Port()) }
	for _, f := range []struct {
		metric, busy, own string
		on                bool
		target            netip.AddrPort
		flood             func(target netip.AddrPort, count int) (testbed.FloodResult, error)
		// setup, when set, is done before the flood and closed after it.
		setup func() (io.Closer, error)
	}{
		{"node_pps", "node_cpu_ns_per_pkt", "node_flood_cpu_ns_per_pkt", measure("node_pps"), sinkVIP, client.FloodUDP, nil},
		{floorKey("node_pps"), floorKey("node_cpu_ns_per_pkt"), floorKey("node_flood_cpu_ns_per_pkt"),
			bed.impl == implTopolb && measure("node_pps"), sinkVIP, client.FloodUDP, floor},
		{"node_ns_pps", "node_ns_cpu_ns_per_pkt", "node_ns_flood_cpu_ns_per_pkt", measure("node_ns_pps"), nodePort, func(to netip.AddrPort, n int) (testbed.FloodResult, error) {
			return bed.tb.FloodWire(ext, client.Node, to, n)
		}, nil},
	} {
		if !f.on {
			continue
		}
		var undo io.Closer
		if f.setup != nil {
			var err error
			if undo, err = f.setup(); err != nil {
				b.Fatalf("%s: %s: %v", label, f.metric, err)
			}
		}
		res, busy, err := nodeFlood(bed.tb, client.Node, want, f.target, *benchNodeN, f.flood)
		if undo != nil {
			err = errors.Join(err, undo.Close())
		}
		if err != nil {
			b.Fatalf("%s: %s: %v", label, f.metric, err)
		}
		if err := checkArrivals(res, *benchNodeN); err != nil {
			b.Errorf("%s: %s: %v: the rate does not count", label, f.metric, err)
			continue
		}
		out[f.metric], out[f.busy], out[f.own] = res.PPS, busy, float64(res.CPU.Nanoseconds())/float64(res.Sent)
	}

	if measure("update_ms") {
		to := map[string]string{"web-a1": "web-a2", "web-a2": "web-a1"}[bed.flipTo]
		ms, err := updateLatency(ctx, bed.tb, flipService(bed.impl, to), client, flipVIPs[bed.impl], to)
		if err != nil {
			b.Errorf("%s: update: %v", label, err)
		} else {
			out["update_ms"] = ms
		}
		bed.flipTo = to
	}
	return out
}

// checkArrivals says why a flood's rate does not count: fewer frames
// injected than asked for, fewer than 90% of them (or more than all)
// arrived, or some left untranslated.
func checkArrivals(res testbed.FloodResult, asked int) error {
	if sent := uint64(res.Sent); res.Sent < asked || res.Arrived < sent*9/10 || res.Arrived > sent || res.Stray != 0 {
		return fmt.Errorf("%d of %d datagrams (%d asked for) reached the backend, %d left untranslated (%d dropped by the node's wire)", res.Arrived, res.Sent, asked, res.Stray, res.WireDrops)
	}
	return nil
}

// nodeFlood sends a few datagrams to target with flood (so node has
// resolved its next hop), then count more through a testbed.WireSink on
// node's switch port for want, and returns the flood's result and the
// machine's busy CPU time during it per datagram, in ns.
func nodeFlood(tb *testbed.Testbed, node *testbed.Node, want, target netip.AddrPort, count int,
	flood func(netip.AddrPort, int) (testbed.FloodResult, error)) (res testbed.FloodResult, cpuNS float64, err error) {
	if _, err := flood(target, 100); err != nil {
		return res, 0, err
	}
	sink, err := tb.AttachWireSink(node, want, target)
	if err != nil {
		return res, 0, err
	}
	defer func() { err = errors.Join(err, sink.Close()) }()
	var before, after time.Duration
	res, err = sink.CountArrivals(func() (testbed.FloodResult, error) {
		var err error
		if before, err = busyCPU(); err != nil {
			return testbed.FloodResult{}, err
		}
		r, err := flood(target, count)
		if err != nil {
			return r, err
		}
		after, err = busyCPU()
		return r, err
	})
	if err != nil {
		return res, 0, err
	}
	if res.Sent == 0 {
		return res, 0, errors.New("the flood injected nothing")
	}
	return res, float64((after - before).Nanoseconds()) / float64(res.Sent), nil
}

// startNginx serves the fast Service's port in pod with nginx: one
// process, every answer "Connection: close" with the pod's JSON Answer.
func startNginx(ctx context.Context, tb *testbed.Testbed, pod *testbed.Pod) error {
	dir := filepath.Join(tb.Dir, "nginx-"+pod.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	listen6 := "" // a pod without IPv6 has no [::] to bind
	if pod.Addr6.IsValid() {
		listen6 = fmt.Sprintf("listen [::]:%d backlog=4096;", nginxPort)
	}
	answer := fmt.Sprintf(`{"pod":"%s","node":"%s","zone":"%s","client":"$remote_addr:$remote_port"}`, pod.Name, pod.Node.Name, pod.Zone())
	conf := fmt.Sprintf(`daemon off;
master_process off;
worker_processes 1;
pid %[1]s/nginx.pid;
error_log stderr warn;
events { worker_connections 4096; }
http {
	access_log off;
	client_body_temp_path %[1]s/body;
	proxy_temp_path %[1]s/proxy;
	fastcgi_temp_path %[1]s/fastcgi;
	uwsgi_temp_path %[1]s/uwsgi;
	scgi_temp_path %[1]s/scgi;
	server {
		listen %[2]d backlog=4096;
		%[4]s
		keepalive_timeout 0;
		location / { default_type application/json; return 200 '%[3]s'; }
	}
}
`, dir, nginxPort, answer, listen6)
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		return err
	}
	p, err := tb.StartProcess(ctx, pod, "nginx", "nginx", "-p", dir, "-c", path)
	if err != nil {
		return err
	}
	target := netip.AddrPortFrom(pod.Addr, nginxPort)
	deadline := time.Now().Add(10 * time.Second)
	for {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		a, err := tb.Pod("client").Request(rctx, v1.ProtocolTCP, target)
		cancel()
		if err == nil && a.Pod == pod.Name {
			return nil
		}
		if !p.Running() || time.Now().After(deadline) {
			return fmt.Errorf("nginx in %s does not answer (%v, %q); its log:\n%s", pod.Name, err, a.Pod, p.LogTail(10))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// wrkResult is one wrk run.
type wrkResult struct {
	requests           int
	rate, p50ms, p99ms float64
	cpuUSPerReq        float64
}

var (
	wrkRequests = regexp.MustCompile(`(\d+) requests in [\d.]+\w+`)
	wrkRate     = regexp.MustCompile(`Requests/sec:\s+([\d.]+)`)
	wrkPct      = regexp.MustCompile(`(?m)^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$`)
	wrkErrors   = regexp.MustCompile(`Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)`)
	wrkNon2xx   = regexp.MustCompile(`Non-2xx or 3xx responses: (\d+)`)
)

// runWrk runs wrk from the client pod against target for d, with a new
// connection per request, and reads the machine's busy CPU time around it.
// Failed requests (socket errors, non-2xx answers) are an error.
func runWrk(ctx context.Context, client *testbed.Pod, target netip.AddrPort, d time.Duration) (wrkResult, error) {
	var r wrkResult
	before, err := busyCPU()
	if err != nil {
		return r, err
	}
	cmd := exec.CommandContext(ctx, "nsenter", "--net="+client.NS.Path, "wrk", "-t1", "-c16", "-d"+strconv.Itoa(int(d.Seconds()))+"s",
		"--latency", "-H", "Connection: close", "http://"+target.String()+"/")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return r, fmt.Errorf("wrk: %w: %s", err, out)
	}
	after, err := busyCPU()
	if err != nil {
		return r, err
	}
	if r, err = parseWrk(out); err != nil {
		return r, err
	}
	r.cpuUSPerReq = (after - before).Seconds() * 1e6 / float64(r.requests)
	return r, nil
}

// parseWrk reads wrk's --latency report.
func parseWrk(out []byte) (wrkResult, error) {
	var r wrkResult
	m := wrkRequests.FindSubmatch(out)
	rate := wrkRate.FindSubmatch(out)
	if m == nil || rate == nil {
		return r, fmt.Errorf("wrk: no request count or rate in %q", out)
	}
	r.requests, _ = strconv.Atoi(string(m[1]))
	r.rate, _ = strconv.ParseFloat(string(rate[1]), 64)
	if r.requests == 0 {
		return r, fmt.Errorf("wrk made no request: %s", out)
	}
	if e := wrkErrors.FindSubmatch(out); e != nil {
		return r, fmt.Errorf("wrk: socket errors: %s", e[0])
	}
	if e := wrkNon2xx.FindSubmatch(out); e != nil {
		return r, fmt.Errorf("wrk: %s", e[0])
	}
	for _, p := range wrkPct.FindAllSubmatch(out, -1) {
		v, err := strconv.ParseFloat(string(p[2]), 64)
		if err != nil {
			return r, fmt.Errorf("wrk: latency %q: %w", p[0], err)
		}
		switch string(p[3]) {
		case "us":
			v /= 1000
		case "s":
			v *= 1000
		}
		if string(p[1]) == "50" {
			r.p50ms = v
		} else {
			r.p99ms = v
		}
	}
	if r.p50ms == 0 || r.p99ms == 0 {
		return r, fmt.Errorf("wrk: no 50%% and 99%% latency in %q", out)
	}
	return r, nil
}

// userHZ is the unit of /proc/stat: USER_HZ, 100 on every Linux
// architecture topolb runs on.
const userHZ = 100

// busyCPU returns the machine's busy CPU time so far, all CPUs: user,
// nice, system, irq, softirq and steal from /proc/stat (guest time is
// already in user).
func busyCPU() (time.Duration, error) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	if !sc.Scan() {
		return 0, errors.New("/proc/stat is empty")
	}
	fields := strings.Fields(sc.Text())
	if len(fields) < 9 || fields[0] != "cpu" {
		return 0, fmt.Errorf("/proc/stat: unexpected first line %q", sc.Text())
	}
	var ticks uint64
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system irq softirq steal
		v, err := strconv.ParseUint(fields[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/stat: %w", err)
		}
		ticks += v
	}
	return time.Duration(ticks) * time.Second / userHZ, nil
}

// updateLatency points the flip Service's EndpointSlice at pod and returns
// the time until a new connection from the client to vip reaches it.
func updateLatency(ctx context.Context, tb *testbed.Testbed, flip testbed.ServiceSpec, client *testbed.Pod, vip netip.AddrPort, pod string) (float64, error) {
	objs, err := tb.Objects([]testbed.ServiceSpec{flip})
	if err != nil {
		return 0, err
	}
	want := objs.Slices[0]
	api := tb.KubeClient().DiscoveryV1().EndpointSlices(want.Namespace)
	cur, err := api.Get(ctx, want.Name, metav1.GetOptions{})
	if err != nil {
		return 0, err
	}
	cur.Endpoints = want.Endpoints
	start := time.Now()
	if _, err := api.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return 0, err
	}
	deadline := start.Add(30 * time.Second)
	for time.Now().Before(deadline) {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		a, err := client.Request(rctx, v1.ProtocolTCP, vip)
		cancel()
		if err == nil && a.Pod == pod {
			return float64(time.Since(start).Microseconds()) / 1000, nil
		}
		time.Sleep(2 * time.Millisecond)
	}
	return 0, fmt.Errorf("flip to %s not seen within 30 s", pod)
}

// createFiller creates Services fill-<from>..fill-<to-1>, each with one
// TCP port and an EndpointSlice of two zone-hinted backends, in parallel.
func createFiller(ctx context.Context, c kubernetes.Interface, l *testbed.Layout, from, to int) error {
	if to <= from {
		return nil
	}
	b1, c1 := l.Pod("web-b1"), l.Pod("web-c1")
	jobs := make(chan int)
	errs := make(chan error, 16)
	var wg sync.WaitGroup
	for w := 0; w < 16; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				if err := createOneFiller(ctx, c, i, b1, c1); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	var err error
loop:
	for i := from; i < to; i++ {
		select {
		case jobs <- i:
		case err = <-errs:
			break loop
		}
	}
	close(jobs)
	wg.Wait()
	close(errs)
	if err == nil {
		err = <-errs
	}
	return err
}

func createOneFiller(ctx context.Context, c kubernetes.Interface, i int, pods ...*testbed.Pod) error {
	name := fmt.Sprintf("fill-%05d", i)
	ip := netip.AddrFrom4([4]byte{10, 96, byte(100 + i/250), byte(1 + i%250)})
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: v1.ServiceSpec{
			ClusterIP: ip.String(),
			Ports:     []v1.ServicePort{{Name: "http", Protocol: v1.ProtocolTCP, Port: 80}},
		},
	}
	if _, err := c.CoreV1().Services("default").Create(ctx, svc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create service %s: %w", name, err)
	}
	port, proto, pname := int32(8080), v1.ProtocolTCP, "http"
	es := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: map[string]string{
			discovery.LabelServiceName: name, discovery.LabelManagedBy: testbed.ManagedBy,
		}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: &pname, Protocol: &proto, Port: &port}},
	}
	for _, p := range pods {
		node, zone := p.Node.Name, p.Zone()
		es.Endpoints = append(es.Endpoints, discovery.Endpoint{
			Addresses: []string{p.Addr.String()},
			NodeName:  &node,
			Zone:      &zone,
			Hints:     &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: zone}}},
		})
	}
	if _, err := c.DiscoveryV1().EndpointSlices("default").Create(ctx, es, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create endpointslice %s: %w", name, err)
	}
	return nil
}
