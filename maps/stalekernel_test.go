package maps

import (
	"maps"
	"testing"

	"github.com/cilium/ebpf"
)

// TestMarkReleasedPaths: the stale walk's two paths, in the kernel
// (ct_mark_stale, bpf_for_each_map_elem) and in user space (the fallback
// on kernels before 5.13), run explicitly over the same entries in all
// four conntrack tables, mark the same entries and count the same
// flows: a forward entry of a released id with another generation is
// marked (CT_F_STALE, expires 0), one of its current generation, a
// reply entry, or one already stale is not; the counts of the asked
// (id, generation)s are their forward entries' as read before any mark.
func TestMarkReleasedPaths(t *testing.T) {
	requirePrivileges(t)
	type entry struct {
		v6       bool
		assured  bool
		dir      tcCtDir
		id, gen  uint32
		stale    bool // planted stale
		packets  uint64
		bytes    uint64
		wantMark bool
	}
	entries := []entry{
		{assured: true, dir: tcCtDirCT_FORWARD, id: 1, gen: 1, packets: 10, bytes: 1000, wantMark: true},
		{assured: false, dir: tcCtDirCT_FORWARD, id: 1, gen: 1, packets: 1, bytes: 60, wantMark: true},
		{v6: true, assured: true, dir: tcCtDirCT_FORWARD, id: 1, gen: 1, packets: 5, bytes: 500, wantMark: true},
		{v6: true, assured: false, dir: tcCtDirCT_FORWARD, id: 1, gen: 2, packets: 7, bytes: 700},   // the id's generation now
		{assured: true, dir: tcCtDirCT_REVERSE, id: 1, gen: 1, packets: 3, bytes: 300},              // a reply entry
		{assured: true, dir: tcCtDirCT_FORWARD, id: 2, gen: 4, stale: true, packets: 2, bytes: 200}, // already stale
		{assured: true, dir: tcCtDirCT_FORWARD, id: 3, gen: 1, packets: 9, bytes: 900},              // not released
	}
	// Id 1 and 2 released (1 now in generation 2); more ids than one run
	// of ct_mark_stale takes, so the kernel path runs twice.
	released := map[uint32]uint32{1: 2, 2: 5}
	for id := uint32(100); len(released) <= staleRunMax; id++ {
		released[id] = 1
	}
	want := map[idGen]bool{{1, 1}: true, {2, 4}: true, {3, 1}: true, {9, 9}: true}
	wantFlows := map[idGen]Traffic{
		{1, 1}: {Flows: 3, Packets: 16, Bytes: 1560},
		{2, 4}: {Flows: 1, Packets: 2, Bytes: 200},
		{3, 1}: {Flows: 1, Packets: 9, Bytes: 900},
	}
	paths := []struct {
		name string
		mark func(fs ctFamilies, released map[uint32]uint32, want map[idGen]bool) (int, map[idGen]Traffic, error)
	}{
		{"kernel", markReleasedInKernel},
		{"user", markReleasedInUser},
	}
	for _, path := range paths {
		t.Run(path.name, func(t *testing.T) {
			d := newDatapath(t, Options{})
			if path.name == "kernel" && !d.compat.forEachMapElem {
				t.Skip("the kernel lacks bpf_for_each_map_elem (Linux 5.13)")
			}
			fs := d.ctFamilies()
			table := func(e entry) *ebpf.Map {
				ts := fs.v4
				if e.v6 {
					ts = fs.v6
				}
				if e.assured {
					return ts[0]
				}
				return ts[1]
			}
			value := func(e entry) tcCtValue {
				v := tcCtValue{Dir: uint8(e.dir), BackendId: e.id, BackendGen: e.gen, Expires: 1 << 62, Packets: e.packets, Bytes: e.bytes}
				if e.stale {
					v.Flags, v.Expires = uint8(tcCtFlagCT_F_STALE), 0
				}
				return v
			}
			for i, e := range entries {
				var err error
				if e.v6 {
					err = table(e).Put(tcCt6Key{Sport: uint16(i + 1)}, tcCt6Value{Ct: value(e)})
				} else {
					err = table(e).Put(tcCtKey{Sport: uint16(i + 1)}, value(e))
				}
				if err != nil {
					t.Fatalf("plant entry %d: %v", i, err)
				}
			}
			n, flows, err := path.mark(fs, released, want)
			if err != nil {
				t.Fatal(err)
			}
			marks := 0
			for i, e := range entries {
				var got tcCtValue
				if e.v6 {
					var v tcCt6Value
					err = table(e).Lookup(tcCt6Key{Sport: uint16(i + 1)}, &v)
					got = v.Ct
				} else {
					err = table(e).Lookup(tcCtKey{Sport: uint16(i + 1)}, &got)
				}
				if err != nil {
					t.Fatalf("read entry %d: %v", i, err)
				}
				wantV := value(e)
				if e.wantMark {
					marks++
					wantV.Flags, wantV.Expires = wantV.Flags|uint8(tcCtFlagCT_F_STALE), 0
				}
				if got != wantV {
					t.Errorf("entry %d (%+v): %+v, want %+v", i, e, got, wantV)
				}
			}
			if n != marks {
				t.Errorf("marked %d entries, want %d", n, marks)
			}
			if !maps.Equal(flows, wantFlows) {
				t.Errorf("counted %v, want %v", flows, wantFlows)
			}
		})
	}
}
