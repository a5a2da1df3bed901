package topology

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
)

// LabelServiceProxyName names the proxy that serves a Service. kube-proxy
// skips every Service that carries it, whatever its value (its Service
// watch selects !service.kubernetes.io/service-proxy-name), and so does
// topolb: another proxy serves such a Service. kube.Watch filters with the
// same selector; SkipReason decides the same for manifests and explain.
const LabelServiceProxyName = "service.kubernetes.io/service-proxy-name"

// Errors ServicePorts returns for Services topolb does not proxy. Callers
// branch on them with errors.Is: ErrNotProxied is normal (the Services
// kube-proxy skips, see SkipReason), ErrNoClusterIP deserves a warning.
var (
	ErrNotProxied  = errors.New("service is not proxied")
	ErrNoClusterIP = errors.New("service has no IPv4 or IPv6 cluster IP")
)

// ServicePorts builds the model of every port of svc in each of its IP
// families, and returns a warning for everything it had to leave out or
// correct: invalid ports are left out (the valid ones are still returned),
// an invalid session affinity timeout is replaced by the default, a family
// whose cluster IP cannot be a frontend is left out. The ports come family
// by family, in the order of svc's cluster IPs (its primary family first),
// each family's in spec order. A Service that is not proxied at all
// returns an error wrapping ErrNotProxied, ErrNoClusterIP or
// ErrUnusableAddress, and no ports.
//
// Each family is modelled as kube-proxy's proxier of that family sees the
// Service: its cluster IP, and only the externalIPs, load-balancer IPs and
// loadBalancerSourceRanges of that family.
func ServicePorts(svc *v1.Service) ([]ServicePort, []string, error) {
	nn := types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
	clusterIPs, ws, err := proxiedClusterIPs(svc, nn)
	if err != nil {
		return nil, nil, err
	}
	var warnings []string
	warn := func(ws ...string) {
		for _, w := range ws {
			if w != "" {
				warnings = append(warnings, fmt.Sprintf("%s: %s", nn, w))
			}
		}
	}
	warn(ws...)
	affinity, w := sessionAffinity(svc)
	warn(w)
	externalIPs, lbIPs, ws := externalFrontendIPs(svc)
	warn(ws...)
	sourceRanges, ws := loadBalancerSourceRanges(svc)
	warn(ws...)
	// The ports of every family, checked once.
	type specPort struct {
		index int
		sp    v1.ServicePort
		proto v1.Protocol
	}
	var kept []ServicePort
	var specPorts []specPort
	for i, sp := range svc.Spec.Ports {
		proto := sp.Protocol
		if proto == "" {
			proto = v1.ProtocolTCP
		}
		if w := portProblem(sp, proto, kept); w != "" {
			warn(w)
			continue
		}
		kept = append(kept, ServicePort{Name: sp.Name, Protocol: proto, Port: uint16(sp.Port)})
		specPorts = append(specPorts, specPort{i, sp, proto})
	}
	var ports []ServicePort
	for _, clusterIP := range clusterIPs {
		family := FamilyOf(clusterIP)
		// As kube-proxy's proxier of this family, only this family's
		// externalIPs and load-balancer IPs count.
		external := hasNodePort(svc) || len(externalIPs[family]) > 0 || len(lbIPs[family]) > 0
		// Every port of svc in this family shares these fields.
		shared := ServicePort{
			Service:                  nn,
			Created:                  svc.CreationTimestamp.Time,
			Family:                   family,
			ClusterIP:                clusterIP,
			ExternalIPs:              externalIPs[family],
			LoadBalancerIPs:          lbIPs[family],
			LoadBalancerSourceRanges: sourceRanges[family],
			ExternallyAccessible:     external,
			InternalPolicyLocal:      svc.Spec.InternalTrafficPolicy != nil && *svc.Spec.InternalTrafficPolicy == v1.ServiceInternalTrafficPolicyLocal,
			ExternalPolicyLocal:      external && svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal,
			Affinity:                 affinity,
			Annotations:              topolbAnnotations(svc),
		}
		for _, sp := range specPorts {
			p := shared
			p.Index, p.Name, p.Protocol, p.Port, p.NodePort = sp.index, sp.sp.Name, sp.proto, uint16(sp.sp.Port), uint16(sp.sp.NodePort)
			ports = append(ports, p)
		}
	}
	return ports, warnings, nil
}

