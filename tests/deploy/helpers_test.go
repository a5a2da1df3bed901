// Package deploy tests the deployment artefacts under deploy/ and tests/kind:
// that the DaemonSet's capability list is exactly what the agent needs, that
// the apiserver accepts every manifest, that the memory limit covers what
// the agent uses, that the kind script is valid shell, and that the Helm
// chart (deploy/helm/topolb) lints, renders deploy/'s objects with its
// defaults and has every agent flag as a value.
package deploy

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/topolb/topolb/internal/testutil"
)

// repoRoot is the repository root, two levels above this package.
func repoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("cannot locate the test's source file")
	}
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// deployDir is deploy/ in the repository.
func deployDir(t testing.TB) string { return filepath.Join(repoRoot(t), "deploy") }

// readStrict decodes one manifest file into obj, failing on unknown fields so
// that a misspelt field in a manifest cannot pass silently.
func readStrict(t testing.TB, name string, obj any) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(deployDir(t), name))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict(data, obj); err != nil {
		t.Fatalf("decode deploy/%s: %v", name, err)
	}
}

// agentDaemonSet returns the DaemonSet from deploy/daemonset.yaml and its
// agent container.
func agentDaemonSet(t testing.TB) (*appsv1.DaemonSet, *v1.Container) {
	t.Helper()
	var ds appsv1.DaemonSet
	readStrict(t, "daemonset.yaml", &ds)
	for i, c := range ds.Spec.Template.Spec.Containers {
		if c.Name == "agent" {
			return &ds, &ds.Spec.Template.Spec.Containers[i]
		}
	}
	t.Fatal("deploy/daemonset.yaml: no container named agent")
	return nil, nil
}

// agentConfig returns the data of deploy/configmap.yaml.
func agentConfig(t testing.TB) map[string]string {
	t.Helper()
	var cm v1.ConfigMap
	readStrict(t, "configmap.yaml", &cm)
	return cm.Data
}

// configUint reads a numeric ConfigMap key.
func configUint(t testing.TB, cfg map[string]string, key string) uint64 {
	t.Helper()
	n, err := strconv.ParseUint(cfg[key], 10, 32)
	if err != nil {
		t.Fatalf("deploy/configmap.yaml: %s: %v", key, err)
	}
	return n
}

// envValue returns the literal value of an environment variable of c.
func envValue(c *v1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name && e.ValueFrom == nil {
			return e.Value, true
		}
	}
	return "", false
}

// agentBuild builds cmd/topolb-agent once per test binary. It uses the
// caller's build settings; the image's static (CGO_ENABLED=0) build differs
// only in how the Go runtime links, not in what the agent asks of the kernel.
var agentBuild = testutil.GoBuild{Pkg: "./cmd/topolb-agent", Dir: "../.."}

// TestMain removes the agent binary built by agentBinary.
func TestMain(m *testing.M) {
	code := m.Run()
	agentBuild.Clean()
	os.Exit(code)
}

// agentBinary is the path of the agent agentBuild built.
func agentBinary(t testing.TB) string { return agentBuild.Path(t) }

// requireDatapathKernel skips t on kernels older than 6.6, which lack the
// tcx attach point the agent uses.
func requireDatapathKernel(t testing.TB) {
	t.Helper()
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	release := unix.ByteSliceToString(u.Release[:])
	var major, minor int
	if _, err := fmt.Sscanf(release, "%d.%d", &major, &minor); err != nil {
		t.Fatalf("kernel release %q: %v", release, err)
	}
	if major < 6 || major == 6 && minor < 6 {
		t.Skipf("kernel %s: the agent attaches with tcx, which needs Linux 6.6 or later", release)
	}
}

// syncBuffer is a bytes.Buffer safe for a process writing while a test
// reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// lastLine returns the last non-empty line of s.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
