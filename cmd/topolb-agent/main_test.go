package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/internal/nettest"
	"github.com/topolb/topolb/internal/testutil"
)

// The tests here run the real topolb-agent binary in a network namespace:
//
//	client(10.1.0.2) ── hc ┐
//	b1(10.1.1.2) ─────── hb1 ┤ node (agent: tc on every veth, auto)
//	b2(10.1.2.2) ─────── hb2 ┘
const manifest = `
apiVersion: v1
kind: Node
metadata: {name: n1, labels: {topology.kubernetes.io/zone: zone-a}}
---
apiVersion: v1
kind: Node
metadata: {name: n2, labels: {topology.kubernetes.io/zone: zone-b}}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.1.1.2], nodeName: n1, zone: zone-a%s}
- {addresses: [10.1.2.2], nodeName: n2, zone: zone-b%s}
`

type bed struct {
	t        *testing.T
	bin      string
	node     *nettest.NS
	client   *nettest.NS
	pin      string
	manifest string
	log      string // the current agent's log file
}

// agentBuild builds this package's binary once per test binary.
var agentBuild = testutil.GoBuild{Pkg: "."}

func agentBinary(t *testing.T) string { return agentBuild.Path(t) }

func TestMain(m *testing.M) {
	code := m.Run()
	agentBuild.Clean()
	os.Exit(code)
}

func newBed(t *testing.T) *bed {
	nettest.RequireRoot(t)
	if err := nettest.RemoveStale(); err != nil {
		t.Logf("remove stale namespaces: %v", err)
	}
	b := &bed{t: t, bin: agentBinary(t)}
	b.node = nettest.NewNS(t, "agent-bin-node")
	must(t, b.node.Sysctl("net.ipv4.ip_forward", "1"))
	must(t, b.node.Sysctl("net.ipv4.conf.all.rp_filter", "0"))
	for i, name := range []string{"c", "b1", "b2"} {
		ns := nettest.NewNS(t, "agent-bin-"+name)
		host := "h" + name
		subnet := fmt.Sprintf("10.1.%d", i)
		must(t, nettest.Veth(b.node, host, ns, "eth0"))
		must(t, b.node.AddAddr(host, subnet+".1/24"))
		must(t, ns.AddAddr("eth0", subnet+".2/24"))
		must(t, ns.AddRoute("default", subnet+".1"))
		must(t, b.node.SetOffload(host, "tx", false))
		switch name {
		case "c":
			b.client = ns
		default:
			ns.ServeHTTPName(t, subnet+".2:8080", name)
		}
	}
	fs := t.TempDir()
	if err := unix.Mount("bpf", fs, "bpf", 0, "mode=0700"); err != nil {
		t.Skipf("mount bpffs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(fs, unix.MNT_DETACH) })
	b.pin = filepath.Join(fs, "topolb")
	b.manifest = filepath.Join(t.TempDir(), "cluster.yaml")
	b.writeManifest(", hints: {forZones: [{name: zone-a}]}", ", hints: {forZones: [{name: zone-b}]}")
	return b
}

// writeManifest replaces the manifest by rename, as editors and ConfigMap
// volume updates do.
func (b *bed) writeManifest(hint1, hint2 string) {
	b.writeRaw(manifest, hint1, hint2)
}

// writeRaw is writeManifest of another template with manifest's two hint
// verbs.
func (b *bed) writeRaw(template, hint1, hint2 string) {
	tmp := b.manifest + ".tmp"
	must(b.t, os.WriteFile(tmp, []byte(fmt.Sprintf(template, hint1, hint2)), 0o644))
	must(b.t, os.Rename(tmp, b.manifest))
}

// start runs the agent in the node namespace, with extra flags after the
// usual ones, and waits until it is ready; it is killed in t.Cleanup.
func (b *bed) start(extra ...string) *exec.Cmd {
	cmd := b.startUnready(extra...)
	b.waitReady()
	return cmd
}

// agentArgs are the agent's usual flags in this bed, then extra.
func (b *bed) agentArgs(extra ...string) []string {
	return append([]string{"--net=" + b.node.Path, b.bin,
		"--node-name", "n1", "--from-file", b.manifest, "--bpffs", b.pin,
		"--uplinks", "", "--pod-interfaces", "auto",
		"--metrics-address", agent.DefaultMetricsAddress, "--health-address", agent.DefaultHealthAddress,
		"--max-frontends", "1024", "--max-backends", "4096", "--max-conntrack", "4096"}, extra...)
}

// startUnready runs the agent without waiting for it to be ready.
func (b *bed) startUnready(extra ...string) *exec.Cmd {
	cmd := exec.Command("nsenter", b.agentArgs(extra...)...)
	logf, err := os.Create(filepath.Join(b.t.TempDir(), "agent.log"))
	must(b.t, err)
	b.log = logf.Name()
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	must(b.t, cmd.Start())
	b.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if b.t.Failed() {
			out, _ := os.ReadFile(logf.Name())
			b.t.Logf("agent log:\n%s", out)
		}
	})
	return cmd
}

