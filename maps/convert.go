package maps

import (
	"encoding/binary"
	"fmt"
	"math"
	"net/netip"
	"time"
)

// This file is the only place that knows the wire layout of map keys and
// values: which fields are in network byte order and which flags mean what.
// Generated structs are marshalled by cilium/ebpf in host byte order, so a
// network-order field is stored as the host-order integer whose in-memory
// bytes are the wire bytes.

// be32 returns the uint32 whose in-memory bytes are a's four octets.
func be32(a netip.Addr) uint32 {
	b := a.As4()
	return binary.NativeEndian.Uint32(b[:])
}

// be16 returns the uint16 whose in-memory bytes are p in network byte order.
func be16(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}

func addrFromBE32(v uint32) netip.Addr {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

func portFromBE16(v uint16) uint16 {
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], v)
	return binary.BigEndian.Uint16(b[:])
}

func addrPortFromWire(addr uint32, port uint16) netip.AddrPort {
	return netip.AddrPortFrom(addrFromBE32(addr), portFromBE16(port))
}

// wireAddr is a as union tlb_addr (bpf/structs.h): 16 bytes, an IPv4
// address IPv4-mapped, which is what As16 writes.
func wireAddr(a netip.Addr) tcTlbAddr {
	return tcTlbAddr{Bytes: a.As16()}
}

// addrFromWire is the inverse of wireAddr: an IPv4-mapped address comes
// back as plain IPv4.
func addrFromWire(w tcTlbAddr) netip.Addr {
	return netip.AddrFrom16(w.Bytes).Unmap()
}

func addrPortOf(w tcTlbAddr, port uint16) netip.AddrPort {
	return netip.AddrPortFrom(addrFromWire(w), portFromBE16(port))
}

// validAddr rejects anything but a unicast-usable address of either
// family and a port.
func validAddr(what string, ap netip.AddrPort) error {
	a := ap.Addr()
	switch {
	case !ap.IsValid():
		return fmt.Errorf("%s: address not set", what)
	case a.Zone() != "":
		return fmt.Errorf("%s %s: an address with a zone is not a Service's", what, ap)
	case a.Unmap().IsUnspecified():
		return fmt.Errorf("%s %s: unspecified address", what, ap)
	case ap.Port() == 0:
		return fmt.Errorf("%s %s: port 0", what, ap)
	}
	return nil
}

// svcKey validates fe and converts it to its map key.
func svcKey(fe Frontend) (tcSvcKey, error) {
	if err := validAddr("frontend", fe.Addr); err != nil {
		return tcSvcKey{}, err
	}
	if fe.Proto != TCP && fe.Proto != UDP {
		return tcSvcKey{}, fmt.Errorf("frontend %s: protocol %d not supported (TCP or UDP only)", fe.Addr, uint8(fe.Proto))
	}
	if fe.Scope != ScopeInternal && fe.Scope != ScopeExternal {
		return tcSvcKey{}, fmt.Errorf("frontend %s: unknown scope %d", fe.Addr, uint8(fe.Scope))
	}
	return tcSvcKey{
		Vip:   wireAddr(fe.Addr.Addr()),
		Port:  be16(fe.Addr.Port()),
		Proto: uint8(fe.Proto),
		Scope: uint8(fe.Scope),
	}, nil
}

// frontend converts a map key back; the inverse of svcKey.
func frontend(k tcSvcKey) Frontend {
	return Frontend{Addr: addrPortOf(k.Vip, k.Port), Proto: Protocol(k.Proto), Scope: Scope(k.Scope)}
}

// normalize validates b and maps 4-in-6 addresses to plain IPv4, so equal
// backends compare equal (the family check against the frontend is
// sameFamily's). A draining backend's weight is 0, an active
// one's at least 1.
func normalize(b Backend) (Backend, error) {
	if err := validAddr("backend", b.Addr); err != nil {
		return Backend{}, err
	}
	b.Addr = netip.AddrPortFrom(b.Addr.Addr().Unmap(), b.Addr.Port())
	switch {
	case b.Draining:
		b.Weight = 0
	case b.Weight == 0:
		b.Weight = 1
	}
	return b, nil
}

