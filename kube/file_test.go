package kube

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

const watchedManifest = `apiVersion: v1
kind: Node
metadata: {name: a1}
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
`

// watched is a FileWatcher on a file in a temporary directory, recording
// what it reports.
type watched struct {
	t       *testing.T
	path    string
	w       *FileWatcher
	tracker *Tracker
	errs    []error
	loads   int
	// seq makes every write a new version of the file, even within the
	// file system's timestamp granularity.
	seq int
}

func newWatched(t *testing.T, content string) *watched {
	t.Helper()
	wd := &watched{t: t, path: filepath.Join(t.TempDir(), "cluster.yaml"), tracker: NewTracker()}
	wd.w = &FileWatcher{Path: wd.path, Tracker: wd.tracker, NodeName: "a1",
		OnLoad:  func(*Objects, []string) { wd.loads++ },
		OnError: func(err error) { wd.errs = append(wd.errs, err) },
	}
	wd.write(content)
	return wd
}

// write replaces the file by rename, so each write is a new inode.
func (wd *watched) write(content string) {
	wd.t.Helper()
	wd.seq++
	tmp := wd.path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		wd.t.Fatal(err)
	}
	if err := os.Rename(tmp, wd.path); err != nil {
		wd.t.Fatal(err)
	}
}

// truncate empties the file in place, as `cmd > cluster.yaml` does first.
func (wd *watched) truncate() {
	wd.t.Helper()
	if err := os.Truncate(wd.path, 0); err != nil {
		wd.t.Fatal(err)
	}
	// A new modification time even on coarse clocks.
	future := time.Now().Add(time.Duration(wd.seq+1) * time.Second)
	wd.seq++
	if err := os.Chtimes(wd.path, future, future); err != nil {
		wd.t.Fatal(err)
	}
}

// services drains the tracker and returns its services' cluster IPs by
// name ("" for a delete), and whether it asked for a resync.
func (wd *watched) drain() (map[string]string, bool) {
	b := wd.tracker.Drain()
	out := map[string]string{}
	for nn, s := range b.Services {
		out[nn.Name] = ""
		if s != nil {
			out[nn.Name] = s.Spec.ClusterIP
		}
	}
	return out, b.Resync
}

func TestFileWatcherKeepsTheLastGoodState(t *testing.T) {
	tests := []struct {
		name    string
		content string // the second version of the file
		// wantIs is the error the second version must fail with.
		wantIs  error
		wantMsg string
	}{
		{name: "empty file", content: "", wantIs: ErrEmptyManifest, wantMsg: "it holds no Node, Service or EndpointSlice"},
		{name: "comments only", content: "# being rewritten\n---\n", wantIs: ErrEmptyManifest},
		{name: "only kinds topolb does not read", content: "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n", wantIs: ErrEmptyManifest},
		{name: "no Node of this node's name", content: strings.Replace(watchedManifest, "a1", "b1", 1), wantIs: ErrNodeMissing, wantMsg: "no Node named as this node (a1)"},
		{name: "truncated mid-line", content: watchedManifest[:len(watchedManifest)-12], wantMsg: "cluster.yaml:8: "},
		{name: "invalid YAML", content: "apiVersion: v1\nkind: [Node\n", wantMsg: "cluster.yaml:2: did not find expected ',' or ']'"},
		{name: "a limit exceeded", content: nestedLists(MaxListDepth + 1), wantIs: ErrManifestLimit},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wd := newWatched(t, watchedManifest)
			if err := wd.w.Load(); err != nil {
				t.Fatal(err)
			}
			if svcs, resync := wd.drain(); svcs["web"] != "10.96.0.1" || !resync {
				t.Fatalf("first load: services %v, resync %v", svcs, resync)
			}
			wd.write(tt.content)
			err := wd.w.Load()
			if err == nil {
				t.Fatal("loaded; want a refusal or an error")
			}
			if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
				t.Errorf("error %v, want one wrapping %v", err, tt.wantIs)
			}
			if tt.wantMsg != "" && !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("error %q, want it to contain %q", err, tt.wantMsg)
			}
			if !strings.Contains(err.Error(), wd.path) {
				t.Errorf("error %q does not name the file", err)
			}
			if b := wd.tracker.Drain(); !b.Empty() {
				t.Errorf("a failed load changed the tracker: %+v", b)
			}
			// The next good version applies against the last good one.
			wd.write(strings.Replace(watchedManifest, "10.96.0.1", "10.96.0.2", 1))
			if err := wd.w.Load(); err != nil {
				t.Fatal(err)
			}
			if svcs, resync := wd.drain(); svcs["web"] != "10.96.0.2" || len(svcs) != 1 || resync {
				t.Errorf("after recovering: services %v, resync %v; want only web changed", svcs, resync)
			}
		})
	}
}

