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

// sweepBatch is the number of entries read per batch lookup (hash maps
// hand out whole buckets, which are far smaller), and of deletes between
// two looks at the sweep's context.
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
// table's state. It reads the table in batches and deletes entry by entry
// without holding the Datapath's lock, so updates and packets go on while
// it runs; an entry a packet revived since it was read is kept (each
// candidate is taken with an atomic lookup-and-delete and put back when
// it turns out alive: deleteExpired). ctx cancels between batches.
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

// deleteExpired deletes the candidates that are still expired and returns
// how many it deleted. A candidate's tuple may have been reopened since
// the scan (a client reusing its port: the datapath wrote two fresh
// entries under the same keys), and only an atomic lookup-and-delete tells
// which entry a delete took: a re-read followed by a delete lost the fresh
// entries of flows reopened in between (TestSweepSparesReopenedFlows),
// and with them connections (a reply untranslated, the client's reset of
// the backend's connection, then a reset the client sees). An entry taken
// alive is put back at once, unless a packet has already written the key
// again.
func deleteExpired(ctx context.Context, ct *ebpf.Map, candidates []tcCtKey, now uint64) (int, error) {
	deleted := 0
	for i, k := range candidates {
		if i%sweepBatch == 0 {
			if err := ctx.Err(); err != nil {
				return deleted, err
			}
		}
		var v tcCtValue
		if err := ct.LookupAndDelete(&k, &v); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				continue // evicted meanwhile
			}
			return deleted, fmt.Errorf("delete expired conntrack entry: %w", err)
		}
		if now > v.Expires {
			deleted++
			continue
		}
		if err := ct.Update(&k, &v, ebpf.UpdateNoExist); err != nil && !errors.Is(err, ebpf.ErrKeyExist) {
			return deleted, fmt.Errorf("put back a conntrack entry revived during the sweep: %w", err)
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
