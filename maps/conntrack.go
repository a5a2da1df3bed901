package maps

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/cilium/ebpf"
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

// conntrackKind classifies an entry of protocol proto (its key's) by its
// family-neutral part v.
func conntrackKind(proto uint8, v tcCtValue) ConntrackKind {
	k := ConntrackKind{Proto: Protocol(proto)}
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
	// a flow count, one entry each), over all tables of both families.
	Live map[ConntrackKind]int
	// Established and Unreplied are the live entries of IPv4's
	// established table (assured flows, never evicted) and of its
	// unreplied one (flows not established yet and closing ones, LRU);
	// Established6 and Unreplied6 those of IPv6's tables.
	Established, Unreplied, Established6, Unreplied6 int
	// EstablishedCap and UnrepliedCap are the tables' sizes
	// (Options.MaxConntrack, Options.MaxConntrackNew), each family's
	// tables alike.
	EstablishedCap, UnrepliedCap int
	// SNATPorts counts the SNAT ports in use by backend: live reply
	// entries of source-translated flows of both families, keyed by
	// backend address.
	SNATPorts map[netip.AddrPort]int
	// Expired is the number of expired entries this sweep deleted (of
	// both families, as are Outdated and Orphans).
	Expired int
	// Outdated is the number of flows this sweep marked stale because
	// their backend id was released after they were created (the change
	// that released it marked the others: stale.go).
	Outdated int
	// Orphans is the number of unexpired entries this sweep deleted
	// because their flow's other direction was gone (evicted from the
	// unreplied table): without it a reply entry would hold its SNAT port
	// until it expires.
	Orphans int
	// The datapath's totals since the maps were created (they survive
	// agent restarts): flows created, entries a new flow replaced, and
	// entries deleted by sweeps (expired and orphans).
	Created, Replaced, Swept uint64
	// Evicted is the number of entries the LRU of the unreplied table
	// evicted to make room, derived: entries inserted (2·Created −
	// Replaced) minus Swept, minus forward entries the datapath deleted
	// as orphans (StatConntrackOrphan), minus the entries counted now. An
	// established flow is never evicted. Approximate while packets race
	// the sweep.
	Evicted uint64
	// Duration is the sweep's wall time.
	Duration time.Duration
}

// sweepBatch is the number of entries read per batch lookup (hash maps
// hand out whole buckets, which are far smaller), and of deletes between
// two looks at the sweep's context.
const sweepBatch = 4096

// monotonicNow reads the datapath's clock of this kernel in ns (a loaded
// Datapath reads its own, compat.now, which a forced fallback may change):
// CLOCK_MONOTONIC_COARSE, what bpf_ktime_get_coarse_ns returns, or
// CLOCK_MONOTONIC on a kernel without that helper (bpf/compat.h,
// compat_now).
func monotonicNow() (uint64, error) {
	clock, err := datapathClock()
	if err != nil {
		return 0, err
	}
	return compat{clock: clock}.now()
}

// ctPeerKey is the key of the other direction's entry of the flow whose
// entry v is stored under k. The mirror of ct4_peer_key in bpf/conntrack.h: change
// both together.
func ctPeerKey(k tcCtKey, v tcCtValue) tcCtKey {
	snat := v.Flags&uint8(tcCtFlagCT_F_SNAT) != 0
	p := tcCtKey{Proto: k.Proto}
	if tcCtDir(v.Dir) == tcCtDirCT_FORWARD {
		p.Saddr, p.Sport, p.Daddr, p.Dport = v.Addr, v.Port, k.Saddr, k.Sport
		if snat {
			p.Daddr, p.Dport = v.NatAddr, v.NatPort
		}
		return p
	}
	p.Saddr, p.Sport, p.Daddr, p.Dport = k.Daddr, k.Dport, v.Addr, v.Port
	if snat {
		p.Saddr, p.Sport = v.NatAddr, v.NatPort
	}
	return p
}

// ct6PeerKey is ctPeerKey for IPv6 (ct6_peer_key in bpf/conntrack6.h:
// change them together).
func ct6PeerKey(k tcCt6Key, v tcCt6Value) tcCt6Key {
	snat := v.Ct.Flags&uint8(tcCtFlagCT_F_SNAT) != 0
	p := tcCt6Key{Proto: k.Proto}
	if tcCtDir(v.Ct.Dir) == tcCtDirCT_FORWARD {
		p.Saddr, p.Sport, p.Daddr, p.Dport = v.Addr, v.Ct.Port, k.Saddr, k.Sport
		if snat {
			p.Daddr, p.Dport = v.NatAddr, v.Ct.NatPort
		}
		return p
	}
	p.Saddr, p.Sport, p.Daddr, p.Dport = k.Daddr, k.Dport, v.Addr, v.Ct.Port
	if snat {
		p.Saddr, p.Sport = v.NatAddr, v.Ct.NatPort
	}
	return p
}

