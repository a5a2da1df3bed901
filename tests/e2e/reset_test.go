package e2e

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

var resetRounds = flag.Int("reset-rounds", 4, "wrk rounds of TestWrkNoReset")

// webA2HintedAway returns svcs with the fast Service's web-a2 hinted for
// zone-b: zone-a's clients are then sent to web-a1 alone, and web-a2,
// still serving, drains on the client's node (a hint flip).
func webA2HintedAway(svcs []testbed.ServiceSpec) []testbed.ServiceSpec {
	out := slices.Clone(svcs)
	for i, s := range out {
		if s.Name != "fast" {
			continue
		}
		s.Endpoints = slices.Clone(s.Endpoints)
		for j, e := range s.Endpoints {
			if e.Pod == "web-a2" {
				e.ForZones = []string{"zone-b"}
				s.Endpoints[j] = e
			}
		}
		out[i] = s
	}
	return out
}

// TestWrkNoReset runs bench-e2e's wrk load (new connection per request,
// nginx answering "Connection: close") through topolb in rounds, with the
// agent paused between rounds as the benchmark pauses it, a hint flip
// (a backend draining or coming back) and an agent restart during every
// round,
// and fails on any wrk socket error, midflow miss or half flow (orphan). Each round starts as the last round's
// flows expire, so its connections reuse tuples that expire and are swept
// (every second here) while it runs: a sweep that deleted the fresh
// entries of a reopened flow broke connections (wrk read errors in
// bench-e2e; BENCHMARKS.md). The fast Service is dual stack here, and
// each round runs a wrk per IP family at once, in the same load window.
// Each round prints the datapath counters that moved, so a failure can be
// matched with what the datapath did.
func TestWrkNoReset(t *testing.T) {
	if testing.Short() {
		t.Skip("long test")
	}
	agentBin := requireAgent(t)
	for _, tool := range []string{"wrk", "nginx"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s: %v (make deps installs it)", tool, err)
		}
	}
	spec := benchSpec(t)
	web := service(t, spec, "zone-hints", "web")
	spec.Services = benchServices(web, nil)
	for i, s := range spec.Services {
		if s.Name == "fast" {
			s.IPFamilies, s.ClusterIPv6 = bothFamilies, fastVIP6.Addr().String()
			spec.Services[i] = s
		}
	}
	variants := [][]testbed.ServiceSpec{webA2HintedAway(spec.Services), spec.Services}
	tb := newTestbed(t, spec)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Minute)
	defer cancel()
	client := tb.Pod("client")
	a, err := tb.StartAgent(ctx, client.Node.Name, testbed.AgentOptions{Binary: agentBin,
		Args: []string{"--conntrack-sweep-interval", "1s"}})
	if err == nil {
		err = a.WaitReady(ctx)
	}
	if err == nil {
		err = tb.WaitAgents(ctx, 2*time.Minute)
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, pod := range []string{"web-a1", "web-a2"} {
		if err := startNginx(ctx, tb, tb.Pod(pod)); err != nil {
			t.Fatal(err)
		}
	}
	var targets []netip.AddrPort
	for _, family := range servedFamilies(t, tb, topology.ScopeInternal) {
		targets = append(targets, map[v1.IPFamily]netip.AddrPort{v1.IPv4Protocol: fastVIP, v1.IPv6Protocol: fastVIP6}[family])
	}
	pin := tb.BPFFS(client.Node.Name)
	before, err := maps.PinnedStats(pin)
	if err != nil {
		t.Fatal(err)
	}
	for r := range *resetRounds {
		// During the round: a hint flip sends zone-a's new connections
		// to web-a1 alone or to both again (web-a2's established ones
		// drain), then the agent restarts; the datapath serves on.
		churn := make(chan error, 1)
		go func() {
			time.Sleep(time.Second)
			if _, err := tb.Apply(ctx, variants[r%2]); err != nil {
				churn <- err
				return
			}
			time.Sleep(time.Second)
			if err := a.Stop(); err != nil {
				churn <- fmt.Errorf("stop the agent: %w", err)
				return
			}
			churn <- a.Start(ctx)
		}()
		ws, werrs := make([]wrkResult, len(targets)), make([]error, len(targets))
		var wg sync.WaitGroup
		for i, target := range targets {
			wg.Go(func() {
				var err error
				if ws[i], err = runWrk(ctx, client, target, *benchDuration); err != nil {
					werrs[i] = fmt.Errorf("to %s: %w", target, err)
				}
			})
		}
		wg.Wait()
		roundEnd := time.Now()
		if err := <-churn; err != nil {
			t.Fatalf("round %d: %v", r+1, err)
		}
		if err := a.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		if err := tb.WaitAgents(ctx, 2*time.Minute); err != nil {
			t.Fatal(err)
		}
		after, err := maps.PinnedStats(pin)
		if err != nil {
			t.Fatal(err)
		}
		for i, w := range ws {
			t.Logf("round %d to %s: %d requests, %.0f/s", r+1, targets[i], w.requests, w.rate)
		}
		t.Logf("round %d: counters: %s", r+1, statDelta(before, after))
		if err := errors.Join(werrs...); err != nil {
			t.Fatalf("round %d: %v", r+1, err)
		}
		// The sweep that lost reopened flows showed first as midflow
		// misses (their next packet found no entry), a few each round,
		// before one of them became a reset.
		if n := after[maps.StatTCPMidflowMiss] - before[maps.StatTCPMidflowMiss]; n != 0 {
			t.Errorf("round %d: %d TCP packets of established connections found no conntrack entry", r+1, n)
		}
		// With tables far from full nothing is evicted, so a flow that
		// finds its other half gone was broken by the datapath itself: a
		// packet of one direction took the flow for an orphan while a
		// packet of the other moved it between the tables (about 100 a
		// round of 15 s before ct_touch_fam looked in both).
		if n := after[maps.StatConntrackOrphan] - before[maps.StatConntrackOrphan]; n != 0 {
			t.Errorf("round %d: %d conntrack entries found their flow's other entry gone", r+1, n)
		}
		before = after
		if err := a.Pause(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second)
		if err := a.Resume(); err != nil {
			t.Fatal(err)
		}
		// The next round starts as the last round's closed flows expire:
		// its connections reuse their tuples while sweeps delete them.
		if r+1 < *resetRounds {
			time.Sleep(time.Until(roundEnd.Add(maps.TimeoutTCPClosing - 2*time.Second)))
		}
	}
}

// statDelta formats the counters that moved from before to after.
func statDelta(before, after map[maps.Stat]uint64) string {
	var out []string
	for s, v := range after {
		if d := v - before[s]; d != 0 {
			out = append(out, fmt.Sprintf("%s=%d", s, d))
		}
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}
