package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/tools/testbed"
)

// previousLayoutCommit is the last commit of map layout 8, whose agent an
// agent of this tree upgrades from (maps/layout8.go).
const previousLayoutCommit = "3f4faed"

// buildPreviousAgent builds cmd/topolb-agent of previousLayoutCommit into
// the test's temporary directory, from `git archive` (the repository is
// only read). It skips when the history does not have the commit (a
// shallow clone, a source tarball).
func buildPreviousAgent(t *testing.T) string {
	t.Helper()
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("git", "-C", root, "cat-file", "-e", previousLayoutCommit+"^{commit}").CombinedOutput(); err != nil {
		t.Skipf("git history without commit %s (the previous layout's agent): %v %s", previousLayoutCommit, err, out)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	if err := os.Mkdir(src, 0o755); err != nil {
		t.Fatal(err)
	}
	archive := exec.Command("sh", "-c", `git -C "$1" archive "$2" | tar -x -C "$3"`, "sh", root, previousLayoutCommit, src)
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("git archive %s: %v\n%s", previousLayoutCommit, err, out)
	}
	bin := filepath.Join(dir, "topolb-agent-previous-layout")
	build := exec.Command("go", "build", "-o", bin, "./cmd/topolb-agent")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the agent of %s: %v\n%s", previousLayoutCommit, err, out)
	}
	return bin
}

// opener is a client that opens connections: a pod or an outside client.
type opener interface {
	Open(ctx context.Context, proto v1.Protocol, target netip.AddrPort) (*testbed.Conn, error)
}

// streamTo opens TCP connections from c to target until one lands on
// pod, and returns it; the others are closed.
func streamTo(ctx context.Context, c opener, target netip.AddrPort, pod string) (*testbed.Conn, error) {
	for range 64 {
		conn, err := c.Open(ctx, v1.ProtocolTCP, target)
		if err != nil {
			return nil, err
		}
		a, err := conn.Ask(ctx)
		if err != nil {
			conn.Close()
			return nil, fmt.Errorf("stream to %s: %w", target, err)
		}
		if a.Pod == pod {
			return conn, nil
		}
		conn.Close()
	}
	return nil, fmt.Errorf("no stream to %s landed on %s in 64 tries", target, pod)
}

// TestUpgradeFromPreviousLayout runs the agent of the previous map layout
// (built from git) on every node, opens long-lived TCP streams (a pod to
// a cluster IP, on the tc path, to a local and a remote backend; the
// outside client to a NodePort on the uplink path, to a local backend and
// with source NAT to a remote one), then replaces every agent with this
// tree's on the same pins. The new agent migrates the maps: every stream
// keeps flowing, answered by its backend (no reset), and new connections
// land as the decision says.
func TestUpgradeFromPreviousLayout(t *testing.T) {
	requireRoot(t)
	newBin := requireAgent(t)
	oldBin := buildPreviousAgent(t)
	spec := outsideSpec(t)
	tb := newTestbed(t, spec)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	// Agents where the streams are translated: the client's node (tc on
	// its veth, replies on its uplink) and the outside client's ingress
	// node (its uplink); fewer agents load faster.
	client, ext := tb.Pod("client"), tb.External("ext1")
	var agents []*testbed.Agent
	for _, node := range []string{client.Node.Name, spec.Outside.IngressNode} {
		a, err := tb.StartAgent(ctx, node, testbed.AgentOptions{Binary: oldBin})
		if err != nil {
			t.Fatal(err)
		}
		agents = append(agents, a)
	}
	for _, a := range agents {
		if err := a.WaitReady(ctx); err != nil {
			t.Fatalf("agent of the previous layout on %s: %v", a.Node.Name, err)
		}
	}
	web := service(t, spec, "missing-hint", "web") // every endpoint: local and remote
	apply(t, tb, []testbed.ServiceSpec{web, northSouthServices()[0]})

	if err := tb.WaitAgents(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, client.Node.Name)
	clusterIP := testbed.FindDecision(ds, "web", v1.ProtocolTCP)
	ds, _ = tb.Decide(objs, spec.Outside.IngressNode)
	nodePort := testbed.FindDecision(ds, "np", v1.ProtocolTCP)
	if clusterIP == nil || nodePort == nil {
		t.Fatal("no TCP decision for web on the client's node or np on node-b1")
	}
	type stream struct {
		what, pod string
		c         *testbed.Conn
	}
	var streams []stream
	for _, s := range []struct {
		what   string
		from   opener
		target netip.AddrPort
		pod    string
	}{
		{"pod to cluster IP, local backend", client, clusterIP.Frontend, "web-a1"},
		{"pod to cluster IP, remote backend", client, clusterIP.Frontend, "web-c1"},
		{"outside to NodePort, local backend", ext, nodePort.NodePort, "web-b1"},
		{"outside to NodePort, remote backend (source NAT)", ext, nodePort.NodePort, "web-b2"},
	} {
		c, err := streamTo(ctx, s.from, s.target, s.pod)
		if err != nil {
			t.Fatalf("%s: %v", s.what, err)
		}
		defer c.Close()
		streams = append(streams, stream{s.what, s.pod, c})
	}

	for _, a := range agents {
		if err := a.Stop(); err != nil {
			t.Fatal(err)
		}
		if err := a.UseBinary(newBin); err != nil {
			t.Fatal(err)
		}
		if err := a.Start(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, a := range agents {
		if err := a.WaitReady(ctx); err != nil {
			t.Fatalf("agent on %s after the upgrade: %v", a.Node.Name, err)
		}
		log, err := os.ReadFile(a.LogPath)
		if err != nil {
			t.Fatal(err)
		}
		_, line, ok := strings.Cut(string(log), "upgraded pinned maps")
		if !ok {
			t.Errorf("agent on %s: no \"upgraded pinned maps\" in its log:\n%s", a.Node.Name, a.LogTail(20))
			continue
		}
		line, _, _ = strings.Cut(line, "\n")
		t.Logf("agent on %s upgraded pinned maps:%s", a.Node.Name, line)
	}
	if err := tb.WaitAgents(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	for _, s := range streams {
		if err := testbed.StreamStays(ctx, s.c, s.pod, 10); err != nil {
			t.Errorf("%s: %v", s.what, err)
		}
	}
	landings, err := tb.Measure(ctx, client, "web", testbed.MeasureOptions{Requests: 120})
	if err != nil {
		t.Fatal(err)
	}
	checkLandings(t, landings, []string{"web-a1", "web-a2", "web-b1", "web-b2", "web-c1", "web-c2"})
	landings, err = tb.MeasureNodePort(ctx, ext, spec.Outside.IngressNode, "np", testbed.MeasureOptions{Requests: 120})
	if err != nil {
		t.Fatal(err)
	}
	checkLandings(t, landings, []string{"web-b1", "web-b2"})
}
