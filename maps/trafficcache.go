package maps

import (
	"sync"
	"time"
)

// trafficCache holds the per-frontend traffic of the last Counters call
// that walked conntrack, for CachedCounters.
type trafficCache struct {
	mu sync.Mutex
	// frontends is that call's Frontends; at when it began, zero before
	// the first.
	frontends map[Frontend]Traffic
	at        time.Time
}

// CachedCounters is Counters with the traffic figures (the ones that
// walk conntrack and read every backend's record) of a call that began
// at most maxAge ago, and when that was; the named counters (Stats,
// Drops, ReverseNAT, Fragments, SourceRangeDrops) are read now. A call
// that walks (its time is new) returns that walk's Frontends, Backends
// and BackendTraffic; a call that reuses it, its Frontends only
// (Backends and BackendTraffic nil: a map per frontend, too big to keep
// for a reader that reckons what it needs of them once per walk). A metrics scrape every second then
// walks a quarter-million entries once per maxAge, not every second
// (issue 38: about 0.3 s of CPU per walk, which the agent's syncs went
// without). The figures still come from the kernel's maps, at most
// maxAge late; callers that explain state read Counters or Programmed.
// Concurrent callers share one walk. The returned maps are shared with
// later calls: read them, never write them.
func (d *upkeep) CachedCounters(maxAge time.Duration) (Counters, time.Time, error) {
	tc := &d.traffic
	tc.mu.Lock()
	defer tc.mu.Unlock()
	if tc.at.IsZero() || time.Since(tc.at) >= maxAge {
		at := time.Now()
		c, err := d.Counters()
		if err != nil {
			return Counters{}, time.Time{}, err
		}
		tc.frontends, tc.at = c.Frontends, at
		return c, at, nil
	}
	c, err := d.namedCounters()
	if err != nil {
		return Counters{}, time.Time{}, err
	}
	c.Frontends = tc.frontends
	return c, tc.at, nil
}

// namedCounters reads the counters that need no walk: every named
// counter of tlb_stats and the source-range drops, under d.mu.
func (d *upkeep) namedCounters() (Counters, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed() {
		return Counters{}, ErrClosed
	}
	return d.namedCountersLocked()
}