// ctTables are the conntrack tables, the established one first, in the
// order the datapath looks them up.
type ctTables [2]*ebpf.Map

// ctTables returns the Datapath's conntrack tables.
func (d *upkeep) ctTables() ctTables { return ctTables{d.conntrack, d.ctNew} }

// ct6Tables returns the Datapath's IPv6 conntrack tables (keys tcCt6Key,
// values tcCt6Value).
func (d *upkeep) ct6Tables() ctTables { return ctTables{d.ct6, d.ct6New} }

// ctFamily is what the sweep needs to know of one address family's
// conntrack entries, keys K and values V (tcCtKey and tcCtValue, or
// IPv6's tcCt6Key and tcCt6Value): one code path sweeps both.
type ctFamily[K comparable, V any] struct {
	// ct is an entry's family-neutral part (ct6_value embeds ct_value).
	ct func(V) tcCtValue
	// peerKey is the key of the other direction's entry (ctPeerKey,
	// ct6PeerKey).
	peerKey func(K, V) K
	// proto is a key's protocol, src its source (for a reply entry, the
	// backend), dst its destination.
	proto    func(K) uint8
	src, dst func(K) netip.AddrPort
	// peers are an entry's other address (forward: the backend; reply:
	// the frontend) and its NAT address (forward: the node's; reply: the
	// client), each with its port.
	peers func(V) (addr, nat netip.AddrPort)
}

// ct4Entries and ct6Entries are the two families' ctFamily.
var (
	ct4Entries = ctFamily[tcCtKey, tcCtValue]{
		ct:      func(v tcCtValue) tcCtValue { return v },
		peerKey: ctPeerKey,
		proto:   func(k tcCtKey) uint8 { return k.Proto },
		src:     func(k tcCtKey) netip.AddrPort { return addrPortFromWire(k.Saddr, k.Sport) },
		dst:     func(k tcCtKey) netip.AddrPort { return addrPortFromWire(k.Daddr, k.Dport) },
		peers: func(v tcCtValue) (netip.AddrPort, netip.AddrPort) {
			return addrPortFromWire(v.Addr, v.Port), addrPortFromWire(v.NatAddr, v.NatPort)
		},
	}
	ct6Entries = ctFamily[tcCt6Key, tcCt6Value]{
		ct:      func(v tcCt6Value) tcCtValue { return v.Ct },
		peerKey: ct6PeerKey,
		proto:   func(k tcCt6Key) uint8 { return k.Proto },
		src:     func(k tcCt6Key) netip.AddrPort { return addrPortOf(k.Saddr, k.Sport) },
		dst:     func(k tcCt6Key) netip.AddrPort { return addrPortOf(k.Daddr, k.Dport) },
		peers: func(v tcCt6Value) (netip.AddrPort, netip.AddrPort) {
			return addrPortOf(v.Addr, v.Ct.Port), addrPortOf(v.NatAddr, v.Ct.NatPort)
		},
	}
)

// lookup reads k's entry from the first of ts that holds it.
func (f ctFamily[K, V]) lookup(ts ctTables, k K) (V, error) {
	var v V
	for _, m := range ts {
		err := m.Lookup(&k, &v)
		if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return v, err
		}
	}
	return v, ebpf.ErrKeyNotExist
}

// snatReply says whether v is the reply entry of a source-translated
// flow: it holds a SNAT port, by its key's source (the backend).
func snatReply(v tcCtValue) bool {
	return tcCtDir(v.Dir) == tcCtDirCT_REVERSE && v.Flags&uint8(tcCtFlagCT_F_SNAT) != 0
}

