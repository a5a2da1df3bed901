package e2e

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/topolb/topolb/tools/testbed"
)

// t95 is Student's t for a two-sided 95% interval, by degrees of freedom
// (index 0 unused); past 30 the normal 1.96 is close enough.
var t95 = []float64{math.NaN(), 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
	2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
	2.060, 2.056, 2.052, 2.048, 2.045, 2.042}

// meanCI returns the mean of the sample's values (NaNs, rounds that did
// not measure, are left out), the half-width of its 95% confidence
// interval, and how many values there were. With fewer than two values
// the interval is NaN: it cannot be known.
func meanCI(s sample) (mean, ci float64, n int) {
	var sum float64
	for _, v := range s {
		if !math.IsNaN(v) {
			sum += v
			n++
		}
	}
	if n == 0 {
		return math.NaN(), math.NaN(), 0
	}
	mean = sum / float64(n)
	if n < 2 {
		return mean, math.NaN(), n
	}
	var ss float64
	for _, v := range s {
		if !math.IsNaN(v) {
			ss += (v - mean) * (v - mean)
		}
	}
	t := 1.96
	if n-1 < len(t95) {
		t = t95[n-1]
	}
	return mean, t * math.Sqrt(ss/float64(n-1)) / math.Sqrt(float64(n)), n
}

// ratios pairs two samples round by round (they were measured in the same
// rounds, interleaved) and returns a[i]/base[i], NaN where either is
// missing or base is not positive.
func ratios(a, base sample) sample {
	out := make(sample, min(len(a), len(base)))
	for i := range out {
		out[i] = math.NaN()
		if !math.IsNaN(a[i]) && !math.IsNaN(base[i]) && base[i] > 0 {
			out[i] = a[i] / base[i]
		}
	}
	return out
}

// goal is one end-to-end goal: at Services services, the ratio of
// topolb's figure to Vs's must be at least Min (rates), or below Max
// (latencies and costs) when Min is 0.
type goal struct {
	Metric   string
	Services int
	Vs       string
	Min, Max float64
	// Issue names where the goal was set.
	Issue string
}

// goals are the end-to-end goals of issues 5, 10, 11 and 23.
var goals = []goal{
	{Metric: "requests_per_s", Services: 10000, Vs: implNFT, Min: 1.3, Issue: "11"},
	{Metric: "requests_per_s", Services: 10000, Vs: implIPT, Min: 1.5, Issue: "11"},
	{Metric: "p99_ms", Services: 10000, Vs: implNFT, Max: 1, Issue: "5"},
	{Metric: "p99_ms", Services: 10000, Vs: implIPT, Max: 1, Issue: "5"},
	{Metric: "cpu_us_per_req", Services: 10000, Vs: implNFT, Max: 1, Issue: "11"},
	{Metric: "cpu_us_per_req", Services: 10000, Vs: implIPT, Max: 1, Issue: "11"},
	{Metric: "pps", Services: 10000, Vs: implNFT, Min: 2, Issue: "11"},
	{Metric: "ns_pps", Services: 10000, Vs: implNFT, Min: 2, Issue: "10"},
	{Metric: "node_pps", Services: 10000, Vs: implNFT, Min: 3, Issue: "23"},
	{Metric: "node_ns_pps", Services: 10000, Vs: implNFT, Min: 3, Issue: "23"},
	// Issue 23's goal again, read as the rate one CPU sustains (the
	// flood's own CPU time per datagram at most a third of nftables'),
	// which the machine's other load does not skew as it does the rate.
	{Metric: "node_flood_cpu_ns_per_pkt", Services: 10000, Vs: implNFT, Max: 1.0 / 3, Issue: "23"},
	{Metric: "node_ns_flood_cpu_ns_per_pkt", Services: 10000, Vs: implNFT, Max: 1.0 / 3, Issue: "23"},
}

// Verdicts.
const (
	met    = "met"
	notMet = "not met"
	na     = "n/a"
)

