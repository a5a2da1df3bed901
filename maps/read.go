package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
)

// Frontends returns the programmed frontends and their backends from the
// userspace mirror, without touching the kernel: active backends in order
// of their first slot (Weight = slots held), then draining ones by
// address (Weight 0).
func (d *readout) Frontends() map[Frontend][]Backend {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[Frontend][]Backend, len(d.fes))
	for fe, s := range d.fes {
		out[fe] = s.backends()
	}
	return out
}

// Services returns what each frontend serves according to the mirror;
// Backends as in Frontends.
func (d *readout) Services() map[Frontend]Service {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[Frontend]Service, len(d.fes))
	for fe, s := range d.fes {
		out[fe] = Service{Backends: s.backends(), Affinity: time.Duration(s.set.affinity) * time.Second, Reject: s.set.reject, Name: s.name}
	}
	return out
}

// Capacity reports how many frontends and backend slots are programmed,
// and the limits Load was given. Slots are what bounds the backends of
// equal-weight frontends; see Usage for ids.
func (d *readout) Capacity() (frontends, frontendsMax, backends, backendsMax int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.fes), int(d.opts.MaxFrontends), d.slots, int(d.opts.MaxBackends)
}

// Usage is the occupancy of the datapath's bounded resources.
type Usage struct {
	Frontends, MaxFrontends int
	// Slots are the entries of every frontend's active table (one per
	// active backend with equal weights); at most MaxBackends.
	Slots int
	// BackendIDs are held by active and draining backends and by ids
	// waiting to be retired; at most MaxBackends.
	BackendIDs  int
	MaxBackends int
	// Pending counts cleanups queued after failed writes (ids to retire,
	// registry entries and frontends to rewrite), retried on every change.
	Pending int
	// SNATPorts is the size of the SNAT port range (Options.SNATPorts):
	// the source ports each backend address:port can be given.
	SNATPorts int
}

// Usage reports the datapath's occupancy.
func (d *readout) Usage() Usage {
	d.mu.Lock()
	defer d.mu.Unlock()
	return Usage{
		Frontends: len(d.fes), MaxFrontends: int(d.opts.MaxFrontends),
		Slots:       d.slots,
		BackendIDs:  int(d.opts.MaxBackends) - d.beIDs.available(),
		MaxBackends: int(d.opts.MaxBackends),
		Pending:     d.pending(),
		SNATPorts:   d.opts.SNATPorts.Size(),
	}
}

// Dump reads the frontends and their backends back from the kernel maps,
// in the order Frontends uses: what the datapath actually does.
func (d *readout) Dump() (map[Frontend][]Backend, error) {
	prog, err := d.Programmed()
	if err != nil {
		return nil, err
	}
	out := make(map[Frontend][]Backend, len(prog))
	for fe, ps := range prog {
		bs := make([]Backend, len(ps.Backends))
		for i, b := range ps.Backends {
			bs[i] = b.Backend
		}
		out[fe] = bs
	}
	return out, nil
}

type svcEntry struct {
	key   tcSvcKey
	value tcSvcValue
}

func (d *readout) readServices() ([]svcEntry, error) {
	return d.kernelMaps().readServices()
}

func (km kernelMaps) readServices() ([]svcEntry, error) {
	var (
		out []svcEntry
		e   svcEntry
	)
	it := km.services.Iterate()
	for it.Next(&e.key, &e.value) {
		out = append(out, e)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read services: %w", err)
	}
	return out, nil
}

// record is one backend id's tlb_backend_stats entry, summed over CPUs.
type record struct {
	gen     uint32 // CPU 0's; mixed reports whether the CPUs disagree
	mixed   bool
	traffic Traffic
}

func sumRecord(per []tcBackendStats) record {
	var r record
	for i, v := range per {
		if i == 0 {
			r.gen = v.Gen
		} else if v.Gen != r.gen {
			r.mixed = true
		}
		r.traffic = r.traffic.plus(Traffic{Flows: v.Flows, Packets: v.Packets, Bytes: v.Bytes})
	}
	return r
}

// readRecord reads one id's generation and counters (its record only;
// member.traffic adds its flows').
func (d *readout) readRecord(id uint32) (record, error) {
	var per []tcBackendStats
	if err := d.backendStats.Lookup(id, &per); err != nil {
		return record{}, fmt.Errorf("read backend record %d: %w", id, err)
	}
	return sumRecord(per), nil
}

// recordBatch is the number of ids read per batch lookup.
const recordBatch = 1024

// readRecords reads the records of ids [0, upto] with batch lookups.
func (d *readout) readRecords(upto uint32) ([]record, error) {
	return d.kernelMaps().readRecords(upto)
}