// SweepConntrack deletes expired conntrack entries (each direction is
// deleted when it has expired and its flow's other direction has too, or
// is gone: peerLive) and orphans (an
// entry whose other direction is in neither table), and reports the
// tables' state. It reads the tables in batches and deletes entry by entry
// without holding the Datapath's lock, so updates and packets go on while
// it runs; an entry a packet revived or re-paired since it was read is
// kept (each candidate is taken with an atomic lookup-and-delete and put
// back when it turns out alive, or read, checked and deleted on kernels
// before 5.14: deleteCandidates). ctx cancels between
// batches.
func (d *upkeep) SweepConntrack(ctx context.Context) (SweepStats, error) {
	start := time.Now()
	st := SweepStats{Live: make(map[ConntrackKind]int), SNATPorts: make(map[netip.AddrPort]int),
		EstablishedCap: int(d.opts.MaxConntrack), UnrepliedCap: int(d.opts.MaxConntrackNew)}
	d.sweepMu.Lock()
	defer d.sweepMu.Unlock()
	d.mu.Lock()
	if d.closed() {
		d.mu.Unlock()
		return SweepStats{}, ErrClosed
	}
	var tables, tables6 ctTables
	var stats, records *ebpf.Map
	var err error
	defer func() {
		for _, m := range append(append(tables[:], tables6[:]...), stats, records) {
			if m != nil {
				m.Close()
			}
		}
	}()
	for i, m := range []*ebpf.Map{d.conntrack, d.ctNew, d.ct6, d.ct6New} {
		to := &tables[i%2]
		if i >= 2 {
			to = &tables6[i%2]
		}
		if *to, err = m.Clone(); err != nil {
			d.mu.Unlock()
			return SweepStats{}, fmt.Errorf("sweep conntrack: %w", err)
		}
	}
	stats, err = d.stats.Clone()
	if err == nil {
		records, err = d.backendStats.Clone()
	}
	d.mu.Unlock()
	if err != nil {
		return SweepStats{}, fmt.Errorf("sweep conntrack: %w", err)
	}
	if st.Outdated, err = markOutdated(ctFamilies{tables, tables6}, records); err != nil {
		return SweepStats{}, fmt.Errorf("sweep conntrack: %w", err)
	}

	now, err := d.compat.now()
	if err != nil {
		return st, err
	}
	live4, kept4, err := sweepFamily(ctx, d.Datapath, ct4Entries, tables, now, &st)
	st.Established, st.Unreplied = live4[0], live4[1]
	if err == nil {
		var live6 [2]int
		var kept6 int
		live6, kept6, err = sweepFamily(ctx, d.Datapath, ct6Entries, tables6, now, &st)
		st.Established6, st.Unreplied6 = live6[0], live6[1]
		kept4 += kept6
	}
	if err != nil {
		return st, errors.Join(err, addStat(stats, StatConntrackSwept, uint64(st.Expired+st.Orphans)))
	}
	kept := kept4
	if n := st.Expired + st.Orphans; n > 0 {
		if err := addStat(stats, StatConntrackSwept, uint64(n)); err != nil {
			return st, err
		}
	}
	totals := make(map[Stat]uint64, 4)
	for _, s := range []Stat{StatConntrackCreated, StatConntrackReplaced, StatConntrackSwept, StatConntrackOrphan} {
		if totals[s], err = readStat(stats, s); err != nil {
			return st, err
		}
	}
	st.Created, st.Replaced, st.Swept = totals[StatConntrackCreated], totals[StatConntrackReplaced], totals[StatConntrackSwept]
	inserted := 2*st.Created - min(st.Replaced, 2*st.Created)
	if accounted := st.Swept + totals[StatConntrackOrphan] + uint64(kept); inserted > accounted {
		st.Evicted = inserted - accounted
	}
	st.Duration = time.Since(start)
	return st, nil
}

