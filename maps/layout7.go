package maps

// Layout 7, frozen: what an agent of the previous layout (commit b133b56)
// pinned, for Load to migrate (migrate.go). Do not edit: this describes
// maps that exist on upgraded nodes, not bpf/. Layout 8 added tlb_frags6,
// the ports of IPv6 fragmented datagrams' first fragments (bpf/frag.h),
// beside IPv4's tlb_frags; no map of layout 7 changed shape, so every one
// is adopted as it is pinned, flows, budgets and fragments included, and
// tlb_frags6 starts empty (an IPv6 datagram in flight across the upgrade
// had its later fragments passed untranslated by layout 7 anyway). When
// layoutVersion moves past migrateFrom+1, layout 8 becomes the one to
// freeze here (TestMigrationFollowsLayout fails until then).

// migrateFrom is the previous layout version, the only one Load migrates.
const migrateFrom = 7

// prevLayoutFingerprint is layout 7's fingerprint (testdata/layout_history).
const prevLayoutFingerprint = 0x4cd1b27f53d24c06

// prevMaps are the maps layout 8 added to layout 7.
var prevMaps = []prevMap{
	{name: tcMapTlbFrags6, added: true},
}
