// Package testutil holds the helpers the tests of every package share, so
// each is written once: failing on an error, skipping where the kernel
// lacks a feature, and building a binary of the module once per test
// binary. Root and namespaces are internal/nettest's.
package testutil

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// Must fails t on err.
func Must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// MustOrSkip is Must, except that it skips t, with err as the reason,
// when err says the kernel lacks a feature (ebpf.ErrNotSupported, as
// tcx links before Linux 6.6): such a test cannot run here, it did not
// fail.
func MustOrSkip(t testing.TB, err error) {
	t.Helper()
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel lacks a feature: %v", err)
	}
	Must(t, err)
}

// buildTimeout bounds one go build: a cold cache builds client-go.
const buildTimeout = 10 * time.Minute

// GoBuild builds a main package of the module once per test binary, with
// the caller's build settings (so `make test` reuses the cache `make
// build` filled), into a temporary directory that Clean removes.
type GoBuild struct {
	// Pkg is the package, as go build takes it, relative to Dir.
	Pkg string
	// Dir is the directory go build runs in; "" is the test's own.
	Dir string

	once      sync.Once
	tmp, path string
	err       error
}

// Path builds the binary the first time and returns its path; it fails
// t when the build failed.
func (b *GoBuild) Path(t testing.TB) string {
	t.Helper()
	b.once.Do(func() {
		if b.tmp, b.err = os.MkdirTemp("", "topolb-test-bin-"); b.err != nil {
			return
		}
		b.path = filepath.Join(b.tmp, filepath.Base(b.Pkg))
		if b.Pkg == "." {
			wd, err := os.Getwd()
			if err != nil {
				b.err = fmt.Errorf("working directory: %w", err)
				return
			}
			b.path = filepath.Join(b.tmp, filepath.Base(wd))
		}
		ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, "go", "build", "-o", b.path, b.Pkg)
		cmd.Dir = b.Dir
		if out, err := cmd.CombinedOutput(); err != nil {
			b.err = fmt.Errorf("go build %s: %w\n%s", b.Pkg, err, out)
		}
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

// Clean removes what Path built; TestMain calls it after the tests.
func (b *GoBuild) Clean() {
	if b.tmp != "" {
		os.RemoveAll(b.tmp)
	}
}