// SkipReason says why svc is one of the Services kube-proxy v1.37 does not
// proxy, in kube-proxy's order, or returns "" when it proxies it:
//   - labelled service.kubernetes.io/service-proxy-name, any value (its
//     watch's label selector);
//   - headless, clusterIP None (its watch's field selector);
//   - without a cluster IP, then of type ExternalName
//     (proxyutil.ShouldSkipService).
func SkipReason(svc *v1.Service) string {
	if name, ok := svc.Labels[LabelServiceProxyName]; ok {
		return fmt.Sprintf("labelled %s=%s: another proxy serves it", LabelServiceProxyName, quoteBounded(name))
	}
	switch {
	case svc.Spec.ClusterIP == v1.ClusterIPNone:
		return "headless (clusterIP None): DNS serves it"
	case svc.Spec.ClusterIP == "":
		return "no cluster IP"
	case svc.Spec.Type == v1.ServiceTypeExternalName:
		return "type ExternalName: DNS serves it"
	}
	return ""
}

// proxiedClusterIPs returns svc's cluster IPs that can be frontends, at
// most one per family, in the order of spec.clusterIPs (spec.clusterIP
// when it is empty), with a warning for each one left out; or why topolb
// does not proxy svc: an error wrapping ErrNotProxied (SkipReason),
// ErrNoClusterIP (no IPv4 or IPv6 cluster IP) or ErrUnusableAddress (no
// cluster IP that can be a frontend).
func proxiedClusterIPs(svc *v1.Service, nn types.NamespacedName) ([]netip.Addr, []string, error) {
	if reason := SkipReason(svc); reason != "" {
		return nil, nil, fmt.Errorf("%s: %s: %w", nn, reason, ErrNotProxied)
	}
	listed := svc.Spec.ClusterIPs
	if len(listed) == 0 {
		listed = []string{svc.Spec.ClusterIP}
	}
	var out []netip.Addr
	var problems, warnings []string
	for _, family := range familiesIn(listed) {
		ip, _ := firstOfFamily(listed, family)
		if problem := AddrProblem(ip); problem != "" {
			problems = append(problems, fmt.Sprintf("clusterIP %s is %s", ip, problem))
			warnings = append(warnings, fmt.Sprintf("clusterIP %s is %s: %s not served", ip, problem, family))
			continue
		}
		out = append(out, ip)
	}
	switch {
	case len(out) > 0:
		return out, warnings, nil
	case len(problems) > 0:
		return nil, nil, fmt.Errorf("%s: %s: %w", nn, strings.Join(problems, "; "), ErrUnusableAddress)
	}
	return nil, nil, fmt.Errorf("%s: clusterIP %s: %w", nn, quoteBounded(svc.Spec.ClusterIP), ErrNoClusterIP)
}

// familiesIn returns the families of the addresses in ss, in the order
// they first appear; what is not an address counts for none.
func familiesIn(ss []string) []v1.IPFamily {
	var out []v1.IPFamily
	for _, s := range ss {
		for _, family := range Families {
			if _, ok := parseAddr(s, family); ok && !slices.Contains(out, family) {
				out = append(out, family)
			}
		}
	}
	return out
}

// externalFrontendIPs returns svc's external IPs and load-balancer ingress
// IPs that can be frontends, per family, in spec order, and a warning for
// each address left out (see frontendIP). Ingress entries in IPMode Proxy
// (the load balancer proxies, its IP never reaches the node) and without
// an IP are skipped silently.
func externalFrontendIPs(svc *v1.Service) (externalIPs, lbIPs map[v1.IPFamily][]netip.Addr, warnings []string) {
	externalIPs, lbIPs = map[v1.IPFamily][]netip.Addr{}, map[v1.IPFamily][]netip.Addr{}
	for _, s := range svc.Spec.ExternalIPs {
		if ip, w := frontendIP(s, "externalIP"); w != "" {
			warnings = append(warnings, w)
		} else {
			externalIPs[FamilyOf(ip)] = append(externalIPs[FamilyOf(ip)], ip)
		}
	}
	for _, ing := range svc.Status.LoadBalancer.Ingress {
		if ing.IPMode != nil && *ing.IPMode == v1.LoadBalancerIPModeProxy || ing.IP == "" {
			continue
		}
		if ip, w := frontendIP(ing.IP, "load-balancer ingress IP"); w != "" {
			warnings = append(warnings, w)
		} else {
			lbIPs[FamilyOf(ip)] = append(lbIPs[FamilyOf(ip)], ip)
		}
	}
	return externalIPs, lbIPs, warnings
}

