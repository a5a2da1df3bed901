package deploy

import (
	"os/exec"
	"path/filepath"
	"testing"
)

// TestShellScripts checks that the project's scripts (the kind script,
// which cannot run on machines without a Docker engine, the local cluster's
// and the build scripts) at least parse (bash -n) and pass shellcheck,
// following the files they source.
func TestShellScripts(t *testing.T) {
	root := repoRoot(t)
	var scripts []string
	for _, dir := range []string{"tests/kind", "tools/cluster", "tools"} {
		s, err := filepath.Glob(filepath.Join(root, dir, "*.sh"))
		if err != nil || len(s) == 0 {
			t.Fatalf("no scripts in %s (%v)", dir, err)
		}
		scripts = append(scripts, s...)
	}
	for _, s := range scripts {
		name := filepath.Base(s)
		t.Run(name+"/bash-n", func(t *testing.T) {
			if out, err := exec.Command("bash", "-n", s).CombinedOutput(); err != nil {
				t.Errorf("bash -n %s: %v\n%s", name, err, out)
			}
		})
		t.Run(name+"/shellcheck", func(t *testing.T) {
			if _, err := exec.LookPath("shellcheck"); err != nil {
				t.Skip("shellcheck not installed (make deps installs it)")
			}
			cmd := exec.Command("shellcheck", "-x", "--severity=style", s)
			cmd.Dir = root // where `# shellcheck source=` paths start
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Errorf("shellcheck %s: %v\n%s", name, err, out)
			}
		})
	}
}
