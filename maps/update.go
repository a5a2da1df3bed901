package maps

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
)

// How a frontend changes. Every change is staged (writes the datapath
// cannot see yet), committed by one map write (the flip of the service
// entry, or one slot), and finished (writes that may fail without harm;
// they are queued and retried). Where weights are equal, one backend
// changing costs at most three writes:
//
//   - Added (active): write slot[count], write its registry entry, flip
//     count+1.
//   - Draining again → active: write slot[count], flip, then its registry
//     entry says active.
//   - Active → draining: its registry entry says draining, the last slot
//     moves into its hole, flip count-1. Its flows keep it; SYNs reusing
//     their tuple and affinity move elsewhere.
//   - Active → gone: the last slot moves into its hole, flip count-1, then
//     its id's generation is bumped (tlb_backend_stats), which releases the
//     id: every flow pinned to it is re-balanced on its next packet. Its
//     registry entry is left as it is; the bumped generation retires it.
//   - Draining → gone: the generation bump alone.
//   - One backend in, one out: the newcomer overwrites the leaver's slot
//     (the commit), with the registry writes and bump around it.
//   - Only NodeLocal/ZoneLocal of one backend: its slots, then its
//     registry entry.
//   - Anything else, and any change of a weighted table: the whole table is
//     written into the inactive buffer, then the service entry flips to it.
//
// In every case a reader sees either the old set or the new one. A write
// that fails before the commit is undone and leaves the previous set
// serving; an undo that fails is queued (an id to retire, a registry entry
// or a frontend to rewrite), logged, and retried at the start of the next
// change.

// SetBackends is SetService(fe, Service{Backends: backends}): no session
// affinity, drop when no backend is active.
func (d *writer) SetBackends(fe Frontend, backends []Backend) (writes int, err error) {
	return d.SetService(fe, Service{Backends: backends})
}

// SetService makes s what fe serves, creating fe if needed, with the
// fewest map writes that keep every intermediate state valid (see the
// comment at the top of update.go). It returns the number of map writes
// issued. The same service again costs 0 writes; order and duplicates
// of backends do not matter. No active backend keeps the frontend and
// makes the datapath drop new flows to it (Drops.NoBackend), or refuse
// them with Reject (StatReject).
//
// Invalid input writes nothing. ErrMapFull is returned, before any write,
// when the change would exceed MaxFrontends or MaxBackends (ids or slots).
// An error with writes > 0 either left the previous set serving (nothing
// committed) or, when the change took effect but a finishing write
// failed, queued that write for retry; the error says which step failed.
func (d *writer) SetService(fe Frontend, s Service) (writes int, err error) {
	key, err := svcKey(fe)
	if err != nil {
		return 0, err
	}
	fe = frontend(key)
	tg, err := normalizeService(s)
	if err == nil {
		err = sameFamily(fe, tg)
	}
	if err != nil {
		return 0, fmt.Errorf("frontend %s: %w", fe, err)
	}
	if _, err := encodeName(s.Name); err != nil {
		return 0, fmt.Errorf("frontend %s: %w", fe, err)
	}

	return d.write(func(t *txn) error {
		var err error
		if svc := d.fes[fe]; svc == nil {
			err = d.create(t, fe, key, tg)
		} else {
			err = d.updateWithRanges(t, svc, tg)
		}
		// The name follows the frontend once it exists, also when a
		// finishing write failed; a failed name write is retried by
		// the next SetService.
		if svc := d.fes[fe]; svc != nil {
			err = errors.Join(err, t.putName(svc, s.Name))
		}
		if err != nil {
			return fmt.Errorf("set service %s: %w", fe, err)
		}
		return nil
	})
}

// write runs f on a new transaction under d's lock, once the writes still
// pending from earlier changes were retried in it, and returns the
// transaction's writes (the retries' included) and f's error; ErrClosed
// and no write after Close.
func (d *writer) write(f func(t *txn) error) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed() {
		return 0, ErrClosed
	}
	t := &txn{d: d.Datapath}
	d.retryPending(t)
	err := f(t)
	return t.writes, errors.Join(err, t.finish())
}

// target is a validated Service.
type target struct {
	active   []Backend // caller's order, duplicates dropped
	draining []Backend
	set      settings
	ranges   []netip.Prefix // sorted
}

