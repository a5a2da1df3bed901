package kube

import (
	"fmt"
	"reflect"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/topology"
)

// change is the previous and current state of one object since the last
// drain. A nil previous means the object was added, a nil current that it
// was deleted.
type change[T any] struct {
	previous, current T
}

// Tracker collects Service, EndpointSlice and Node changes between syncs, in
// the style of kube-proxy's change trackers: per object it keeps the state
// at the last sync (previous) and the latest state (current), drops changes
// that cancel out or touch nothing topolb reads, and signals that a sync is
// needed. Safe for concurrent use.
type Tracker struct {
	mu       sync.Mutex
	services map[types.NamespacedName]*change[*v1.Service]
	slices   map[types.NamespacedName]*change[*discovery.EndpointSlice]
	nodes    map[string]*change[*v1.Node]
	// summary is the topology summary's latest state; summaryChanged says
	// it changed since the last drain.
	summary        SummaryChange
	summaryChanged bool
	resync         bool
	since          time.Time
	notify         chan struct{}
	now            func() time.Time
}

// NewTracker returns an empty tracker.
func NewTracker() *Tracker {
	return &Tracker{
		services: map[types.NamespacedName]*change[*v1.Service]{},
		slices:   map[types.NamespacedName]*change[*discovery.EndpointSlice]{},
		nodes:    map[string]*change[*v1.Node]{},
		notify:   make(chan struct{}, 1),
		now:      time.Now,
	}
}

// Batch is the set of changes drained from a Tracker. Each map holds the
// current object per key, nil when it was deleted.
type Batch struct {
	Services map[types.NamespacedName]*v1.Service
	Slices   map[types.NamespacedName]*discovery.EndpointSlice
	Nodes    map[string]*v1.Node
	// Summary is the topology summary's state when it changed since the
	// last drain, nil when it did not.
	Summary *SummaryChange
	// Resync asks for every service to be decided again.
	Resync bool
	// Since is when the oldest change in the batch was observed.
	Since time.Time
}

// Empty reports whether the batch holds nothing to do.
func (b Batch) Empty() bool {
	return !b.Resync && len(b.Services) == 0 && len(b.Slices) == 0 && len(b.Nodes) == 0 && b.Summary == nil
}

// Notify returns a channel that receives a value when a sync is needed.
func (t *Tracker) Notify() <-chan struct{} { return t.notify }

// ServiceChanged records a Service add (prev nil), update or delete (cur nil).
func (t *Tracker) ServiceChanged(prev, cur *v1.Service) {
	if obj := either(prev, cur); obj != nil {
		record(t, t.services, types.NamespacedName{Namespace: obj.Namespace, Name: obj.Name}, prev, cur, serviceEqual)
	}
}

// SliceChanged records an EndpointSlice add, update or delete.
func (t *Tracker) SliceChanged(prev, cur *discovery.EndpointSlice) {
	if obj := either(prev, cur); obj != nil {
		record(t, t.slices, types.NamespacedName{Namespace: obj.Namespace, Name: obj.Name}, prev, cur, sliceEqual)
	}
}

// NodeChanged records a Node add, update or delete.
func (t *Tracker) NodeChanged(prev, cur *v1.Node) {
	if obj := either(prev, cur); obj != nil {
		record(t, t.nodes, obj.Name, prev, cur, nodeEqual)
	}
}

// SummaryChange is the state of the topology summary an agent with
// --node-watch=own reads the other nodes from.
type SummaryChange struct {
	// Summary is the last summary read, nil when none has been: a summary
	// that is deleted, or replaced by one that cannot be read, leaves the
	// last good one in force.
	Summary *topology.Summary
	// Note, when not "", says why Summary may be out of date: its
	// ConfigMap was deleted or cannot be read, or its writer has not
	// refreshed it in time (CheckSummaryAge).
	Note string
}

// SummaryChanged records an add, update or delete of the topology
// summary's ConfigMap (SummaryName). A delete, or data that cannot be
// decoded, keeps the last summary read and notes why.
func (t *Tracker) SummaryChanged(_, cur *v1.ConfigMap) {
	t.mu.Lock()
	defer t.mu.Unlock()
	next := SummaryChange{Summary: t.summary.Summary}
	if cur == nil {
		next.Note = fmt.Sprintf("the topology summary %s was deleted", SummaryName)
	} else if s, err := topology.DecodeSummary([]byte(cur.Data[topology.SummaryDataKey])); err != nil {
		next.Note = fmt.Sprintf("the topology summary %s cannot be read (%v)", SummaryName, err)
	} else {
		next.Summary = s
	}
	t.setSummaryLocked(next)
}

