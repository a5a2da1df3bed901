package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/cilium/ebpf"
)

// kernelState is one read of the maps that describe frontends: what the
// datapath does, independent of the mirror.
type kernelState struct {
	services map[tcSvcKey]tcSvcValue
	slots    map[tcBackendKey]tcBackendValue
	registry []tcRegistryValue // index: backend id
	records  []record          // index: backend id, up to the largest id referenced
	ranges   map[tcSrcRangeKey]bool
}

// kernelMaps are the maps that describe frontends, as a Datapath or a
// read-only Pinned view holds them.
type kernelMaps struct {
	services, backends, registry, backendStats, srcRanges *ebpf.Map
	// maxBackends is the registry's size; ncpu the per-CPU values' length.
	maxBackends uint32
	ncpu        int
}

// kernelMaps returns the Datapath's maps that describe frontends.
func (d *readout) kernelMaps() kernelMaps {
	return kernelMaps{services: d.services, backends: d.backends, registry: d.registry, backendStats: d.backendStats,
		srcRanges: d.srcRanges, maxBackends: d.opts.MaxBackends, ncpu: d.ncpu}
}

// snapshot reads services, every slot, the registry and the records of
// every id a slot, a registry entry or the mirror refers to.
func (d *readout) snapshot() (*kernelState, error) {
	mID, ok := d.maxMemberID()
	return d.kernelMaps().snapshot(mID, ok)
}

// snapshot reads services, every slot, the registry and the records of
// every id a slot or a registry entry refers to, and of the ids up to
// minID when withMin.
func (km kernelMaps) snapshot(minID uint32, withMin bool) (*kernelState, error) {
	k := &kernelState{
		services: make(map[tcSvcKey]tcSvcValue),
		slots:    make(map[tcBackendKey]tcBackendValue),
		ranges:   make(map[tcSrcRangeKey]bool),
	}
	var (
		rk tcSrcRangeKey
		rv uint8
	)
	rit := km.srcRanges.Iterate()
	for rit.Next(&rk, &rv) {
		k.ranges[rk] = true
	}
	if err := rit.Err(); err != nil {
		return nil, fmt.Errorf("read src_ranges: %w", err)
	}
	svcs, err := km.readServices()
	if err != nil {
		return nil, err
	}
	for _, e := range svcs {
		k.services[e.key] = e.value
	}
	var (
		bk    tcBackendKey
		bv    tcBackendValue
		maxID uint32
	)
	it := km.backends.Iterate()
	for it.Next(&bk, &bv) {
		k.slots[bk] = bv
		maxID = max(maxID, bv.Id)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read backends: %w", err)
	}
	if k.registry, err = km.readRegistry(); err != nil {
		return nil, err
	}
	for id, r := range k.registry {
		if r != (tcRegistryValue{}) {
			maxID = max(maxID, uint32(id))
		}
	}
	if withMin {
		maxID = max(maxID, minID)
	}
	if maxID >= km.maxBackends {
		maxID = km.maxBackends - 1
	}
	if k.records, err = km.readRecords(maxID); err != nil {
		return nil, err
	}
	return k, nil
}

// readRegistry reads the whole registry array with batch lookups.
func (km kernelMaps) readRegistry() ([]tcRegistryValue, error) {
	const chunk = 4096
	out := make([]tcRegistryValue, 0, km.maxBackends)
	keys := make([]uint32, chunk)
	vals := make([]tcRegistryValue, chunk)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := km.registry.BatchLookup(&cursor, keys, vals, nil)
		for i := 0; i < n; i++ {
			if keys[i] != uint32(len(out)) {
				return nil, fmt.Errorf("read registry: batch returned id %d, expected %d", keys[i], len(out))
			}
			out = append(out, vals[i])
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read registry: %w", err)
		}
	}
}

// recordOf returns id's record, and false when it was not read.
func (k *kernelState) recordOf(id uint32) (record, bool) {
	if int(id) >= len(k.records) {
		return record{}, false
	}
	return k.records[id], true
}