// normalizeService validates s and splits its backends by state. The same
// address twice with different settings is an error.
func normalizeService(s Service) (target, error) {
	aff, err := affinitySeconds(s.Affinity)
	if err != nil {
		return target{}, err
	}
	ranges, err := normalizeRanges(s.SourceRanges)
	if err != nil {
		return target{}, err
	}
	tg := target{set: settings{affinity: aff, reject: s.Reject, srcRanges: len(ranges) > 0, srcNode: len(ranges) > 0 && s.SourceRangesNode},
		ranges: ranges}
	seen := make(map[netip.AddrPort]Backend, len(s.Backends))
	for _, b := range s.Backends {
		b, err := normalize(b)
		if err != nil {
			return target{}, err
		}
		if prev, ok := seen[b.Addr]; ok {
			if prev != b {
				return target{}, fmt.Errorf("backend %s listed twice with different settings", b.Addr)
			}
			continue
		}
		seen[b.Addr] = b
		if b.Draining {
			tg.draining = append(tg.draining, b)
		} else {
			tg.active = append(tg.active, b)
		}
	}
	return tg, nil
}

// sameFamily checks that every backend and source range of tg has fe's
// address family: the datapath translates addresses, never families, and
// a range of the other family would match no source.
func sameFamily(fe Frontend, tg target) error {
	v4 := fe.Addr.Addr().Is4()
	for _, b := range slices.Concat(tg.active, tg.draining) {
		if b.Addr.Addr().Is4() != v4 {
			return fmt.Errorf("backend %s: not the frontend's address family", b.Addr)
		}
	}
	for _, p := range tg.ranges {
		if p.Addr().Is4() != v4 {
			return fmt.Errorf("source range %s: not the frontend's address family", p)
		}
	}
	return nil
}

// plan is what a change does to each backend of a frontend.
type plan struct {
	tg     target
	counts []uint32 // slots of tg.active[i]
	equal  bool     // all active weights equal: one slot each
	// next holds the Backend each staying member becomes (Weight = its
	// slot count, 0 when draining).
	next    map[*member]Backend
	added   []Backend // active, not programmed yet (Weight = slot count)
	fresh   []*member // added, once ids are allocated
	undrain []*member // draining -> active
	drain   []*member // active -> draining
	gone    []*member // programmed, not in the target (active or draining)
	// reflagged members change only NodeLocal/ZoneLocal; reweighted says
	// some staying active member's slot count changes.
	reflagged  []*member
	reweighted bool
}

// planChange compares s with tg. A draining backend of tg that s does not
// program is ignored.
func planChange(s *service, tg target) *plan {
	p := &plan{tg: tg, next: make(map[*member]Backend)}
	w := make([]uint32, len(tg.active))
	for i, b := range tg.active {
		w[i] = b.Weight
	}
	p.counts, p.equal = slotCounts(w)
	want := make(map[netip.AddrPort]Backend, len(tg.active)+len(tg.draining))
	for i, b := range tg.active {
		b.Weight = p.counts[i]
		want[b.Addr] = b
		if _, ok := s.members[b.Addr]; !ok {
			p.added = append(p.added, b)
		}
	}
	for _, b := range tg.draining {
		want[b.Addr] = b
	}
	for _, m := range s.members {
		b, ok := want[m.be.Addr]
		switch {
		case !ok:
			p.gone = append(p.gone, m)
			continue
		case m.be.Draining && !b.Draining:
			p.undrain = append(p.undrain, m)
		case !m.be.Draining && b.Draining:
			p.drain = append(p.drain, m)
		default:
			if b.Weight != m.be.Weight {
				p.reweighted = true
			}
			if backendFlags(b) != backendFlags(m.be) {
				p.reflagged = append(p.reflagged, m)
			}
		}
		p.next[m] = b
	}
	for _, l := range [][]*member{p.undrain, p.drain, p.gone, p.reflagged} {
		slices.SortFunc(l, func(a, b *member) int { return a.be.Addr.Compare(b.be.Addr) })
	}
	return p
}

// activeGone counts the gone members that were active.
func (p *plan) activeGone() []*member {
	var out []*member
	for _, m := range p.gone {
		if !m.be.Draining {
			out = append(out, m)
		}
	}
	return out
}

