package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Upgrading from the previous layout (migrateFrom, layout8.go) without a
// reset. Load finds maps of that layout pinned and, instead of failing:
//
//  1. opens the pinned maps whose shape changed (prevMaps) and creates their
//     twins of this layout, unpinned, with every entry converted, and
//     creates the maps this layout added, unpinned and empty; every
//     other map kept its shape and is adopted as it is pinned, flows
//     (conntrack, SNAT ports) included, so the old and the new programs
//     share them;
//  2. loads this layout's programs on them and adopts them (adopt.go)
//     like any restart;
//  3. swaps the programs on every pinned link (interfaces' tcx and XDP
//     links, the socket hooks' cgroup links), each an atomic replacement
//     in the kernel; a swap that fails puts the links already swapped back;
//  4. copies again what the old programs created between 1 and 3
//     (affinity, socket records: the maps they write whose shape changed);
//  5. pins the new maps over the old ones (rename, atomic per map) and
//     stamps tlb_meta with this layout.
//
// Until 3 nothing of the old datapath is written: a failure (a hostile or
// truncated map, a size that does not fit) leaves it pinned, attached and
// forwarding, and Load returns the error. The new maps are unpinned until
// 5, so nothing is left behind either.

// prevMap is one map of the previous layout whose shape changed, or one
// this layout added.
type prevMap struct {
	name string
	// added: the previous layout has no such map; it starts empty, and
	// nothing of the rest applies.
	added      bool
	typ        ebpf.MapType
	key, value any
	// delta: the programs write it; copied again after the swap.
	delta bool
	// optional: an agent may not have pinned it (tlb_names).
	optional bool
	// copy converts every entry of from into to with flags.
	copy func(from, to *ebpf.Map, flags ebpf.MapUpdateFlags) (int, error)
}

// migration carries the pinned maps of the previous layout into this one.
type migration struct {
	pinPath string
	// old are the pinned maps of prevMaps (nil for an optional one not
	// pinned), fresh their twins of this layout, by name.
	old, fresh map[string]*ebpf.Map
	// copied and delta count the entries converted per map, before and
	// after the swap.
	copied, delta map[string]int
	// swapped are the links whose program was replaced, with the program
	// each had, for rollback.
	swapped []swappedLink
}

type swappedLink struct {
	pin string
	l   link.Link
	old *ebpf.Program
}

// testBeforeSwap, nil outside tests, runs between the conversion and the
// swap, where the old programs may still write to their maps.
var testBeforeSwap func(pinPath string)

// prepareMigration opens the previous layout's pinned maps and converts
// them into fresh ones sized as spec says (which sizeMaps set from the
// options: they must be the old maps' sizes). It writes nothing pinned.
func prepareMigration(pinPath string, spec *ebpf.CollectionSpec, maxFrontends uint32) (_ *migration, err error) {
	mg := &migration{pinPath: pinPath, old: map[string]*ebpf.Map{}, fresh: map[string]*ebpf.Map{},
		copied: map[string]int{}, delta: map[string]int{}}
	defer func() {
		if err != nil {
			mg.close()
		}
	}()
	for _, lm := range prevMaps {
		if lm.added {
			// The previous layout has no such map: one pinned says these
			// are not its maps (this layout's, stamped otherwise).
			if _, err := os.Stat(filepath.Join(pinPath, lm.name)); err == nil {
				return nil, fmt.Errorf("layout %d has no %s, yet one is pinned at %s: %w", migrateFrom, lm.name, pinPath, ErrLayoutMismatch)
			}
			ms := spec.Maps[lm.name].Copy()
			ms.Pinning = ebpf.PinNone
			if mg.fresh[lm.name], err = ebpf.NewMap(ms); err != nil {
				return nil, fmt.Errorf("create %s of layout %d: %w", lm.name, layoutVersion, err)
			}
			continue
		}
		path := filepath.Join(pinPath, lm.name)
		old, err := ebpf.LoadPinnedMap(path, nil)
		if lm.optional && errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("open layout %d %s: %w", migrateFrom, lm.name, err)
		}
		mg.old[lm.name] = old
		var ms *ebpf.MapSpec
		if lm.name == namesMap {
			ms = namesSpec(maxFrontends)
		} else {
			ms = spec.Maps[lm.name].Copy()
		}
		ms.Pinning = ebpf.PinNone
		if err := lm.check(old, ms); err != nil {
			return nil, fmt.Errorf("layout %d map %s: %w: %w", migrateFrom, path, err, ErrLayoutMismatch)
		}
		fresh, err := ebpf.NewMap(ms)
		if err != nil {
			return nil, fmt.Errorf("create %s of layout %d: %w", lm.name, layoutVersion, err)
		}
		mg.fresh[lm.name] = fresh
		if mg.copied[lm.name], err = lm.copy(old, fresh, ebpf.UpdateAny); err != nil {
			return nil, fmt.Errorf("convert %s from layout %d: %w", lm.name, migrateFrom, err)
		}
	}
	return mg, nil
}