// loadBalancerSourceRanges returns svc's loadBalancerSourceRanges per
// family as kube-proxy's proxier of each family uses them: each trimmed of
// spaces (the API's validation lets them through), masked, an IPv4-mapped
// prefix counting as IPv4; a family is absent (nil: any source) when it has
// no range or one allows everything (/0). A range that is not a prefix is
// left out with a warning (the apiserver refuses them; manifests may hold
// them).
func loadBalancerSourceRanges(svc *v1.Service) (map[v1.IPFamily][]netip.Prefix, []string) {
	out := map[v1.IPFamily][]netip.Prefix{}
	open := map[v1.IPFamily]bool{}
	var warnings []string
	for _, s := range svc.Spec.LoadBalancerSourceRanges {
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			warnings = append(warnings, fmt.Sprintf("loadBalancerSourceRange %s is not a prefix: left out", quoteBounded(s)))
			continue
		}
		if p.Addr().Is4In6() && p.Bits() >= 96 {
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		family := FamilyOf(p.Addr())
		switch p = p.Masked(); {
		case p.Bits() == 0:
			open[family] = true
		case !slices.Contains(out[family], p):
			out[family] = append(out[family], p)
		}
	}
	for family := range open {
		delete(out, family)
	}
	return out, warnings
}

// hasNodePort reports whether any port of svc has a nodePort.
func hasNodePort(svc *v1.Service) bool {
	return slices.ContainsFunc(svc.Spec.Ports, func(sp v1.ServicePort) bool { return sp.NodePort != 0 })
}

// topolbAnnotations returns svc's annotations under topolb.io/, or nil
// when it has none.
func topolbAnnotations(svc *v1.Service) map[string]string {
	var ann map[string]string
	for k, v := range svc.Annotations {
		if strings.HasPrefix(k, "topolb.io/") {
			if ann == nil {
				ann = map[string]string{}
			}
			ann[k] = v
		}
	}
	return ann
}

// portProblem returns why the service port sp (of protocol proto, its
// default applied) is not served, or "" when it is: it repeats the number
// or name of a port in kept (the ports already accepted), or its number,
// nodePort or protocol is out of range.
func portProblem(sp v1.ServicePort, proto v1.Protocol, kept []ServicePort) string {
	if j := slices.IndexFunc(kept, func(p ServicePort) bool {
		return p.Protocol == proto && (int32(p.Port) == sp.Port || p.Name == sp.Name)
	}); j >= 0 {
		// The API forbids both; kube-proxy keys ports by name and
		// protocol. The first port in spec order keeps its place.
		return fmt.Sprintf("port %s (%d/%s) repeats the number or name of port %s (%d/%s): ignored, the first one is served",
			quoteBounded(sp.Name), sp.Port, proto, quoteBounded(kept[j].Name), kept[j].Port, kept[j].Protocol)
	}
	switch {
	case sp.Port < 1 || sp.Port > 65535:
		return fmt.Sprintf("port %s: number %d out of range", quoteBounded(sp.Name), sp.Port)
	case sp.NodePort < 0 || sp.NodePort > 65535:
		return fmt.Sprintf("port %s: nodePort %d out of range", quoteBounded(sp.Name), sp.NodePort)
	case proto != v1.ProtocolTCP && proto != v1.ProtocolUDP && proto != v1.ProtocolSCTP:
		return fmt.Sprintf("port %s: unknown protocol %s", quoteBounded(sp.Name), quoteBounded(string(proto)))
	}
	return ""
}

// MaxAffinitySeconds is the longest ClientIP affinity timeout the API
// accepts (k8s.io/kubernetes pkg/apis/core MaxClientIPServiceAffinitySeconds,
// which k8s.io/api does not export).
const MaxAffinitySeconds = 86400