// tableSame reports whether the slot table keeps its members and counts.
func (p *plan) tableSame() bool {
	return len(p.added) == 0 && len(p.undrain) == 0 && len(p.drain) == 0 &&
		len(p.activeGone()) == 0 && !p.reweighted
}

// empty reports whether the change writes nothing.
func (p *plan) empty(s *service) bool {
	return p.tableSame() && len(p.gone) == 0 && len(p.reflagged) == 0 && p.tg.set == s.set
}

// tableLen is the number of slots of the target table.
func (p *plan) tableLen() int {
	n := 0
	for _, c := range p.counts {
		n += int(c)
	}
	return n
}

func (d *writer) checkCapacity(s *service, p *plan) error {
	if len(p.added) > d.beIDs.available() {
		return fmt.Errorf("%d more backend ids needed, %d free of %d: %w", len(p.added), d.beIDs.available(), d.opts.MaxBackends, ErrMapFull)
	}
	if grow := p.tableLen() - len(s.table); d.slots+grow > int(d.opts.MaxBackends) {
		return fmt.Errorf("%d + %d slots exceed %d: %w", d.slots, grow, d.opts.MaxBackends, ErrMapFull)
	}
	return nil
}

// allocate gives every added backend an id; the members carry the id's
// current generation and counters. On error nothing is allocated.
func (d *writer) allocate(p *plan) error {
	for _, b := range p.added {
		id, ok := d.beIDs.alloc()
		if !ok {
			d.releaseFresh(p)
			return fmt.Errorf("no free backend id: %w", ErrMapFull)
		}
		// A free id's flows were marked stale when it was released:
		// its record is all it carries.
		rec, err := d.readRecord(id)
		if err != nil {
			d.beIDs.release(id)
			d.releaseFresh(p)
			return err
		}
		p.fresh = append(p.fresh, &member{be: b, id: id, gen: rec.gen, base: rec.traffic, fresh: true})
	}
	return nil
}

// releaseFresh returns the ids of an uncommitted change, except those
// queued to retire (their registry entry could not be undone).
func (d *writer) releaseFresh(p *plan) {
	for _, m := range p.fresh {
		if m.fresh {
			d.beIDs.release(m.id)
		}
	}
	p.fresh = nil
}

func (d *writer) create(t *txn, fe Frontend, key tcSvcKey, tg target) error {
	if len(d.fes) >= int(d.opts.MaxFrontends) {
		return fmt.Errorf("%d frontends: %w", d.opts.MaxFrontends, ErrMapFull)
	}
	id, ok := d.svcIDs.alloc()
	if !ok {
		return fmt.Errorf("no free service id: %w", ErrMapFull)
	}
	// A new frontend is a rewrite of an empty one: buffer 0 is written,
	// then "flipped" to by creating the service entry. Its source ranges
	// and a zero refusal count go in before.
	s := &service{fe: fe, key: key, id: id, buffer: 1, members: make(map[netip.AddrPort]*member)}
	var err error
	if tg.set.srcRanges {
		err = d.resetRangeDrops(t, id)
	}
	if err == nil {
		// A reused id may still hold prefixes a failed delete left.
		err = d.pruneRanges(t, id, tg.ranges)
	}
	if err == nil {
		err = d.putRanges(t, id, tg.ranges)
	}
	committed := false
	if err == nil {
		committed, err = d.rewrite(t, s, planChange(s, tg))
	}
	if !committed {
		// Nothing is visible; delete what was written under the id
		// before the id can be handed out again.
		err = errors.Join(err, d.pruneRanges(t, id, nil))
		d.trim(t, s, 0, 0)
		if s.high[0] == 0 {
			d.svcIDs.release(id)
		}
		return err
	}
	d.fes[fe] = s
	return err
}

// updateWithRanges is update with the source ranges around it: prefixes
// in before the service entry names them, out after (srcrange.go).
func (d *writer) updateWithRanges(t *txn, s *service, tg target) error {
	if err := d.putRanges(t, s.id, tg.ranges); err != nil {
		return err
	}
	if tg.set.srcRanges && !s.set.srcRanges {
		if err := d.resetRangeDrops(t, s.id); err != nil {
			return err
		}
	}
	if err := d.update(t, s, tg); err != nil {
		return err
	}
	return d.pruneRanges(t, s.id, tg.ranges)
}

