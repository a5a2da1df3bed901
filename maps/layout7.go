package maps

import "github.com/cilium/ebpf"

// Layout 7, frozen: what an agent of the previous layout (commit b133b56,
// bpf/structs.h "layout 7") pinned, for Load to migrate (migrate.go). Do
// not edit: this describes maps that exist on upgraded nodes, not bpf/.
// Layout 8 changed four things:
//   - struct ct_value's pad (zero in every entry layout 7 wrote) is
//     tcp_next, the sequence number a direction of a TCP flow reached, 0
//     while unknown (bpf/conntrack.h, ct_tcp_learn): a flow of layout 7
//     learns its sequence numbers from each direction's next packet (until
//     then its FINs and RSTs are judged by what the other direction
//     learnt, or close it as layout 7 did);
//   - struct ct_value grew by iif, the interface a direction's packets
//     arrive on (and explicit padding), 72 to 80 bytes (ct6_value 104 to
//     112): the four conntrack tables are converted, every entry with iif
//     0, unknown, which lets its replies in from anywhere as layout 7 did
//     (bpf/conntrack.h, ct_iif_plausible); flows created after the upgrade
//     have it;
//   - struct meta's pad (zero) is hash_seed, the node's flow hash seed:
//     maps of layout 7 keep layout 7's constant (layout7HashSeed), so no
//     flow, affinity or SNAT port moves;
//   - tlb_frags6 was added, the ports of IPv6 fragmented datagrams' first
//     fragments (bpf/frag.h), beside IPv4's tlb_frags; it starts empty (an
//     IPv6 datagram in flight across the upgrade had its later fragments
//     passed untranslated by layout 7 anyway).
// Every other map of layout 7 is adopted as it is pinned, budgets and
// fragments included. When layoutVersion moves past
// migrateFrom+1, layout 8 becomes the one to
// freeze here (TestMigrationFollowsLayout fails until then).

// migrateFrom is the previous layout version, the only one Load migrates.
const migrateFrom = 7

// prevLayoutFingerprint is layout 7's fingerprint (testdata/layout_history).
const prevLayoutFingerprint = 0x4cd1b27f53d24c06

// prevMaps are the maps layout 8 reshaped (the conntrack tables, whose
// values grew) or added to layout 7. The programs write the conntrack
// tables: what the old ones created during the upgrade is copied again
// after the swap.
var prevMaps = []prevMap{
	{name: tcMapTlbConntrack, typ: ebpf.Hash, key: ctKey7{}, value: ctValue7{}, delta: true, copy: copyCt7},
	{name: tcMapTlbCtNew, typ: ebpf.LRUHash, key: ctKey7{}, value: ctValue7{}, delta: true, copy: copyCt7},
	{name: tcMapTlbCt6, typ: ebpf.Hash, key: ct6Key7{}, value: ct6Value7{}, delta: true, copy: copyCt67},
	{name: tcMapTlbCt6New, typ: ebpf.LRUHash, key: ct6Key7{}, value: ct6Value7{}, delta: true, copy: copyCt67},
	{name: tcMapTlbFrags6, added: true},
}

// ctKey7 and ct6Key7 are layout 7's struct ct_key and ct6_key, as bytes:
// layout 8 kept them.
type (
	ctKey7  [16]byte
	ct6Key7 [40]byte
)

// ctValue7 is layout 7's struct ct_value (72 bytes).
type ctValue7 struct {
	Addr       uint32
	Port       uint16
	Dir        uint8
	State      uint8
	BackendId  uint32
	BackendGen uint32
	Expires    uint64
	Flags      uint8
	Redirect   uint8
	NatPort    uint16
	NatAddr    uint32
	SvcId      uint32
	Ifindex    uint32
	Smac       [6]uint8
	Dmac       [6]uint8
	Pad        uint32 // layout 8's tcp_next
	Packets    uint64
	Bytes      uint64
}

// ct6Value7 is layout 7's struct ct6_value (104 bytes).
type ct6Value7 struct {
	Ct      ctValue7
	Addr    [16]byte
	NatAddr [16]byte
}

// ctValueFrom7 converts a conntrack value of layout 7: every field kept,
// iif 0 (unknown).
func ctValueFrom7(v ctValue7) tcCtValue {
	return tcCtValue{
		Addr: v.Addr, Port: v.Port, Dir: v.Dir, State: v.State, BackendId: v.BackendId, BackendGen: v.BackendGen,
		Expires: v.Expires, Flags: v.Flags, Redirect: v.Redirect, NatPort: v.NatPort, NatAddr: v.NatAddr,
		SvcId: v.SvcId, Ifindex: v.Ifindex, Smac: v.Smac, Dmac: v.Dmac, TcpNext: v.Pad,
		Packets: v.Packets, Bytes: v.Bytes,
	}
}

func copyCt7(from, to *ebpf.Map, flags ebpf.MapUpdateFlags) (int, error) {
	return convertEntries(from, to, flags, func(k ctKey7, v ctValue7) (ctKey7, tcCtValue) {
		return k, ctValueFrom7(v)
	})
}

func copyCt67(from, to *ebpf.Map, flags ebpf.MapUpdateFlags) (int, error) {
	return convertEntries(from, to, flags, func(k ct6Key7, v ct6Value7) (ct6Key7, tcCt6Value) {
		return k, tcCt6Value{Ct: ctValueFrom7(v.Ct), Addr: tcTlbAddr{Bytes: v.Addr}, NatAddr: tcTlbAddr{Bytes: v.NatAddr}}
	})
}