// affinitySeconds converts an affinity timeout to the datapath's whole
// seconds, rounding up; 0 means off.
func affinitySeconds(d time.Duration) (uint32, error) {
	switch {
	case d < 0:
		return 0, fmt.Errorf("affinity timeout %s is negative", d)
	case d == 0:
		return 0, nil
	}
	s := (d + time.Second - 1) / time.Second
	if s > math.MaxUint32 {
		return 0, fmt.Errorf("affinity timeout %s is too long", d)
	}
	return uint32(s), nil
}

// svcFlags are a service's svc_value.flags.
func svcFlags(set settings) uint8 {
	var f uint8
	if set.affinity > 0 {
		f |= uint8(tcSvcFlagSVC_F_AFFINITY)
	}
	if set.reject {
		f |= uint8(tcSvcFlagSVC_F_REJECT)
	}
	if set.srcRanges {
		f |= uint8(tcSvcFlagSVC_F_SRC_RANGES)
		if set.srcNode {
			f |= uint8(tcSvcFlagSVC_F_SRC_NODE)
		}
	}
	return f
}

// backendFlags are a backend's flags bits (enum backend_flag).
func backendFlags(b Backend) uint8 {
	var f uint8
	if b.NodeLocal {
		f |= uint8(tcBackendFlagBACKEND_F_NODE_LOCAL)
	}
	if b.ZoneLocal {
		f |= uint8(tcBackendFlagBACKEND_F_ZONE_LOCAL)
	}
	return f
}

// withFlags returns b with NodeLocal and ZoneLocal set from flags.
func withFlags(b Backend, flags uint8) Backend {
	b.NodeLocal = flags&uint8(tcBackendFlagBACKEND_F_NODE_LOCAL) != 0
	b.ZoneLocal = flags&uint8(tcBackendFlagBACKEND_F_ZONE_LOCAL) != 0
	return b
}

// backendValue is the slot value of member m.
func backendValue(m *member) tcBackendValue {
	return tcBackendValue{
		Addr:  wireAddr(m.be.Addr.Addr()),
		Port:  be16(m.be.Addr.Port()),
		Flags: backendFlags(m.be),
		Id:    m.id,
		Gen:   m.gen,
	}
}

// backendFromValue decodes a slot value: the backend (without weight) and
// its id and generation.
func backendFromValue(v tcBackendValue) (b Backend, id, gen uint32) {
	return withFlags(Backend{Addr: addrPortOf(v.Addr, v.Port)}, v.Flags), v.Id, v.Gen
}

func backendKey(svcID, slot uint32, buffer uint8) tcBackendKey {
	return tcBackendKey{SvcId: svcID, Slot: slot, Buffer: buffer}
}

// registryValue is the registry entry of member m of service svcID.
func registryValue(svcID uint32, m *member) tcRegistryValue {
	state := tcBackendStateBACKEND_ACTIVE
	if m.be.Draining {
		state = tcBackendStateBACKEND_DRAINING
	}
	return tcRegistryValue{
		SvcId: svcID,
		Addr:  wireAddr(m.be.Addr.Addr()),
		Port:  be16(m.be.Addr.Port()),
		State: uint8(state),
		Flags: backendFlags(m.be),
		Gen:   m.gen,
	}
}

// stateName names a registry state for drift reports.
func stateName(s uint8) string {
	switch tcBackendState(s) {
	case tcBackendStateBACKEND_FREE:
		return "free"
	case tcBackendStateBACKEND_ACTIVE:
		return "active"
	case tcBackendStateBACKEND_DRAINING:
		return "draining"
	default:
		return fmt.Sprintf("state(%d)", s)
	}
}

// svcValue is the tlb_services value of service id with count slots in
// buffer, flip generation gen and settings set.
func svcValue(id, count, gen uint32, buffer uint8, set settings) tcSvcValue {
	return tcSvcValue{Id: id, Count: count, Generation: gen, AffinityTimeout: set.affinity,
		Buffer: buffer, Flags: svcFlags(set)}
}

// settingsFromValue decodes a service's settings.
func settingsFromValue(v tcSvcValue) settings {
	set := settings{
		reject:    v.Flags&uint8(tcSvcFlagSVC_F_REJECT) != 0,
		srcRanges: v.Flags&uint8(tcSvcFlagSVC_F_SRC_RANGES) != 0,
	}
	set.srcNode = set.srcRanges && v.Flags&uint8(tcSvcFlagSVC_F_SRC_NODE) != 0
	if v.Flags&uint8(tcSvcFlagSVC_F_AFFINITY) != 0 {
		set.affinity = v.AffinityTimeout
	}
	return set
}
