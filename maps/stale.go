package maps

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cilium/ebpf"
)

// An established packet costs one map lookup, its conntrack entry
// (issue 23): it neither validates its backend nor counts in the
// backend's per-CPU record. Both moved here, to the agent:
//
//   - Validity. When an id is released (its generation bumped), the
//     forward entries of the flows pinned to it are marked stale
//     (CT_F_STALE, expired) by a walk of both conntrack tables within
//     staleDelay of the change; their next packet re-balances them, as the
//     generation check on every packet did. The sweep marks any flow
//     whose generation is not its id's (markOutdated): one created from a
//     slot read just before the release, after the walk passed.
//   - Counters. A flow's packets after its first are counted in its
//     forward entry; a backend's traffic is its record (new flows, first
//     packets, the counts of entries the datapath deleted: ct_fold) plus
//     its live flows' entries plus the entries the sweep deleted
//     (flowCounts.swept). Entries the unreplied table's LRU evicts take
//     their counts with them; Counters never reports less than it did.

// idGen names one backend id in one generation: a (frontend, backend)
// pair.
type idGen struct{ id, gen uint32 }

// entryTraffic is what a forward entry counted, or nothing for a reply
// entry.
func entryTraffic(v tcCtValue) (idGen, Traffic, bool) {
	if tcCtDir(v.Dir) != tcCtDirCT_FORWARD {
		return idGen{}, Traffic{}, false
	}
	return idGen{v.BackendId, v.BackendGen}, Traffic{Flows: 1, Packets: v.Packets, Bytes: v.Bytes}, true
}

// walk calls f for every entry of both conntrack tables, read in
// batches.
func (ts ctTables) walk(f func(m *ebpf.Map, k tcCtKey, v tcCtValue) error) error {
	for _, m := range ts {
		if err := walkTable(m, func(k tcCtKey, v tcCtValue) error { return f(m, k, v) }); err != nil {
			return err
		}
	}
	return nil
}

// walkTable calls f for every entry of the conntrack table m (keys K,
// values V: tcCtKey and tcCtValue, or IPv6's tcCt6Key and tcCt6Value),
// read in batches.
func walkTable[K, V any](m *ebpf.Map, f func(k K, v V) error) error {
	keys := make([]K, sweepBatch)
	vals := make([]V, sweepBatch)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		for i := 0; i < n; i++ {
			if ferr := f(keys[i], vals[i]); ferr != nil {
				return ferr
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read conntrack: %w", err)
		}
	}
}

// walkValues calls f with the family-neutral part (ct_value) of every
// entry of the IPv4 tables ts and the IPv6 tables ts6 (ct6_value embeds
// it), for the readers that need nothing else: counters.
func walkValues(ts, ts6 ctTables, f func(v tcCtValue)) error {
	if err := ts.walk(func(_ *ebpf.Map, _ tcCtKey, v tcCtValue) error { f(v); return nil }); err != nil {
		return err
	}
	for _, m := range ts6 {
		if err := walkTable(m, func(_ tcCt6Key, v tcCt6Value) error { f(v.Ct); return nil }); err != nil {
			return err
		}
	}
	return nil
}

// ctFamilies are the conntrack tables of both families.
type ctFamilies struct{ v4, v6 ctTables }

// ctFamilies returns the Datapath's conntrack tables of both families.
func (d *upkeep) ctFamilies() ctFamilies { return ctFamilies{d.ctTables(), d.ct6Tables()} }

// cloneCtTables returns copies of the conntrack tables' handles, of both
// families, for a walk that runs without d.mu (the caller holds it here):
// map writes go on while it reads. The caller closes them.
func (d *upkeep) cloneCtTables() (ctFamilies, error) {
	var out ctFamilies
	from := d.ctFamilies()
	for _, f := range []struct{ from, to *ctTables }{{&from.v4, &out.v4}, {&from.v6, &out.v6}} {
		for i, m := range f.from {
			c, err := m.Clone()
			if err != nil {
				out.close()
				return ctFamilies{}, err
			}
			f.to[i] = c
		}
	}
	return out, nil
}