// frontendIP parses an externalIP or load-balancer IP of either family
// (an IPv4-mapped IPv6 address is its IPv4 address). It returns the
// address when it can be a frontend, and a warning otherwise.
func frontendIP(s, what string) (netip.Addr, string) {
	ip, err := netip.ParseAddr(strings.TrimSpace(s))
	if err != nil {
		return netip.Addr{}, fmt.Sprintf("%s %s is not an IP address: ignored", what, quoteBounded(s))
	}
	ip = ip.Unmap()
	if problem := AddrProblem(ip); problem != "" {
		return netip.Addr{}, fmt.Sprintf("%s %s is %s: ignored", what, ip, problem)
	}
	return ip, ""
}

// sessionAffinity reads the Service's session affinity, with the API's
// default timeout and its validation (1..86400 seconds). What the API would
// reject is not allowed to cost the Service its traffic: an unknown type is
// None, an invalid timeout the default; the warning says which.
func sessionAffinity(svc *v1.Service) (SessionAffinity, string) {
	switch svc.Spec.SessionAffinity {
	case "", v1.ServiceAffinityNone:
		return SessionAffinity{}, ""
	case v1.ServiceAffinityClientIP:
	default:
		return SessionAffinity{}, fmt.Sprintf("sessionAffinity %s is not None or ClientIP: no affinity", quoteBounded(string(svc.Spec.SessionAffinity)))
	}
	cfg := svc.Spec.SessionAffinityConfig
	if cfg == nil || cfg.ClientIP == nil || cfg.ClientIP.TimeoutSeconds == nil {
		return SessionAffinity{ClientIP: true, TimeoutSeconds: v1.DefaultClientIPServiceAffinitySeconds}, ""
	}
	t := *cfg.ClientIP.TimeoutSeconds
	if t < 1 || t > MaxAffinitySeconds {
		return SessionAffinity{ClientIP: true, TimeoutSeconds: v1.DefaultClientIPServiceAffinitySeconds},
			fmt.Sprintf("sessionAffinityConfig.clientIP.timeoutSeconds %d is outside 1..%d: using the default %d", t, MaxAffinitySeconds, v1.DefaultClientIPServiceAffinitySeconds)
	}
	return SessionAffinity{ClientIP: true, TimeoutSeconds: t}, ""
}

// NodeFromObject builds the model of a node: its labels, allocatable CPU,
// Ready condition and IPv4 and IPv6 addresses (an IPv4-mapped one as its
// IPv4 address). keep selects the labels to retain; nil keeps them
// all.
func NodeFromObject(n *v1.Node, keep func(key string) bool) Node {
	labels := make(map[string]string, len(n.Labels))
	for k, v := range n.Labels {
		if keep == nil || keep(k) {
			labels[k] = v
		}
	}
	out := Node{Name: n.Name, Labels: labels, AllocatableMilliCPU: milliCPU(n.Status.Allocatable.Cpu())}
	for _, a := range n.Status.Addresses {
		if ip, err := netip.ParseAddr(strings.TrimSpace(a.Address)); err == nil {
			ip = ip.Unmap()
			out.Addresses = append(out.Addresses, NodeAddress{Type: a.Type, Addr: ip})
		}
	}
	for _, c := range n.Status.Conditions {
		if c.Type == v1.NodeReady {
			out.Ready = c.Status
			break
		}
	}
	switch {
	case n.DeletionTimestamp != nil:
		out.Leaving = "being deleted"
	case slices.ContainsFunc(n.Spec.Taints, func(t v1.Taint) bool { return t.Key == ToBeDeletedTaint }):
		out.Leaving = "tainted " + ToBeDeletedTaint
	}
	return out
}

// milliCPU returns q in millicores without overflowing: quantities beyond
// MaxNodeCPUCores in either direction are clamped to ±math.MaxInt64, which
// Node.hasCPU rejects.
func milliCPU(q *resource.Quantity) int64 {
	switch {
	case q.CmpInt64(MaxNodeCPUCores) > 0:
		return math.MaxInt64
	case q.CmpInt64(-MaxNodeCPUCores) < 0:
		return -math.MaxInt64
	}
	return q.MilliValue()
}

