package maps

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
)

// The stale walk (flushStale) in two paths with the same rules: where the
// kernel has bpf_for_each_map_elem (5.13), bpf/ct_stale.c walks the four
// conntrack tables in the kernel, run with BPF_PROG_TEST_RUN, so no entry
// is copied to user space (issue 38: the copy of a quarter-million
// entries, most of a core for a fraction of a second per walk, was what
// a rollout's changes waited for); elsewhere the agent walks them
// (markStale).

// staleRunMax is STALE_RUN_MAX in bpf/ct_stale.c: the released ids, and
// the finals, one run of ct_mark_stale takes. Change both together.
const staleRunMax = 1024

// markReleased marks stale every forward entry of fs whose id released
// holds with another generation (id -> its generation now), and returns:
//   - how many entries it marked;
//   - the counts of the live forward entries of each (id, generation)
//     of want, as read before any mark.
//
// In the kernel where the Datapath found bpf_for_each_map_elem, else in
// user space; a kernel walk that fails is done again in user space (a
// mark is idempotent, and the counts are the second walk's).
func (d *upkeep) markReleased(fs ctFamilies, released map[uint32]uint32, want map[idGen]bool) (int, map[idGen]Traffic, error) {
	if d.compat.forEachMapElem {
		w, err := d.staleQ.loadWalker(fs)
		if err == nil {
			var (
				n     int
				flows map[idGen]Traffic
			)
			if n, flows, err = w.markReleased(released, want); err == nil {
				return n, flows, nil
			}
		}
		d.log.Error("the stale walk in the kernel failed; walking in the agent", "err", err)
	}
	return markReleasedInUser(fs, released, want)
}

// markReleasedInUser is markReleased by a walk of the tables' copies in
// user space (markStale).
func markReleasedInUser(fs ctFamilies, released map[uint32]uint32, want map[idGen]bool) (int, map[idGen]Traffic, error) {
	flows := make(map[idGen]Traffic, len(want))
	n, err := fs.markStale(func(ig idGen) bool {
		gen, ok := released[ig.id]
		return ok && gen != ig.gen
	}, func(ig idGen, tr Traffic) {
		if want[ig] {
			flows[ig] = flows[ig].plus(tr)
		}
	})
	return n, flows, err
}

// ctStaleSpec is bpf/ct_stale.c's object, parsed once.
var ctStaleSpec = sync.OnceValues(loadCtstale)

// staleWalker is ct_mark_stale loaded over one Datapath's conntrack
// tables, with its own two maps.
type staleWalker struct {
	Prog   *ebpf.Program `ebpf:"ct_mark_stale"`
	IDs    *ebpf.Map     `ebpf:"tlb_stale_ids"`
	Finals *ebpf.Map     `ebpf:"tlb_stale_finals"`
}

// loadWalker returns ct_mark_stale loaded over the tables fs (copies of
// the Datapath's handles: the program keeps its own references), loaded
// at the first walk and kept until the Datapath closes (a load parses and
// hands the kernel the object's BTF: garbage for every walk, which the
// agent's syncs paid for). Under q.walking; the Datapath's tables never
// change after Load.
func (q *staleQueue) loadWalker(fs ctFamilies) (*staleWalker, error) {
	if q.walker == nil {
		w, err := loadStaleWalker(fs)
		if err != nil {
			return nil, fmt.Errorf("load the stale walk: %w", err)
		}
		q.walker = w
	}
	return q.walker, nil
}

// closeWalker closes the walker loadWalker kept, once the walk under way
// (if any) has ended.
func (q *staleQueue) closeWalker() {
	q.walking.Lock()
	defer q.walking.Unlock()
	if q.walker != nil {
		q.walker.close()
		q.walker = nil
	}
}

// loadStaleWalker loads ct_mark_stale over the tables fs.
func loadStaleWalker(fs ctFamilies) (*staleWalker, error) {
	parsed, err := ctStaleSpec()
	if err != nil {
		return nil, err
	}
	spec := parsed.Copy()
	replace := map[string]*ebpf.Map{
		ctstaleMapTlbConntrack: fs.v4[0], ctstaleMapTlbCtNew: fs.v4[1],
		ctstaleMapTlbCt6: fs.v6[0], ctstaleMapTlbCt6New: fs.v6[1],
	}
	for name, m := range replace {
		// Sized by Options: the spec's default would not match.
		spec.Maps[name].MaxEntries = m.MaxEntries()
	}
	var w staleWalker
	if err := spec.LoadAndAssign(&w, &ebpf.CollectionOptions{MapReplacements: replace}); err != nil {
		return nil, err
	}
	return &w, nil
}

