package maps

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
)

// Frontends returns the programmed frontends and their backends (in slot
// order) from the userspace mirror, without touching the kernel.
func (d *Datapath) Frontends() map[Frontend][]Backend {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[Frontend][]Backend, len(d.fes))
	for fe, s := range d.fes {
		out[fe] = s.backends()
	}
	return out
}

// Capacity reports how many frontends and backends are programmed, and the
// limits Load was given.
func (d *Datapath) Capacity() (frontends, frontendsMax, backends, backendsMax int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.fes), int(d.opts.MaxFrontends), d.active, int(d.opts.MaxBackends)
}

// Dump reads the frontends and their active backends (in slot order) back
// from the kernel maps: what the datapath actually uses.
func (d *Datapath) Dump() (map[Frontend][]Backend, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	svcs, err := d.readServices()
	if err != nil {
		return nil, err
	}
	out := make(map[Frontend][]Backend, len(svcs))
	for _, sv := range svcs {
		fe := frontend(sv.key)
		bs := make([]Backend, 0, sv.value.Count)
		for i := uint32(0); i < sv.value.Count; i++ {
			var v tcBackendValue
			if err := d.backends.Lookup(backendKey(sv.value.Id, i, sv.value.Buffer), &v); err != nil {
				return nil, fmt.Errorf("dump %s slot %d: %w", fe, i, err)
			}
			b, _ := backendFromValue(v)
			bs = append(bs, b)
		}
		out[fe] = bs
	}
	return out, nil
}

type svcEntry struct {
	key   tcSvcKey
	value tcSvcValue
}

func (d *Datapath) readServices() ([]svcEntry, error) {
	var (
		out []svcEntry
		e   svcEntry
	)
	it := d.services.Iterate()
	for it.Next(&e.key, &e.value) {
		out = append(out, e)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read services: %w", err)
	}
	return out, nil
}

// Counters reads the datapath counters, summed over CPUs.
func (d *Datapath) Counters() (Counters, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	c := Counters{
		Frontends: make(map[Frontend]Traffic, len(d.fes)),
		Backends:  make(map[Frontend]map[netip.AddrPort]uint64, len(d.fes)),
	}
	var err error
	stat := func(r tcStatReason) uint64 {
		var per []uint64
		if e := d.stats.Lookup(uint32(r), &per); e != nil {
			err = errors.Join(err, fmt.Errorf("read stat %d: %w", r, e))
		}
		return sum(per)
	}
	c.Drops = Drops{
		NoBackend:    stat(tcStatReasonSTAT_DROP_NO_BACKEND),
		MapFull:      stat(tcStatReasonSTAT_DROP_MAP_FULL),
		ParseError:   stat(tcStatReasonSTAT_DROP_PARSE_ERROR),
		RewriteError: stat(tcStatReasonSTAT_DROP_REWRITE),
	}
	c.ReverseNAT = stat(tcStatReasonSTAT_REVERSE_NAT)
	c.Fragments = stat(tcStatReasonSTAT_FRAGMENT)
	if err != nil {
		return Counters{}, err
	}
	for fe, s := range d.fes {
		t, err := d.svcCounter(s.id)
		if err != nil {
			return Counters{}, err
		}
		base := d.svcBase[s.id]
		c.Frontends[fe] = Traffic{Packets: t.Packets - base.Packets, Bytes: t.Bytes - base.Bytes}
		per := make(map[netip.AddrPort]uint64, len(s.slots))
		for _, sl := range s.slots {
			p, err := d.backendCounter(sl.id)
			if err != nil {
				return Counters{}, err
			}
			per[sl.be.Addr] = p - d.beBase[sl.id]
		}
		c.Backends[fe] = per
	}
	return c, nil
}

func sum(vs []uint64) uint64 {
	var n uint64
	for _, v := range vs {
		n += v
	}
	return n
}

func (d *Datapath) svcCounter(id uint32) (Traffic, error) {
	var per []tcTraffic
	if err := d.svcStats.Lookup(id, &per); err != nil {
		return Traffic{}, fmt.Errorf("read service counter %d: %w", id, err)
	}
	var t Traffic
	for _, v := range per {
		t.Packets += v.Packets
		t.Bytes += v.Bytes
	}
	return t, nil
}

func (d *Datapath) backendCounter(id uint32) (uint64, error) {
	var per []uint64
	if err := d.beStats.Lookup(id, &per); err != nil {
		return 0, fmt.Errorf("read backend counter %d: %w", id, err)
	}
	return sum(per), nil
}

// readSvcCounter and readBackendCounter return the counter an id is about
// to inherit; zero if it cannot be read (counters are best effort).
func (d *Datapath) readSvcCounter(id uint32) Traffic {
	t, _ := d.svcCounter(id)
	return t
}