// judge returns the verdict of g on the per-round ratios r: met only when
// the whole 95% interval is on the right side of the bound, n/a when the
// interval cannot be computed.
func (g goal) judge(r sample) string {
	mean, ci, n := meanCI(r)
	switch {
	case n < 2 || math.IsNaN(ci):
		return na
	case g.Min > 0 && mean-ci >= g.Min:
		return met
	case g.Min == 0 && mean+ci < g.Max:
		return met
	}
	return notMet
}

func (g goal) bound() string {
	if g.Min > 0 {
		return fmt.Sprintf("ratio>=%.2f", g.Min)
	}
	return fmt.Sprintf("ratio<%.2f", g.Max)
}

// find returns the result of impl at services, or nil.
func find(rs []result, impl string, services int) *result {
	for i := range rs {
		if rs[i].impl == impl && rs[i].services == services {
			return &rs[i]
		}
	}
	return nil
}

// verdictFor combines the goals on metric at the scale of res: n/a for
// kube-proxy and where no goal applies or one cannot be judged, met when
// every goal is met.
func verdictFor(rs []result, res *result, metric string) string {
	if res.impl != implTopolb {
		return na
	}
	v := na
	for _, g := range goals {
		if g.Metric != metric || g.Services != res.services {
			continue
		}
		other := find(rs, g.Vs, res.services)
		if other == nil {
			return na
		}
		switch g.judge(ratios(res.samples[metric], other.samples[metric])) {
		case na:
			return na
		case notMet:
			v = notMet
		case met:
			if v == na {
				v = met
			}
		}
	}
	return v
}

func num(v float64) string {
	if math.IsNaN(v) {
		return na
	}
	return fmt.Sprintf("%.3f", v)
}

// printResults prints one BENCH line per implementation and metric of one
// scale.
func printResults(rs []result) {
	for i := range rs {
		res := &rs[i]
		nft := find(rs, implNFT, res.services)
		for _, metric := range benchMetrics {
			if _, measured := res.samples[metric]; !measured {
				continue
			}
			mean, ci, _ := meanCI(res.samples[metric])
			ratio, rci := math.NaN(), math.NaN()
			if nft != nil {
				ratio, rci, _ = meanCI(ratios(res.samples[metric], nft.samples[metric]))
			}
			fmt.Printf("BENCH e2e impl=%s services=%d metric=%s value=%s ci95=%s ratio_vs_nftables=%s ratio_ci95=%s verdict=%s\n",
				res.impl, res.services, metric, num(mean), num(ci), num(ratio), num(rci), verdictFor(rs, res, metric))
		}
		if floor := find(rs, implFloor, res.services); res.impl == implTopolb && floor != nil {
			for _, metric := range nodeMetrics {
				ratio, rci, _ := meanCI(ratios(res.samples[metric], floor.samples[metric]))
				fmt.Printf("BENCH e2e impl=%s services=%d metric=%s ratio_vs_floor=%s ratio_ci95=%s\n", res.impl, res.services, metric, num(ratio), num(rci))
			}
		}
		if r := familyRatio(res); r != nil {
			ratio, rci, _ := meanCI(r)
			fmt.Printf("BENCH e2e impl=%s services=%d ratio=pps_ipv6/pps value=%s ci95=%s\n", res.impl, res.services, num(ratio), num(rci))
		}
		for metric, why := range res.skipped {
			fmt.Printf("  (%s %s not measured: %s)\n", res.impl, metric, why)
		}
	}
}

// familyRatio returns res's IPv6 flood rate over its IPv4 one, round by
// round (the two floods run back to back in each round), or nil when
// either was not measured.
func familyRatio(res *result) sample {
	v6, ok6 := res.samples["pps_ipv6"]
	v4, ok4 := res.samples["pps"]
	if !ok6 || !ok4 {
		return nil
	}
	return ratios(v6, v4)
}

