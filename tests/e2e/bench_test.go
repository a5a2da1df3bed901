package e2e

import (
	"context"
	"flag"
	"fmt"
	"net/netip"
	"slices"
	"sort"
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
	benchScales = flag.String("bench-e2e-services", "10,1000,10000", "service counts BenchmarkE2E measures at")
	benchImpls  = flag.String("bench-e2e-impls", "topolb,kube-proxy-nft,kube-proxy-ipt", "implementations BenchmarkE2E measures")
	benchRounds = flag.Int("bench-e2e-rounds", 3, "repetitions of each measurement; the median is reported")
)

// Implementations compared by BenchmarkE2E.
const (
	implTopolb = "topolb"
	implNFT    = "kube-proxy-nft"
	implIPT    = "kube-proxy-ipt"
)

// Bench Services: the measured ones are "web" (zone hints: the client's
// zone-a has web-a1 on its node and web-a2 on the next), "flip" (one
// backend, swapped to time updates) and "sink" (UDP to a port nothing
// listens on, for the flood). Filler Services bring the count up.
var (
	flipVIP = netip.MustParseAddrPort("10.96.0.20:80")
	sinkVIP = netip.MustParseAddrPort("10.96.0.30:9")
)

func benchServices(web testbed.ServiceSpec, flipTo string) []testbed.ServiceSpec {
	return []testbed.ServiceSpec{
		web,
		{Name: "flip", ClusterIP: flipVIP.Addr().String(), Ports: []testbed.PortSpec{{Name: "http", Port: 80}}, Endpoints: []testbed.EndpointSpec{{Pod: flipTo}}},
		{Name: "sink", ClusterIP: sinkVIP.Addr().String(), Ports: []testbed.PortSpec{{Name: "sink", Protocol: v1.ProtocolUDP, Port: 9, TargetPort: 9}}, Endpoints: []testbed.EndpointSpec{{Pod: "web-b1"}}},
	}
}

// BenchmarkE2E compares topolb with kube-proxy in nftables and iptables
// mode on the same testbed and real kube-apiserver, each alone on the
// client's node, at 10, 1,000 and 10,000 Services: requests/s and p50/p99
// latency of short HTTP connections (one new connection per request), the
// packets/s of a one-way UDP flood to a Service generated in the kernel
// (live-frame BPF test runs, see testbed.FloodUDP), and the time from an
// EndpointSlice change to the new backend answering. It prints
//
//	BENCH e2e impl=<topolb|kube-proxy-nft|kube-proxy-ipt> services=<n> metric=<requests_per_s|p50_ms|p99_ms|pps|update_ms> value=<f>
//
// with the median of -bench-e2e-rounds rounds, then the ratios. Run it with
// `make bench-e2e`.
func BenchmarkE2E(b *testing.B) {
	if testing.Short() {
		b.Skip("long benchmark")
	}
	requireRoot(b)
	agentBin := requireAgent(b)
	kp := kubeProxyBinary(b)
	cluster := kubetest.Start(b)
	cfg := rest.CopyConfig(cluster.Config)
	cfg.QPS, cfg.Burst = 2000, 4000
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		b.Fatal(err)
	}
	spec := demoSpec(b)
	layout, err := testbed.NewLayout(spec)
	if err != nil {
		b.Fatal(err)
	}

	results := map[string]map[int]map[string]float64{} // impl → services → metric → value
	filler := 0
	for _, s := range strings.Split(*benchScales, ",") {
		total, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			b.Fatalf("-bench-e2e-services: %v", err)
		}
		// web, flip, sink and default/kubernetes are four.
		want := max(total-4, 0)
		t0 := time.Now()
		if err := createFiller(b.Context(), client, layout, filler, want); err != nil {
			b.Fatal(err)
		}
		if want > filler {
			b.Logf("created %d filler Services and EndpointSlices in %v", want-filler, time.Since(t0).Round(time.Millisecond))
			filler = want
		}
		for _, impl := range strings.Split(*benchImpls, ",") {
			m := benchOne(b, cluster.Config, spec, impl, agentBin, kp, total)
			if results[impl] == nil {
				results[impl] = map[int]map[string]float64{}
			}
			results[impl][total] = m
			for _, metric := range []string{"requests_per_s", "p50_ms", "p99_ms", "pps", "update_ms"} {
				if v, ok := m[metric]; ok {
					fmt.Printf("BENCH e2e impl=%s services=%d metric=%s value=%.3f\n", impl, total, metric, v)
				}
			}
		}
	}
	printRatios(results)
}

