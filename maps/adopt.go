package maps

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
)

type adoptStats struct {
	staleSlots    int
	registryFixes int
	rewritten     int
}

// adopt rebuilds the mirror from the kernel maps (after an agent restart
// the maps are pinned and still forwarding) and collects garbage. Steps:
// frontends and their tables from the services and slots, stale slots
// deleted, draining backends and stray registry entries from the
// registry, id allocators rebuilt, and frontends found broken rewritten.
func (d *Datapath) adopt() (adoptStats, error) {
	var st adoptStats
	k, err := d.snapshot()
	if err != nil {
		return st, err
	}
	t := &txn{d: d}
	broken := d.adoptServices(k)
	if err := d.adoptRanges(t, k); err != nil {
		return st, err
	}
	if err := d.adoptSlots(t, k, &st); err != nil {
		return st, err
	}
	if err := d.adoptRegistry(t, k, broken, &st); err != nil {
		return st, err
	}
	d.adoptIDs()
	if err := d.adoptBroken(t, k, broken, &st); err != nil {
		return st, err
	}
	if err := d.adoptNames(t); err != nil {
		return st, err
	}
	if t.writes > 0 {
		d.log.Info("garbage-collected pinned maps", "writes", t.writes, "rewritten", st.rewritten)
	}
	return st, t.finish()
}

// brokenService is an adopted frontend the datapath does not serve
// whole: it is rewritten from what was found.
type brokenService struct {
	s *service
	// needID are members whose id another frontend holds (or which were
	// found under two ids): they get a fresh id.
	needID []*member
}

// adoptServices builds a service per tlb_services entry, its members and
// table from the active buffer's slots. A frontend with a missing or
// inconsistent slot, a member whose generation is not its id's, or an id
// another frontend already holds is returned as broken.
func (d *Datapath) adoptServices(k *kernelState) map[*service]*brokenService {
	broken := map[*service]*brokenService{}
	mark := func(s *service) *brokenService {
		if broken[s] == nil {
			broken[s] = &brokenService{s: s}
		}
		return broken[s]
	}
	held := map[uint32]*service{}
	for _, e := range sortedServiceEntries(k) {
		s := &service{fe: frontend(e.key), key: e.key, id: e.value.Id, gen: e.value.Generation,
			buffer: e.value.Buffer & 1, set: settingsFromValue(e.value), members: make(map[netip.AddrPort]*member)}
		if e.value.Buffer > 1 {
			mark(s)
		}
		byID := map[uint32]*member{}
		for i := uint32(0); i < e.value.Count; i++ {
			v, ok := k.slots[backendKey(s.id, i, s.buffer)]
			if !ok {
				mark(s)
				continue
			}
			b, id, gen := backendFromValue(v)
			m := byID[id]
			switch {
			case m != nil && (m.be.Addr != b.Addr || m.gen != gen || backendFlags(m.be) != backendFlags(b)):
				mark(s)
				continue
			case m == nil && s.members[b.Addr] != nil: // one address, two ids
				mark(s)
				m = s.members[b.Addr]
			case m == nil:
				b.Weight = 0
				m = &member{be: b, id: id, gen: gen}
				byID[id] = m
				s.members[b.Addr] = m
				if other := held[id]; other != nil && other != s {
					mark(s).needID = append(mark(s).needID, m)
				} else {
					held[id] = s
				}
				if rec, ok := k.recordOf(id); !ok || rec.mixed || rec.gen != gen {
					mark(s)
				}
			}
			m.be.Weight++
			s.table = append(s.table, m)
		}
		d.fes[s.fe] = s
	}
	return broken
}

// sortedServiceEntries lists the services by id, so adoption is
// deterministic when ids clash.
func sortedServiceEntries(k *kernelState) []svcEntry {
	out := make([]svcEntry, 0, len(k.services))
	for key, v := range k.services {
		out = append(out, svcEntry{key, v})
	}
	slices.SortFunc(out, func(a, b svcEntry) int {
		return cmp.Or(cmp.Compare(a.value.Id, b.value.Id), cmp.Compare(frontend(a.key).String(), frontend(b.key).String()))
	})
	return out
}

