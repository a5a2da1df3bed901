package e2e

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/topolb/topolb/internal/nettest"
	"github.com/topolb/topolb/tools/testbed"
)

// agent is how the tests get topolb-agent: a binary, or the reason there
// is none.
var agent struct {
	binary string
	// missing is why there is no binary: the tests that need it skip.
	missing string
	// broken is why the binary could not be built: those tests fail.
	broken string
}

func TestMain(m *testing.M) {
	// Under nettest.EnvUnit (make unit) no test here runs as root: no
	// agent to build, no leftovers to look for.
	if os.Geteuid() == 0 && os.Getenv(nettest.EnvUnit) == "" {
		if err := testbed.RemoveStale(""); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: removing leftovers of earlier runs:", err)
		}
		tmp, err := os.MkdirTemp("", "topolb-e2e-")
		if err != nil {
			fmt.Fprintln(os.Stderr, "e2e:", err)
			os.Exit(1)
		}
		findAgent(tmp)
		code := m.Run()
		os.RemoveAll(tmp)
		if left := leftovers(); left != "" {
			fmt.Fprintln(os.Stderr, "e2e: FAIL: left behind:", left)
			code = 1
		}
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// findAgent builds cmd/topolb-agent into dir, unless $TOPOLB_AGENT_BINARY
// names a binary.
func findAgent(dir string) {
	if bin := os.Getenv("TOPOLB_AGENT_BINARY"); bin != "" {
		agent.binary = bin
		return
	}
	root, err := moduleRoot()
	if err != nil {
		agent.broken = err.Error()
		return
	}
	srcs, _ := filepath.Glob(filepath.Join(root, "cmd", "topolb-agent", "*.go"))
	if len(srcs) == 0 {
		agent.missing = "cmd/topolb-agent has no source yet"
		return
	}
	bin := filepath.Join(dir, "topolb-agent")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/topolb-agent")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		agent.broken = fmt.Sprintf("go build ./cmd/topolb-agent: %v\n%s", err, out)
		return
	}
	agent.binary = bin
}

func moduleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", fmt.Errorf("not inside the topolb module")
	}
	return filepath.Dir(mod), nil
}

// leftovers names the namespaces and state directories of this process
// that still exist after every test's cleanup.
func leftovers() string {
	var left []string
	mine := fmt.Sprintf("%d-", os.Getpid())
	if entries, err := os.ReadDir(testbed.NetnsDir); err == nil {
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), testbed.Prefix+mine) {
				left = append(left, "netns "+e.Name())
			}
		}
	}
	if entries, err := os.ReadDir(testbed.DefaultStateRoot); err == nil {
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), mine) {
				left = append(left, "state "+filepath.Join(testbed.DefaultStateRoot, e.Name()))
			}
		}
	}
	return strings.Join(left, ", ")
}

// requireRoot skips tests that cannot create namespaces or load BPF.
var requireRoot = nettest.RequireRoot

// requireAgent skips when the agent is not written yet and fails when it
// does not build.
func requireAgent(t testing.TB) string {
	t.Helper()
	switch {
	case agent.broken != "":
		t.Fatalf("topolb-agent: %s", agent.broken)
	case agent.missing != "":
		t.Skipf("topolb-agent: %s", agent.missing)
	}
	return agent.binary
}

// plainSwitchPorts reads TOPOLB_E2E_SWITCH_PORTS: "plain" gives the
// testbed's switch ports no XDP program, as a kind node's eth0 has its
// peer on the host's bridge (the agents' uplinks then take the tc path);
// "" or "xdp" keeps them (the uplinks take XDP). Run the suite both ways.
func plainSwitchPorts(t testing.TB) bool {
	t.Helper()
	switch v := os.Getenv("TOPOLB_E2E_SWITCH_PORTS"); v {
	case "", "xdp":
		return false
	case "plain":
		return true
	default:
		t.Fatalf("TOPOLB_E2E_SWITCH_PORTS=%q: want xdp or plain", v)
		return false
	}
}

// newTestbed creates a testbed from spec and tears it down when the test
// ends, printing the agents' last log lines first if it failed.
func newTestbed(t testing.TB, spec *testbed.Spec) *testbed.Testbed {
	t.Helper()
	requireRoot(t)
	level := slog.LevelWarn
	if os.Getenv("TOPOLB_E2E_DEBUG") != "" {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: level}))
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	tb, err := testbed.New(ctx, spec, testbed.Options{Logger: log, PlainSwitchPorts: plainSwitchPorts(t)})
	if err != nil {
		t.Fatalf("testbed: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, a := range tb.Agents() {
				t.Logf("last lines of %s:\n%s", a.LogPath, a.LogTail(30))
			}
			for _, k := range tb.KubeProxies() {
				t.Logf("last lines of %s:\n%s", k.LogPath, k.LogTail(30))
			}
		}
		if err := tb.Close(); err != nil {
			t.Errorf("teardown: %v", err)
		}
	})
	return tb
}

// testWriter sends log lines to t.Log; after the test it drops them.
type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	defer func() { recover() }() // logging after the test ended panics
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