// EndpointsForPort returns the endpoints of one service port from the
// Service's EndpointSlices, as seen from node nodeName, and a warning for
// everything it had to skip.
//
// Only the slices of the port's family count (addressType IPv4 or IPv6;
// FQDN slices are left out with a warning, as kube-proxy ignores them);
// the slice port must match the service port by name and protocol and have
// a number. Each endpoint contributes its first address
// only. The same ip:port in several slices counts once: a ready copy is
// preferred, then one on nodeName. The result is sorted by address.
func EndpointsForPort(port ServicePort, epSlices []*discovery.EndpointSlice, nodeName string) ([]Endpoint, []string) {
	var warnings []string
	sorted := slices.Clone(epSlices)
	slices.SortFunc(sorted, func(a, b *discovery.EndpointSlice) int { return cmp.Compare(a.Name, b.Name) })
	byAddr := map[netip.AddrPort]Endpoint{}
	for _, s := range sorted {
		if s.AddressType != discovery.AddressTypeIPv4 && s.AddressType != discovery.AddressTypeIPv6 {
			warnings = append(warnings, fmt.Sprintf("endpointslice %s/%s: addressType %s is not served (IPv4 and IPv6 only)", s.Namespace, s.Name, quoteBounded(string(s.AddressType))))
			continue
		}
		if string(s.AddressType) != string(port.Family) {
			continue
		}
		num, ok := slicePort(s, port)
		if !ok {
			continue
		}
		for i, e := range s.Endpoints {
			if len(e.Addresses) == 0 {
				warnings = append(warnings, fmt.Sprintf("endpointslice %s/%s: endpoint %d has no address", s.Namespace, s.Name, i))
				continue
			}
			ip, ok := parseAddr(e.Addresses[0], port.Family)
			if !ok {
				warnings = append(warnings, fmt.Sprintf("endpointslice %s/%s: endpoint address %s is not %s", s.Namespace, s.Name, quoteBounded(e.Addresses[0]), port.Family))
				continue
			}
			if problem := AddrProblem(ip); problem != "" {
				warnings = append(warnings, fmt.Sprintf("endpointslice %s/%s: endpoint address %s is %s: skipped", s.Namespace, s.Name, ip, problem))
				continue
			}
			ep := endpointFrom(e, netip.AddrPortFrom(ip, num))
			if prev, dup := byAddr[ep.Addr]; dup && !preferOver(ep, prev, nodeName) {
				continue
			}
			byAddr[ep.Addr] = ep
		}
	}
	out := make([]Endpoint, 0, len(byAddr))
	for _, ep := range byAddr {
		out = append(out, ep)
	}
	slices.SortFunc(out, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
	return out, warnings
}

// preferOver reports whether a duplicate endpoint should replace the copy
// already kept: a ready copy wins, then a copy on this node.
func preferOver(ep, prev Endpoint, nodeName string) bool {
	if ep.Ready != prev.Ready {
		return ep.Ready
	}
	return ep.NodeName == nodeName && prev.NodeName != nodeName
}

// slicePort returns the number of the slice port matching the service port
// by name and protocol, with the API's defaults (nil name is "", nil
// protocol is TCP). A matching port without a number does not count.
func slicePort(s *discovery.EndpointSlice, port ServicePort) (uint16, bool) {
	for _, p := range s.Ports {
		name, proto := "", v1.ProtocolTCP
		if p.Name != nil {
			name = *p.Name
		}
		if p.Protocol != nil {
			proto = *p.Protocol
		}
		if name != port.Name || proto != port.Protocol {
			continue
		}
		if p.Port == nil || *p.Port < 1 || *p.Port > 65535 {
			return 0, false
		}
		return uint16(*p.Port), true
	}
	return 0, false
}

func endpointFrom(e discovery.Endpoint, addr netip.AddrPort) Endpoint {
	ep := Endpoint{
		Addr:        addr,
		Ready:       e.Conditions.Ready == nil || *e.Conditions.Ready,
		Serving:     e.Conditions.Serving == nil || *e.Conditions.Serving,
		Terminating: e.Conditions.Terminating != nil && *e.Conditions.Terminating,
	}
	if e.NodeName != nil {
		ep.NodeName = *e.NodeName
	}
	if e.Zone != nil {
		ep.Zone = *e.Zone
	}
	if e.Hints != nil {
		for _, z := range e.Hints.ForZones {
			ep.ZoneHints = append(ep.ZoneHints, z.Name)
		}
		for _, n := range e.Hints.ForNodes {
			ep.NodeHints = append(ep.NodeHints, n.Name)
		}
	}
	return ep
}
