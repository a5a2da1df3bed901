package maps

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// ConntrackKind is a class of conntrack entries: protocol and TCP state.
type ConntrackKind struct {
	Proto Protocol
	// State is "syn_sent", "established" or "closing" for TCP, "" for UDP.
	State string
}

func (k ConntrackKind) String() string {
	if k.State == "" {
		return k.Proto.String()
	}
	return k.Proto.String() + "_" + k.State
}

// conntrackKind classifies an entry.
func conntrackKind(key tcCtKey, v tcCtValue) ConntrackKind {
	k := ConntrackKind{Proto: Protocol(key.Proto)}
	switch tcCtState(v.State) {
	case tcCtStateCT_TCP_SYN_SENT:
		k.State = "syn_sent"
	case tcCtStateCT_TCP_ESTABLISHED:
		k.State = "established"
	case tcCtStateCT_TCP_CLOSING:
		k.State = "closing"
	case tcCtStateCT_UDP:
	default:
		k.State = fmt.Sprintf("state%d", v.State)
	}
	return k
}

// SweepStats is what one SweepConntrack saw and did.
type SweepStats struct {
	// Live counts the entries left unexpired, by kind (both directions of
	// a flow count, one entry each).
	Live map[ConntrackKind]int
	// Expired is the number of entries this sweep deleted.
	Expired int
	// The datapath's totals since the maps were created (they survive
	// agent restarts): flows created, entries a new flow overwrote, and
	// entries deleted by sweeps.
	Created, Replaced, Swept uint64
	// Evicted is the number of entries the LRU evicted to make room,
	// derived: entries inserted (2·Created − Replaced) minus Swept minus
	// the live and expired-but-kept entries counted now. An eviction of
	// an established flow re-balances it silently (see
	// StatTCPMidflowMiss). Approximate while packets race the sweep.
	Evicted uint64
	// Duration is the sweep's wall time.
	Duration time.Duration
}

// sweepBatch is the number of entries read per batch lookup. Hash maps
// hand out whole buckets, which are far smaller.
const sweepBatch = 4096

// monotonicNow is the datapath's clock: CLOCK_MONOTONIC_COARSE in ns,
// what bpf_ktime_get_coarse_ns returns.
func monotonicNow() (uint64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts); err != nil {
		return 0, fmt.Errorf("read CLOCK_MONOTONIC_COARSE: %w", err)
	}
	return uint64(ts.Nano()), nil
}

// SweepConntrack deletes expired conntrack entries (each direction is
// deleted when it has expired; both expire together) and reports the
// table's state. It reads the table in batches and deletes in batches
// without holding the Datapath's lock, so updates and packets go on while
// it runs; an entry a packet revived since it was read is kept (each
// candidate is looked up again just before the delete). ctx cancels
// between batches.
func (d *Datapath) SweepConntrack(ctx context.Context) (SweepStats, error) {
	start := time.Now()
	d.sweepMu.Lock()
	defer d.sweepMu.Unlock()
	d.mu.Lock()
	if d.closed() {
		d.mu.Unlock()
		return SweepStats{}, ErrClosed
	}
	ct, err := d.conntrack.Clone()
	if err != nil {
		d.mu.Unlock()
		return SweepStats{}, fmt.Errorf("sweep conntrack: %w", err)
	}
	defer ct.Close()
	stats, err := d.stats.Clone()
	d.mu.Unlock()
	if err != nil {
		return SweepStats{}, fmt.Errorf("sweep conntrack: %w", err)
	}
	defer stats.Close()

	now, err := monotonicNow()
	if err != nil {
		return SweepStats{}, err
	}
	st := SweepStats{Live: make(map[ConntrackKind]int)}
	expired, kept, err := scanConntrack(ctx, ct, now, st.Live)
	if err != nil {
		return st, err
	}
	deleted, err := deleteExpired(ctx, ct, expired, now)
	st.Expired = deleted
	kept += len(expired) - deleted
	if deleted > 0 {
		if aerr := addStat(stats, StatConntrackSwept, uint64(deleted)); aerr != nil {
			err = errors.Join(err, aerr)
		}
	}
	if err != nil {
		return st, err
	}
	totals := make(map[Stat]uint64, 3)
	for _, s := range []Stat{StatConntrackCreated, StatConntrackReplaced, StatConntrackSwept} {
		if totals[s], err = readStat(stats, s); err != nil {
			return st, err
		}
	}
	st.Created, st.Replaced, st.Swept = totals[StatConntrackCreated], totals[StatConntrackReplaced], totals[StatConntrackSwept]
	inserted := 2*st.Created - min(st.Replaced, 2*st.Created)
	if accounted := st.Swept + uint64(kept); inserted > accounted {
		st.Evicted = inserted - accounted
	}
	st.Duration = time.Since(start)
	return st, nil
}