// CheckSummaryAge notes, once, that the summary was written longer than
// staleAfter before now: its writer is down, or cannot write.
func (t *Tracker) CheckSummaryAge(now time.Time, staleAfter time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.summary.Summary
	if s == nil || t.summary.Note != "" || now.Sub(s.Written) <= staleAfter {
		return
	}
	t.setSummaryLocked(SummaryChange{Summary: s, Note: fmt.Sprintf("the topology summary was last written %s ago (at %s; its writer refreshes it every %s)",
		now.Sub(s.Written).Round(time.Second), s.Written.UTC().Format(time.RFC3339), SummaryRefresh)})
}

func (t *Tracker) setSummaryLocked(next SummaryChange) {
	cur := t.summary
	if next.Note == cur.Note && next.Summary.SameInputs(cur.Summary) &&
		(next.Summary == nil || next.Summary.Written.Equal(cur.Summary.Written)) {
		return
	}
	t.summary, t.summaryChanged = next, true
	t.signalLocked()
}

// either returns the current object, or the previous one of a delete.
func either[T any](prev, cur *T) *T {
	if cur != nil {
		return cur
	}
	return prev
}

// Resync asks for a full resync at the next drain.
func (t *Tracker) Resync() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.resync = true
	t.signalLocked()
}

func record[K comparable, T comparable](t *Tracker, m map[K]*change[T], key K, prev, cur T, equal func(a, b T) bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	c, ok := m[key]
	if !ok {
		c = &change[T]{previous: prev}
		m[key] = c
	}
	c.current = cur
	if equal(c.previous, c.current) {
		delete(m, key)
		if t.emptyLocked() {
			t.since = time.Time{}
		}
		return
	}
	t.signalLocked()
}

func (t *Tracker) signalLocked() {
	if t.since.IsZero() {
		t.since = t.now()
	}
	select {
	case t.notify <- struct{}{}:
	default:
	}
}

// OldestPending returns when the oldest change not yet drained was
// observed, or the zero time when nothing is pending.
func (t *Tracker) OldestPending() time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.emptyLocked() {
		return time.Time{}
	}
	return t.since
}

func (t *Tracker) emptyLocked() bool {
	return !t.resync && len(t.services) == 0 && len(t.slices) == 0 && len(t.nodes) == 0 && !t.summaryChanged
}

// Drain returns the pending changes and starts a new batch.
func (t *Tracker) Drain() Batch {
	t.mu.Lock()
	defer t.mu.Unlock()
	b := Batch{
		Services: make(map[types.NamespacedName]*v1.Service, len(t.services)),
		Slices:   make(map[types.NamespacedName]*discovery.EndpointSlice, len(t.slices)),
		Nodes:    make(map[string]*v1.Node, len(t.nodes)),
		Resync:   t.resync,
		Since:    t.since,
	}
	for k, c := range t.services {
		b.Services[k] = c.current
	}
	for k, c := range t.slices {
		b.Slices[k] = c.current
	}
	for k, c := range t.nodes {
		b.Nodes[k] = c.current
	}
	if t.summaryChanged {
		sc := t.summary
		b.Summary = &sc
	}
	t.summaryChanged = false
	clear(t.services)
	clear(t.slices)
	clear(t.nodes)
	t.resync = false
	t.since = time.Time{}
	return b
}

// serviceEqual compares what topolb reads of a Service: its spec, its
// load-balancer status, its topolb.io/ annotations and its
// service-proxy-name label (topology.SkipReason).
func serviceEqual(a, b *v1.Service) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	proxyName := func(s *v1.Service) (string, bool) {
		v, ok := s.Labels[topology.LabelServiceProxyName]
		return v, ok
	}
	an, aok := proxyName(a)
	bn, bok := proxyName(b)
	return an == bn && aok == bok &&
		equality.Semantic.DeepEqual(a.Spec, b.Spec) &&
		equality.Semantic.DeepEqual(a.Status.LoadBalancer, b.Status.LoadBalancer) &&
		equality.Semantic.DeepEqual(topolbAnnotations(a.Annotations), topolbAnnotations(b.Annotations))
}

func topolbAnnotations(ann map[string]string) map[string]string {
	var out map[string]string
	for k, v := range ann {
		if strings.HasPrefix(k, "topolb.io/") {
			if out == nil {
				out = map[string]string{}
			}
			out[k] = v
		}
	}
	return out
}

// sliceEqual compares what topolb reads of an EndpointSlice.
func sliceEqual(a, b *discovery.EndpointSlice) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return a.AddressType == b.AddressType &&
		a.Labels[discovery.LabelServiceName] == b.Labels[discovery.LabelServiceName] &&
		equality.Semantic.DeepEqual(a.Ports, b.Ports) &&
		equality.Semantic.DeepEqual(a.Endpoints, b.Endpoints)
}

// nodeEqual compares what topolb reads of a Node: its model in the
// decision engine (labels, allocatable CPU, readiness, addresses), so a
// field the engine starts to read can never be dropped here as a no-op.
func nodeEqual(a, b *v1.Node) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return reflect.DeepEqual(topology.NodeFromObject(a, nil), topology.NodeFromObject(b, nil))
}
