package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/topolb/topolb/internal/kubetest"
)

// TestServerSideDryRun applies deploy/ (kubectl apply -k, as the README
// says) with --dry-run=server to a real kube-apiserver, which runs its
// validation and admission (Pod Security, priority classes) on every
// object without persisting it. The namespace is created for real first:
// objects in a namespace that a dry run only pretends to create are
// rejected. A copy of deploy/ with a DaemonSet the apiserver must refuse
// proves that the check can fail.
func TestServerSideDryRun(t *testing.T) {
	c := kubetest.Start(t)
	kubectl := c.Bin("kubectl")
	if _, err := os.Stat(kubectl); err != nil {
		t.Skipf("no kubectl in the kube binaries (make kube-bins): %v", err)
	}
	dir := deployDir(t)
	want := kustomizeResources(t, dir)

	run := func(args ...string) (string, error) {
		cmd := exec.Command(kubectl, append([]string{"--kubeconfig", c.KubeconfigPath}, args...)...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		return out.String(), err
	}
	if out, err := run("apply", "-f", filepath.Join(dir, "namespace.yaml")); err != nil {
		t.Fatalf("create the namespace: %v\n%s", err, out)
	}

	t.Run("deploy", func(t *testing.T) {
		out, err := run("apply", "--dry-run=server", "-k", dir)
		if err != nil {
			t.Fatalf("kubectl apply --dry-run=server -k deploy/: %v\n%s", err, out)
		}
		var applied int
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			if !strings.HasSuffix(line, "(server dry run)") {
				t.Errorf("unexpected output line %q", line)
				continue
			}
			applied++
		}
		// One line per object: every manifest reached the apiserver.
		if objects := countObjects(t, run); applied != objects || objects < len(want) {
			t.Errorf("dry run reported %d objects, kustomize renders %d from %d files\n%s", applied, objects, len(want), out)
		}
		t.Logf("\n%s", out)
	})

	t.Run("broken", func(t *testing.T) {
		broken := t.TempDir()
		for _, name := range append(want, "kustomization.yaml") {
			data, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				t.Fatal(err)
			}
			if name == "daemonset.yaml" {
				// Only privileged containers may propagate mounts back to
				// the host: validation must refuse this.
				fixed := "          mountPath: " + podPinDir + "\n"
				if !bytes.Contains(data, []byte(fixed)) {
					t.Fatalf("deploy/daemonset.yaml no longer contains %q: update this test", fixed)
				}
				data = bytes.ReplaceAll(data, []byte(fixed), []byte(fixed+"          mountPropagation: Bidirectional\n"))
			}
			if err := os.WriteFile(filepath.Join(broken, name), data, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		out, err := run("apply", "--dry-run=server", "-k", broken)
		if err == nil {
			t.Fatalf("the apiserver accepted a non-privileged DaemonSet with Bidirectional propagation:\n%s", out)
		}
		if !strings.Contains(out, "Bidirectional") {
			t.Errorf("rejected, but the error does not name the cause:\n%s", out)
		}
	})
}

// kustomizeResources returns the files deploy/kustomization.yaml lists and
// checks that it lists every manifest in deploy/.
func kustomizeResources(t testing.TB, dir string) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		Resources []string `json:"resources"`
	}
	if err := yaml.Unmarshal(data, &k); err != nil {
		t.Fatalf("deploy/kustomization.yaml: %v", err)
	}
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		name := filepath.Base(f)
		if name != "kustomization.yaml" && !slices.Contains(k.Resources, name) {
			t.Errorf("deploy/%s is not listed in deploy/kustomization.yaml", name)
		}
	}
	return k.Resources
}

// countObjects counts the objects `kubectl kustomize deploy/` renders.
func countObjects(t testing.TB, run func(...string) (string, error)) int {
	t.Helper()
	out, err := run("kustomize", deployDir(t))
	if err != nil {
		t.Fatalf("kubectl kustomize deploy/: %v\n%s", err, out)
	}
	n := 0
	for _, doc := range strings.Split(out, "\n---\n") {
		if strings.TrimSpace(doc) != "" {
			n++
		}
	}
	return n
}