// waitLog waits until the current agent's log has a line containing all of
// parts, and returns it.
func (b *bed) waitLog(parts ...string) string {
	b.t.Helper()
	var found string
	waitFor(b.t, fmt.Sprintf("agent log line with %q", parts), func() bool {
		data, err := os.ReadFile(b.log)
		must(b.t, err)
		for _, line := range strings.Split(string(data), "\n") {
			ok := true
			for _, p := range parts {
				ok = ok && strings.Contains(line, p)
			}
			if ok {
				found = line
				return true
			}
		}
		return false
	})
	return found
}

// get fetches http://addrPath (host:port/path, agent.DefaultHealthAddress +
// "/readyz") from inside the node's namespace; a status other than 200 is
// an error carrying the body.
func (b *bed) get(addrPath string) (string, error) {
	resp, err := b.node.HTTPClient(2 * time.Second).Get("http://" + addrPath)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("%s: %s", resp.Status, body)
	}
	return string(body), err
}

// startTimeout bounds an agent's start: loading and verifying the programs
// takes seconds on a loaded machine, more than waitFor's budget.
const startTimeout = 60 * time.Second

// waitStarted waits until the current agent has loaded and attached its
// datapath (its "agent started" line), ready or not.
func (b *bed) waitStarted() {
	b.t.Helper()
	deadline := time.Now().Add(startTimeout)
	for {
		data, err := os.ReadFile(b.log)
		must(b.t, err)
		if strings.Contains(string(data), "agent started") {
			return
		} else if time.Now().After(deadline) {
			b.t.Fatalf("agent not started within %v", startTimeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (b *bed) waitReady() {
	deadline := time.Now().Add(startTimeout)
	for {
		if _, err := b.get(agent.DefaultHealthAddress + "/readyz"); err == nil {
			return
		} else if time.Now().After(deadline) {
			b.t.Fatalf("agent not ready: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// programmed returns the agent's view of the maps.
func (b *bed) programmed() map[string][]string {
	body, err := b.get(agent.DefaultHealthAddress + "/debug/state")
	must(b.t, err)
	var st struct {
		Programmed map[string][]string `json:"programmed"`
	}
	must(b.t, json.Unmarshal([]byte(body), &st))
	return st.Programmed
}

// metric returns the value of an unlabelled metric.
func (b *bed) metric(name string) float64 {
	body, err := b.get(agent.DefaultMetricsAddress + "/metrics")
	must(b.t, err)
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			must(b.t, err)
			return f
		}
	}
	b.t.Fatalf("metric %s not found", name)
	return 0
}

// load sends requests, each on a new connection, until ctx is done.
func (b *bed) load(ctx context.Context, ok, failed *atomic.Int64, landed *sync.Map) {
	c := b.client.HTTPClient(2 * time.Second)
	for ctx.Err() == nil {
		resp, err := c.Get("http://10.96.0.10/")
		if err != nil {
			if ctx.Err() == nil {
				failed.Add(1)
			}
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		ok.Add(1)
		n, _ := landed.LoadOrStore(string(body), new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
	}
}

// TestRestartUnderTraffic kills the agent with SIGKILL while requests flow
// and starts it again: no request fails, and the new agent adopts the pinned
// maps without rewriting any entry of the unchanged service.
func TestRestartUnderTraffic(t *testing.T) {
	b := newBed(t)
	cmd := b.start()
	before := b.programmed()
	if got := before["10.96.0.10:80/TCP"]; len(got) != 1 || got[0] != "10.1.1.2:8080" {
		t.Fatalf("programmed %v, want only the zone-a backend", before)
	}

	ctx, cancel := context.WithCancel(context.Background())
	var ok, failed atomic.Int64
	var landed sync.Map
	done := make(chan struct{})
	go func() { defer close(done); b.load(ctx, &ok, &failed, &landed) }()
	time.Sleep(500 * time.Millisecond)

	must(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	okAtKill := ok.Load()
	time.Sleep(time.Second) // traffic flows with no agent at all
	okWhileDown := ok.Load() - okAtKill
	b.start()
	time.Sleep(500 * time.Millisecond)
	cancel()
	<-done

	if failed.Load() != 0 {
		t.Errorf("%d of %d requests failed across the restart", failed.Load(), ok.Load()+failed.Load())
	}
	if okWhileDown == 0 {
		t.Errorf("no request completed while the agent was down")
	}
	landed.Range(func(k, v any) bool {
		if k != "b1" {
			t.Errorf("%d requests landed on %s, outside the zone", v.(*atomic.Int64).Load(), k)
		}
		return true
	})
	if after := b.programmed(); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("programmed changed across the restart: %v, before %v", after, before)
	}
	if w := b.metric("topolb_map_writes_total"); w != 0 {
		t.Errorf("restarted agent made %v map writes for unchanged services, want 0", w)
	}
	t.Logf("%d requests, %d while no agent ran, 0 failed", ok.Load(), okWhileDown)

	// A manifest replaced by rename is picked up.
	b.writeManifest("", ", hints: {forZones: [{name: zone-b}]}")
	deadline := time.Now().Add(5 * time.Second)
	for len(b.programmed()["10.96.0.10:80/TCP"]) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("manifest replaced by rename not applied: %v", b.programmed())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestAutoPodInterfaces checks that a veth created after the agent started
// gets the tc program, and loses its pinned link when it goes away.
func TestAutoPodInterfaces(t *testing.T) {
	b := newBed(t)
	b.start()
	links := filepath.Join(b.pin, "links")
	for _, host := range []string{"hc", "hb1", "hb2"} {
		if _, err := os.Stat(filepath.Join(links, "tc_"+host)); err != nil {
			t.Errorf("veth %s present at start: %v", host, err)
		}
	}
	late := nettest.NewNS(t, "agent-bin-late")
	must(t, nettest.Veth(b.node, "hlate", late, "eth0"))
	waitFor(t, "tc link pinned for a new veth", func() bool {
		_, err := os.Stat(filepath.Join(links, "tc_hlate"))
		return err == nil
	})
	must(t, b.node.Netlink().LinkDel(mustLink(t, b, "hlate")))
	waitFor(t, "tc link unpinned for a deleted veth", func() bool {
		_, err := os.Stat(filepath.Join(links, "tc_hlate"))
		return os.IsNotExist(err)
	})
}

func mustLink(t *testing.T, b *bed, name string) netlink.Link {
	l, err := b.node.Netlink().LinkByName(name)
	must(t, err)
	return l
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

var must = testutil.Must

// TestBadManifestKeepsDatapath rewrites the running agent's manifest with
// what a hostile-but-fair user produces (emptied in place, as `cmd > file`
// does first; invalid YAML; without this node), then restarts the agent on
// an empty file: each time the pinned frontend keeps its backend and
// requests keep landing on it, and the log says why the file was not
// applied. Then a good file applies again.
func TestBadManifestKeepsDatapath(t *testing.T) {
	b := newBed(t)
	cmd := b.start()
	want := fmt.Sprint(b.programmed())
	check := func(what string) {
		t.Helper()
		if got := fmt.Sprint(b.programmed()); got != want {
			t.Errorf("%s: programmed %s, want %s", what, got, want)
		}
		resp, err := b.client.HTTPClient(2 * time.Second).Get("http://10.96.0.10/")
		if err != nil {
			t.Errorf("%s: request to the service: %v", what, err)
			return
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(body) != "b1" {
			t.Errorf("%s: request landed on %q (%v), want b1", what, body, err)
		}
	}

	must(t, os.Truncate(b.manifest, 0))
	b.waitLog("manifest not applied", "it holds no Node, Service or EndpointSlice")
	check("emptied in place")

	must(t, os.WriteFile(b.manifest, []byte("apiVersion: v1\nkind: [Node\n"), 0o644))
	b.waitLog("manifest not loaded", b.manifest+":2: did not find expected")
	check("invalid YAML")

	must(t, os.WriteFile(b.manifest, []byte(strings.ReplaceAll(fmt.Sprintf(manifest, "", ""), "name: n1", "name: n9")), 0o644))
	b.waitLog("manifest not applied", "no Node named as this node (n1)")
	check("without this node")

	// A new agent started on an empty file adopts the pinned datapath and
	// removes nothing: it is alive, not ready, and the frontend serves.
	must(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	must(t, os.Truncate(b.manifest, 0))
	b.startUnready()
	b.waitStarted()
	b.waitLog("manifest not applied", "it holds no Node, Service or EndpointSlice")
	if _, err := b.get(agent.DefaultHealthAddress + "/healthz"); err != nil {
		t.Errorf("healthz of an agent waiting for a good manifest: %v", err)
	}
	if _, err := b.get(agent.DefaultHealthAddress + "/readyz"); err == nil {
		t.Error("ready without a manifest applied")
	}
	check("restarted on an empty file")

	b.writeManifest("", ", hints: {forZones: [{name: zone-b}]}")
	b.waitReady()
	waitFor(t, "the good manifest applied", func() bool { return len(b.programmed()["10.96.0.10:80/TCP"]) == 2 })
}
