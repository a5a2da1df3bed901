package maps

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// How a backend set changes (see the package tests for the exact writes):
//
//   - One backend added: write slot[count], write its registry entry, flip
//     the service entry to count+1. 3 writes.
//   - One backend removed: clear its registry entry (its flows move at
//     once), move the last slot into the hole, flip to count-1. 3 writes (2
//     when it was the last slot). The old last slot stays as a stale entry
//     beyond count, invisible to the datapath, until it is overwritten by
//     the next add, or removed by the next full rewrite, DeleteFrontend,
//     capacity pressure or Load.
//   - One backend replaced by another: overwrite its slot, then hand its id
//     to the newcomer in the registry. 2 writes, no flip needed.
//   - Only the flags of one backend changed: rewrite its slot. 1 write.
//   - Anything else: write the whole new set into the inactive buffer, flip
//     the service entry to it, then clear the registry entries of removed
//     backends and delete the old buffer.
//
// In every case a reader sees either the old set or the new one. A write
// that fails before the flip is undone where it is visible and leaves the
// previous set serving.

// txn counts the map writes of one API call and wraps their errors.
type txn struct {
	d      *Datapath
	writes int
}

func (t *txn) put(m *ebpf.Map, what string, key, value any) error {
	t.writes++
	if err := m.Update(key, value, ebpf.UpdateAny); err != nil {
		if errors.Is(err, unix.E2BIG) || errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.ENOMEM) {
			return fmt.Errorf("write %s: %w: %w", what, ErrMapFull, err)
		}
		return fmt.Errorf("write %s: %w", what, err)
	}
	t.d.log.Log(context.Background(), levelTrace, "map write", "map", what, "key", key, "value", value)
	return nil
}

// del deletes key; a missing key is not an error.
func (t *txn) del(m *ebpf.Map, what string, key any) error {
	t.writes++
	if err := m.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete %s: %w", what, err)
	}
	t.d.log.Log(context.Background(), levelTrace, "map delete", "map", what, "key", key)
	return nil
}

func (t *txn) putSlot(s *service, i uint32, buf uint8, sl slot) error {
	return t.put(t.d.backends, "backends", backendKey(s.id, i, buf), backendValue(sl.be, sl.id))
}

func (t *txn) putRegistry(id, svcID uint32, addr netip.AddrPort) error {
	return t.put(t.d.registry, "registry", id, registryValue(svcID, addr))
}

func (t *txn) clearRegistry(id uint32) error {
	return t.put(t.d.registry, "registry", id, tcRegistryValue{})
}

func (t *txn) flip(s *service, count uint32, buf uint8) error {
	return t.put(t.d.services, "services", s.key, s.value(count, s.gen+1, buf))
}