func (d *writer) update(t *txn, s *service, tg target) error {
	p := planChange(s, tg)
	if p.empty(s) {
		return nil
	}
	var err error
	switch {
	case p.tableSame():
		err = d.updateInPlace(t, s, p)
	case p.equal && s.equalWeights() && len(p.reflagged) == 0 &&
		len(p.added)+len(p.undrain) <= 1 && len(p.drain)+len(p.activeGone()) <= 1:
		err = d.updateOne(t, s, p)
	default:
		_, err = d.rewrite(t, s, p)
	}
	return err
}

// nextValue is m's slot value once the change is committed.
func (p *plan) nextValue(m *member) *member {
	if b, ok := p.next[m]; ok {
		return &member{be: b, id: m.id, gen: m.gen}
	}
	return m
}

// registryStep writes m's registry entry as the plan leaves it; when
// taken before the commit its undo restores the current entry.
func (d *writer) registryStep(t *txn, s *service, p *plan, m *member, before bool) step {
	st := step{
		do:    func() error { return t.putRegistry(s, p.nextValue(m)) },
		queue: func() { d.fixRegistry[m.id] = true },
	}
	if before {
		st.undo = func() error { return t.putRegistry(s, m) }
	}
	return st
}

// freshStep writes a new member's registry entry before the commit; its
// undo clears it, and when that fails the id is retired instead.
func (d *writer) freshStep(t *txn, s *service, m *member) step {
	return step{
		do:   func() error { return t.putRegistry(s, m) },
		undo: func() error { return t.clearRegistry(m.id) },
		queue: func() {
			m.fresh = false // not returned to the allocator: retired
			d.retire = append(d.retire, retiring{m.id, m.gen + 1})
		},
	}
}

// releaseStep bumps m's generation after the commit, which releases its
// id: flows pinned to it are re-balanced on their next packet.
func (d *writer) releaseStep(t *txn, m *member) step {
	return step{
		do: func() error {
			if err := t.putGeneration(m.id, m.gen+1); err != nil {
				return err
			}
			d.beIDs.release(m.id)
			return nil
		},
		queue: func() { d.retire = append(d.retire, retiring{m.id, m.gen + 1}) },
	}
}

// slotStep rewrites slot i of the active buffer from old to next, both
// visible: its undo writes old back; when that fails the frontend is
// reprogrammed on the next change.
func (d *writer) slotStep(t *txn, s *service, i uint32, old, next *member) step {
	return step{
		do:    func() error { return t.putSlot(s, i, s.buffer, next) },
		undo:  func() error { return t.putSlot(s, i, s.buffer, old) },
		queue: func() { d.dirty[s.fe] = true },
	}
}

// finishSteps are the writes after the commit every path shares:
// registry entries of backends turning active or changing flags, and
// releasing the ids of gone backends.
func (d *writer) finishSteps(t *txn, s *service, p *plan) []step {
	var post []step
	for _, m := range append(slices.Clone(p.undrain), p.reflagged...) {
		post = append(post, d.registryStep(t, s, p, m, false))
	}
	for _, m := range p.gone {
		post = append(post, d.releaseStep(t, m))
	}
	return post
}

// commitMirror records a committed change: table is the new active
// buffer buf, flipped says the service entry was written.
func (d *writer) commitMirror(s *service, p *plan, table []*member, buf uint8, flipped bool) {
	for m, b := range p.next {
		m.be = b
	}
	for _, m := range p.gone {
		d.queueFinal(d.beginFinal(s, m))
		delete(s.members, m.be.Addr)
	}
	for _, m := range p.fresh {
		m.fresh = false
		s.members[m.be.Addr] = m
	}
	p.fresh = nil
	d.slots += len(table) - len(s.table)
	s.table = table
	s.buffer = buf
	s.set = p.tg.set
	if flipped {
		s.gen++
	}
}

