package deploy

import (
	"os/exec"
	"path/filepath"
	"testing"
)

// TestShellScripts checks the kind script, which cannot run on machines
// without a Docker engine, at least parses (bash -n) and passes shellcheck.
func TestShellScripts(t *testing.T) {
	scripts, err := filepath.Glob(filepath.Join(repoRoot(t), "tests", "kind", "*.sh"))
	if err != nil || len(scripts) == 0 {
		t.Fatalf("no scripts in tests/kind (%v)", err)
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
			if out, err := exec.Command("shellcheck", "--severity=style", s).CombinedOutput(); err != nil {
				t.Errorf("shellcheck %s: %v\n%s", name, err, out)
			}
		})
	}
}