func (km kernelMaps) readRecords(upto uint32) ([]record, error) {
	out := make([]record, 0, upto+1)
	keys := make([]uint32, recordBatch)
	vals := make([]tcBackendStats, recordBatch*km.ncpu)
	var cursor ebpf.MapBatchCursor
	for uint32(len(out)) <= upto {
		n, err := km.backendStats.BatchLookup(&cursor, keys, vals, nil)
		if errors.Is(err, ebpf.ErrNotSupported) && len(out) == 0 {
			// Linux 5.10 has no batch operations on per-CPU arrays.
			return km.lookupRecords(upto)
		}
		for i := 0; i < n && uint32(len(out)) <= upto; i++ {
			if keys[i] != uint32(len(out)) {
				return nil, fmt.Errorf("read backend records: batch returned id %d, expected %d", keys[i], len(out))
			}
			out = append(out, sumRecord(vals[i*km.ncpu:(i+1)*km.ncpu]))
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read backend records: %w", err)
		}
	}
	return out, nil
}

// lookupRecords is readRecords one lookup per id, for kernels without
// batch lookups on per-CPU arrays.
func (km kernelMaps) lookupRecords(upto uint32) ([]record, error) {
	out := make([]record, 0, upto+1)
	per := make([]tcBackendStats, km.ncpu)
	for id := uint32(0); id <= upto; id++ {
		if err := km.backendStats.Lookup(id, per); err != nil {
			return nil, fmt.Errorf("read backend record %d: %w", id, err)
		}
		out = append(out, sumRecord(per))
	}
	return out, nil
}

// maxMemberID is the largest id a member holds, and whether any does.
func (d *readout) maxMemberID() (uint32, bool) {
	var (
		maxID uint32
		any   bool
	)
	for _, s := range d.fes {
		for _, m := range s.members {
			maxID, any = max(maxID, m.id), true
		}
	}
	return maxID, any
}

// Counters reads the datapath counters, summed over CPUs. A scrape must
// not hold up map writes (issue 38: a change waits for whatever holds the
// Datapath's lock), so the lock is held only for short steps:
//
//  1. under it: the statistics, the sweep's counts (taken, not yet
//     applied), the frontends' keys, and copies of the handles of the
//     records and conntrack tables;
//  2. without it: the records (a batch read of every id) and the walk of
//     conntrack for the live flows' counts (about 0.1 s per
//     quarter-million entries);
//  3. under it again, countersChunk frontends at a time: each member's
//     traffic, which it never reports less than (m.seen);
//  4. without it: the maps returned.
//
// What the walk must come after is taken before it: the records and the
// sweep's counts. A flow folded into either while the walk runs is then
// counted by the next call, never twice (a member never reports less
// than it did, so the undercount does not show). A frontend deleted
// between 1 and 3 is left out; one created since is reported by the next
// call.
func (d *readout) Counters() (Counters, error) {
	c, in, err := d.countersBeforeWalk()
	if err != nil {
		return Counters{}, err
	}
	defer in.close()
	var (
		recs  []record
		flows map[idGen]Traffic
	)
	if in.anyMember {
		if recs, err = in.km.readRecords(in.maxID); err != nil {
			return Counters{}, err
		}
		if flows, err = in.tables.traffic(nil); err != nil {
			return Counters{}, err
		}
	}
	type result struct {
		fe    Frontend
		total Traffic
		// members are the frontend's rows of perMember.
		members []memberTraffic
	}
	results := make([]result, 0, len(in.fes))
	for start := 0; start < len(in.fes); start += countersChunk {
		d.mu.Lock()
		if d.closed() {
			d.mu.Unlock()
			return Counters{}, ErrClosed
		}
		for _, fe := range in.fes[start:min(start+countersChunk, len(in.fes))] {
			s := d.fes[fe]
			if s == nil {
				continue
			}
			r := result{fe: fe, total: s.released, members: make([]memberTraffic, 0, len(s.members))}
			for _, m := range s.members {
				m.swept = m.swept.plus(in.swept[idGen{m.id, m.gen}])
				var tr Traffic
				// A member assigned since the records were read has none
				// here, and reports what it did (nothing) until the next call.
				if int(m.id) < len(recs) {
					tr = m.traffic(recs[m.id], flows)
				}
				tr = tr.atLeast(m.seen)
				m.seen = tr
				r.total = r.total.plus(tr)
				r.members = append(r.members, memberTraffic{m.be.Addr, tr})
			}
			results = append(results, r)
		}
		d.mu.Unlock()
	}
	for _, r := range results {
		per := make(map[netip.AddrPort]uint64, len(r.members))
		perT := make(map[netip.AddrPort]Traffic, len(r.members))
		for _, mt := range r.members {
			per[mt.addr] = mt.tr.Packets
			perT[mt.addr] = mt.tr
		}
		c.Frontends[r.fe] = r.total
		c.Backends[r.fe] = per
		c.BackendTraffic[r.fe] = perT
	}
	return c, nil
}