// updateOne applies at most one backend joining and one leaving an
// equal-weight table (the three-write paths), with the finishing writes
// of draining backends.
func (d *writer) updateOne(t *txn, s *service, p *plan) error {
	if err := d.checkCapacity(s, p); err != nil {
		return err
	}
	if err := d.allocate(p); err != nil {
		return err
	}
	in, out := p.joining(), p.leaving()
	var c change
	if out != nil && p.next[out].Draining {
		c.pre = append(c.pre, d.registryStep(t, s, p, out, true))
	}
	if in != nil && in.fresh {
		c.pre = append(c.pre, d.freshStep(t, s, in))
	}
	var (
		table   []*member
		flipped = true
	)
	switch {
	case out == nil:
		var err error
		if table, err = d.stageAppend(t, s, p, in, &c); err != nil {
			d.releaseFresh(p)
			return err
		}
	case in == nil:
		table = d.stageRemove(t, s, p, out, &c)
	default:
		table, flipped = d.stageReplace(t, s, p, in, out, &c)
	}
	c.post = d.finishSteps(t, s, p)
	committed, err := d.run(&c, func() { d.commitMirror(s, p, table, s.buffer, flipped) })
	if !committed {
		d.releaseFresh(p)
	}
	return err
}

// joining is the backend entering the table, if any: fresh or undrained.
func (p *plan) joining() *member {
	switch {
	case len(p.fresh) == 1:
		return p.fresh[0]
	case len(p.undrain) == 1:
		return p.undrain[0]
	}
	return nil
}

// leaving is the backend leaving the table, if any: draining or gone.
func (p *plan) leaving() *member {
	if len(p.drain) == 1 {
		return p.drain[0]
	}
	if g := p.activeGone(); len(g) == 1 {
		return g[0]
	}
	return nil
}

// stageAppend stages in at slot count (invisible until the flip to
// count+1) and returns the new table.
func (d *writer) stageAppend(t *txn, s *service, p *plan, in *member, c *change) ([]*member, error) {
	buf, n := s.buffer, uint32(len(s.table))
	if n >= s.high[buf] {
		if err := d.ensureKernelRoom(t, 1, s); err != nil {
			return nil, err
		}
	}
	c.pre = append([]step{{do: func() error {
		if err := t.putSlot(s, n, buf, p.nextValue(in)); err != nil {
			return err
		}
		d.setHigh(s, buf, max(s.high[buf], n+1))
		return nil
	}}}, c.pre...)
	c.commit = func() error { return t.putService(s, n+1, buf, p.tg.set) }
	return append(slices.Clone(s.table), in), nil
}

// stageRemove moves the last slot into out's hole and flips to count-1;
// it returns the new table.
func (d *writer) stageRemove(t *txn, s *service, p *plan, out *member, c *change) []*member {
	i, last := slices.Index(s.table, out), len(s.table)-1
	table := slices.Clone(s.table)
	if i != last {
		c.pre = append(c.pre, d.slotStep(t, s, uint32(i), out, s.table[last]))
		table[i] = s.table[last]
	}
	c.commit = func() error { return t.putService(s, uint32(last), s.buffer, p.tg.set) }
	return table[:last]
}

// stageReplace overwrites out's slot with in (the commit), writing the
// service entry first when the settings change; it returns the new table
// and whether the service entry is written.
func (d *writer) stageReplace(t *txn, s *service, p *plan, in, out *member, c *change) ([]*member, bool) {
	i, n := slices.Index(s.table, out), uint32(len(s.table))
	flipped := p.tg.set != s.set
	if flipped {
		c.pre = append(c.pre, step{
			do:    func() error { return t.putService(s, n, s.buffer, p.tg.set) },
			undo:  func() error { return t.putService(s, n, s.buffer, s.set) },
			queue: func() { d.dirty[s.fe] = true },
		})
	}
	c.commit = func() error { return t.putSlot(s, uint32(i), s.buffer, p.nextValue(in)) }
	table := slices.Clone(s.table)
	table[i] = in
	return table, flipped
}

// updateInPlace applies changes that keep the table's members and
// counts: flags, settings, draining backends leaving.
func (d *writer) updateInPlace(t *txn, s *service, p *plan) error {
	var c change
	for _, m := range p.reflagged {
		for i, x := range s.table {
			if x == m {
				c.pre = append(c.pre, d.slotStep(t, s, uint32(i), m, p.nextValue(m)))
			}
		}
	}
	flipped := p.tg.set != s.set
	if flipped {
		n := uint32(len(s.table))
		c.commit = func() error { return t.putService(s, n, s.buffer, p.tg.set) }
	}
	c.post = d.finishSteps(t, s, p)
	_, err := d.run(&c, func() { d.commitMirror(s, p, s.table, s.buffer, flipped) })
	return err
}