// sweepFamily sweeps one family's tables ts (the established one first)
// for SweepConntrack, counting into st what it saw and deleted. It
// returns the live entries left in each table and the entries kept
// (live, and expired ones kept for their live peer or revived).
func sweepFamily[K comparable, V any](ctx context.Context, d *Datapath, f ctFamily[K, V], ts ctTables, now uint64, st *SweepStats) (live [2]int, kept int, err error) {
	var scans [2]ctScan[K, V]
	for i, m := range ts {
		// Only the unreplied table's entries are kept for the orphan
		// check: its size bounds the sweep's memory.
		if scans[i], err = scanConntrack(ctx, f, m, now, st, i == 1); err != nil {
			return live, kept, err
		}
	}
	live = [2]int{scans[0].live, scans[1].live}
	kept = scans[0].live + scans[1].live
	// unlive takes a live entry the sweep deleted from table i out of
	// the counts.
	unlive := func(i int, k K, v tcCtValue) {
		st.Live[conntrackKind(f.proto(k), v)]--
		if snatReply(v) {
			st.SNATPorts[f.src(k)]--
		}
		live[i]--
		kept--
	}
	for i, m := range ts {
		// A stale flow (its backend released) expired by its forward
		// entry alone: its reply entry, still live, goes with it, or it
		// would stay in the established table, which no orphan check
		// reads, until its own expiry.
		peers := make(map[K]tcCtValue)
		deleted, err := deleteCandidates(ctx, d.compat.lookupAndDelete, m, scans[i].expired, func(k K, v V) bool {
			c := f.ct(v)
			if now <= c.Expires || f.peerLive(m, k, v, now) {
				return false
			}
			d.addSwept(c) // its counts, for Counters (stale.go)
			if c.Flags&uint8(tcCtFlagCT_F_STALE) != 0 {
				peers[f.peerKey(k, v)] = c
			}
			return true
		})
		st.Expired += len(deleted)
		kept += len(scans[i].expired) - len(deleted)
		if err == nil && len(peers) > 0 {
			var gone []K
			gone, err = deleteCandidates(ctx, d.compat.lookupAndDelete, m, slices.Collect(maps.Keys(peers)), func(k K, v V) bool {
				fwd, c := peers[k], f.ct(v)
				if tcCtDir(c.Dir) != tcCtDirCT_REVERSE || c.BackendId != fwd.BackendId || c.BackendGen != fwd.BackendGen || now > c.Expires {
					return false
				}
				unlive(i, k, c)
				return true
			})
			st.Expired += len(gone)
		}
		if err != nil {
			return live, kept, err
		}
	}
	// Orphans: a live entry of the unreplied table whose peer is in
	// neither table. Only that table loses entries one at a time (LRU
	// evictions); the established one loses flows whole (an entry is
	// swept only once its peer expired too, and a closing flow moves out
	// whole). A peer
	// missing from the unreplied table's scan is looked up in both
	// tables before the delete: the flow may be mid-promotion.
	orphaned := func(k K, v V) bool {
		_, err := f.lookup(ts, f.peerKey(k, v))
		if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return false
		}
		d.addSwept(f.ct(v))
		return true
	}
	var candidates []K
	kinds := make(map[K]tcCtValue)
	for _, e := range scans[1].entries {
		if !scans[1].has(f.peerKey(e.k, e.v)) {
			candidates = append(candidates, e.k)
			kinds[e.k] = f.ct(e.v)
		}
	}
	orphans, err := deleteCandidates(ctx, d.compat.lookupAndDelete, ts[1], candidates, orphaned)
	st.Orphans += len(orphans)
	for _, k := range orphans {
		unlive(1, k, kinds[k])
	}
	return live, kept, err
}

// peerLive reports whether the other direction of the flow whose entry v
// (stored under k in m) expired is still live in m: the entries of an
// assured flow that is not source-NATed refresh alone, each on its own
// direction's packets, and the flow lives while either does (the mirror
// of ct_refreshes_alone and ct_peer_live in bpf/conntrack.h: change them
// together). A flow marked stale (its backend released) is not kept
// alive by its reply entry: it is swept whole.
//
// lookupPeer reads the peer's entry (of either family: its family-neutral
// part), an error when there is none.
func peerLive(v tcCtValue, now uint64, lookupPeer func(*tcCtValue) error) bool {
	alone := uint8(tcCtFlagCT_F_ASSURED)
	if v.Flags&(alone|uint8(tcCtFlagCT_F_SNAT)) != alone || v.Flags&uint8(tcCtFlagCT_F_STALE) != 0 {
		return false
	}
	var p tcCtValue
	if err := lookupPeer(&p); err != nil {
		return false
	}
	return p.Dir != v.Dir && p.BackendId == v.BackendId && p.BackendGen == v.BackendGen &&
		p.Flags&uint8(tcCtFlagCT_F_STALE) == 0 && now <= p.Expires
}

// peerLive is peerLive for the entry v stored under k in m.
func (f ctFamily[K, V]) peerLive(m *ebpf.Map, k K, v V, now uint64) bool {
	return peerLive(f.ct(v), now, func(p *tcCtValue) error {
		var pv V
		pk := f.peerKey(k, v)
		if err := m.Lookup(&pk, &pv); err != nil {
			return err
		}
		*p = f.ct(pv)
		return nil
	})
}

// ctEntry is one conntrack entry as a scan read it.
type ctEntry[K, V any] struct {
	k K
	v V
}

// ctScan is what scanConntrack read from one table.
type ctScan[K comparable, V any] struct {
	// expired are the keys of expired entries, live the number of live
	// ones. With keep, entries are the live entries and keys every key.
	expired []K
	entries []ctEntry[K, V]
	keys    map[K]struct{}
	live    int
}

