package agent

import (
	"fmt"
	"sync"
	"time"

	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// DefaultHealthTimeout is how long a change may wait for the maps, or one
// sync may run, before /healthz fails. kube-proxy's /healthz fails when an
// update has been queued for longer than twice its sync period, 2 × 30 s by
// default; the agent syncs within milliseconds of a change, so the same
// minute only trips when the loop is stuck.
const DefaultHealthTimeout = time.Minute

// Health is the body of /healthz: whether the sync loop keeps up, and why
// not. Times are omitted when they do not apply.
type Health struct {
	Healthy bool `json:"healthy"`
	// Reason says why the agent is unhealthy, or that it keeps up.
	Reason string `json:"reason"`
	// LastSync is when the last sync finished.
	LastSync *time.Time `json:"lastSync,omitempty"`
	// PendingSince is when the oldest change not yet taken by the sync loop
	// was observed.
	PendingSince *time.Time `json:"pendingSince,omitempty"`
	// SyncingSince is when the sync running now started.
	SyncingSince *time.Time `json:"syncingSince,omitempty"`
	// Timeout is the threshold, in seconds.
	Timeout float64 `json:"timeoutSeconds"`
}

// liveness records the sync loop's progress for /healthz. It has its own
// lock: a sync that never returns holds the agent's.
type liveness struct {
	mu       sync.Mutex
	tracker  *kube.Tracker
	syncing  time.Time
	lastSync time.Time
	// self is this node as last folded in, nil while it is unknown or
	// deleted: the proxy health server's node eligibility.
	self *topology.Node
}

// setSelf records this node's latest version (nil: unknown or deleted).
func (l *liveness) setSelf(n *topology.Node) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.self = n
}

func (l *liveness) watch(t *kube.Tracker) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.tracker = t
}

func (l *liveness) begin(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.syncing = now
}

func (l *liveness) end(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.syncing = time.Time{}
	l.lastSync = now
}

// Health reports whether the sync loop keeps up: unhealthy when the sync
// running now started more than the timeout ago (the loop is wedged, for
// example on a datapath write that never returns), or when a change has
// waited longer than the timeout without being taken (nothing drains the
// tracker). Services whose writes fail and are retried do not count: they
// are reported by metrics and events, and a restart would not fix them.
func (a *Agent) Health() Health {
	timeout := a.cfg.HealthTimeout
	if timeout <= 0 {
		timeout = DefaultHealthTimeout
	}
	now := a.now()
	a.live.mu.Lock()
	syncing, lastSync, tracker := a.live.syncing, a.live.lastSync, a.live.tracker
	a.live.mu.Unlock()
	var pending time.Time
	if tracker != nil {
		pending = tracker.OldestPending()
	}
	h := Health{Healthy: true, Reason: "the sync loop keeps up", Timeout: timeout.Seconds()}
	if !lastSync.IsZero() {
		h.LastSync = &lastSync
	}
	if !pending.IsZero() {
		h.PendingSince = &pending
	}
	if !syncing.IsZero() {
		h.SyncingSince = &syncing
	}
	switch {
	case !syncing.IsZero() && now.Sub(syncing) > timeout:
		h.Healthy = false
		h.Reason = fmt.Sprintf("a sync has been running for %s, longer than %s: the sync loop is stuck", now.Sub(syncing).Round(time.Second), timeout)
	case !pending.IsZero() && now.Sub(pending) > timeout:
		h.Healthy = false
		h.Reason = fmt.Sprintf("a change has waited %s for the sync loop, longer than %s", now.Sub(pending).Round(time.Second), timeout)
	}
	return h
}