// expandTable lists the members of the target table, slot by slot: each
// active backend of the target repeated by its slot count.
func expandTable(s *service, p *plan) []*member {
	fresh := make(map[netip.AddrPort]*member, len(p.fresh))
	for _, m := range p.fresh {
		fresh[m.be.Addr] = m
	}
	table := make([]*member, 0, p.tableLen())
	for i, b := range p.tg.active {
		m := s.members[b.Addr]
		if m == nil {
			m = fresh[b.Addr]
		}
		for k := uint32(0); k < p.counts[i]; k++ {
			table = append(table, m)
		}
	}
	return table
}

// rewrite writes the target table into the inactive buffer and flips the
// service entry to it. For a new frontend s has no members and the flip
// creates the service entry.
func (d *writer) rewrite(t *txn, s *service, p *plan) (committed bool, err error) {
	if err := d.checkCapacity(s, p); err != nil {
		return false, err
	}
	if err := d.allocate(p); err != nil {
		return false, err
	}
	nb, ob := 1-s.buffer, s.buffer
	table := expandTable(s, p)
	m := uint32(len(table))
	if m > s.high[nb] {
		if err := d.ensureKernelRoom(t, int(m-s.high[nb]), s); err != nil {
			d.releaseFresh(p)
			return false, err
		}
	}
	var c change
	c.pre = append(c.pre, step{do: func() error {
		for i, x := range table {
			if err := t.putSlot(s, uint32(i), nb, p.nextValue(x)); err != nil {
				return err
			}
			d.setHigh(s, nb, max(s.high[nb], uint32(i)+1))
		}
		return nil
	}})
	for _, x := range p.fresh {
		c.pre = append(c.pre, d.freshStep(t, s, x))
	}
	for _, x := range p.drain {
		c.pre = append(c.pre, d.registryStep(t, s, p, x, true))
	}
	c.commit = func() error { return t.putService(s, m, nb, p.tg.set) }
	c.post = d.finishSteps(t, s, p)
	committed, err = d.run(&c, func() { d.commitMirror(s, p, table, nb, true) })
	if !committed {
		d.releaseFresh(p)
		return false, err
	}
	// Stale slots are invisible; failing to delete them only costs memory
	// until the next cleanup.
	d.trim(t, s, ob, 0)
	d.trim(t, s, nb, m)
	return true, err
}

// reprogram writes s as the mirror holds it into the inactive buffer,
// rewrites its members' registry entries and flips to it: the repair of a
// frontend whose kernel entries drifted.
func (d *writer) reprogram(t *txn, s *service) error {
	p := &plan{tg: target{set: s.set}}
	nb, ob := 1-s.buffer, s.buffer
	m := uint32(len(s.table))
	if m > s.high[nb] {
		if err := d.ensureKernelRoom(t, int(m-s.high[nb]), s); err != nil {
			return err
		}
	}
	for i, x := range s.table {
		if err := t.putSlot(s, uint32(i), nb, x); err != nil {
			return err
		}
		d.setHigh(s, nb, max(s.high[nb], uint32(i)+1))
	}
	for _, x := range sortedMembers(s) {
		if err := t.putRegistry(s, x); err != nil {
			return err
		}
	}
	if err := t.putService(s, m, nb, s.set); err != nil {
		return err
	}
	d.commitMirror(s, p, s.table, nb, true)
	d.trim(t, s, ob, 0)
	d.trim(t, s, nb, m)
	return nil
}

func sortedMembers(s *service) []*member {
	out := make([]*member, 0, len(s.members))
	for _, m := range s.members {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b *member) int { return cmp.Compare(a.id, b.id) })
	return out
}

// trim deletes the kernel entries of buffer buf at slots [from, high).
func (d *writer) trim(t *txn, s *service, buf uint8, from uint32) {
	for i := s.high[buf]; i > from; i-- {
		if err := t.del(d.backends, "backends", backendKey(s.id, i-1, buf)); err != nil {
			d.log.Warn("stale backend slot not deleted", "frontend", s.fe, "slot", i-1, "buffer", buf, "err", err)
			return
		}
		d.setHigh(s, buf, i-1)
	}
}

