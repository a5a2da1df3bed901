package maps

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
)

// DriftKind names one way the kernel maps can disagree with the mirror.
type DriftKind string

// Kinds of drift Verify reports.
const (
	// DriftFrontendMissing: programmed, but tlb_services has no entry.
	DriftFrontendMissing DriftKind = "frontend_missing"
	// DriftFrontendUnexpected: in tlb_services, but not programmed.
	DriftFrontendUnexpected DriftKind = "frontend_unexpected"
	// DriftService: the service entry's id, slot count, buffer or
	// settings differ.
	DriftService DriftKind = "service"
	// DriftSlotMissing: the slot count covers a slot tlb_backends lacks
	// (packets hashing to it are dropped as no_backend).
	DriftSlotMissing DriftKind = "slot_missing"
	// DriftSlotWrong: a slot holds another backend, id, generation or
	// flags.
	DriftSlotWrong DriftKind = "slot_wrong"
	// DriftIDShared: a slot holds the id of another frontend's backend.
	DriftIDShared DriftKind = "id_shared"
	// DriftRegistry: a backend's registry entry differs (service,
	// address, state, flags or generation).
	DriftRegistry DriftKind = "registry"
	// DriftRegistryOrphan: the registry entry of an id no backend holds
	// is in force (not free, current generation).
	DriftRegistryOrphan DriftKind = "registry_orphan"
	// DriftGeneration: a backend's id has another generation in
	// tlb_backend_stats (or the CPUs disagree), so its flows are not
	// honoured.
	DriftGeneration DriftKind = "generation"
	// DriftSourceRange: tlb_src_ranges lacks a programmed prefix (its
	// sources are refused) or holds one not programmed (let in).
	DriftSourceRange DriftKind = "source_range"
)

// DriftKinds lists every DriftKind, so metrics can export each one from
// the start (a kind that never drifted is 0, not absent).
var DriftKinds = []DriftKind{
	DriftFrontendMissing, DriftFrontendUnexpected, DriftService, DriftSlotMissing, DriftSlotWrong,
	DriftIDShared, DriftRegistry, DriftRegistryOrphan, DriftGeneration, DriftSourceRange,
}

// Drift is one disagreement between the kernel and the mirror.
type Drift struct {
	Kind DriftKind
	// Frontend concerned; the zero Frontend for registry orphans.
	Frontend Frontend
	// ID is the backend id concerned, when there is one.
	ID     uint32
	Detail string
}

func (d Drift) String() string {
	fe := "-"
	if d.Frontend != (Frontend{}) {
		fe = d.Frontend.String()
	}
	return fmt.Sprintf("%s %s id %d: %s", d.Kind, fe, d.ID, d.Detail)
}

// Verify compares the kernel maps with the mirror and returns every
// disagreement, ordered by frontend; none means the datapath does exactly
// what was programmed. It writes nothing.
func (d *upkeep) Verify() ([]Drift, error) {
	return readKernel(d.Datapath, d.verify)
}

func (d *upkeep) verify(k *kernelState) []Drift {
	var out []Drift
	owners := d.owners()
	for _, s := range d.sortedFrontends() {
		out = append(out, d.verifyFrontend(k, s, owners)...)
	}
	ours := make(map[tcSvcKey]bool, len(d.fes))
	for _, s := range d.fes {
		ours[s.key] = true
	}
	var unexpected []Drift
	for key, v := range k.services {
		if !ours[key] {
			unexpected = append(unexpected, Drift{Kind: DriftFrontendUnexpected, Frontend: frontend(key), Detail: fmt.Sprintf("service id %d, %d slots", v.Id, v.Count)})
		}
	}
	slices.SortFunc(unexpected, func(a, b Drift) int { return cmp.Compare(a.Frontend.String(), b.Frontend.String()) })
	out = append(out, unexpected...)
	out = append(out, d.verifyRanges(k)...)
	retiring := make(map[uint32]bool, len(d.retire))
	for _, r := range d.retire {
		retiring[r.id] = true
	}
	for id, r := range k.registry {
		if owners[uint32(id)] == nil && !retiring[uint32(id)] && k.current(uint32(id)) {
			out = append(out, Drift{Kind: DriftRegistryOrphan, ID: uint32(id),
				Detail: fmt.Sprintf("registry says service %d %s %s gen %d", r.SvcId, addrPortOf(r.Addr, r.Port), stateName(r.State), r.Gen)})
		}
	}
	return out
}

