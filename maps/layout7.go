package maps

// Layout 7, frozen: what an agent of the previous layout (commit b133b56,
// bpf/structs.h "layout 7") pinned, for Load to migrate (migrate.go). Do
// not edit: this describes maps that exist on upgraded nodes, not bpf/.
// Layout 8 names a conntrack value's four bytes of padding: struct
// ct_value's pad (zero in every entry layout 7 wrote) is tcp_next, the
// sequence number a direction of a TCP flow reached, 0 while unknown
// (bpf/conntrack.h, ct_tcp_learn). Nothing changed shape, so nothing is
// converted: every map is adopted as it is pinned, IPv4 and IPv6 flows
// included, and a flow of layout 7 learns its sequence numbers from each
// direction's next packet (until then its FINs and RSTs are judged by
// what the other direction learnt, or close it as layout 7 did).
// When layoutVersion moves past migrateFrom+1, layout 8 becomes the one to
// freeze here (TestMigrationFollowsLayout fails until then).

// migrateFrom is the previous layout version, the only one Load migrates.
const migrateFrom = 7

// prevLayoutFingerprint is layout 7's fingerprint (testdata/layout_history).
const prevLayoutFingerprint = 0x4cd1b27f53d24c06

// prevMaps are the maps of layout 7 that layout 8 reshaped: none.
var prevMaps = []prevMap{}