func TestFileWatcherAllowEmpty(t *testing.T) {
	wd := newWatched(t, watchedManifest)
	wd.w.AllowEmpty = true
	if err := wd.w.Load(); err != nil {
		t.Fatal(err)
	}
	wd.drain()
	wd.write("")
	if err := wd.w.Load(); err != nil {
		t.Fatalf("empty file with AllowEmpty: %v", err)
	}
	if svcs, _ := wd.drain(); len(svcs) != 1 || svcs["web"] != "" {
		t.Errorf("empty file with AllowEmpty: services %v, want web deleted", svcs)
	}
}

// TestFileWatcherRefusedFirstLoad checks that an agent started on a bad file
// asks for nothing: no resync, so frontends a previous agent left in the
// maps are not removed.
func TestFileWatcherRefusedFirstLoad(t *testing.T) {
	wd := newWatched(t, "")
	if err := wd.w.Load(); !errors.Is(err, ErrEmptyManifest) {
		t.Fatalf("error %v, want ErrEmptyManifest", err)
	}
	if b := wd.tracker.Drain(); !b.Empty() {
		t.Errorf("refused first load touched the tracker: %+v", b)
	}
	wd.write(watchedManifest)
	if err := wd.w.Load(); err != nil {
		t.Fatal(err)
	}
	if _, resync := wd.drain(); !resync {
		t.Error("the first applied load did not ask for a resync")
	}
}

// TestFileWatcherReportsEachFailure polls as Run does and checks what is
// reported: every version of the file that fails, once; a missing file
// once per distinct error; nothing for polls of an unchanged file.
func TestFileWatcherReportsEachFailure(t *testing.T) {
	wd := newWatched(t, watchedManifest)
	wd.w.poll()
	if wd.loads != 1 || len(wd.errs) != 0 {
		t.Fatalf("first poll: %d loads, errors %v", wd.loads, wd.errs)
	}
	steps := []struct {
		name   string
		change func()
		// wantErrs is how many errors are reported after the change and
		// three more polls.
		wantErrs  int
		wantLoads int
	}{
		{name: "unchanged", change: func() {}, wantLoads: 1},
		{name: "truncated in place", change: wd.truncate, wantErrs: 1, wantLoads: 1},
		{name: "broken YAML", change: func() { wd.write("kind: [\n") }, wantErrs: 2, wantLoads: 1},
		{name: "the same broken YAML, rewritten", change: func() { wd.write("kind: [\n") }, wantErrs: 3, wantLoads: 1},
		{name: "removed", change: func() { os.Remove(wd.path) }, wantErrs: 4, wantLoads: 1},
		{name: "back", change: func() { wd.write(watchedManifest) }, wantErrs: 4, wantLoads: 2},
		{name: "empty again", change: func() { wd.write("") }, wantErrs: 5, wantLoads: 2},
	}
	for _, st := range steps {
		st.change()
		for range 4 {
			wd.w.poll()
		}
		if len(wd.errs) != st.wantErrs || wd.loads != st.wantLoads {
			t.Fatalf("%s: %d errors reported, %d loads; want %d and %d\nerrors: %v", st.name, len(wd.errs), wd.loads, st.wantErrs, st.wantLoads, wd.errs)
		}
	}
	if !errors.Is(wd.errs[3], os.ErrNotExist) {
		t.Errorf("removed file reported as %v", wd.errs[3])
	}
}

// TestFileWatcherSpecialFiles checks that a FIFO, a device or a directory
// as the manifest is a clear error at once: never a blocked open on a FIFO
// without a writer, never reading /dev/zero until memory runs out.
func TestFileWatcherSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo.yaml")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		path string
		want string
	}{
		{path: fifo, want: "is a named pipe, not a regular file"},
		{path: "/dev/zero", want: "is a character device, not a regular file"},
		{path: dir, want: "is a directory, not a regular file"},
	}
	for _, tt := range tests {
		t.Run(filepath.Base(tt.path), func(t *testing.T) {
			done := make(chan error, 1)
			go func() {
				_, _, err := LoadManifests(tt.path)
				done <- err
			}()
			select {
			case err := <-done:
				if err == nil || !strings.Contains(err.Error(), tt.want) {
					t.Errorf("error %v, want one saying it %s", err, tt.want)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("LoadManifests blocked")
			}
		})
	}
}

// TestLoadManifestsSizeLimit checks that a file above MaxManifestBytes is
// refused from its size, before it is read (the file is sparse).
func TestLoadManifestsSizeLimit(t *testing.T) {
	path := filepath.Join(t.TempDir(), "big.yaml")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(MaxManifestBytes + 1); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	_, _, err = LoadManifests(path)
	if !errors.Is(err, ErrManifestLimit) || !strings.Contains(err.Error(), "is more than 32 MiB") {
		t.Errorf("error %v, want ErrManifestLimit naming the limit", err)
	}
}