// check compares a pinned map with what the previous layout made and what its twin
// will hold.
func (lm prevMap) check(old *ebpf.Map, ms *ebpf.MapSpec) error {
	keySize, valueSize := uint32(binary.Size(lm.key)), uint32(binary.Size(lm.value))
	switch {
	case old.Type() != lm.typ:
		return fmt.Errorf("type %s, layout %d made %s", old.Type(), migrateFrom, lm.typ)
	case old.KeySize() != keySize || old.ValueSize() != valueSize:
		return fmt.Errorf("key and value of %d and %d bytes, layout %d has %d and %d",
			old.KeySize(), old.ValueSize(), migrateFrom, keySize, valueSize)
	case old.MaxEntries() != ms.MaxEntries && lm.name != namesMap:
		return fmt.Errorf("%d entries, this agent's options make %d (start it with the old agent's sizes)",
			old.MaxEntries(), ms.MaxEntries)
	}
	return nil
}

// convertEntries copies every entry of from into to, converted by conv.
// With UpdateNoExist, keys to already holds are left as they are.
func convertEntries[OK, OV, NK, NV any](from, to *ebpf.Map, flags ebpf.MapUpdateFlags, conv func(OK, OV) (NK, NV)) (int, error) {
	var (
		k OK
		v OV
		n int
	)
	it := from.Iterate()
	for it.Next(&k, &v) {
		nk, nv := conv(k, v)
		err := to.Update(&nk, &nv, flags)
		if flags == ebpf.UpdateNoExist && errors.Is(err, ebpf.ErrKeyExist) {
			continue
		}
		if err != nil {
			return n, fmt.Errorf("write entry %d: %w", n, err)
		}
		n++
	}
	if err := it.Err(); err != nil {
		return n, fmt.Errorf("read: %w", err)
	}
	return n, nil
}

// replacements are the fresh maps the programs are loaded with instead of
// the pinned ones of the same name (tlb_names is not a program's map).
func (mg *migration) replacements() map[string]*ebpf.Map {
	if mg == nil {
		return nil
	}
	out := make(map[string]*ebpf.Map, len(mg.fresh))
	for name, m := range mg.fresh {
		if name != namesMap {
			out[name] = m
		}
	}
	return out
}

// names is the converted tlb_names, created empty when the old agent
// pinned none; the caller owns (closes) it.
func (mg *migration) names(maxFrontends uint32) (*ebpf.Map, error) {
	if m := mg.fresh[namesMap]; m != nil {
		return m.Clone()
	}
	spec := namesSpec(maxFrontends)
	spec.Pinning = ebpf.PinNone
	m, err := ebpf.NewMap(spec)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", namesMap, err)
	}
	mg.fresh[namesMap] = m
	return m.Clone()
}

// commit swaps the programs on every pinned link for d's, copies what the
// old programs wrote meanwhile and pins the fresh maps over the old ones.
// It fails without a trace of the new layout on the node when the swap
// fails; after it, it returns the first error of the steps that follow,
// with the new programs forwarding on the new maps.
func (mg *migration) commit(d *Datapath, fingerprint uint64) error {
	if testBeforeSwap != nil {
		testBeforeSwap(mg.pinPath)
	}
	if err := mg.swap(d); err != nil {
		return fmt.Errorf("replace the layout %d programs: %w", migrateFrom, err)
	}
	for _, lm := range prevMaps {
		if !lm.delta || mg.old[lm.name] == nil {
			continue
		}
		n, err := lm.copy(mg.old[lm.name], mg.fresh[lm.name], ebpf.UpdateNoExist)
		if err != nil {
			return fmt.Errorf("copy %s entries written during the upgrade: %w", lm.name, err)
		}
		mg.delta[lm.name] = n
	}
	for _, lm := range prevMaps {
		if lm.added {
			continue
		}
		if err := mg.pin(lm.name); err != nil {
			return err
		}
	}
	meta := tcMeta{LayoutVersion: layoutVersion, HashSeed: d.hashSeed, Fingerprint: fingerprint}
	if err := d.meta.Update(uint32(0), &meta, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("stamp layout %d: %w", layoutVersion, err)
	}
	// The maps this layout added are pinned after the stamp: a crash
	// before it leaves none pinned, and the next start migrates again (a
	// map of them pinned would tell it these are not the previous
	// layout's maps); a crash after it, some unpinned, which that start
	// creates afresh.
	for _, lm := range prevMaps {
		if !lm.added {
			continue
		}
		if err := mg.pin(lm.name); err != nil {
			return err
		}
	}
	return nil
}