// printGoals prints one GOAL line per goal: the ratio topolb reached, its
// interval, the bound and the verdict; and, for a goal implFloor was
// measured for, a CEILING line: the same goal judged on the floor's
// figures, which says whether any proxy on that hook could meet it here.
func printGoals(rs []result) {
	for _, g := range goals {
		top, other := find(rs, implTopolb, g.Services), find(rs, g.Vs, g.Services)
		ratio, ci, v := math.NaN(), math.NaN(), na
		if top != nil && other != nil {
			r := ratios(top.samples[g.Metric], other.samples[g.Metric])
			ratio, ci, _ = meanCI(r)
			v = g.judge(r)
		}
		fmt.Printf("GOAL e2e metric=%s services=%d vs=%s ratio=%s ci95=%s goal=%s issue=%s verdict=%s\n",
			g.Metric, g.Services, g.Vs, num(ratio), num(ci), g.bound(), g.Issue, v)
		if floor := find(rs, implFloor, g.Services); floor != nil && other != nil {
			if _, measured := floor.samples[g.Metric]; measured {
				r := ratios(floor.samples[g.Metric], other.samples[g.Metric])
				ratio, ci, _ := meanCI(r)
				fmt.Printf("CEILING e2e metric=%s services=%d vs=%s impl=%s ratio=%s ci95=%s goal=%s verdict=%s\n",
					g.Metric, g.Services, g.Vs, implFloor, num(ratio), num(ci), g.bound(), g.judge(r))
			}
		}
	}
}

func TestBenchStatistics(t *testing.T) {
	nan := math.NaN()
	mean, ci, n := meanCI(sample{10, 12, nan, 14})
	// sd 2, n 3: t(2) 4.303 * 2 / sqrt(3).
	if n != 3 || mean != 12 || math.Abs(ci-4.303*2/math.Sqrt(3)) > 1e-9 {
		t.Errorf("meanCI = %v ± %v (n %d)", mean, ci, n)
	}
	if _, ci, n := meanCI(sample{5}); n != 1 || !math.IsNaN(ci) {
		t.Errorf("one value: ci %v, n %d; want NaN, 1", ci, n)
	}
	r := ratios(sample{2, 4, nan, 9}, sample{1, 2, 3, 0})
	if r[0] != 2 || r[1] != 2 || !math.IsNaN(r[2]) || !math.IsNaN(r[3]) {
		t.Errorf("ratios %v", r)
	}
	for _, c := range []struct {
		name string
		g    goal
		r    sample
		want string
	}{
		{"rate met with the whole interval above", goal{Min: 1.3}, sample{1.5, 1.6, 1.55}, met},
		{"rate whose interval reaches below", goal{Min: 1.3}, sample{1.2, 1.6, 1.4}, notMet},
		{"rate below", goal{Min: 2}, sample{1.1, 1.2, 1.15}, notMet},
		{"cost below", goal{Max: 1}, sample{0.8, 0.85, 0.82}, met},
		{"cost at par", goal{Max: 1}, sample{0.9, 1.1, 1.0}, notMet},
		{"one round", goal{Min: 1.3}, sample{2}, na},
	} {
		if got := c.g.judge(c.r); got != c.want {
			t.Errorf("%s: %s, want %s", c.name, got, c.want)
		}
	}
	rs := []result{
		{impl: implTopolb, services: 10000, samples: map[string]sample{"pps": {4, 4.2, 4.1}, "update_ms": {1, 1, 1}}},
		{impl: implNFT, services: 10000, samples: map[string]sample{"pps": {1, 1, 1}, "update_ms": {5, 5, 5}}},
		{impl: implFloor, services: 10000, samples: map[string]sample{"pps": {5, 5, 5}}},
	}
	if r := familyRatio(&result{samples: map[string]sample{"pps": {2, 4}, "pps_ipv6": {1, 3}}}); len(r) != 2 || r[0] != 0.5 || r[1] != 0.75 {
		t.Errorf("familyRatio = %v, want [0.5 0.75]", r)
	}
	if r := familyRatio(&rs[0]); r != nil {
		t.Errorf("familyRatio without pps_ipv6 = %v, want nil", r)
	}
	for _, c := range []struct {
		impl, metric, want string
	}{
		{implTopolb, "pps", met},
		{implTopolb, "update_ms", na},      // no goal
		{implTopolb, "requests_per_s", na}, // needs iptables too, which did not run
		{implNFT, "pps", na},               // verdicts are topolb's
		{implFloor, "pps", na},             // the floor's too: it is judged on CEILING lines
	} {
		if got := verdictFor(rs, find(rs, c.impl, 10000), c.metric); got != c.want {
			t.Errorf("%s %s: %s, want %s", c.impl, c.metric, got, c.want)
		}
	}
}

