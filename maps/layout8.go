package maps

// Layout 8, frozen: what an agent of the previous layout (commit 3f4faed,
// bpf/structs.h "layout 8") pinned, for Load to migrate (migrate.go). Do
// not edit: this describes maps that exist on upgraded nodes, not bpf/.
// Layout 9 changed one thing, not a change of shape:
//   - tlb_ct_proven was added, the sources that completed a TCP handshake
//     with a budget of new flows of their own (bpf/conntrack.h,
//     ct_src_take); it starts empty (every source is unproven until its
//     next handshake, and shares its cell as under layout 8).
// Every map of layout 8 is adopted as it is pinned, IPv4 and IPv6 flows,
// budgets, fragments and tlb_meta's hash seed included. When layoutVersion moves past
// migrateFrom+1, layout 9 becomes the one to
// freeze here (TestMigrationFollowsLayout fails until then).

// migrateFrom is the previous layout version, the only one Load migrates.
const migrateFrom = 8

// prevLayoutFingerprint is layout 8's fingerprint (testdata/layout_history).
const prevLayoutFingerprint = 0x49bc0a7fcb02acb3

// prevMaps are the maps layout 9 added to layout 8: none was reshaped.
var prevMaps = []prevMap{
	{name: tcMapTlbCtProven, added: true},
}