func (s ctScan[K, V]) has(k K) bool {
	_, ok := s.keys[k]
	return ok
}

// scanConntrack reads every entry of one table of family f: expired
// ones are returned as such, live ones counted by kind into st.Live and,
// for reply entries of source-translated flows, by backend into
// st.SNATPorts; with keep, the live entries and all keys are returned
// too.
func scanConntrack[K comparable, V any](ctx context.Context, f ctFamily[K, V], ct *ebpf.Map, now uint64, st *SweepStats, keep bool) (ctScan[K, V], error) {
	keys := make([]K, sweepBatch)
	vals := make([]V, sweepBatch)
	scan := ctScan[K, V]{keys: make(map[K]struct{})}
	var cursor ebpf.MapBatchCursor
	for {
		if err := ctx.Err(); err != nil {
			return ctScan[K, V]{}, err
		}
		n, err := ct.BatchLookup(&cursor, keys, vals, nil)
		for i := 0; i < n; i++ {
			k, v := keys[i], vals[i]
			c := f.ct(v)
			if keep {
				scan.keys[k] = struct{}{}
			}
			if now > c.Expires {
				scan.expired = append(scan.expired, k)
				continue
			}
			if keep {
				scan.entries = append(scan.entries, ctEntry[K, V]{k, v})
			}
			st.Live[conntrackKind(f.proto(k), c)]++
			scan.live++
			if snatReply(c) {
				st.SNATPorts[f.src(k)]++
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return scan, nil
		}
		if err != nil {
			return ctScan[K, V]{}, fmt.Errorf("read conntrack: %w", err)
		}
	}
}

// deleteCandidates deletes from ct the candidates for which still holds
// when each is taken, and returns the keys it deleted. A candidate's tuple
// may have been reopened since the scan (a client reusing its port: the
// datapath wrote fresh entries under the same keys), and only an atomic
// lookup-and-delete tells which entry a delete took: a re-read followed
// by a delete lost the fresh entries of flows reopened in between
// (TestSweepSparesReopenedFlows), and with them connections (a reply
// untranslated, the client's reset of the backend's connection, then a
// reset the client sees: the wrk read errors of make bench-e2e). An entry
// taken for which still does not hold is put back at once, unless a
// packet has already written the key again.
//
// Without atomic (a kernel without lookup-and-delete on hash maps, before
// 5.14), each candidate is read, checked and then deleted: a tuple
// reopened in the microseconds between the read and the delete loses its
// fresh entries, as with any re-read. Its next packet then starts the
// flow anew (a forward packet) or passes untranslated (a reply, which the
// client answers with a reset): a client that reuses a port the very
// moment its old flow on it is swept. The remaining cases are safe: an
// entry evicted, moved or replaced before the read is skipped, and one
// that still does not hold when read is left alone.
func deleteCandidates[K, V any](ctx context.Context, atomic bool, ct *ebpf.Map, candidates []K, still func(K, V) bool) ([]K, error) {
	var deleted []K
	for i, k := range candidates {
		if i%sweepBatch == 0 {
			if err := ctx.Err(); err != nil {
				return deleted, err
			}
		}
		var v V
		if !atomic {
			ok, err := readCheckDelete(ct, k, still)
			if err != nil {
				return deleted, err
			}
			if ok {
				deleted = append(deleted, k)
			}
			continue
		}
		if err := ct.LookupAndDelete(&k, &v); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				continue // evicted, moved or replaced meanwhile
			}
			return deleted, fmt.Errorf("delete conntrack entry: %w", err)
		}
		if still(k, v) {
			deleted = append(deleted, k)
			continue
		}
		if err := ct.Update(&k, &v, ebpf.UpdateNoExist); err != nil && !errors.Is(err, ebpf.ErrKeyExist) {
			return deleted, fmt.Errorf("put back a conntrack entry revived during the sweep: %w", err)
		}
	}
	return deleted, nil
}

// readCheckDelete deletes k from ct when still holds for its entry as read,
// and says whether it did (deleteCandidates without atomic).
func readCheckDelete[K, V any](ct *ebpf.Map, k K, still func(K, V) bool) (bool, error) {
	var v V
	if err := ct.Lookup(&k, &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return false, nil // evicted, moved or replaced meanwhile
		}
		return false, fmt.Errorf("read conntrack entry: %w", err)
	}
	if !still(k, v) {
		return false, nil
	}
	if err := ct.Delete(&k); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return false, nil
		}
		return false, fmt.Errorf("delete conntrack entry: %w", err)
	}
	return true, nil
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