// benchOne measures one implementation on a fresh testbed.
func benchOne(b *testing.B, cfg *rest.Config, spec *testbed.Spec, impl, agentBin, kp string, services int) map[string]float64 {
	b.Helper()
	tb := newTestbed(b, spec)
	defer tb.Close()
	web := service(b, spec, "zone-hints", "web")
	ctx, cancel := context.WithTimeout(b.Context(), 15*time.Minute)
	defer cancel()
	if err := tb.ConnectAPIServer(ctx, cfg); err != nil {
		b.Fatal(err)
	}
	if _, err := tb.Apply(ctx, benchServices(web, "web-a1")); err != nil {
		b.Fatal(err)
	}
	client := tb.Pod("client")
	node := client.Node.Name
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
	default:
		b.Fatalf("unknown implementation %q", impl)
	}
	// Ready means the measured Services answer from where they should.
	landings, err := tb.Measure(ctx, client, "web", testbed.MeasureOptions{Requests: 60})
	if err != nil {
		b.Fatalf("%s, %d services: %v", impl, services, err)
	}
	for _, l := range landings {
		for _, p := range l.Problems() {
			b.Errorf("%s, %d services: web %s: %s", impl, services, l.Decision.Protocol, p)
		}
	}
	b.Logf("%s ready with %d services in %v", impl, services, time.Since(t0).Round(time.Millisecond))

	out := map[string]float64{}
	var rps, p50, p99, pps, upd []float64
	for r := 0; r < *benchRounds; r++ {
		rate, l50, l99, failed, why := httpRate(ctx, client, landings[0].Decision.Frontend, 3*time.Second)
		if failed > 0 {
			b.Errorf("%s, %d services: %d requests failed: %v", impl, services, failed, why)
		}
		rps, p50, p99 = append(rps, rate), append(p50, l50), append(p99, l99)

		const frames = 200_000
		res, err := testbed.CountArrivals(tb.Pod("web-b1").NS, func() (testbed.FloodResult, error) {
			return client.FloodUDP(sinkVIP, frames)
		})
		if err != nil {
			b.Fatal(err)
		}
		if res.Arrived < frames*9/10 || res.Arrived > frames {
			b.Errorf("%s, %d services: %d of %d flood datagrams reached the backend: the rate does not count", impl, services, res.Arrived, frames)
		}
		pps = append(pps, res.PPS)
	}
	for r := 0; r < *benchRounds+2; r++ {
		to := []string{"web-a2", "web-a1"}[r%2]
		ms, err := updateLatency(ctx, tb, benchServices(web, to)[1], client, to)
		if err != nil {
			b.Errorf("%s, %d services: update: %v", impl, services, err)
			continue
		}
		upd = append(upd, ms)
		time.Sleep(1200 * time.Millisecond) // past kube-proxy's 1 s minimum sync period
	}
	out["requests_per_s"], out["p50_ms"], out["p99_ms"], out["pps"] = median(rps), median(p50), median(p99), median(pps)
	if len(upd) > 0 {
		out["update_ms"] = median(upd)
	}
	return out
}

// httpRate sends HTTP requests on new connections from 8 workers for d and
// returns the rate and the p50 and p99 latency in ms.
func httpRate(ctx context.Context, client *testbed.Pod, target netip.AddrPort, d time.Duration) (rate, p50, p99 float64, failed int, why []string) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	start := time.Now()
	recs := client.Send(ctx, testbed.Load{Proto: v1.ProtocolTCP, Target: target, Parallel: 8, Timeout: 2 * time.Second})
	took := time.Since(start)
	var lat []float64
	for _, r := range recs {
		if r.Err == nil {
			lat = append(lat, float64(r.Took.Microseconds())/1000)
		}
	}
	sort.Float64s(lat)
	tally := testbed.Summarize(client, recs)
	return float64(len(lat)) / took.Seconds(), percentile(lat, 0.50), percentile(lat, 0.99), tally.Failed, tally.Errors
}

