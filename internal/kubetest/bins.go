package kubetest

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
)

const (
	// EnvBinDir names the directory holding the binaries built by
	// tools/kube-bins.sh (the Makefile exports it). A relative path is taken
	// from the repository root. Unset, it defaults to DefaultBinDir().
	EnvBinDir = "TOPOLB_KUBE_BINS"

	// KubeVersion is the Kubernetes release the binaries are built from.
	KubeVersion = "v1.37.2"

	// EnvRequired, when set to a non-empty value, turns a missing binary from
	// a skipped test into a failed one, for runs that must not pass vacuously.
	EnvRequired = "TOPOLB_KUBE_REQUIRED"

	modulePath = "github.com/topolb/topolb"
)

// ErrNoBinaries is returned (wrapped) by Run when etcd or kube-apiserver is
// not in the binary directory; Start skips the test instead.
var ErrNoBinaries = errors.New("kube binaries not found")

// requiredBins are the binaries Run needs; kubectl and kube-proxy are only
// handed out by Cluster.Bin.
var requiredBins = []string{"etcd", "kube-apiserver"}

// DefaultBinDir is where `make kube-bins` puts the binaries: a per-user
// cache outside the repository ($XDG_CACHE_HOME or ~/.cache, then
// topolb/kube-bins-<version>), so every clone on a machine, CI's included,
// reuses one build.
func DefaultBinDir() (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("locate kube binaries: %w", err)
	}
	return filepath.Join(cache, "topolb", "kube-bins-"+KubeVersion), nil
}

// BinDir returns the directory that holds etcd, kube-apiserver, kube-proxy
// and kubectl: $TOPOLB_KUBE_BINS, or DefaultBinDir(). It does not check that
// the binaries are there.
func BinDir() (string, error) {
	dir := os.Getenv(EnvBinDir)
	if dir == "" {
		return DefaultBinDir()
	}
	if filepath.IsAbs(dir) {
		return dir, nil
	}
	root, err := repoRoot()
	if err != nil {
		return "", fmt.Errorf("locate kube binaries: %w", err)
	}
	if dir != "" {
		return filepath.Join(root, dir), nil
	}
	return DefaultBinDir()
}

// checkBins reports ErrNoBinaries if a binary Run needs is missing from dir.
func checkBins(dir string) error {
	for _, name := range requiredBins {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return fmt.Errorf("%w: no executable %s in %s (run `make kube-bins` or set %s)",
				ErrNoBinaries, name, dir, EnvBinDir)
		}
	}
	return nil
}

// repoRoot finds the directory of topolb's go.mod, starting from this
// source file (absolute unless built with -trimpath) and then from the
// working directory (the package directory under `go test`).
func repoRoot() (string, error) {
	var starts []string
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		starts = append(starts, filepath.Dir(file))
	}
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	for _, dir := range starts {
		for {
			if isTopolbModule(filepath.Join(dir, "go.mod")) {
				return dir, nil
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	return "", fmt.Errorf("no go.mod of %s above %s (set %s)", modulePath, strings.Join(starts, " or "), EnvBinDir)
}

func isTopolbModule(gomod string) bool {
	f, err := os.Open(gomod)
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 2 && fields[0] == "module" {
			return strings.Trim(fields[1], `"`) == modulePath
		}
	}
	return false
}