// verifyFrontend compares one frontend: its service entry, every slot of
// its table, and its members' registry entries and generations.
func (d *upkeep) verifyFrontend(k *kernelState, s *service, owners map[uint32]*service) []Drift {
	var out []Drift
	add := func(kind DriftKind, id uint32, format string, args ...any) {
		out = append(out, Drift{Kind: kind, Frontend: s.fe, ID: id, Detail: fmt.Sprintf(format, args...)})
	}
	v, ok := k.services[s.key]
	switch {
	case !ok:
		add(DriftFrontendMissing, 0, "no service entry")
	case v.Id != s.id || v.Count != uint32(len(s.table)) || v.Buffer != s.buffer || settingsFromValue(v) != s.set:
		add(DriftService, 0, "kernel id %d count %d buffer %d, programmed id %d count %d buffer %d (settings %+v, programmed %+v)",
			v.Id, v.Count, v.Buffer, s.id, len(s.table), s.buffer, settingsFromValue(v), s.set)
	}
	for i, m := range s.table {
		got, ok := k.slots[backendKey(s.id, uint32(i), s.buffer)]
		switch {
		case !ok:
			add(DriftSlotMissing, m.id, "slot %d (%s) missing", i, m.be.Addr)
		case got == backendValue(m):
		case owners[got.Id] != nil && owners[got.Id] != s:
			add(DriftIDShared, got.Id, "slot %d holds id %d of %s", i, got.Id, owners[got.Id].fe)
		default:
			b, id, gen := backendFromValue(got)
			add(DriftSlotWrong, m.id, "slot %d holds %s id %d gen %d, programmed %s id %d gen %d", i, b.Addr, id, gen, m.be.Addr, m.id, m.gen)
		}
	}
	// A kernel count beyond the table sends packets to slots the mirror
	// does not have.
	for i := uint32(len(s.table)); ok && v.Id == s.id && i < v.Count; i++ {
		if _, found := k.slots[backendKey(s.id, i, v.Buffer)]; !found {
			add(DriftSlotMissing, 0, "count %d covers slot %d, which does not exist", v.Count, i)
		}
	}
	for _, m := range sortedMembers(s) {
		if rec, ok := k.recordOf(m.id); !ok || rec.mixed || rec.gen != m.gen {
			add(DriftGeneration, m.id, "%s: record generation %d (CPUs disagree: %t), programmed %d", m.be.Addr, rec.gen, rec.mixed, m.gen)
		}
		if int(m.id) < len(k.registry) && k.registry[m.id] != registryValue(s.id, m) && !d.fixRegistry[m.id] {
			r := k.registry[m.id]
			add(DriftRegistry, m.id, "%s: registry says service %d %s %s gen %d, programmed %s gen %d",
				m.be.Addr, r.SvcId, addrPortOf(r.Addr, r.Port), stateName(r.State), r.Gen, stateName(registryValue(s.id, m).State), m.gen)
		}
	}
	return out
}

// RepairReport says what Repair found and did.
type RepairReport struct {
	// Found is what Verify reported before the repair.
	Found []Drift
	// Reprogrammed frontends were rewritten whole from the mirror
	// (inactive buffer, registry entries, flip).
	Reprogrammed []Frontend
	// Deleted frontends were in the kernel but not programmed.
	Deleted []Frontend
	// Registry counts registry entries rewritten on their own.
	Registry int
	// Retired ids had a registry entry in force that no backend holds;
	// their generation was bumped.
	Retired []uint32
	// Regenerated ids had a generation other than programmed; they got a
	// fresh one (their flows re-balance).
	Regenerated []uint32
	// Writes is the number of map writes.
	Writes int
	// Remaining is what Verify reports after the repair; empty when the
	// datapath is whole again.
	Remaining []Drift
}

// Repair verifies the kernel maps against the mirror and rewrites what
// drifted, so the datapath does what was programmed again. The mirror is
// the truth being restored: frontends the kernel lacks or holds wrongly
// are reprogrammed whole, frontends only the kernel has are deleted,
// stray registry entries are retired. It returns what it found and did;
// the error joins the writes that failed.
func (d *upkeep) Repair() (RepairReport, error) {
	var rep RepairReport
	_, err := d.write(func(t *txn) error { return d.repair(t, &rep) })
	return rep, err
}

