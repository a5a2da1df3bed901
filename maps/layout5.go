package maps

// Layout 5, frozen: what an agent of the previous layout (commit e43bc36,
// bpf/structs.h "layout 5") pinned, for Load to migrate (migrate.go). Do
// not edit: this describes maps that exist on upgraded nodes, not bpf/.
// Layout 6 reshaped no map of layout 5: every one is adopted as it is
// pinned, IPv4 flows (conntrack, SNAT ports) and affinity included. It
// added the IPv6 conntrack (tlb_ct6, tlb_ct6_new, tlb_ct6_src), which the
// upgrade creates empty and pins once the programs are swapped. When
// layoutVersion moves past migrateFrom+1, layout 6 becomes the one to
// freeze here (TestMigrationFollowsLayout fails until then).

// migrateFrom is the previous layout version, the only one Load migrates.
const migrateFrom = 5

// prevLayoutFingerprint is layout 5's fingerprint (testdata/layout_history).
const prevLayoutFingerprint = 0x50be0ea90902fe68

// prevMaps are the maps layout 6 added to layout 5's.
var prevMaps = []prevMap{
	{name: tcMapTlbCt6, added: true},
	{name: tcMapTlbCt6New, added: true},
	{name: tcMapTlbCt6Src, added: true},
}