// current reports whether id's registry entry is in force: not free, and
// of the id's current generation.
func (k *kernelState) current(id uint32) bool {
	if int(id) >= len(k.registry) {
		return false
	}
	r := k.registry[id]
	rec, ok := k.recordOf(id)
	return r.State != uint8(tcBackendStateBACKEND_FREE) && ok && !rec.mixed && rec.gen == r.Gen
}

// ProgrammedService is one frontend as the kernel maps hold it.
type ProgrammedService struct {
	ID         uint32
	Generation uint32 // flips so far
	Buffer     uint8
	Slots      uint32 // the table's size (svc_value.count)
	Affinity   time.Duration
	Reject     bool
	// SourceRanges are the prefixes tlb_src_ranges holds for the
	// frontend, sorted, when its entry asks for source ranges; nil when
	// it does not. SourceRangesNode is its SVC_F_SRC_NODE.
	SourceRanges     []netip.Prefix
	SourceRangesNode bool
	// Backends are the active ones in order of their first slot, then the
	// draining ones (current registry entries of this frontend) by
	// address.
	Backends []ProgrammedBackend
	// Problems found while reading the frontend (a slot missing, an id
	// with two addresses, a registry entry that disagrees); empty when it
	// is whole.
	Problems []string
}

// ProgrammedBackend is one backend as the kernel maps hold it.
type ProgrammedBackend struct {
	// Backend's Weight is the number of slots it holds (0 when
	// draining); Draining is true for backends found only in the
	// registry.
	Backend
	ID, Gen uint32
	// State is what its registry entry says ("active", "draining",
	// "free", ...); Current whether that entry is of the id's current
	// generation.
	State   string
	Current bool
	// Traffic is what its id counted since it was assigned: its record and
	// its live flows (zero when the id's record is not of this
	// generation); flows the agent's sweep deleted are left out.
	Traffic Traffic
}

// Programmed reads every frontend back from the kernel: settings,
// backends with their ids and slot counts, draining backends from the
// registry, and the problems that make a frontend inconsistent.
func (d *readout) Programmed() (map[Frontend]ProgrammedService, error) {
	// The kernel's state is read under the lock; the live flows' counts,
	// a walk of conntrack (most of a second for a quarter million flows),
	// from copies of the tables' handles after it, as Counters does, so
	// changes go on meanwhile.
	type read struct {
		k      *kernelState
		tables ctFamilies
		err    error
	}
	r, err := readKernel(d.Datapath, func(k *kernelState) read {
		tables, err := d.cloneCtTables()
		return read{k, tables, err}
	})
	if err == nil {
		err = r.err
	}
	if err != nil {
		return nil, err
	}
	defer r.tables.close()
	if err := r.k.addFlows(r.tables.v4, r.tables.v6); err != nil {
		return nil, err
	}
	return r.k.programmed(), nil
}

// readKernel reads the kernel maps under d's lock and returns what derive
// makes of them (derive may read the mirror too, which the lock guards);
// ErrClosed after Close.
func readKernel[T any](d *Datapath, derive func(*kernelState) T) (T, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var zero T
	if d.closed() {
		return zero, ErrClosed
	}
	k, err := d.snapshot()
	if err != nil {
		return zero, err
	}
	return derive(k), nil
}

// addFlows adds the counts of the live flows in ts to their backend's
// record when of the record's generation: since layout 4 an established
// flow counts its packets in its conntrack entry, and the record holds
// only what flows that are gone counted (ct_fold, bpf/ct.h). Flows the
// agent's sweep deleted are not in either (Counters adds them).
func (k *kernelState) addFlows(ts, ts6 ctTables) error {
	return walkValues(ts, ts6, func(v tcCtValue) {
		if ig, tr, ok := entryTraffic(v); ok && int(ig.id) < len(k.records) && k.records[ig.id].gen == ig.gen {
			k.records[ig.id].traffic = k.records[ig.id].traffic.plus(tr)
		}
	})
}

