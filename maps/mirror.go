package maps

import (
	"cmp"
	"net/netip"
	"slices"
)

// member is one programmed backend of a frontend: active (it holds slots
// in the table) or draining (it holds none). Its id stands for it in
// tlb_registry and tlb_backend_stats while its generation is current.
type member struct {
	be    Backend // normalized; be.Weight is the slot count (0 when draining)
	id    uint32
	gen   uint32
	base  Traffic // the id's counters when it was assigned (zero when adopted)
	fresh bool    // id allocated by the change in progress, not yet committed
	// swept sums the counts of this member's flows that sweeps deleted;
	// seen is the most Counters reported, which it never goes below
	// (an LRU eviction takes a flow's counts with it).
	swept, seen Traffic
}

// traffic is what m carried since it was assigned: rec, its id's record,
// plus flows, its live flows' counts (ctTables.traffic), plus what sweeps
// deleted.
func (m *member) traffic(rec record, flows map[idGen]Traffic) Traffic {
	if rec.gen != m.gen {
		return Traffic{}
	}
	return rec.traffic.plus(flows[idGen{m.id, m.gen}]).plus(m.swept).minus(m.base)
}

// settings are a frontend's per-service options as the datapath stores
// them.
type settings struct {
	affinity uint32 // seconds; 0: off
	reject   bool
	// srcRanges: new flows only from the frontend's prefixes in
	// tlb_src_ranges (mirror.ranges); srcNode: the node's own processes
	// pass too.
	srcRanges, srcNode bool
}

// service is the mirror of one frontend.
type service struct {
	fe     Frontend
	key    tcSvcKey
	id     uint32
	gen    uint32 // flips (svc_value.generation)
	buffer uint8
	set    settings
	// table is the active buffer: slot i holds table[i]. With equal
	// weights every active member appears once.
	table   []*member
	members map[netip.AddrPort]*member
	// high[b] bounds the kernel entries of buffer b: slots [0, high[b])
	// may exist. Entries at or beyond len(table) in the active buffer, and
	// all of the inactive buffer, are stale: invisible to the datapath and
	// deleted lazily.
	high [2]uint32
	// released sums the final counts of ids this process released, so the
	// frontend's counters never go backwards.
	released Traffic
	// name is what tlb_names says for the frontend ("": nothing).
	name string
}

// equalWeights reports whether the table holds every active member once.
func (s *service) equalWeights() bool {
	for _, m := range s.table {
		if m.be.Weight != 1 {
			return false
		}
	}
	return true
}

// backends lists the members as read back: active ones in order of their
// first slot, then draining ones by address. Dump returns the same order.
func (s *service) backends() []Backend {
	out := make([]Backend, 0, len(s.members))
	seen := make(map[*member]bool, len(s.table))
	for _, m := range s.table {
		if !seen[m] {
			seen[m] = true
			out = append(out, m.be)
		}
	}
	start := len(out)
	for _, m := range s.members {
		if m.be.Draining {
			out = append(out, m.be)
		}
	}
	sortDraining(out[start:])
	return out
}

func sortDraining(bs []Backend) {
	slices.SortFunc(bs, func(a, b Backend) int { return a.Addr.Compare(b.Addr) })
}

// byID finds the member holding id.
func (s *service) byID(id uint32) *member {
	for _, m := range s.members {
		if m.id == id {
			return m
		}
	}
	return nil
}

// mirror is what this process believes the kernel maps hold.
type mirror struct {
	fes    map[Frontend]*service
	svcIDs idAlloc
	beIDs  idAlloc
	slots  int // sum of len(table): counted against MaxBackends
	// kernelSlots is the sum of high[]: entries possibly in the backends
	// map.
	kernelSlots int
	// retire holds ids whose release (the generation bump) failed: their
	// flows may still be honoured, and they are not reused until a retry
	// succeeds.
	retire []retiring
	// fixRegistry holds ids of members whose registry entry may differ
	// from the mirror (a write after a flip failed); rewritten on retry.
	fixRegistry map[uint32]bool
	// dirty holds frontends whose kernel slots may differ from the mirror
	// (an undo failed); reprogrammed on retry.
	dirty map[Frontend]bool
	// ranges holds the prefixes tlb_src_ranges holds, by svc id.
	ranges map[uint32]map[netip.Prefix]bool
}

// retiring is an id waiting for its generation to become gen.
type retiring struct {
	id, gen uint32
}

func newMirror(opts Options) mirror {
	return mirror{
		fes:         make(map[Frontend]*service),
		svcIDs:      idAlloc{next: 1, limit: opts.MaxFrontends + 1},
		beIDs:       idAlloc{next: 0, limit: opts.MaxBackends},
		fixRegistry: make(map[uint32]bool),
		dirty:       make(map[Frontend]bool),
		ranges:      make(map[uint32]map[netip.Prefix]bool),
	}
}

func (m *mirror) setHigh(s *service, buf uint8, v uint32) {
	m.kernelSlots += int(v) - int(s.high[buf])
	s.high[buf] = v
}

// owners maps every id held by a member to its frontend.
func (m *mirror) owners() map[uint32]*service {
	out := make(map[uint32]*service)
	for _, s := range m.fes {
		for _, mb := range s.members {
			out[mb.id] = s
		}
	}
	return out
}

// sortedFrontends returns the mirror's frontends in a stable order.
func (m *mirror) sortedFrontends() []*service {
	out := make([]*service, 0, len(m.fes))
	for _, s := range m.fes {
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b *service) int { return cmp.Compare(a.id, b.id) })
	return out
}

// idAlloc hands out ids in [next0, limit), reusing freed ones first.
type idAlloc struct {
	next  uint32
	limit uint32
	free  []uint32
}

func (a *idAlloc) alloc() (uint32, bool) {
	if n := len(a.free); n > 0 {
		id := a.free[n-1]
		a.free = a.free[:n-1]
		return id, true
	}
	if a.next >= a.limit {
		return 0, false
	}
	a.next++
	return a.next - 1, true
}

func (a *idAlloc) release(id uint32) { a.free = append(a.free, id) }

// available is how many ids alloc can still hand out.
func (a *idAlloc) available() int { return len(a.free) + int(a.limit-a.next) }

// rebuild resets the allocator so exactly the ids in used are taken.
func (a *idAlloc) rebuild(first uint32, used map[uint32]bool) {
	a.next = first
	for id := range used {
		if id+1 > a.next {
			a.next = id + 1
		}
	}
	a.free = a.free[:0]
	for id := a.next; id > first; id-- {
		if !used[id-1] {
			a.free = append(a.free, id-1)
		}
	}
}
