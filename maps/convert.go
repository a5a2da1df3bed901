package maps

import (
	"encoding/binary"
	"fmt"
	"net/netip"
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

// validIPv4 rejects anything but a unicast-usable IPv4 address and port.
func validIPv4(what string, ap netip.AddrPort) error {
	a := ap.Addr()
	switch {
	case !ap.IsValid():
		return fmt.Errorf("%s: address not set", what)
	case !a.Is4() && !a.Is4In6():
		return fmt.Errorf("%s %s: only IPv4 is supported", what, ap)
	case a.Unmap().IsUnspecified():
		return fmt.Errorf("%s %s: unspecified address", what, ap)
	case ap.Port() == 0:
		return fmt.Errorf("%s %s: port 0", what, ap)
	}
	return nil
}

// svcKey validates fe and converts it to its map key.
func svcKey(fe Frontend) (tcSvcKey, error) {
	if err := validIPv4("frontend", fe.Addr); err != nil {
		return tcSvcKey{}, err
	}
	if fe.Proto != TCP && fe.Proto != UDP {
		return tcSvcKey{}, fmt.Errorf("frontend %s: protocol %d not supported (TCP or UDP only)", fe.Addr, uint8(fe.Proto))
	}
	return tcSvcKey{
		Vip:   be32(fe.Addr.Addr().Unmap()),
		Port:  be16(fe.Addr.Port()),
		Proto: uint8(fe.Proto),
	}, nil
}

// frontend converts a map key back; the inverse of svcKey.
func frontend(k tcSvcKey) Frontend {
	return Frontend{Addr: addrPortFromWire(k.Vip, k.Port), Proto: Protocol(k.Proto)}
}

// normalize validates b and maps 4-in-6 addresses to plain IPv4, so equal
// backends compare equal.
func normalize(b Backend) (Backend, error) {
	if err := validIPv4("backend", b.Addr); err != nil {
		return Backend{}, err
	}
	b.Addr = netip.AddrPortFrom(b.Addr.Addr().Unmap(), b.Addr.Port())
	return b, nil
}

// Bits of backend_value.flags (enum backend_flag in bpf/consts.h).
const (
	backendNodeLocal = 1
	backendZoneLocal = 2
)

// backendValue converts a normalized backend and its id.
func backendValue(b Backend, id uint32) tcBackendValue {
	v := tcBackendValue{
		Addr: be32(b.Addr.Addr()),
		Port: be16(b.Addr.Port()),
		Id:   id,
	}
	if b.NodeLocal {
		v.Flags |= backendNodeLocal
	}
	if b.ZoneLocal {
		v.Flags |= backendZoneLocal
	}
	return v
}

// backendFromValue is the inverse of backendValue.
func backendFromValue(v tcBackendValue) (Backend, uint32) {
	return Backend{
		Addr:      addrPortFromWire(v.Addr, v.Port),
		NodeLocal: v.Flags&backendNodeLocal != 0,
		ZoneLocal: v.Flags&backendZoneLocal != 0,
	}, v.Id
}

func backendKey(svcID, slot uint32, buffer uint8) tcBackendKey {
	return tcBackendKey{SvcId: svcID, Slot: slot, Buffer: buffer}
}

// registryValue is what the registry holds for a permitted (service,
// backend) pair; the zero value marks a free id.
func registryValue(svcID uint32, addr netip.AddrPort) tcRegistryValue {
	return tcRegistryValue{SvcId: svcID, Addr: be32(addr.Addr()), Port: be16(addr.Port())}
}