// scanConntrack reads every entry: expired ones are returned, live ones
// counted by kind into live; kept is the number of live entries.
func scanConntrack(ctx context.Context, ct *ebpf.Map, now uint64, live map[ConntrackKind]int) (expired []tcCtKey, kept int, err error) {
	keys := make([]tcCtKey, sweepBatch)
	vals := make([]tcCtValue, sweepBatch)
	var cursor ebpf.MapBatchCursor
	for {
		if err := ctx.Err(); err != nil {
			return nil, 0, err
		}
		n, err := ct.BatchLookup(&cursor, keys, vals, nil)
		for i := 0; i < n; i++ {
			if now > vals[i].Expires {
				expired = append(expired, keys[i])
				continue
			}
			live[conntrackKind(keys[i], vals[i])]++
			kept++
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return expired, kept, nil
		}
		if err != nil {
			return nil, 0, fmt.Errorf("read conntrack: %w", err)
		}
	}
}

// deleteExpired deletes the candidates that are still expired, in
// batches, and returns how many it deleted.
func deleteExpired(ctx context.Context, ct *ebpf.Map, candidates []tcCtKey, now uint64) (int, error) {
	deleted := 0
	batch := make([]tcCtKey, 0, sweepBatch)
	for len(candidates) > 0 {
		if err := ctx.Err(); err != nil {
			return deleted, err
		}
		batch = batch[:0]
		for len(candidates) > 0 && len(batch) < sweepBatch {
			k := candidates[0]
			candidates = candidates[1:]
			var v tcCtValue
			if err := ct.Lookup(&k, &v); err != nil {
				if errors.Is(err, ebpf.ErrKeyNotExist) {
					continue // evicted or replaced meanwhile
				}
				return deleted, fmt.Errorf("re-read conntrack entry: %w", err)
			}
			if now > v.Expires {
				batch = append(batch, k)
			}
		}
		for len(batch) > 0 {
			n, err := ct.BatchDelete(batch, nil)
			deleted += n
			switch {
			case err == nil:
				batch = nil
			case errors.Is(err, ebpf.ErrKeyNotExist):
				batch = batch[n+1:] // that one vanished meanwhile
			default:
				return deleted, fmt.Errorf("delete expired conntrack entries: %w", err)
			}
		}
	}
	return deleted, nil
}

// readStat sums one counter of tlb_stats over CPUs.
func readStat(stats *ebpf.Map, s Stat) (uint64, error) {
	var per []uint64
	if err := stats.Lookup(uint32(s), &per); err != nil {
		return 0, fmt.Errorf("read stat %s: %w", s, err)
	}
	var n uint64
	for _, v := range per {
		n += v
	}
	return n, nil
}

// addStat adds n to a counter only user space writes (CPU 0's slot).
func addStat(stats *ebpf.Map, s Stat, n uint64) error {
	var per []uint64
	if err := stats.Lookup(uint32(s), &per); err != nil {
		return fmt.Errorf("read stat %s: %w", s, err)
	}
	per[0] += n
	if err := stats.Update(uint32(s), per, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write stat %s: %w", s, err)
	}
	return nil
}