// repair is Repair in t, filling rep.
func (d *upkeep) repair(t *txn, rep *RepairReport) error {
	k, err := d.snapshot()
	if err != nil {
		return err
	}
	rep.Found = d.verify(k)
	reprogram, errs := d.fixDrift(t, k, rep)
	for _, s := range d.sortedFrontends() {
		if !reprogram[s.fe] {
			continue
		}
		if err := d.reprogram(t, s); err != nil {
			errs = append(errs, fmt.Errorf("reprogram %s: %w", s.fe, err))
			continue
		}
		rep.Reprogrammed = append(rep.Reprogrammed, s.fe)
	}
	rep.Writes = t.writes
	if k, err = d.snapshot(); err != nil {
		errs = append(errs, err)
	} else {
		rep.Remaining = d.verify(k)
	}
	if len(rep.Found) > 0 {
		d.log.Warn("datapath drift repaired", "found", len(rep.Found), "reprogrammed", len(rep.Reprogrammed),
			"deleted", len(rep.Deleted), "registry", rep.Registry, "retired", len(rep.Retired), "writes", rep.Writes,
			"remaining", len(rep.Remaining))
	}
	return errors.Join(errs...)
}

// fixDrift repairs what it can entry by entry (stranger frontends,
// orphan registry entries, generations, registry entries) and returns the
// frontends to reprogram whole, with the errors of writes that failed.
func (d *upkeep) fixDrift(t *txn, k *kernelState, rep *RepairReport) (map[Frontend]bool, []error) {
	var errs []error
	reprogram := map[Frontend]bool{}
	owners := d.owners()
	fixedRanges := false
	for _, dr := range rep.Found {
		switch dr.Kind {
		case DriftFrontendUnexpected:
			if err := d.deleteUnexpected(t, k, dr.Frontend); err != nil {
				errs = append(errs, err)
				continue
			}
			rep.Deleted = append(rep.Deleted, dr.Frontend)
		case DriftRegistryOrphan:
			rec, _ := k.recordOf(dr.ID)
			if err := t.putGeneration(dr.ID, rec.gen+1); err != nil {
				errs = append(errs, err)
				continue
			}
			rep.Retired = append(rep.Retired, dr.ID)
		case DriftGeneration:
			s := owners[dr.ID]
			if err := d.regenerate(t, k, s, s.byID(dr.ID)); err != nil {
				errs = append(errs, err)
				continue
			}
			rep.Regenerated = append(rep.Regenerated, dr.ID)
			reprogram[s.fe] = true
		case DriftSourceRange:
			if fixedRanges {
				continue
			}
			fixedRanges = true
			if err := d.fixRanges(t, k); err != nil {
				errs = append(errs, err)
			}
		case DriftRegistry:
			if reprogram[dr.Frontend] {
				continue // the reprogram rewrites it
			}
			s := d.fes[dr.Frontend]
			if err := t.putRegistry(s, s.byID(dr.ID)); err != nil {
				errs = append(errs, err)
				continue
			}
			rep.Registry++
		default:
			reprogram[dr.Frontend] = true
		}
	}
	return reprogram, errs
}

// deleteUnexpected removes a frontend only the kernel has, and its slots
// unless a programmed frontend uses the same service id.
func (d *upkeep) deleteUnexpected(t *txn, k *kernelState, fe Frontend) error {
	key, err := svcKey(fe)
	if err != nil {
		return err
	}
	v := k.services[key]
	if err := t.del(d.services, "services", key); err != nil {
		return err
	}
	for _, s := range d.fes {
		if s.id == v.Id {
			return nil
		}
	}
	for bk := range k.slots {
		if bk.SvcId == v.Id {
			if err := t.del(d.backends, "backends", bk); err != nil {
				return err
			}
		}
	}
	return nil
}

// regenerate gives member m of s a generation no flow carries and sets
// it on every CPU; the frontend must then be reprogrammed so its slots
// and registry entry carry it too.
func (d *upkeep) regenerate(t *txn, k *kernelState, s *service, m *member) error {
	rec, _ := k.recordOf(m.id)
	gen := max(m.gen, rec.gen) + 1
	final := d.beginFinal(s, m)
	if err := t.putGeneration(m.id, gen); err != nil {
		return err
	}
	d.queueFinal(final)
	m.gen, m.base, m.swept, m.seen = gen, Traffic{}, Traffic{}, Traffic{}
	return nil
}