// ensureKernelRoom makes room for need more entries in the backends map by
// deleting stale slots of other services, in no particular order. The map
// holds 2*MaxBackends, and active slots never exceed MaxBackends, so this
// always succeeds when the deletes do.
func (d *writer) ensureKernelRoom(t *txn, need int, except *service) error {
	limit := 2 * int(d.opts.MaxBackends)
	if d.kernelSlots+need <= limit {
		return nil
	}
	for _, s := range d.fes {
		if s == except {
			continue
		}
		d.trim(t, s, 1-s.buffer, 0)
		d.trim(t, s, s.buffer, uint32(len(s.table)))
		if d.kernelSlots+need <= limit {
			return nil
		}
	}
	if except != nil {
		d.trim(t, except, except.buffer, uint32(len(except.table)))
	}
	if d.kernelSlots+need <= limit {
		return nil
	}
	return fmt.Errorf("backends map holds %d of %d entries, %d more needed: %w", d.kernelSlots, limit, need, ErrMapFull)
}

// retryPending retries the queued cleanups of earlier changes. Failures
// stay queued and are logged; they do not fail the change at hand.
func (d *writer) retryPending(t *txn) {
	if d.pending() == 0 {
		return
	}
	left := d.retire[:0]
	for _, r := range d.retire {
		if err := t.putGeneration(r.id, r.gen); err != nil {
			d.log.Warn("retiring backend id failed again", "id", r.id, "err", err)
			left = append(left, r)
			continue
		}
		d.beIDs.release(r.id)
	}
	d.retire = left
	owners := d.owners()
	for id := range d.fixRegistry {
		s := owners[id]
		if s == nil {
			delete(d.fixRegistry, id)
			continue
		}
		if err := t.putRegistry(s, s.byID(id)); err != nil {
			d.log.Warn("registry rewrite failed again", "id", id, "err", err)
			continue
		}
		delete(d.fixRegistry, id)
	}
	for fe := range d.dirty {
		s := d.fes[fe]
		if s != nil {
			if err := d.reprogram(t, s); err != nil {
				d.log.Warn("reprogramming frontend failed again", "frontend", fe, "err", err)
				continue
			}
		}
		delete(d.dirty, fe)
	}
}

// DeleteFrontend removes fe: new flows to it pass untouched from then on,
// and the ids of its backends are released, so flows pinned to them are
// no longer translated. Deleting an unknown frontend is not an error (0
// writes).
func (d *writer) DeleteFrontend(fe Frontend) (writes int, err error) {
	key, err := svcKey(fe)
	if err != nil {
		return 0, err
	}
	fe = frontend(key)
	return d.write(func(t *txn) error { return d.deleteFrontend(t, fe) })
}

// deleteFrontend deletes fe, when it is programmed, in t.
func (d *writer) deleteFrontend(t *txn, fe Frontend) error {
	s := d.fes[fe]
	if s == nil {
		return nil
	}
	c := change{commit: func() error { return t.del(d.services, "services", s.key) }}
	for _, m := range sortedMembers(s) {
		c.post = append(c.post, d.releaseStep(t, m))
	}
	committed, err := d.run(&c, func() {
		delete(d.fes, fe)
		delete(d.dirty, fe)
		d.slots -= len(s.table)
	})
	if !committed {
		return fmt.Errorf("delete frontend %s: %w", fe, err)
	}
	d.trim(t, s, 0, 0)
	d.trim(t, s, 1, 0)
	if rerr := d.pruneRanges(t, s.id, nil); rerr != nil {
		err = errors.Join(err, rerr)
	}
	// A name left behind names nothing (readers show names of
	// frontends in tlb_services only) and Load deletes it.
	if nerr := t.putName(s, ""); nerr != nil {
		d.log.Warn("frontend deleted, its name record stays until the next load", "frontend", fe, "err", nerr)
	}
	// Slots that could not be deleted keep the service id until Load
	// collects them.
	if s.high == [2]uint32{} {
		d.svcIDs.release(s.id)
	}
	if err != nil {
		return fmt.Errorf("delete frontend %s: %w", fe, err)
	}
	return nil
}
