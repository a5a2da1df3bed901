// Package nettest gives privileged unit tests throw-away network
// namespaces: each is created with a unique name and removed in
// t.Cleanup, also when the test fails, and comes with what such tests
// need around it (echo servers that answer with their own name, a
// one-connection-per-request HTTP client, transmit checksum offload and
// checksum error counters).
//
// It is a thin layer over internal/netns, which does the namespace work
// for it, for tools/testbed and for maps. Its users are the tests of maps
// (real traffic through the datapath), agent and cmd/topolb-agent
// (integration on a namespace node), and tests/deploy (capabilities and
// memory). The end-to-end testbed (tools/testbed) does not use it: it
// builds on internal/netns directly.
//
// Every namespace is named Prefix + "<pid>-<n>-" + a caller-chosen suffix;
// RemoveStale removes those of crashed runs (whose pid is gone) without
// touching namespaces of concurrent test processes.
package nettest

import (
	"fmt"
	"os"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/netns"
)

// Prefix starts the name of every namespace this package creates.
const Prefix = "tlbt-"

// EnvUnit names the environment variable under which RequireRoot skips
// even as root: `make unit` sets it to run, quickly, exactly the tests a
// user without privileges runs.
const EnvUnit = "TOPOLB_UNIT"

// RequireRoot skips t unless the process can create namespaces, and under
// EnvUnit.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Getenv(EnvUnit) != "" {
		t.Skip("needs root; skipped under " + EnvUnit + " (make unit)")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_BPF)")
	}
}

// NS is a named network namespace of a test; every method of netns.NS
// works on it.
type NS struct {
	*netns.NS
}

// ChecksumErrors are a namespace's receive checksum error counters.
type ChecksumErrors = netns.ChecksumErrors

var seq atomic.Uint32

// NewNS creates the namespace Prefix+"<pid>-<n>-"+suffix with loopback up,
// and deletes it in t.Cleanup (also when the test fails).
func NewNS(t testing.TB, suffix string) *NS {
	t.Helper()
	RequireRoot(t)
	name := fmt.Sprintf("%s%d-%d-%s", Prefix, os.Getpid(), seq.Add(1), suffix)
	ns, err := netns.Create(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ns.Delete(); err != nil {
			t.Errorf("delete netns %s: %v", name, err)
		}
	})
	return &NS{ns}
}

// RemoveStale deletes namespaces named Prefix+"<pid>-..." whose process
// no longer exists: leftovers of crashed or killed test runs.
func RemoveStale() error { return netns.RemoveStale(Prefix) }

// Veth creates a veth pair: aName in a, bName in b, both up.
func Veth(a *NS, aName string, b *NS, bName string) error {
	return netns.Veth(a.NS, aName, b.NS, bName)
}

// SetOffload switches an offload feature of ifname. Only "tx" (transmit
// checksum offload, netns.NS.SetTxChecksum) is supported; it is the one
// the datapath's checksum tests need.
func (ns *NS) SetOffload(ifname, feature string, on bool) error {
	if feature != "tx" {
		return fmt.Errorf("%s: offload feature %q: only \"tx\" is supported", ns.Name, feature)
	}
	return ns.SetTxChecksum(ifname, on)
}

// BPFFS mounts a private bpf filesystem for t in a temporary directory,
// so pins never land in the node's /sys/fs/bpf, and unmounts it in
// t.Cleanup (which drops the pins: maps, and links, which detaches). It
// skips t where bpffs cannot be mounted.
func BPFFS(t testing.TB) string {
	t.Helper()
	RequireRoot(t)
	dir := t.TempDir()
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		t.Skipf("cannot mount bpffs (kernel without CONFIG_BPF_SYSCALL?): %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount bpffs %s: %v", dir, err)
		}
	})
	return dir
}
