package maps

// Layout 7, frozen: what an agent of the previous layout (commit b133b56,
// bpf/structs.h "layout 7") pinned, for Load to migrate (migrate.go). Do
// not edit: this describes maps that exist on upgraded nodes, not bpf/.
// Layout 8 changed two things, neither a change of shape:
//   - struct ct_value's pad (zero in every entry layout 7 wrote) is
//     tcp_next, the sequence number a direction of a TCP flow reached, 0
//     while unknown (bpf/conntrack.h, ct_tcp_learn): a flow of layout 7
//     learns its sequence numbers from each direction's next packet (until
//     then its FINs and RSTs are judged by what the other direction
//     learnt, or close it as layout 7 did);
//   - tlb_frags6 was added, the ports of IPv6 fragmented datagrams' first
//     fragments (bpf/frag.h), beside IPv4's tlb_frags; it starts empty (an
//     IPv6 datagram in flight across the upgrade had its later fragments
//     passed untranslated by layout 7 anyway).
// Every map of layout 7 is adopted as it is pinned, IPv4 and IPv6 flows,
// budgets and fragments included. When layoutVersion moves past
// migrateFrom+1, layout 8 becomes the one to
// freeze here (TestMigrationFollowsLayout fails until then).

// migrateFrom is the previous layout version, the only one Load migrates.
const migrateFrom = 7

// prevLayoutFingerprint is layout 7's fingerprint (testdata/layout_history).
const prevLayoutFingerprint = 0x4cd1b27f53d24c06

// prevMaps are the maps layout 8 added to layout 7: none was reshaped.
var prevMaps = []prevMap{
	{name: tcMapTlbFrags6, added: true},
}
