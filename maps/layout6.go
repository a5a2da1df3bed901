package maps

import "github.com/cilium/ebpf"

// Layout 6, frozen: what an agent of the previous layout (commit 1a4cb88,
// bpf/structs.h "layout 6") pinned, for Load to migrate (migrate.go). Do
// not edit: this describes maps that exist on upgraded nodes, not bpf/.
// Layout 7 reshaped the per-source budgets of new flows: tlb_ct_src and
// tlb_ct6_src were LRU hashes with an entry per source, and are fixed
// arrays of budget cells now (bpf/maps.h). Every other map is adopted as
// it is pinned, IPv4 and IPv6 flows (conntrack, SNAT ports) and affinity
// included. When layoutVersion moves past migrateFrom+1, layout 7 becomes
// the one to freeze here (TestMigrationFollowsLayout fails until then).

// migrateFrom is the previous layout version, the only one Load migrates.
const migrateFrom = 6

// prevLayoutFingerprint is layout 6's fingerprint (testdata/layout_history).
const prevLayoutFingerprint = 0x2a9956544a0dbc44

// prevMaps are the maps of layout 6 that layout 7 reshaped.
var prevMaps = []prevMap{
	{name: tcMapTlbCtSrc, typ: ebpf.LRUHash, key: uint32(0), value: tcCtSrc{}, copy: budgetsStartFull},
	{name: tcMapTlbCt6Src, typ: ebpf.LRUHash, key: [16]byte{}, value: tcCtSrc{}, copy: budgetsStartFull},
}

// budgetsStartFull is the conversion of layout 6's per-source budgets
// into layout 7's cells: none is carried over, every cell starts with a
// full budget, as a source did that layout 6's LRU had forgotten (a
// budget only ever limits new flows, never an established one). Returns
// the number of entries converted: 0.
func budgetsStartFull(from, to *ebpf.Map, flags ebpf.MapUpdateFlags) (int, error) {
	return 0, nil
}
