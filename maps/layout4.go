package maps

import (
	"structs"

	"github.com/cilium/ebpf"
)

// Layout 4, frozen: the wire format of the maps an agent of the previous
// layout (commit e000925, bpf/structs.h "layout 4") pinned, for Load to
// migrate them (migrate.go). Do not edit: these structs describe maps
// that exist on upgraded nodes, not bpf/. Only the maps whose key or value
// changed shape in layout 5 (IPv4 addresses became union tlb_addr) are
// here; every other shared map kept its layout 4 key and value and is
// adopted as it is pinned. When layoutVersion moves past
// migrateFrom+1, layout 5 becomes the one to freeze here
// (TestMigrationFollowsLayout fails until then).

// migrateFrom is the previous layout version, the only one Load migrates.
const migrateFrom = 4

// layout4Fingerprint is layout 4's fingerprint (testdata/layout_history).
const layout4Fingerprint = 0x542555b51cbcb38b

// Every __be32 address of layout 4 is held as the host-order uint32 whose
// in-memory bytes are the address's octets (convert.go, be32).

type l4SvcKey struct {
	_     structs.HostLayout
	Vip   uint32
	Port  uint16
	Proto uint8
	Scope uint8
}

type l4BackendValue struct {
	_     structs.HostLayout
	Addr  uint32
	Port  uint16
	Flags uint8
	Pad   uint8
	Id    uint32
	Gen   uint32
}

type l4RegistryValue struct {
	_     structs.HostLayout
	SvcId uint32
	Addr  uint32
	Port  uint16
	State uint8
	Flags uint8
	Gen   uint32
}

type l4AffinityKey struct {
	_      structs.HostLayout
	Client uint32
	SvcId  uint32
}

type l4SockRevnatKey struct {
	_      structs.HostLayout
	Cookie uint64
	Addr   uint32
	Port   uint16
	Pad    uint16
}

type l4SockRevnatValue struct {
	_    structs.HostLayout
	Addr uint32
	Port uint16
	Pad  uint16
}

type l4SrcRangeKey struct {
	_         structs.HostLayout
	Prefixlen uint32
	SvcId     uint32
	Addr      uint32
}

// l4Addr converts a layout 4 address to a tlb_addr. 0 (no address: an
// unused registry slot) stays all zero.
func l4Addr(v uint32) tcTlbAddr {
	if v == 0 {
		return tcTlbAddr{}
	}
	return wireAddr(addrFromBE32(v))
}

func l4SvcKeyNow(k l4SvcKey) tcSvcKey {
	return tcSvcKey{Vip: l4Addr(k.Vip), Port: k.Port, Proto: k.Proto, Scope: k.Scope}
}

// l4Maps are the layout 4 maps whose shape changed, with the sizes of
// their keys and values then and the conversion of their entries.
// Entries the old programs create (affinity, socket records) are copied
// again after the programs are swapped (delta).
var l4Maps = []l4Map{
	{name: tcMapTlbServices, typ: ebpf.Hash, key: l4SvcKey{}, value: tcSvcValue{},
		copy: func(from, to *ebpf.Map, f ebpf.MapUpdateFlags) (int, error) {
			return convertEntries(from, to, f, func(k l4SvcKey, v tcSvcValue) (tcSvcKey, tcSvcValue) {
				return l4SvcKeyNow(k), v
			})
		}},
	{name: tcMapTlbBackends, typ: ebpf.Hash, key: tcBackendKey{}, value: l4BackendValue{},
		copy: func(from, to *ebpf.Map, f ebpf.MapUpdateFlags) (int, error) {
			return convertEntries(from, to, f, func(k tcBackendKey, v l4BackendValue) (tcBackendKey, tcBackendValue) {
				return k, tcBackendValue{Addr: l4Addr(v.Addr), Port: v.Port, Flags: v.Flags, Id: v.Id, Gen: v.Gen}
			})
		}},
	{name: tcMapTlbRegistry, typ: ebpf.Array, key: uint32(0), value: l4RegistryValue{},
		copy: func(from, to *ebpf.Map, f ebpf.MapUpdateFlags) (int, error) {
			return convertEntries(from, to, f, func(k uint32, v l4RegistryValue) (uint32, tcRegistryValue) {
				return k, tcRegistryValue{SvcId: v.SvcId, Addr: l4Addr(v.Addr), Port: v.Port, State: v.State, Flags: v.Flags, Gen: v.Gen}
			})
		}},
	{name: tcMapTlbAffinity, typ: ebpf.LRUHash, key: l4AffinityKey{}, value: tcAffinityValue{}, delta: true,
		copy: func(from, to *ebpf.Map, f ebpf.MapUpdateFlags) (int, error) {
			return convertEntries(from, to, f, func(k l4AffinityKey, v tcAffinityValue) (tcAffinityKey, tcAffinityValue) {
				return tcAffinityKey{Client: l4Addr(k.Client), SvcId: k.SvcId}, v
			})
		}},
	{name: tcMapTlbSockRevnat, typ: ebpf.LRUHash, key: l4SockRevnatKey{}, value: l4SockRevnatValue{}, delta: true,
		copy: func(from, to *ebpf.Map, f ebpf.MapUpdateFlags) (int, error) {
			return convertEntries(from, to, f, func(k l4SockRevnatKey, v l4SockRevnatValue) (tcSockRevnatKey, tcSockRevnatValue) {
				return tcSockRevnatKey{Cookie: k.Cookie, Addr: l4Addr(k.Addr), Port: k.Port},
					tcSockRevnatValue{Addr: l4Addr(v.Addr), Port: v.Port}
			})
		}},
	{name: tcMapTlbSrcRanges, typ: ebpf.LPMTrie, key: l4SrcRangeKey{}, value: uint8(0),
		copy: func(from, to *ebpf.Map, f ebpf.MapUpdateFlags) (int, error) {
			return convertEntries(from, to, f, func(k l4SrcRangeKey, v uint8) (tcSrcRangeKey, uint8) {
				// Always IPv4-mapped: 0.0.0.0/0 is a range.
				return tcSrcRangeKey{Prefixlen: k.Prefixlen + v4MappedBits, SvcId: k.SvcId,
					Addr: wireAddr(addrFromBE32(k.Addr))}, v
			})
		}},
	{name: namesMap, typ: ebpf.Hash, key: l4SvcKey{}, value: nameValue{}, optional: true,
		copy: func(from, to *ebpf.Map, f ebpf.MapUpdateFlags) (int, error) {
			return convertEntries(from, to, f, func(k l4SvcKey, v nameValue) (tcSvcKey, nameValue) {
				return l4SvcKeyNow(k), v
			})
		}},
}