// close closes the program and its maps.
func (w *staleWalker) close() {
	w.Prog.Close()
	w.IDs.Close()
	w.Finals.Close()
}

// staleRunData is the frame BPF_PROG_TEST_RUN hands ct_mark_stale, which
// reads none of it: a tc program's run needs an Ethernet header's length.
var staleRunData = make([]byte, 14)

// markReleasedInKernel is markReleased by ct_mark_stale, loaded over fs
// for this one walk.
func markReleasedInKernel(fs ctFamilies, released map[uint32]uint32, want map[idGen]bool) (int, map[idGen]Traffic, error) {
	w, err := loadStaleWalker(fs)
	if err != nil {
		return 0, nil, fmt.Errorf("load the stale walk: %w", err)
	}
	defer w.close()
	return w.markReleased(released, want)
}

// markReleased is markReleased by w: one run of ct_mark_stale per
// staleRunMax ids and finals, each a walk of the four tables in the
// kernel.
func (w *staleWalker) markReleased(released map[uint32]uint32, want map[idGen]bool) (int, map[idGen]Traffic, error) {
	flows := make(map[idGen]Traffic, len(want))
	ids := make([]uint32, 0, len(released))
	for id := range released {
		ids = append(ids, id)
	}
	finals := make([]idGen, 0, len(want))
	for ig := range want {
		finals = append(finals, ig)
	}
	n := 0
	for len(ids) > 0 || len(finals) > 0 {
		runIDs, runFinals := ids[:min(staleRunMax, len(ids))], finals[:min(staleRunMax, len(finals))]
		ids, finals = ids[len(runIDs):], finals[len(runFinals):]
		marked, err := w.run(released, runIDs, runFinals, flows)
		n += marked
		if err != nil {
			return n, nil, err
		}
	}
	return n, flows, nil
}

// run marks the flows of ids (with their generations in released) and
// counts those of finals into flows, in one run of ct_mark_stale, and
// empties its maps after.
func (w *staleWalker) run(released map[uint32]uint32, ids []uint32, finals []idGen, flows map[idGen]Traffic) (int, error) {
	for _, id := range ids {
		if err := w.IDs.Update(id, released[id], ebpf.UpdateNoExist); err != nil {
			return 0, fmt.Errorf("stale walk: queue id %d: %w", id, err)
		}
	}
	for _, ig := range finals {
		if err := w.Finals.Update(ctstaleStaleIdGen{Id: ig.id, Gen: ig.gen}, ctstaleStaleTraffic{}, ebpf.UpdateNoExist); err != nil {
			return 0, fmt.Errorf("stale walk: queue final %d/%d: %w", ig.id, ig.gen, err)
		}
	}
	marked, err := w.Prog.Run(&ebpf.RunOptions{Data: staleRunData})
	if err != nil {
		return 0, fmt.Errorf("stale walk: run: %w", err)
	}
	for _, ig := range finals {
		var tr ctstaleStaleTraffic
		key := ctstaleStaleIdGen{Id: ig.id, Gen: ig.gen}
		if err := w.Finals.Lookup(key, &tr); err != nil {
			return int(marked), fmt.Errorf("stale walk: read final %d/%d: %w", ig.id, ig.gen, err)
		}
		if tr.Flows > 0 {
			flows[ig] = Traffic{Flows: tr.Flows, Packets: tr.Packets, Bytes: tr.Bytes}
		}
		if err := w.Finals.Delete(key); err != nil {
			return int(marked), fmt.Errorf("stale walk: clear final %d/%d: %w", ig.id, ig.gen, err)
		}
	}
	for _, id := range ids {
		if err := w.IDs.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return int(marked), fmt.Errorf("stale walk: clear id %d: %w", id, err)
		}
	}
	return int(marked), nil
}