// close closes the handles of cloned tables (nil ones are skipped).
func (fs ctFamilies) close() {
	for _, ts := range []ctTables{fs.v4, fs.v6} {
		for _, m := range ts {
			if m != nil {
				m.Close()
			}
		}
	}
}

// traffic sums the counts of fs's forward entries by backend id and
// generation, for the pairs want accepts (nil: all).
func (fs ctFamilies) traffic(want func(idGen) bool) (map[idGen]Traffic, error) {
	out := make(map[idGen]Traffic)
	err := walkValues(fs.v4, fs.v6, func(v tcCtValue) {
		if ig, tr, ok := entryTraffic(v); ok && (want == nil || want(ig)) {
			out[ig] = out[ig].plus(tr)
		}
	})
	return out, err
}

// staleDelay is how long released ids wait for others before one walk of
// conntrack marks their flows stale: a walk reads every entry (about
// 0.1 s for a quarter-million), so a burst of changes (a rollout, a
// frontend deleted with its backends) shares one, well within the
// second in which a gone backend's flows must move
// (TestRemovedBackendDrainsWithinASecond).
const staleDelay = 50 * time.Millisecond

// staleGap is the least time from the end of one walk to the start of
// the next, or the last walk's own length if longer: under a steady
// stream of releases (a rollout) the walks, each most of a core for a
// fraction of a second at a quarter-million entries, would otherwise
// follow one another back to back and take a core from the agent's syncs
// (issue 38); so they take half of one at most. A released backend's
// flows are still marked within a walk, a gap and a walk: within the
// second at a quarter-million entries.
const staleGap = 200 * time.Millisecond

// staleQueue holds the ids released since the last walk, each with its
// newest generation: an entry with any other is no longer honoured (an
// id released twice before the walk marks both older generations).
type staleQueue struct {
	mu      sync.Mutex
	pending map[uint32]uint32
	timer   *time.Timer
	// walking is held by flushStale from taking pending to the end of
	// its walk, so that a flush returns only once every id queued before
	// it is marked, also those the timer's flush took just before.
	walking sync.Mutex
	// lastEnd is when the last walk ended, lastTook how long it took
	// (staleGap), under mu.
	lastEnd  time.Time
	lastTook time.Duration
	// walker is the kernel walk, under walking (loadWalker).
	walker *staleWalker
}

// queueStale schedules the walk that marks the flows of released (id ->
// new generation) stale and counts the live flows of d.finals, within
// staleDelay. Under d.mu.
func (d *upkeep) queueStale(released map[uint32]uint32) {
	if len(released) == 0 && len(d.finals) == 0 {
		return
	}
	q := &d.staleQ
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.pending == nil {
		q.pending = make(map[uint32]uint32)
	}
	for id, gen := range released {
		q.pending[id] = gen
	}
	if q.timer == nil {
		delay := staleDelay
		if since, gap := time.Since(q.lastEnd), max(staleGap, q.lastTook); since < gap {
			delay = max(delay, gap-since)
		}
		q.timer = time.AfterFunc(delay, func() {
			if err := d.flushStale(); err != nil && !errors.Is(err, ErrClosed) {
				d.log.Error("marking the flows of released backends stale failed; the sweep marks them", "err", err)
			}
		})
	}
}