// countersChunk is how many frontends Counters reckons per hold of the
// Datapath's lock: about a millisecond's work, so that a change waits at
// most that long for a scrape.
const countersChunk = 500

// memberTraffic is one backend's traffic in a Counters call.
type memberTraffic struct {
	addr netip.AddrPort
	tr   Traffic
}

// countersInput is what Counters reads under the lock before its walk.
type countersInput struct {
	// fes are the frontends programmed then.
	fes []Frontend
	// swept are the sweep's counts by id and generation, taken from the
	// Datapath, for the members that own them.
	swept map[idGen]Traffic
	// maxID is the largest id a member held; anyMember whether any did
	// (else km and tables are unset).
	maxID     uint32
	anyMember bool
	// km holds a copy of the records' handle, tables copies of the
	// conntrack tables' handles, for reads without the lock.
	km     kernelMaps
	tables ctFamilies
}

// close closes the copied handles.
func (in countersInput) close() {
	if in.km.backendStats != nil {
		in.km.backendStats.Close()
	}
	in.tables.close()
}

// countersBeforeWalk is Counters' first step, under d.mu: the statistics,
// the sweep's counts, the frontends, and copies of the records' and
// conntrack tables' handles (which the caller closes) when any frontend
// has a member.
func (d *readout) countersBeforeWalk() (Counters, countersInput, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var in countersInput
	if d.closed() {
		return Counters{}, in, ErrClosed
	}
	c, err := d.namedCountersLocked()
	if err != nil {
		return Counters{}, in, err
	}
	c.Frontends = make(map[Frontend]Traffic, len(d.fes))
	c.Backends = make(map[Frontend]map[netip.AddrPort]uint64, len(d.fes))
	c.BackendTraffic = make(map[Frontend]map[netip.AddrPort]Traffic, len(d.fes))
	in.swept = d.takeSwept()
	in.fes = make([]Frontend, 0, len(d.fes))
	for fe, s := range d.fes {
		in.fes = append(in.fes, fe)
		for _, m := range s.members {
			in.maxID, in.anyMember = max(in.maxID, m.id), true
		}
	}
	if !in.anyMember {
		return c, in, nil
	}
	in.km = kernelMaps{ncpu: d.ncpu}
	if in.km.backendStats, err = d.backendStats.Clone(); err != nil {
		return Counters{}, in, fmt.Errorf("read backend records: %w", err)
	}
	if in.tables, err = d.cloneCtTables(); err != nil {
		in.close()
		return Counters{}, countersInput{}, fmt.Errorf("read conntrack: %w", err)
	}
	return c, in, nil
}

// namedCountersLocked is namedCounters, under d.mu: the Counters
// without traffic figures.
func (d *readout) namedCountersLocked() (Counters, error) {
	stats, err := d.readStats()
	if err != nil {
		return Counters{}, err
	}
	c := Counters{
		Stats: stats,
		Drops: Drops{
			NoBackend:    stats[StatDropNoBackend],
			MapFull:      stats[StatDropMapFull],
			ParseError:   stats[StatDropParseError],
			RewriteError: stats[StatDropRewrite],
		},
		ReverseNAT: stats[StatReverseNAT],
		Fragments:  stats[StatFragment],
	}
	if c.SourceRangeDrops, err = d.sourceRangeDrops(); err != nil {
		return Counters{}, err
	}
	return c, nil
}

// readStats reads every named counter of tlb_stats.
func (d *readout) readStats() (map[Stat]uint64, error) {
	return readAllStats(d.stats)
}

// PinnedStats reads every named counter of the datapath pinned at pinPath,
// summed over CPUs. It opens the pinned map directly and does not take the
// directory's lock, so the agent that owns the datapath keeps running: for
// tests and operators.
func PinnedStats(pinPath string) (map[Stat]uint64, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinPath, tcMapTlbStats), nil)
	if err != nil {
		return nil, fmt.Errorf("open pinned %s: %w", tcMapTlbStats, err)
	}
	defer m.Close()
	return readAllStats(m)
}

// readAllStats reads every named counter of a tlb_stats map.
func readAllStats(stats *ebpf.Map) (map[Stat]uint64, error) {
	out := make(map[Stat]uint64, numStats)
	for r := Stat(0); int(r) < numStats; r++ {
		n, err := readStat(stats, r)
		if err != nil {
			return nil, err
		}
		out[r] = n
	}
	return out, nil
}