// updateLatency points the flip Service's EndpointSlice at pod and returns
// the time until a new connection from the client reaches it.
func updateLatency(ctx context.Context, tb *testbed.Testbed, flip testbed.ServiceSpec, client *testbed.Pod, pod string) (float64, error) {
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
		a, err := client.Request(rctx, v1.ProtocolTCP, flipVIP)
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

// goal is one end-to-end benchmark goal: at Services services, topolb's
// figure for Metric must be at least MinRatio times kube-proxy's (for
// rates; for times and costs kube-proxy's over topolb's), where a larger
// ratio favours topolb.
type goal struct {
	Metric   string
	Services int
	Vs       string
	MinRatio float64
	// Issue names where the goal was set.
	Issue string
}

// goals are the end-to-end goals of issues 5 and 11. A latency or cost
// "below kube-proxy" is a ratio above 1.
var goals = []goal{
	{"requests_per_s", 10000, implNFT, 1.3, "5, 11"},
	{"requests_per_s", 10000, implIPT, 1.5, "5, 11"},
	{"p99_ms", 10000, implNFT, 1, "5"},
	{"p99_ms", 10000, implIPT, 1, "5"},
	{"pps", 10000, implNFT, 2, "11"},
}

// lowerIsBetter names the metrics whose ratio is kube-proxy / topolb.
var lowerIsBetter = map[string]bool{"p50_ms": true, "p99_ms": true, "update_ms": true, "cpu_us_per_req": true}

// ratio returns topolb's advantage over other for a metric (> 1 favours
// topolb), and false when either figure is missing or zero.
func ratio(metric string, topolb, other float64) (float64, bool) {
	if topolb <= 0 || other <= 0 {
		return 0, false
	}
	if lowerIsBetter[metric] {
		return other / topolb, true
	}
	return topolb / other, true
}

// verdict says whether a ratio meets g: "met", "not met", or "n/a" when
// it could not be measured.
func verdict(g goal, r float64, measured bool) string {
	switch {
	case !measured:
		return "n/a"
	case r >= g.MinRatio:
		return "met"
	}
	return "not met"
}

// printRatios prints topolb's figures relative to each kube-proxy mode,
// then a verdict line per goal.
func printRatios(results map[string]map[int]map[string]float64) {
	top := results[implTopolb]
	if top == nil {
		return
	}
	var scales []int
	for n := range top {
		scales = append(scales, n)
	}
	slices.Sort(scales)
	fmt.Println("\nratios (topolb / kube-proxy; for latencies and update time, kube-proxy / topolb):")
	for _, other := range []string{implNFT, implIPT} {
		for _, n := range scales {
			o := results[other][n]
			if o == nil {
				continue
			}
			t := top[n]
			fmt.Printf("  vs %-15s services=%-6d", other, n)
			for _, m := range []string{"requests_per_s", "p50_ms", "p99_ms", "pps", "update_ms"} {
				r, ok := ratio(m, t[m], o[m])
				if !ok {
					fmt.Printf("  %s n/a", m)
					continue
				}
				fmt.Printf("  %s %.2fx", m, r)
			}
			fmt.Println()
		}
	}
	for _, g := range goals {
		r, ok := ratio(g.Metric, top[g.Services][g.Metric], results[g.Vs][g.Services][g.Metric])
		fmt.Printf("GOAL e2e metric=%s services=%d vs=%s ratio=%.2f goal>=%.2f issue=%s verdict=%s\n",
			g.Metric, g.Services, g.Vs, r, g.MinRatio, g.Issue, verdict(g, r, ok))
	}
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	sort.Float64s(s)
	return s[len(s)/2]
}

func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p * float64(len(sorted)-1))
	return sorted[i]
}
