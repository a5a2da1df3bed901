package main

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/nettest"
)

// isBPFFS reports whether path is on a bpf filesystem.
func isBPFFS(t *testing.T, path string) bool {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		t.Fatalf("statfs %s: %v", path, err)
	}
	return st.Type == unix.BPF_FS_MAGIC
}

// mountTmpfs mounts a tmpfs at a new directory, a root that is not a bpf
// filesystem whatever the test directory is on, and unmounts it (and what
// the test mounted on it) in cleanup.
func mountTmpfs(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		// The tmpfs and whatever the test mounted over it (lazily, so mounts
		// below go with them).
		for {
			err := unix.Unmount(dir, unix.MNT_DETACH)
			if errors.Is(err, unix.EINVAL) {
				return
			}
			if err != nil {
				t.Errorf("unmount %s: %v", dir, err)
				return
			}
		}
	})
	return dir
}

// TestEnsureBPFFS checks where the agent mounts a bpf filesystem, with a
// tmpfs standing in for the node's /sys/fs/bpf: only at the root, when the
// pin path does not exist yet and nothing above it is a bpf filesystem
// (a node without systemd's mount); never when the pin path exists on one,
// as in the DaemonSet, which mounts only the node's /sys/fs/bpf/topolb into
// a pod (at its /sys/fs/bpf), a directory below a file system that is not
// a bpf filesystem.
func TestEnsureBPFFS(t *testing.T) {
	nettest.RequireRoot(t)
	log := slog.New(slog.DiscardHandler)

	t.Run("node without bpffs: mounted at the root", func(t *testing.T) {
		root := mountTmpfs(t)
		if err := ensureBPFFS(log, filepath.Join(root, "topolb"), root); err != nil {
			t.Fatal(err)
		}
		if !isBPFFS(t, root) {
			t.Fatalf("%s is not a bpf filesystem after ensureBPFFS", root)
		}
		// Pins made there are on it.
		if err := os.Mkdir(filepath.Join(root, "topolb"), 0o700); err != nil {
			t.Fatal(err)
		}
		if !isBPFFS(t, filepath.Join(root, "topolb")) {
			t.Error("pin path not on the mounted bpf filesystem")
		}
	})

	t.Run("pod: only the pin directory is mounted", func(t *testing.T) {
		// The node's bpffs with the pin directory in it...
		node := t.TempDir()
		if err := unix.Mount("bpf", node, "bpf", 0, "mode=0700"); err != nil {
			t.Skipf("mount bpffs: %v", err)
		}
		t.Cleanup(func() { _ = unix.Unmount(node, unix.MNT_DETACH) })
		if err := os.Mkdir(filepath.Join(node, "topolb"), 0o700); err != nil {
			t.Fatal(err)
		}
		// ...bind-mounted into the pod's /sys/fs/bpf, which is not one.
		root := mountTmpfs(t)
		pin := filepath.Join(root, "topolb")
		if err := os.Mkdir(pin, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount(filepath.Join(node, "topolb"), pin, "", unix.MS_BIND, ""); err != nil {
			t.Fatalf("bind mount: %v", err)
		}
		if err := ensureBPFFS(log, pin, root); err != nil {
			t.Fatal(err)
		}
		if isBPFFS(t, root) {
			t.Fatalf("a bpf filesystem was mounted over %s, hiding the node's pins", root)
		}
		if !isBPFFS(t, pin) {
			t.Fatal("the pin directory is no longer the node's bpf filesystem")
		}
	})

	t.Run("pin path exists elsewhere: refused", func(t *testing.T) {
		root := mountTmpfs(t)
		pin := filepath.Join(root, "topolb")
		if err := os.Mkdir(pin, 0o700); err != nil {
			t.Fatal(err)
		}
		err := ensureBPFFS(log, pin, root)
		if err == nil || !strings.Contains(err.Error(), "exists but is not on a bpf filesystem") {
			t.Fatalf("error %v, want one saying the pin path is not on a bpf filesystem", err)
		}
		if isBPFFS(t, root) {
			t.Error("mounted a bpf filesystem although the pin path exists")
		}
	})

	t.Run("pin path outside the root: nothing mounted", func(t *testing.T) {
		root := mountTmpfs(t)
		other := mountTmpfs(t)
		err := ensureBPFFS(log, filepath.Join(other, "a", "topolb"), root)
		if err == nil || !strings.Contains(err.Error(), "is not on a bpf filesystem") {
			t.Fatalf("error %v, want one naming the directory that is not on a bpf filesystem", err)
		}
		if isBPFFS(t, root) || isBPFFS(t, other) {
			t.Error("mounted a bpf filesystem for a pin path outside the root")
		}
	})
}