func (k *kernelState) programmed() map[Frontend]ProgrammedService {
	out := make(map[Frontend]ProgrammedService, len(k.services))
	byID := make(map[uint32]Frontend, len(k.services))
	for key, v := range k.services {
		fe := frontend(key)
		set := settingsFromValue(v)
		ps := ProgrammedService{ID: v.Id, Generation: v.Generation, Buffer: v.Buffer, Slots: v.Count,
			Affinity: time.Duration(set.affinity) * time.Second, Reject: set.reject, SourceRangesNode: set.srcNode}
		if set.srcRanges {
			ps.SourceRanges = k.rangesOf(v.Id)
		}
		if other, dup := byID[v.Id]; dup {
			ps.Problems = append(ps.Problems, fmt.Sprintf("service id %d also used by %s", v.Id, other))
		}
		byID[v.Id] = fe
		index := map[uint32]int{} // id -> index in ps.Backends
		for i := uint32(0); i < v.Count; i++ {
			sv, ok := k.slots[backendKey(v.Id, i, v.Buffer)]
			if !ok {
				ps.Problems = append(ps.Problems, fmt.Sprintf("slot %d of %d missing", i, v.Count))
				continue
			}
			b, id, gen := backendFromValue(sv)
			if j, seen := index[id]; seen {
				pb := &ps.Backends[j]
				if pb.Addr != b.Addr || pb.Gen != gen {
					ps.Problems = append(ps.Problems, fmt.Sprintf("slot %d: id %d stands for %s gen %d and %s gen %d", i, id, pb.Addr, pb.Gen, b.Addr, gen))
				}
				pb.Weight++
				continue
			}
			b.Weight = 1
			index[id] = len(ps.Backends)
			ps.Backends = append(ps.Backends, k.programmedBackend(b, id, gen, v.Id, &ps))
		}
		seenAddr := map[string]bool{}
		for _, pb := range ps.Backends {
			if seenAddr[pb.Addr.String()] {
				ps.Problems = append(ps.Problems, fmt.Sprintf("backend %s holds two ids", pb.Addr))
			}
			seenAddr[pb.Addr.String()] = true
		}
		start := len(ps.Backends)
		for id, r := range k.registry {
			if r.SvcId != v.Id || r.State != uint8(tcBackendStateBACKEND_DRAINING) || !k.current(uint32(id)) {
				continue
			}
			if _, active := index[uint32(id)]; active {
				continue
			}
			b := withFlags(Backend{Addr: addrPortOf(r.Addr, r.Port), Draining: true}, r.Flags)
			rec, _ := k.recordOf(uint32(id))
			ps.Backends = append(ps.Backends, ProgrammedBackend{Backend: b, ID: uint32(id), Gen: r.Gen, State: stateName(r.State), Current: true, Traffic: rec.traffic})
		}
		slices.SortFunc(ps.Backends[start:], func(a, b ProgrammedBackend) int { return a.Addr.Compare(b.Addr) })
		out[fe] = ps
	}
	return out
}

// programmedBackend completes an active backend read from a slot with its
// registry entry and record, noting disagreements in ps.
func (k *kernelState) programmedBackend(b Backend, id, gen, svcID uint32, ps *ProgrammedService) ProgrammedBackend {
	pb := ProgrammedBackend{Backend: b, ID: id, Gen: gen, State: "none"}
	rec, ok := k.recordOf(id)
	if ok && rec.gen == gen {
		pb.Traffic = rec.traffic
	}
	if !ok || rec.gen != gen || rec.mixed {
		ps.Problems = append(ps.Problems, fmt.Sprintf("backend %s id %d: slot generation %d, record %d (mixed %t)", b.Addr, id, gen, rec.gen, rec.mixed))
	}
	if int(id) < len(k.registry) {
		r := k.registry[id]
		pb.State, pb.Current = stateName(r.State), k.current(id)
		want := tcRegistryValue{SvcId: svcID, Addr: wireAddr(b.Addr.Addr()), Port: be16(b.Addr.Port()),
			State: uint8(tcBackendStateBACKEND_ACTIVE), Flags: backendFlags(b), Gen: gen}
		if r != want {
			ps.Problems = append(ps.Problems, fmt.Sprintf("backend %s id %d: registry says service %d %s %s gen %d",
				b.Addr, id, r.SvcId, addrPortOf(r.Addr, r.Port), stateName(r.State), r.Gen))
		}
	}
	return pb
}
