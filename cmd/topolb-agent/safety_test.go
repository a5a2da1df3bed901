package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/internal/childproc"
)

// linkIDs returns the ids of the links pinned in the bed's pin directory,
// by pin name: a link re-adopted or re-created gets another id or none.
func (b *bed) linkIDs() map[string]link.ID {
	b.t.Helper()
	out := map[string]link.ID{}
	entries, err := os.ReadDir(filepath.Join(b.pin, "links"))
	must(b.t, err)
	for _, e := range entries {
		l, err := link.LoadPinnedLink(filepath.Join(b.pin, "links", e.Name()), nil)
		must(b.t, err)
		info, err := l.Info()
		must(b.t, err)
		out[e.Name()] = info.ID
		must(b.t, l.Close())
	}
	return out
}

// TestSecondAgentRefused: a second agent on the same --bpffs exits with a
// clear error before it touches a link or a map, and the first keeps
// serving.
func TestSecondAgentRefused(t *testing.T) {
	b := newBed(t)
	b.start()
	links, programmed := b.linkIDs(), b.programmed()
	if len(links) == 0 {
		t.Fatal("no links pinned by the first agent")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Other HTTP ports, so that only the lock can stop it.
	cmd := exec.CommandContext(ctx, "nsenter", b.agentArgs("--metrics-address", "127.0.0.1:9975", "--health-address", "127.0.0.1:9976")...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := childproc.Run(cmd)
	if err == nil || ctx.Err() != nil {
		t.Fatalf("second agent did not exit with an error (err %v, ctx %v):\n%s", err, ctx.Err(), out.String())
	}
	if !strings.Contains(out.String(), "another agent owns "+b.pin) {
		t.Errorf("second agent's error does not say why:\n%s", out.String())
	}
	if got := b.linkIDs(); !mapsEqual(got, links) {
		t.Errorf("links changed: %v, before %v", got, links)
	}
	if got := b.programmed(); !mapsEqual2(got, programmed) {
		t.Errorf("maps changed: %v, before %v", got, programmed)
	}
	b.waitReady()
}

// TestDriftRepaired: a slot deleted from the maps behind the agent's back
// (the kernel no longer matching what it programmed) is found by the
// periodic verification, repaired, counted and logged; traffic is served
// again.
func TestDriftRepaired(t *testing.T) {
	b := newBed(t)
	b.start("--verify-interval", "500ms")
	if got := b.programmed()["10.96.0.10:80/TCP"]; !slices.Equal(got, []string{"10.1.1.2:8080"}) {
		t.Fatalf("programmed %v", got)
	}
	// Delete every backend slot: the frontend keeps its count and now
	// points at nothing (new flows would be dropped as no_backend).
	m, err := ebpf.LoadPinnedMap(filepath.Join(b.pin, "tlb_backends"), nil)
	must(t, err)
	defer m.Close()
	var keys [][]byte
	var k, v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, slices.Clone(k))
	}
	must(t, it.Err())
	if len(keys) == 0 {
		t.Fatal("no slots to corrupt")
	}
	for _, key := range keys {
		must(t, m.Delete(key))
	}

	b.waitLog("datapath maps drifted from what was programmed; repaired")
	waitFor(t, "a repair counted", func() bool { return b.labelledMetricSum("topolb_datapath_drift_repaired_total") > 0 })
	if got := b.programmed()["10.96.0.10:80/TCP"]; !slices.Equal(got, []string{"10.1.1.2:8080"}) {
		t.Errorf("after the repair the maps hold %v", got)
	}
	resp, err := b.client.HTTPClient(2 * time.Second).Get("http://10.96.0.10/")
	if err != nil {
		t.Fatalf("request after the repair: %v", err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(body) != "b1" {
		t.Errorf("request after the repair landed on %q (%v), want b1", body, err)
	}
}

// labelledMetricSum sums every series of a labelled metric.
func (b *bed) labelledMetricSum(name string) float64 {
	body, err := b.get(agent.DefaultMetricsAddress + "/metrics")
	must(b.t, err)
	sum := 0.0
	for _, line := range strings.Split(body, "\n") {
		if !strings.HasPrefix(line, name+"{") {
			continue
		}
		f, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		must(b.t, err)
		sum += f
	}
	return sum
}

func mapsEqual[K comparable, V comparable](a, b map[K]V) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

func mapsEqual2(a, b map[string][]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if !slices.Equal(v, b[k]) {
			return false
		}
	}
	return true
}

// TestSNATPortsWarnedAgainstNodePortRange: --snat-ports is checked against
// the NodePort range the agent serves (--service-node-port-range), not the
// apiserver's default one.
func TestSNATPortsWarnedAgainstNodePortRange(t *testing.T) {
	b := newBed(t)
	b.start("--snat-ports", "61000-65535", "--service-node-port-range", "62000-62100")
	b.waitLog("--snat-ports overlaps the NodePort range", "62000-62100")
}

// TestLogsJSON: --logging-format=json logs one JSON object a line with
// Kubernetes components' fields, and klog's verbosity -v 4 shows the
// agent's debug lines.
func TestLogsJSON(t *testing.T) {
	b := newBed(t)
	b.start("--logging-format", "json", "-v", "4", "--snat-ports", "61000-65535", "--service-node-port-range", "62000-62100")
	line := b.waitLog(`"msg":"--snat-ports overlaps the NodePort range"`, `"nodePorts":"62000-62100"`, `"v":0`, `"ts":`, `"caller":`)
	var fields map[string]any
	if err := json.Unmarshal([]byte(line), &fields); err != nil {
		t.Fatalf("not one JSON object: %v: %s", err, line)
	}
	b.waitLog(`"msg":"agent started"`, `"node":"n1"`)
	debug := b.waitLog(`"v":4`)
	if err := json.Unmarshal([]byte(debug), &fields); err != nil {
		t.Fatalf("a debug line is not one JSON object: %v: %s", err, debug)
	}
}