// adoptSlots sets every service's high[] from the slots the kernel holds
// and deletes the stale ones: slots of unknown services, of the inactive
// buffer, or beyond the active count.
func (d *Datapath) adoptSlots(t *txn, k *kernelState, st *adoptStats) error {
	byID := make(map[uint32]*service, len(d.fes))
	for _, s := range d.fes {
		if byID[s.id] == nil {
			byID[s.id] = s
		}
	}
	for key := range k.slots {
		s := byID[key.SvcId]
		if s == nil || key.Buffer > 1 {
			if err := t.del(d.backends, "backends", key); err != nil {
				return err
			}
			st.staleSlots++
			continue
		}
		if key.Slot+1 > s.high[key.Buffer] {
			d.setHigh(s, key.Buffer, key.Slot+1)
		}
	}
	before := d.kernelSlots
	for _, s := range d.fes {
		d.trim(t, s, 1-s.buffer, 0)
		d.trim(t, s, s.buffer, uint32(len(s.table)))
	}
	st.staleSlots += before - d.kernelSlots
	return nil
}

// adoptRegistry reads the registry: a current draining entry of a known
// frontend is a draining member; active members get their entry
// rewritten when it differs; any other entry in force (a backend released
// by a crashed change) is retired by a generation bump.
func (d *Datapath) adoptRegistry(t *txn, k *kernelState, broken map[*service]*brokenService, st *adoptStats) error {
	byID := make(map[uint32]*service, len(d.fes))
	owner := map[uint32]*service{}
	for _, s := range d.sortedFrontends() {
		if byID[s.id] == nil {
			byID[s.id] = s
		}
		for _, m := range s.members {
			if b := broken[s]; b == nil || !slices.Contains(b.needID, m) {
				owner[m.id] = s
			}
		}
	}
	for i, r := range k.registry {
		id := uint32(i)
		if s := owner[id]; s != nil {
			m := s.byID(id)
			if r != registryValue(s.id, m) {
				if err := t.putRegistry(s, m); err != nil {
					return err
				}
				st.registryFixes++
			}
			continue
		}
		if !k.current(id) {
			continue
		}
		b := withFlags(Backend{Addr: addrPortOf(r.Addr, r.Port), Draining: true}, r.Flags)
		if s := byID[r.SvcId]; s != nil && r.State == uint8(tcBackendStateBACKEND_DRAINING) && s.members[b.Addr] == nil {
			s.members[b.Addr] = &member{be: b, id: id, gen: r.Gen}
			owner[id] = s
			continue
		}
		if err := t.putGeneration(id, r.Gen+1); err != nil {
			return err
		}
		st.registryFixes++
	}
	return nil
}

// adoptIDs rebuilds the id allocators and the slot count from the
// members found.
func (d *Datapath) adoptIDs() {
	usedSvc := make(map[uint32]bool, len(d.fes))
	usedBe := map[uint32]bool{}
	for _, s := range d.fes {
		usedSvc[s.id] = true
		for _, m := range s.members {
			usedBe[m.id] = true
		}
		d.slots += len(s.table)
	}
	d.svcIDs.rebuild(1, usedSvc)
	d.beIDs.rebuild(0, usedBe)
}

// adoptBroken rewrites the frontends adoptServices found broken from what
// was found: members whose id is held elsewhere get a fresh id, members
// whose generation is not their id's get a fresh generation, and the
// whole table is written into the other buffer, so the datapath sees a
// whole set again. A service id two frontends share goes to the first;
// the others get a new one.
func (d *Datapath) adoptBroken(t *txn, k *kernelState, broken map[*service]*brokenService, st *adoptStats) error {
	seenSvc := map[uint32]*service{}
	for _, s := range d.sortedFrontends() {
		if other := seenSvc[s.id]; other != nil && other != s {
			id, ok := d.svcIDs.alloc()
			if !ok {
				return fmt.Errorf("repair %s: no free service id: %w", s.fe, ErrMapFull)
			}
			s.id, s.high = id, [2]uint32{}
			if broken[s] == nil {
				broken[s] = &brokenService{s: s}
			}
		}
		seenSvc[s.id] = s
	}
	for _, s := range d.sortedFrontends() {
		b := broken[s]
		if b == nil {
			continue
		}
		for _, m := range b.needID {
			id, ok := d.beIDs.alloc()
			if !ok {
				return fmt.Errorf("repair %s: no free backend id: %w", s.fe, ErrMapFull)
			}
			rec, err := d.readRecord(id)
			if err != nil {
				return fmt.Errorf("repair %s: %w", s.fe, err)
			}
			m.id, m.gen, m.base = id, rec.gen, Traffic{}
		}
		for _, m := range s.members {
			if rec, ok := k.recordOf(m.id); ok && (rec.mixed || rec.gen != m.gen) && !slices.Contains(b.needID, m) {
				if err := d.regenerate(t, k, s, m); err != nil {
					return fmt.Errorf("repair %s: %w", s.fe, err)
				}
			}
		}
		if err := d.reprogram(t, s); err != nil {
			return fmt.Errorf("repair %s: %w", s.fe, err)
		}
		st.rewritten++
	}
	return nil
}
