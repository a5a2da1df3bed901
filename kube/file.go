package kube

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
)

// FileWatcher feeds a Tracker from a manifest file (standalone mode). The
// file is checked every Interval and reloaded when its inode, size or
// modification time changes, so both in-place writes and replacement by
// rename (editors, ConfigMap volume updates) are seen. A file that fails to
// load is reported through OnError and the previous objects stay in force.
type FileWatcher struct {
	Path     string
	Tracker  *Tracker
	Interval time.Duration
	// OnLoad, if set, is called after every successful load with the
	// loader's warnings.
	OnLoad func(warnings []string)
	// OnError, if set, is called when the file cannot be read or parsed.
	OnError func(err error)

	services map[types.NamespacedName]*v1.Service
	slices   map[types.NamespacedName]*discovery.EndpointSlice
	nodes    map[string]*v1.Node
	stamp    fileStamp
}

type fileStamp struct {
	ino   uint64
	size  int64
	mtime time.Time
}

// Load reads the file once and records every difference from the last
// successful load in the tracker. The first successful load also asks for a
// full resync.
func (w *FileWatcher) Load() error {
	st, err := os.Stat(w.Path)
	if err != nil {
		return fmt.Errorf("stat manifests: %w", err)
	}
	objs, warnings, err := LoadManifests(w.Path)
	if err != nil {
		return err
	}
	w.stamp = stampOf(st)
	first := w.services == nil
	services := map[types.NamespacedName]*v1.Service{}
	for _, s := range objs.Services {
		services[types.NamespacedName{Namespace: s.Namespace, Name: s.Name}] = s
	}
	slices := map[types.NamespacedName]*discovery.EndpointSlice{}
	for _, s := range objs.Slices {
		slices[types.NamespacedName{Namespace: s.Namespace, Name: s.Name}] = s
	}
	nodes := map[string]*v1.Node{}
	for _, n := range objs.Nodes {
		nodes[n.Name] = n
	}
	diff(w.services, services, w.Tracker.ServiceChanged)
	diff(w.slices, slices, w.Tracker.SliceChanged)
	diff(w.nodes, nodes, w.Tracker.NodeChanged)
	w.services, w.slices, w.nodes = services, slices, nodes
	if first {
		w.Tracker.Resync()
	}
	if w.OnLoad != nil {
		w.OnLoad(warnings)
	}
	return nil
}

// Run loads the file and then polls it until ctx is done.
func (w *FileWatcher) Run(ctx context.Context) {
	interval := w.Interval
	if interval <= 0 {
		interval = 200 * time.Millisecond
	}
	failed := false
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		st, err := os.Stat(w.Path)
		changed := err != nil || stampOf(st) != w.stamp || w.services == nil
		if changed {
			if err := w.Load(); err != nil {
				// Report each failure once until the file changes again.
				if !failed && w.OnError != nil {
					w.OnError(err)
				}
				failed = true
				if st != nil {
					w.stamp = stampOf(st)
				}
			} else {
				failed = false
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

func stampOf(st os.FileInfo) fileStamp {
	s := fileStamp{size: st.Size(), mtime: st.ModTime()}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		s.ino = sys.Ino
	}
	return s
}

// diff reports every add, update and delete between two snapshots.
func diff[K comparable, T any](prev, cur map[K]*T, changed func(prev, cur *T)) {
	for k, c := range cur {
		changed(prev[k], c)
	}
	for k, p := range prev {
		if _, ok := cur[k]; !ok {
			changed(p, nil)
		}
	}
}