func (d *Datapath) readBackendCounter(id uint32) uint64 {
	n, _ := d.backendCounter(id)
	return n
}

type adoptStats struct {
	staleSlots    int
	registryFixes int
}

// adopt rebuilds the mirror from the kernel maps (after an agent restart
// the maps are pinned and still forwarding) and collects garbage: slots
// outside every service's active range, and registry entries no active
// slot refers to.
func (d *Datapath) adopt() (adoptStats, error) {
	var st adoptStats
	svcs, err := d.readServices()
	if err != nil {
		return st, err
	}
	t := &txn{d: d}
	byID := make(map[uint32]*service, len(svcs))
	usedSvc := make(map[uint32]bool, len(svcs))
	var broken []*service
	for _, sv := range svcs {
		s := &service{key: sv.key, id: sv.value.Id, gen: sv.value.Generation,
			buffer: sv.value.Buffer & 1, index: make(map[netip.AddrPort]int)}
		ok := true
		for i := uint32(0); i < sv.value.Count; i++ {
			var v tcBackendValue
			if err := d.backends.Lookup(backendKey(s.id, i, s.buffer), &v); err != nil {
				if !errors.Is(err, ebpf.ErrKeyNotExist) {
					return st, fmt.Errorf("read slot: %w", err)
				}
				ok = false
				continue
			}
			b, id := backendFromValue(v)
			if _, dup := s.index[b.Addr]; dup {
				ok = false
				continue
			}
			s.index[b.Addr] = len(s.slots)
			s.slots = append(s.slots, slot{be: b, id: id})
		}
		if !ok || sv.value.Buffer > 1 {
			broken = append(broken, s)
		}
		usedSvc[s.id] = true
		byID[s.id] = s
		d.fes[frontend(sv.key)] = s
	}

	// Backend slots: keep the active range, count everything else as
	// garbage. high[] is set so trim below deletes exactly the garbage.
	var (
		k       tcBackendKey
		v       tcBackendValue
		orphans []tcBackendKey
	)
	it := d.backends.Iterate()
	for it.Next(&k, &v) {
		s := byID[k.SvcId]
		if s == nil || k.Buffer > 1 {
			orphans = append(orphans, k)
			continue
		}
		if k.Slot+1 > s.high[k.Buffer] {
			d.setHigh(s, k.Buffer, k.Slot+1)
		}
	}
	if err := it.Err(); err != nil {
		return st, fmt.Errorf("read backends: %w", err)
	}
	for _, k := range orphans {
		if err := t.del(d.backends, "backends", k); err != nil {
			return st, err
		}
		st.staleSlots++
	}
	before := d.kernelSlots
	for _, s := range d.fes {
		d.trim(t, s, 1-s.buffer, 0)
		d.trim(t, s, s.buffer, uint32(len(s.slots)))
	}
	st.staleSlots += before - d.kernelSlots

	// Backend ids: every active slot owns one.
	owner := make(map[uint32]bool)
	for _, s := range d.fes {
		for _, sl := range s.slots {
			owner[sl.id] = true
		}
	}
	// Registry: entries must match their slot; all others are cleared.
	want := make(map[uint32]tcRegistryValue, len(owner))
	for _, s := range d.fes {
		for _, sl := range s.slots {
			want[sl.id] = registryValue(s.id, sl.be.Addr)
		}
	}
	const chunk = 4096
	keys := make([]uint32, chunk)
	vals := make([]tcRegistryValue, chunk)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := d.registry.BatchLookup(&cursor, keys, vals, nil)
		for i := 0; i < n; i++ {
			w, ok := want[keys[i]]
			if vals[i] != w && (ok || vals[i] != tcRegistryValue{}) {
				if err := t.put(d.registry, "registry", keys[i], w); err != nil {
					return st, err
				}
				st.registryFixes++
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			break
		}
		if err != nil {
			return st, fmt.Errorf("read registry: %w", err)
		}
	}

	for _, s := range d.fes {
		d.active += len(s.slots)
	}
	d.svcIDs.rebuild(1, usedSvc)
	d.beIDs.rebuild(0, owner)

	// Services whose slots were incomplete (a crash mid-change cannot
	// cause this, corruption could) are rewritten from what was found into
	// the other buffer, so the datapath sees a whole set again.
	for _, s := range broken {
		if err := d.rewrite(t, s, s.backends()); err != nil {
			return st, fmt.Errorf("repair %s: %w", frontend(s.key), err)
		}
	}
	if t.writes > 0 {
		d.log.Info("garbage-collected pinned maps", "writes", t.writes, "repaired", len(broken))
	}
	return st, nil
}