// pin pins the fresh map name over the old one: pinned beside it first,
// then renamed over it, so readers of the pin find one or the other.
func (mg *migration) pin(name string) error {
	m := mg.fresh[name]
	if m == nil {
		return nil
	}
	path := filepath.Join(mg.pinPath, name)
	tmp := path + "_upgrade" // bpffs refuses names with a dot
	if err := unix.Unlink(tmp); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove stale %s: %w", tmp, err)
	}
	if err := m.Pin(tmp); err != nil {
		return fmt.Errorf("pin %s of layout %d: %w", name, layoutVersion, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("pin %s of layout %d over layout %d's: %w", name, layoutVersion, migrateFrom, err)
	}
	return nil
}

// swap replaces the program of every link pinned under PinPath/links with
// d's program for the same hook; on failure it puts back those it
// replaced. A link whose interface is gone is left to attach, which
// removes it.
func (mg *migration) swap(d *Datapath) (err error) {
	defer func() {
		if err != nil {
			err = errors.Join(err, mg.rollback())
		}
	}()
	entries, err := os.ReadDir(d.linksDir())
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("list links: %w", err)
	}
	for _, e := range entries {
		pin := filepath.Join(d.linksDir(), e.Name())
		l, err := link.LoadPinnedLink(pin, nil)
		if err != nil {
			return fmt.Errorf("load pinned link %s: %w", pin, err)
		}
		info, err := l.Info()
		if err != nil {
			l.Close()
			return fmt.Errorf("link %s: %w", pin, err)
		}
		if info.Cgroup() == nil && linkIfindex(l) <= 0 {
			l.Close()
			continue
		}
		old, err := ebpf.NewProgramFromID(info.Program)
		if err != nil {
			l.Close()
			return fmt.Errorf("program of link %s: %w", pin, err)
		}
		prog, err := d.programFor(e.Name(), old)
		if err == nil {
			err = l.Update(prog)
		}
		if err != nil {
			old.Close()
			l.Close()
			return fmt.Errorf("link %s: %w", pin, err)
		}
		mg.swapped = append(mg.swapped, swappedLink{pin: pin, l: l, old: old})
	}
	return nil
}

// programFor is d's program for the link pinned as pinName that runs old:
// a socket hook by its pin's name, an interface's by the program's name
// (the uplink's tcx hook runs tc_uplink or tc_uplink_lb).
func (d *Datapath) programFor(pinName string, old *ebpf.Program) (*ebpf.Program, error) {
	if name, ok := strings.CutPrefix(pinName, "sock_"); ok {
		i := slices.IndexFunc(sockHooks, func(h sockHook) bool { return h.name == name })
		if i < 0 {
			return nil, fmt.Errorf("no socket hook %q", name)
		}
		return d.sockColl.Programs[sockHooks[i].prog], nil
	}
	info, err := old.Info()
	if err != nil {
		return nil, fmt.Errorf("program info: %w", err)
	}
	for _, coll := range []*ebpf.Collection{d.tcColl, d.xdpColl, d.uplinkColl} {
		for name, p := range coll.Programs {
			// The kernel keeps the first 15 bytes of a program's name.
			if name[:min(len(name), 15)] == info.Name {
				return p, nil
			}
		}
	}
	return nil, fmt.Errorf("no program of layout %d for %q", layoutVersion, info.Name)
}

// rollback puts the old programs back on the links swap replaced.
func (mg *migration) rollback() error {
	var errs []error
	for _, s := range mg.swapped {
		if err := s.l.Update(s.old); err != nil {
			errs = append(errs, fmt.Errorf("put the layout %d program back on %s: %w", migrateFrom, s.pin, err))
		}
	}
	mg.closeLinks()
	return errors.Join(errs...)
}

func (mg *migration) closeLinks() {
	for _, s := range mg.swapped {
		s.l.Close()
		s.old.Close()
	}
	mg.swapped = nil
}

// close releases the links, the old maps and the fresh ones: the
// programs and d hold their own references (clones) to what they use.
func (mg *migration) close() {
	if mg == nil {
		return
	}
	mg.closeLinks()
	for _, ms := range []map[string]*ebpf.Map{mg.old, mg.fresh} {
		for _, m := range ms {
			m.Close()
		}
	}
	mg.old, mg.fresh = nil, nil
}

// logArgs are the counts of entries migrated, per map.
func (mg *migration) logArgs() []any {
	var args []any
	for _, lm := range prevMaps {
		if _, ok := mg.fresh[lm.name]; !ok || lm.added {
			continue
		}
		args = append(args, lm.name, mg.copied[lm.name])
		if lm.delta {
			args = append(args, lm.name+"_during_swap", mg.delta[lm.name])
		}
	}
	return args
}
