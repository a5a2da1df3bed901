package kube

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Reasons a manifest that decodes without error is still not applied by a
// FileWatcher, unless AllowEmpty is set. Both are what a file being
// rewritten in place looks like (`cmd > cluster.yaml` truncates it first),
// and applying one would delete every frontend. Callers branch on them with
// errors.Is; both wrap ErrNotApplied.
var (
	ErrNotApplied    = errors.New("manifest not applied")
	ErrEmptyManifest = fmt.Errorf("%w: it holds no Node, Service or EndpointSlice", ErrNotApplied)
	ErrNodeMissing   = fmt.Errorf("%w: it has no Node named as this node", ErrNotApplied)
)

// FileWatcher feeds a Tracker from a manifest file (standalone mode). The
// file is checked every Interval and reloaded when its inode, size or
// modification time changes, so both in-place writes and replacement by
// rename (editors, ConfigMap volume updates) are seen.
//
// Loading is transactional: a file that cannot be read or decoded, or that
// is refused (ErrEmptyManifest, ErrNodeMissing), changes nothing, and the
// objects of the last applied file stay in force. Before the first applied
// file the tracker is not touched at all, so an agent never removes the
// frontends an earlier agent left in the maps because of a bad file.
type FileWatcher struct {
	Path     string
	Tracker  *Tracker
	Interval time.Duration
	// NodeName, if set, is the node the manifest is for: a manifest
	// without a Node of this name is refused with ErrNodeMissing.
	NodeName string
	// AllowEmpty applies manifests that hold no objects, or no Node named
	// NodeName, as the cluster's state instead of refusing them.
	AllowEmpty bool
	// OnLoad, if set, is called after every applied load with the
	// objects applied and the loader's warnings.
	OnLoad func(objs *Objects, warnings []string)
	// OnError, if set, is called when a load fails or is refused: once
	// per version of the file, and again whenever the error changes, never
	// once per poll of an unchanged file.
	OnError func(err error)

	services map[types.NamespacedName]*v1.Service
	slices   map[types.NamespacedName]*discovery.EndpointSlice
	nodes    map[string]*v1.Node
	// tried is the stamp of the last version of the file read, applied
	// or not.
	tried   fileStamp
	loaded  bool
	lastErr string
}

type fileStamp struct {
	ino   uint64
	size  int64
	mtime time.Time
}

// Load reads the file once and, if it decodes and is not refused, records
// every difference from the last applied load in the tracker. The first
// applied load also asks for a full resync. On error nothing changes.
func (w *FileWatcher) Load() error {
	data, stamp, err := readManifest(w.Path)
	if err != nil {
		return err
	}
	w.tried = stamp
	objs, warnings, err := DecodeManifests(w.Path, data)
	if err != nil {
		return err
	}
	if err := w.accept(objs); err != nil {
		return err
	}
	w.apply(objs)
	if w.OnLoad != nil {
		w.OnLoad(objs, warnings)
	}
	return nil
}

// accept returns why objs must not be applied, or nil.
func (w *FileWatcher) accept(objs *Objects) error {
	switch {
	case w.AllowEmpty:
		return nil
	case objs.Empty():
		return fmt.Errorf("%s: %w", w.Path, ErrEmptyManifest)
	case w.NodeName != "" && !objs.HasNode(w.NodeName):
		return fmt.Errorf("%s: %w (%s)", w.Path, ErrNodeMissing, w.NodeName)
	}
	return nil
}

// apply records the differences between the applied objects and objs.
func (w *FileWatcher) apply(objs *Objects) {
	services := make(map[types.NamespacedName]*v1.Service, len(objs.Services))
	for _, s := range objs.Services {
		services[types.NamespacedName{Namespace: s.Namespace, Name: s.Name}] = s
	}
	slices := make(map[types.NamespacedName]*discovery.EndpointSlice, len(objs.Slices))
	for _, s := range objs.Slices {
		slices[types.NamespacedName{Namespace: s.Namespace, Name: s.Name}] = s
	}
	nodes := make(map[string]*v1.Node, len(objs.Nodes))
	for _, n := range objs.Nodes {
		nodes[n.Name] = n
	}
	diff(w.services, services, w.Tracker.ServiceChanged)
	diff(w.slices, slices, w.Tracker.SliceChanged)
	diff(w.nodes, nodes, w.Tracker.NodeChanged)
	w.services, w.slices, w.nodes = services, slices, nodes
	if !w.loaded {
		w.loaded = true
		w.Tracker.Resync()
	}
}

// Run loads the file and then polls it until ctx is done.
func (w *FileWatcher) Run(ctx context.Context) {
	interval := w.Interval
	if interval <= 0 {
		interval = 200 * time.Millisecond
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		w.poll()
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// poll loads the file if its stamp differs from the last one read: a file
// that failed is neither read nor reported again until it changes. Every
// failed version is reported; a file that cannot be found is reported once
// per distinct error.
func (w *FileWatcher) poll() {
	st, err := os.Stat(w.Path)
	if err != nil {
		w.report(fmt.Errorf("read manifests: %w", err), false)
		return
	}
	stamp := stampOf(st)
	if stamp == w.tried {
		return
	}
	err = w.Load()
	// A read that failed, or a file that changed again between the stat
	// and the read, is tried again only when the stamp moves on.
	w.tried = stamp
	if err != nil {
		w.report(err, true)
		return
	}
	w.lastErr = ""
}

// report passes err to OnError, unless it repeats the last error and is
// not about a new version of the file.
func (w *FileWatcher) report(err error, newVersion bool) {
	msg := err.Error()
	if !newVersion && msg == w.lastErr {
		return
	}
	w.lastErr = msg
	if w.OnError != nil {
		w.OnError(err)
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