func TestParseWrk(t *testing.T) {
	out := []byte(`Running 2s test @ http://10.96.0.40:80/
  1 threads and 16 connections
  Latency Distribution
     50%  346.00us
     75%    1.22ms
     90%    2.91ms
     99%    7.14ms
  31007 requests in 2.02s, 5.53MB read
Requests/sec:  15347.84
Transfer/sec:      2.74MB
`)
	r, err := parseWrk(out)
	if err != nil || r.requests != 31007 || r.rate != 15347.84 || r.p50ms != 0.346 || r.p99ms != 7.14 {
		t.Errorf("parseWrk = %+v, %v", r, err)
	}
	for _, bad := range []string{
		"  10 requests in 1.00s\n  Socket errors: connect 0, read 3, write 0, timeout 0\nRequests/sec: 10\n     50% 1ms\n     99% 2ms\n",
		"  10 requests in 1.00s\n  Non-2xx or 3xx responses: 2\nRequests/sec: 10\n     50% 1ms\n     99% 2ms\n",
		"  0 requests in 1.00s\nRequests/sec: 0\n",
		"garbage",
	} {
		if r, err := parseWrk([]byte(bad)); err == nil {
			t.Errorf("parseWrk(%q) = %+v, want an error", bad, r)
		}
	}
}

func TestSelectedMetrics(t *testing.T) {
	defer func(v string) { *benchOnly = v }(*benchOnly)
	for _, c := range []struct {
		name, flag string
		want       []string // nil: an error
	}{
		{"default: all", "", benchMetrics},
		{"a rate brings its costs", "node_ns_pps", []string{"node_ns_pps", "node_ns_cpu_ns_per_pkt", "node_ns_flood_cpu_ns_per_pkt"}},
		{"wrk's four together, in print order", "update_ms,p99_ms", []string{"requests_per_s", "p50_ms", "p99_ms", "cpu_us_per_req", "update_ms"}},
		{"unknown", "pps,nope", nil},
	} {
		*benchOnly = c.flag
		got, err := selectedMetrics()
		if c.want == nil {
			if err == nil {
				t.Errorf("%s: %v, want an error", c.name, got)
			}
			continue
		}
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("%s: %v, %v; want %v", c.name, got, err, c.want)
		}
	}
}

func TestCheckArrivals(t *testing.T) {
	for _, c := range []struct {
		name string
		res  testbed.FloodResult
		ok   bool
	}{
		{"all arrived", testbed.FloodResult{Sent: 1000, Arrived: 1000}, true},
		{"90% arrived", testbed.FloodResult{Sent: 1000, Arrived: 900}, true},
		{"fewer than 90%", testbed.FloodResult{Sent: 1000, Arrived: 899}, false},
		{"more than sent", testbed.FloodResult{Sent: 1000, Arrived: 1001}, false},
		{"fewer injected than asked", testbed.FloodResult{Sent: 999, Arrived: 999}, false},
		{"one left untranslated", testbed.FloodResult{Sent: 1000, Arrived: 999, Stray: 1}, false},
	} {
		if err := checkArrivals(c.res, 1000); (err == nil) != c.ok {
			t.Errorf("%s: %v, want ok %v", c.name, err, c.ok)
		}
	}
}
