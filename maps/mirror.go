package maps

import (
	"net/netip"
)

// slot is one active backend slot of a service: slot i of the mirror is
// slot i of the service's active buffer in the kernel.
type slot struct {
	be Backend
	id uint32 // backend id: registry and per-backend counter index
}

// service is the mirror of one frontend.
type service struct {
	key    tcSvcKey
	id     uint32
	gen    uint32
	buffer uint8
	slots  []slot
	index  map[netip.AddrPort]int // backend address -> slot
	// high[b] bounds the kernel entries of buffer b: slots [0, high[b])
	// may exist. Entries at or beyond len(slots) in the active buffer, and
	// all of the inactive buffer, are stale: invisible to the datapath and
	// deleted lazily.
	high [2]uint32
}

func (s *service) value(count uint32, gen uint32, buffer uint8) tcSvcValue {
	return tcSvcValue{Id: s.id, Count: count, Generation: gen, Buffer: buffer}
}

func (s *service) backends() []Backend {
	out := make([]Backend, len(s.slots))
	for i, sl := range s.slots {
		out[i] = sl.be
	}
	return out
}

// mirror is what this process believes the kernel maps hold.
type mirror struct {
	fes         map[Frontend]*service
	svcIDs      idAlloc
	beIDs       idAlloc
	active      int // sum of len(slots): counted against MaxBackends
	kernelSlots int // sum of high[]: entries possibly in the backends map
	// Counter values at the moment an id was (re)assigned; Counters
	// reports the difference so reused ids start from zero.
	svcBase map[uint32]Traffic
	beBase  map[uint32]uint64
	// zombies are backend ids whose registry entry still has to be
	// cleared (a write failed after the flip); retried on every change.
	zombies []uint32
}

func newMirror(opts Options) mirror {
	return mirror{
		fes:     make(map[Frontend]*service),
		svcIDs:  idAlloc{next: 1, limit: opts.MaxFrontends + 1},
		beIDs:   idAlloc{next: 0, limit: opts.MaxBackends},
		svcBase: make(map[uint32]Traffic),
		beBase:  make(map[uint32]uint64),
	}
}

func (m *mirror) setHigh(s *service, buf uint8, v uint32) {
	m.kernelSlots += int(v) - int(s.high[buf])
	s.high[buf] = v
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
