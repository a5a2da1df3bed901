package topology

import (
	"errors"
	"net/netip"
)

// ErrUnusableAddress is wrapped by the errors about addresses that cannot be
// a frontend or a backend (AddrProblem).
var ErrUnusableAddress = errors.New("address cannot be a frontend or a backend")

// Special IPv4 ranges no frontend or backend may be in, besides those
// netip classifies (unspecified, loopback, multicast, link-local).
var (
	// thisNetwork is 0.0.0.0/8, "this host on this network" (RFC 1122):
	// only ever a source address.
	thisNetwork = netip.MustParsePrefix("0.0.0.0/8")
	// reserved is 240.0.0.0/4, reserved for future use (RFC 1112), which
	// includes the limited broadcast address 255.255.255.255.
	reserved  = netip.MustParsePrefix("240.0.0.0/4")
	broadcast = netip.AddrFrom4([4]byte{255, 255, 255, 255})
)

// AddrProblem says why an address cannot be a frontend (a cluster IP,
// externalIP, load-balancer IP or NodePort address) or a backend, or
// returns "" when it can. Refused in IPv4: unspecified and the rest of
// 0.0.0.0/8, loopback (127.0.0.0/8: it never leaves the host, and a
// datapath that translated it would capture the node's own services), the
// limited broadcast address, the reserved 240.0.0.0/4, multicast
// (224.0.0.0/4), and link-local (169.254.0.0/16: it is only meaningful on
// one link, and Services are not). Refused in IPv6, for the same reasons:
// unspecified (::), loopback (::1), multicast (ff00::/8), link-local
// (fe80::/10), an address with a zone, and IPv4-mapped addresses
// (::ffff:0:0/96), which name an IPv4 address and are decided as one.
func AddrProblem(ip netip.Addr) string {
	switch {
	case !ip.IsValid():
		return "not an address"
	case ip.Is4In6():
		return "IPv4-mapped"
	case ip.Zone() != "":
		return "scoped to a zone"
	case ip.IsUnspecified():
		return "unspecified"
	case thisNetwork.Contains(ip):
		return "in 0.0.0.0/8 (this network)"
	case ip.IsLoopback():
		return "loopback"
	case ip == broadcast:
		return "the broadcast address"
	case reserved.Contains(ip):
		return "in the reserved 240.0.0.0/4"
	case ip.IsMulticast():
		return "multicast"
	case ip.IsLinkLocalUnicast():
		return "link-local"
	}
	return ""
}