// flushStale runs now the one walk of conntrack that the changes since
// the last one left to do, and waits for a walk already under way (the
// timer's): it marks the flows of the queued ids stale, and counts the
// live flows of the members released since (finals) into their
// frontends' released totals. It walks copies of the conntrack tables'
// handles without holding the Datapath's lock, so changes and scrapes go
// on meanwhile; only the totals are added under it. A change never waits
// for a walk (issue 38): the writer queues, this walks, in the kernel
// where it can (markReleased). (Not at a lower
// CPU priority: a thread of nice 19 that runs Go code holds one of the
// runtime's Ps, and a garbage collection's stop-the-world then waits for
// it; measured, a change's worst case went from 37 ms to 441 ms.)
func (d *upkeep) flushStale() error {
	q := &d.staleQ
	q.walking.Lock()
	defer q.walking.Unlock()
	q.mu.Lock()
	released := q.pending
	q.pending = nil
	if q.timer != nil {
		q.timer.Stop()
		q.timer = nil
	}
	q.mu.Unlock()
	d.mu.Lock()
	if d.closed() {
		d.mu.Unlock()
		if len(released) == 0 {
			return nil
		}
		return ErrClosed
	}
	finals := d.finals
	d.finals = nil
	if len(released) == 0 && len(finals) == 0 {
		d.mu.Unlock()
		return nil
	}
	tables, err := d.cloneCtTables()
	d.mu.Unlock()
	if err != nil {
		return fmt.Errorf("mark stale flows: %w", err)
	}
	defer tables.close()
	start := time.Now()
	want := make(map[idGen]bool, len(finals))
	for _, fc := range finals {
		want[fc.ig] = true
	}
	n, flows, err := d.markReleased(tables, released, want)
	q.mu.Lock()
	q.lastEnd = time.Now()
	q.lastTook = q.lastEnd.Sub(start)
	q.mu.Unlock()
	d.log.Log(context.Background(), levelTrace, "marked flows of released backend ids stale", "ids", len(released), "flows", n, "finals", len(finals))
	if err != nil {
		// The finals stay at what Counters last reported for them.
		return err
	}
	d.settleFinal(finals, flows)
	return nil
}

// markStale marks stale (CT_F_STALE, expired) every forward entry of
// both families whose id and generation stale names, and returns how
// many it marked. It gives every forward entry's counts to seen (nil:
// none), as read before any mark.
func (fs ctFamilies) markStale(stale func(idGen) bool, seen func(idGen, Traffic)) (int, error) {
	n := 0
	for _, m := range fs.v4 {
		got, err := markStaleIn[tcCtKey](m, func(v *tcCtValue) *tcCtValue { return v }, stale, seen)
		n += got
		if err != nil {
			return n, err
		}
	}
	for _, m := range fs.v6 {
		got, err := markStaleIn[tcCt6Key](m, func(v *tcCt6Value) *tcCtValue { return &v.Ct }, stale, seen)
		n += got
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// markStaleIn is markStale for one table m of keys K and values V, whose
// family-neutral part ct returns. Each entry is read again just before it
// is rewritten, and left alone when it changed (moved, closed, or a new
// flow under the same tuple); the datapath writes fields in place, so an
// increment racing the rewrite is lost.
func markStaleIn[K, V any](m *ebpf.Map, ct func(*V) *tcCtValue, stale func(idGen) bool, seen func(idGen, Traffic)) (int, error) {
	flag := uint8(tcCtFlagCT_F_STALE)
	n := 0
	err := walkTable(m, func(k K, v V) error {
		was := ct(&v)
		ig, tr, fwd := entryTraffic(*was)
		if fwd && seen != nil {
			seen(ig, tr)
		}
		if !fwd || was.Flags&flag != 0 || !stale(ig) {
			return nil
		}
		var cur V
		if err := m.Lookup(&k, &cur); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				return nil
			}
			return fmt.Errorf("mark stale flows: %w", err)
		}
		now := ct(&cur)
		if now.BackendId != was.BackendId || now.BackendGen != was.BackendGen || now.Flags&flag != 0 {
			return nil
		}
		now.Flags |= flag
		now.Expires = 0
		if err := m.Update(&k, &cur, ebpf.UpdateExist); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("mark stale flows: %w", err)
		}
		n++
		return nil
	})
	return n, err
}