// SetBackends makes backends the permitted set of fe, creating fe if
// needed, with the fewest map writes that keep every intermediate state
// valid (see the comment at the top of update.go). It returns the number
// of map writes issued. The same set again costs 0 writes; order and
// duplicates do not matter. An empty set keeps the frontend and makes the
// datapath drop its traffic (counted as Drops.NoBackend).
//
// Invalid input writes nothing. ErrMapFull is returned, before any write,
// when the change would exceed MaxFrontends or MaxBackends.
func (d *Datapath) SetBackends(fe Frontend, backends []Backend) (writes int, err error) {
	key, err := svcKey(fe)
	if err != nil {
		return 0, err
	}
	fe = frontend(key)
	want, err := normalizeSet(backends)
	if err != nil {
		return 0, fmt.Errorf("frontend %s: %w", fe, err)
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	if d.tcColl == nil {
		return 0, errors.New("datapath closed")
	}
	t := &txn{d: d}
	d.retryZombies(t)
	s := d.fes[fe]
	if s == nil {
		err = d.create(t, fe, key, want)
	} else {
		err = d.update(t, s, want)
	}
	if err != nil {
		return t.writes, fmt.Errorf("set backends of %s: %w", fe, err)
	}
	return t.writes, nil
}

// normalizeSet validates and de-duplicates a backend set, keeping order.
func normalizeSet(in []Backend) ([]Backend, error) {
	out := make([]Backend, 0, len(in))
	seen := make(map[netip.AddrPort]int, len(in))
	for _, b := range in {
		b, err := normalize(b)
		if err != nil {
			return nil, err
		}
		if i, ok := seen[b.Addr]; ok {
			if out[i] != b {
				return nil, fmt.Errorf("backend %s listed twice with different flags", b.Addr)
			}
			continue
		}
		seen[b.Addr] = len(out)
		out = append(out, b)
	}
	return out, nil
}

func (d *Datapath) create(t *txn, fe Frontend, key tcSvcKey, want []Backend) error {
	if len(d.fes) >= int(d.opts.MaxFrontends) {
		return fmt.Errorf("%d frontends: %w", d.opts.MaxFrontends, ErrMapFull)
	}
	if d.active+len(want) > int(d.opts.MaxBackends) {
		return fmt.Errorf("%d + %d backends exceed %d: %w", d.active, len(want), d.opts.MaxBackends, ErrMapFull)
	}
	id, ok := d.svcIDs.alloc()
	if !ok {
		return fmt.Errorf("no free service id: %w", ErrMapFull)
	}
	s := &service{key: key, id: id, index: make(map[netip.AddrPort]int)}
	// A new frontend is a full rewrite of an empty one: buffer 0 is written,
	// then "flipped" by creating the service entry.
	s.buffer = 1
	base := d.readSvcCounter(id)
	if err := d.rewrite(t, s, want); err != nil {
		// Nothing is visible; delete what was written under the id
		// before the id can be handed out again.
		d.trim(t, s, 0, 0)
		if s.high[0] == 0 {
			d.svcIDs.release(id)
		}
		return err
	}
	d.svcBase[id] = base
	d.fes[fe] = s
	return nil
}

func (d *Datapath) update(t *txn, s *service, want []Backend) error {
	wanted := make(map[netip.AddrPort]Backend, len(want))
	for _, b := range want {
		wanted[b.Addr] = b
	}
	var removed, changed []int
	for i, sl := range s.slots {
		b, ok := wanted[sl.be.Addr]
		switch {
		case !ok:
			removed = append(removed, i)
		case b != sl.be:
			changed = append(changed, i)
		}
	}
	var added []Backend
	for _, b := range want {
		if _, ok := s.index[b.Addr]; !ok {
			added = append(added, b)
		}
	}
	if len(removed)+len(added)+len(changed) == 0 {
		return nil
	}
	if grow := len(added) - len(removed); d.active+grow > int(d.opts.MaxBackends) {
		return fmt.Errorf("%d + %d backends exceed %d: %w", d.active, grow, d.opts.MaxBackends, ErrMapFull)
	}

	switch {
	case len(added) == 1 && len(removed) == 0 && len(changed) == 0:
		return d.addOne(t, s, added[0])
	case len(added) == 0 && len(removed) == 1 && len(changed) == 0:
		return d.removeOne(t, s, removed[0])
	case len(added) == 1 && len(removed) == 1 && len(changed) == 0:
		return d.replaceOne(t, s, removed[0], added[0])
	case len(added) == 0 && len(removed) == 0 && len(changed) == 1:
		i := changed[0]
		sl := slot{be: wanted[s.slots[i].be.Addr], id: s.slots[i].id}
		if err := t.putSlot(s, uint32(i), s.buffer, sl); err != nil {
			return err
		}
		s.slots[i] = sl
		return nil
	default:
		return d.rewrite(t, s, want)
	}
}

// addOne appends b as slot count of the active buffer and flips count.
func (d *Datapath) addOne(t *txn, s *service, b Backend) error {
	n := uint32(len(s.slots))
	buf := s.buffer
	if n >= s.high[buf] {
		if err := d.ensureKernelRoom(t, 1, s); err != nil {
			return err
		}
	}
	id, ok := d.beIDs.alloc()
	if !ok {
		return fmt.Errorf("no free backend id: %w", ErrMapFull)
	}
	base := d.readBackendCounter(id)
	sl := slot{be: b, id: id}
	if err := t.putSlot(s, n, buf, sl); err != nil {
		d.beIDs.release(id)
		return err
	}
	if n+1 > s.high[buf] {
		d.setHigh(s, buf, n+1)
	}
	if err := t.putRegistry(id, s.id, b.Addr); err != nil {
		d.beIDs.release(id)
		return err
	}
	if err := t.flip(s, n+1, buf); err != nil {
		t.clearRegistry(id)
		d.beIDs.release(id)
		return err
	}
	s.gen++
	s.index[b.Addr] = len(s.slots)
	s.slots = append(s.slots, sl)
	d.beBase[id] = base
	d.active++
	return nil
}

// removeOne drops slot i: registry first so its flows move at once, then
// the last slot fills the hole, then the flip shrinks count.
func (d *Datapath) removeOne(t *txn, s *service, i int) error {
	last := len(s.slots) - 1
	victim, moved := s.slots[i], s.slots[last]
	buf := s.buffer
	if err := t.clearRegistry(victim.id); err != nil {
		return err
	}
	if i != last {
		if err := t.putSlot(s, uint32(i), buf, moved); err != nil {
			t.putRegistry(victim.id, s.id, victim.be.Addr)
			return err
		}
	}
	if err := t.flip(s, uint32(last), buf); err != nil {
		if i != last {
			t.putSlot(s, uint32(i), buf, victim)
		}
		t.putRegistry(victim.id, s.id, victim.be.Addr)
		return err
	}
	s.gen++
	s.slots[i] = moved
	s.index[moved.be.Addr] = i
	s.slots = s.slots[:last]
	delete(s.index, victim.be.Addr)
	d.beIDs.release(victim.id)
	delete(d.beBase, victim.id)
	d.active--
	return nil
}

// replaceOne puts b into slot i and hands it the old backend's id.
func (d *Datapath) replaceOne(t *txn, s *service, i int, b Backend) error {
	victim := s.slots[i]
	sl := slot{be: b, id: victim.id}
	base := d.readBackendCounter(sl.id)
	if err := t.putSlot(s, uint32(i), s.buffer, sl); err != nil {
		return err
	}
	if err := t.putRegistry(sl.id, s.id, b.Addr); err != nil {
		t.putSlot(s, uint32(i), s.buffer, victim)
		return err
	}
	s.slots[i] = sl
	delete(s.index, victim.be.Addr)
	s.index[b.Addr] = i
	d.beBase[sl.id] = base
	return nil
}

// rewrite writes want into the inactive buffer, flips the service entry to
// it and cleans up afterwards. For a new frontend s has no slots and the
// flip creates the service entry.
func (d *Datapath) rewrite(t *txn, s *service, want []Backend) error {
	nb, ob := 1-s.buffer, s.buffer
	m := uint32(len(want))
	wanted := make(map[netip.AddrPort]bool, len(want))
	for _, b := range want {
		wanted[b.Addr] = true
	}

	// Ids: kept backends keep theirs; newcomers take removed backends' ids
	// first, so one registry write both retires the old backend and admits
	// the new one.
	var retired []slot
	for _, sl := range s.slots {
		if !wanted[sl.be.Addr] {
			retired = append(retired, sl)
		}
	}
	type grant struct {
		id   uint32
		prev *slot // previous owner of a reused id; nil for a fresh id
		addr netip.AddrPort
		base uint64
	}
	var grants []grant
	releaseFresh := func() {
		for _, g := range grants {
			if g.prev == nil {
				d.beIDs.release(g.id)
			}
		}
	}
	slots := make([]slot, m)
	reused := 0
	for i, b := range want {
		if j, ok := s.index[b.Addr]; ok {
			slots[i] = slot{be: b, id: s.slots[j].id}
			continue
		}
		g := grant{addr: b.Addr}
		if reused < len(retired) {
			g.id, g.prev = retired[reused].id, &retired[reused]
			reused++
		} else {
			id, ok := d.beIDs.alloc()
			if !ok {
				releaseFresh()
				return fmt.Errorf("no free backend id: %w", ErrMapFull)
			}
			g.id = id
		}
		g.base = d.readBackendCounter(g.id)
		grants = append(grants, g)
		slots[i] = slot{be: b, id: g.id}
	}

	if m > s.high[nb] {
		if err := d.ensureKernelRoom(t, int(m-s.high[nb]), s); err != nil {
			releaseFresh()
			return err
		}
	}
	// undo restores the first n registry grants; slots written into the
	// inactive buffer are invisible and stay as stale entries.
	undo := func(n int) {
		for _, g := range grants[:n] {
			if g.prev != nil {
				t.putRegistry(g.id, s.id, g.prev.be.Addr)
			} else {
				t.clearRegistry(g.id)
			}
		}
		releaseFresh()
	}
	for i, sl := range slots {
		if err := t.putSlot(s, uint32(i), nb, sl); err != nil {
			undo(0)
			return err
		}
		if uint32(i)+1 > s.high[nb] {
			d.setHigh(s, nb, uint32(i)+1)
		}
	}
	for k, g := range grants {
		if err := t.putRegistry(g.id, s.id, g.addr); err != nil {
			undo(k)
			return err
		}
	}
	if err := t.flip(s, m, nb); err != nil {
		undo(len(grants))
		return err
	}

	// The new set serves from here on: commit the mirror, then clean up.
	d.active += len(slots) - len(s.slots)
	s.gen++
	s.buffer = nb
	s.slots = slots
	s.index = make(map[netip.AddrPort]int, len(slots))
	for i, sl := range slots {
		s.index[sl.be.Addr] = i
	}
	for _, g := range grants {
		d.beBase[g.id] = g.base
	}

	// Flows pinned to retired backends must move now: a failure here is
	// reported, and retried on the next change.
	var errs []error
	for _, sl := range retired[reused:] {
		if err := t.clearRegistry(sl.id); err != nil {
			d.zombies = append(d.zombies, sl.id)
			errs = append(errs, err)
			continue
		}
		d.beIDs.release(sl.id)
		delete(d.beBase, sl.id)
	}
	// Stale slots are invisible; failing to delete them only costs memory
	// until the next cleanup.
	d.trim(t, s, ob, 0)
	d.trim(t, s, nb, m)
	return errors.Join(errs...)
}

// trim deletes the kernel entries of buffer buf at slots [from, high).
func (d *Datapath) trim(t *txn, s *service, buf uint8, from uint32) {
	for i := s.high[buf]; i > from; i-- {
		if err := t.del(d.backends, "backends", backendKey(s.id, i-1, buf)); err != nil {
			d.log.Warn("stale backend slot not deleted", "frontend", frontend(s.key), "slot", i-1, "buffer", buf, "err", err)
			return
		}
		d.setHigh(s, buf, i-1)
	}
}

// ensureKernelRoom makes room for need more entries in the backends map by
// deleting stale slots of other services, oldest-first by no particular
// order. The map holds 2*MaxBackends, and active slots never exceed
// MaxBackends, so this always succeeds when the deletes do.
func (d *Datapath) ensureKernelRoom(t *txn, need int, except *service) error {
	limit := 2 * int(d.opts.MaxBackends)
	if d.kernelSlots+need <= limit {
		return nil
	}
	for _, s := range d.fes {
		if s == except {
			continue
		}
		d.trim(t, s, 1-s.buffer, 0)
		d.trim(t, s, s.buffer, uint32(len(s.slots)))
		if d.kernelSlots+need <= limit {
			return nil
		}
	}
	if except != nil {
		d.trim(t, except, except.buffer, uint32(len(except.slots)))
	}
	if d.kernelSlots+need <= limit {
		return nil
	}
	return fmt.Errorf("backends map holds %d of %d entries, %d more needed: %w", d.kernelSlots, limit, need, ErrMapFull)
}

// retryZombies clears registry entries a previous call failed to clear.
func (d *Datapath) retryZombies(t *txn) {
	left := d.zombies[:0]
	for _, id := range d.zombies {
		if err := t.clearRegistry(id); err != nil {
			left = append(left, id)
			continue
		}
		d.beIDs.release(id)
		delete(d.beBase, id)
	}
	d.zombies = left
}

// DeleteFrontend removes fe: its traffic passes untouched from then on, and
// flows pinned to its backends are no longer translated. Deleting an
// unknown frontend is not an error (0 writes).
func (d *Datapath) DeleteFrontend(fe Frontend) (writes int, err error) {
	key, err := svcKey(fe)
	if err != nil {
		return 0, err
	}
	fe = frontend(key)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.tcColl == nil {
		return 0, errors.New("datapath closed")
	}
	t := &txn{d: d}
	d.retryZombies(t)
	s := d.fes[fe]
	if s == nil {
		return t.writes, nil
	}
	if err := t.del(d.services, "services", s.key); err != nil {
		return t.writes, fmt.Errorf("delete frontend %s: %w", fe, err)
	}
	delete(d.fes, fe)
	d.active -= len(s.slots)
	var errs []error
	for _, sl := range s.slots {
		if err := t.clearRegistry(sl.id); err != nil {
			d.zombies = append(d.zombies, sl.id)
			errs = append(errs, err)
			continue
		}
		d.beIDs.release(sl.id)
		delete(d.beBase, sl.id)
	}
	d.trim(t, s, 0, 0)
	d.trim(t, s, 1, 0)
	// Slots that could not be deleted stay counted until Load collects them.
	if s.high == [2]uint32{} {
		d.svcIDs.release(s.id)
		delete(d.svcBase, s.id)
	}
	if err := errors.Join(errs...); err != nil {
		return t.writes, fmt.Errorf("delete frontend %s: %w", fe, err)
	}
	return t.writes, nil
}
