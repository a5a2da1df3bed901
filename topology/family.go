package topology

import (
	"net/netip"
	"strings"

	v1 "k8s.io/api/core/v1"
)

// Families are the IP families topolb decides, in the order reports list
// them. Each family is decided on its own, as kube-proxy runs one proxier
// per family: a dual-stack Service is one ServicePort per port and family,
// each with that family's cluster IP, externalIPs, load-balancer IPs,
// source ranges, EndpointSlices (addressType) and node addresses.
var Families = []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}

// FamilyOf returns the IP family of ip: IPv4 for a 4-byte address, IPv6
// for any other (an IPv4-mapped IPv6 address included, which AddrProblem
// refuses).
func FamilyOf(ip netip.Addr) v1.IPFamily {
	if ip.Is4() {
		return v1.IPv4Protocol
	}
	return v1.IPv6Protocol
}

// parseAddr parses s, spaces trimmed, as an address of family: an IPv4
// address for IPv4, an IPv6 address that is not IPv4-mapped for IPv6 (as
// the EndpointSlice API validates addresses per addressType).
func parseAddr(s string, family v1.IPFamily) (netip.Addr, bool) {
	ip, err := netip.ParseAddr(strings.TrimSpace(s))
	if err != nil || ip.Zone() != "" || FamilyOf(ip) != family || ip.Is4In6() {
		return netip.Addr{}, false
	}
	return ip, true
}

// firstOfFamily returns the first address of family in ss (parseAddr).
func firstOfFamily(ss []string, family v1.IPFamily) (netip.Addr, bool) {
	for _, s := range ss {
		if ip, ok := parseAddr(s, family); ok {
			return ip, true
		}
	}
	return netip.Addr{}, false
}