// markOutdated is the sweep's backstop to markStale: it marks stale the
// flows whose generation is no longer their id's in tlb_backend_stats
// (records), whichever change released it. A flow created from a slot
// read just before a release, whose entry appeared after that change's
// walk had passed, is caught here. A valid flow's generation is always
// its id's: an id's generation changes only when it is released.
func markOutdated(tables ctFamilies, records *ebpf.Map) (int, error) {
	gens := make(map[uint32]record)
	return tables.markStale(func(ig idGen) bool {
		rec, ok := gens[ig.id]
		if !ok {
			var per []tcBackendStats
			if err := records.Lookup(ig.id, &per); err != nil {
				return false
			}
			rec = sumRecord(per)
			gens[ig.id] = rec
		}
		return !rec.mixed && rec.gen != ig.gen
	}, nil)
}

// sweptCounts keeps the counts of forward entries the sweep deleted, by
// id and generation, until Counters folds them into the member that
// owns them (or drops them when none does).
func (d *upkeep) addSwept(v tcCtValue) {
	ig, tr, ok := entryTraffic(v)
	if !ok {
		return
	}
	d.sweptMu.Lock()
	defer d.sweptMu.Unlock()
	if d.swept == nil {
		d.swept = make(map[idGen]Traffic)
	}
	d.swept[ig] = d.swept[ig].plus(tr)
}

// takeSwept returns the swept counts and forgets them.
func (d *upkeep) takeSwept() map[idGen]Traffic {
	d.sweptMu.Lock()
	defer d.sweptMu.Unlock()
	out := d.swept
	d.swept = nil
	return out
}

// finalCount is a released member's traffic waiting for its live flows'
// counts: what it carried, read as its id was released (under d.mu), and
// the frontend whose released total receives it.
type finalCount struct {
	s   *service
	ig  idGen
	m   member // as released: its base, swept and seen counts
	rec record
	ok  bool // rec was read
}

// beginFinal reads what member m carried as its id is released, but its
// live flows' counts: its record (before the release bumps its
// generation) and what sweeps deleted. Under d.mu.
func (d *upkeep) beginFinal(s *service, m *member) finalCount {
	rec, err := d.readRecord(m.id)
	fc := finalCount{s: s, ig: idGen{m.id, m.gen}, rec: rec, ok: err == nil}
	if sw := d.takeSweptOf(fc.ig); sw != (Traffic{}) {
		m.swept = m.swept.plus(sw)
	}
	fc.m = *m
	return fc
}

// queueFinal adds a released member's traffic to its frontend's released
// total: at once what Counters reported for it (m.seen), so the total
// never goes down, and the rest when flushStale's walk has counted its
// live flows. Under d.mu; the release that made it queued its id for
// that walk (txn.finish).
func (d *upkeep) queueFinal(fc finalCount) {
	fc.s.released = fc.s.released.plus(fc.m.seen)
	if fc.ok {
		d.finals = append(d.finals, fc)
	}
}

// settleFinal adds the live flows of finals, counted by flushStale's
// walk (flows, by id and generation), to their frontends' released
// totals, under d.mu.
func (d *upkeep) settleFinal(finals []finalCount, flows map[idGen]Traffic) {
	if len(finals) == 0 {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, fc := range finals {
		final := fc.m.traffic(fc.rec, flows).atLeast(fc.m.seen)
		fc.s.released = fc.s.released.plus(final.minus(fc.m.seen))
	}
}

// takeSweptOf returns the swept counts of one id and generation and
// forgets them.
func (d *upkeep) takeSweptOf(ig idGen) Traffic {
	d.sweptMu.Lock()
	defer d.sweptMu.Unlock()
	tr := d.swept[ig]
	delete(d.swept, ig)
	return tr
}

// stop drops the queued ids and their walk: the Datapath is closing (the
// next agent's adoption and sweep mark what is left).
func (q *staleQueue) stop() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.timer != nil {
		q.timer.Stop()
		q.timer = nil
	}
	q.pending = nil
}
