package agent

import (
	"cmp"
	"math"
	"net/netip"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// The decision engine says what to program (topology.NodeFrontends and
// topology.Claims: which frontends, in which scope, with which backend set
// and settings, and who owns a contested frontend); this file only
// translates its answer into the datapath's types. The agent and the
// testbed's in-process datapath (tools/testbed/direct.go) both program
// through these two functions, so neither can drift from the other.

// weightScale turns the decision's fractions into the datapath's relative
// integer weights: a millionth of a node's new flows is the finest share
// that survives the conversion (the datapath's weighted tables are far
// coarser, see docs/datapath.md).
const weightScale = 1_000_000

// Scopes are the scopes a frontend is programmed in, in the order the
// agent reports them.
var Scopes = []topology.Scope{topology.ScopeInternal, topology.ScopeExternal}

// ScopeFamilies are, per scope, the IP families the agent programs
// frontends of that scope in, in topology.Families' order: IPv4 always,
// IPv6 where the datapath serves it (Datapath.IPv6). A frontend of another
// family or scope is decided, explained, counted and health-checked, but
// not programmed. Its JSON is an object keyed by scope:
// {"internal":["IPv4","IPv6"],"external":["IPv4"]}.
type ScopeFamilies map[topology.Scope][]v1.IPFamily

// ProgrammedFamilies returns the families the agent programs per scope
// into a datapath that serves IPv6 in the scopes ipv6 says (the
// datapath's IPv6 method).
func ProgrammedFamilies(ipv6 func(maps.Scope) bool) ScopeFamilies {
	out := make(ScopeFamilies, len(Scopes))
	for _, scope := range Scopes {
		families := []v1.IPFamily{v1.IPv4Protocol}
		if ipv6(datapathScope(scope)) {
			families = append(families, v1.IPv6Protocol)
		}
		out[scope] = families
	}
	return out
}

// Programs reports whether frontends of family in scope are programmed.
func (sf ScopeFamilies) Programs(family v1.IPFamily, scope topology.Scope) bool {
	return slices.Contains(sf[scope], family)
}

// Everywhere returns the families programmed in every scope, in
// topology.Families' order: what DebugState.Families says, as an agent
// that programmed per family only said it.
func (sf ScopeFamilies) Everywhere() []v1.IPFamily { return sf.inScopes(len(Scopes)) }

// Anywhere returns the families programmed in at least one scope, in
// topology.Families' order.
func (sf ScopeFamilies) Anywhere() []v1.IPFamily { return sf.inScopes(1) }

// inScopes returns the families programmed in at least n scopes.
func (sf ScopeFamilies) inScopes(n int) []v1.IPFamily {
	var out []v1.IPFamily
	for _, family := range topology.Families {
		in := 0
		for _, scope := range Scopes {
			if sf.Programs(family, scope) {
				in++
			}
		}
		if in >= n {
			out = append(out, family)
		}
	}
	return out
}

// String renders the families per scope, "internal: IPv4 IPv6; external:
// IPv4" (a scope without any: "-").
func (sf ScopeFamilies) String() string {
	parts := make([]string, 0, len(Scopes))
	for _, scope := range Scopes {
		names := make([]string, 0, len(sf[scope]))
		for _, f := range sf[scope] {
			names = append(names, string(f))
		}
		parts = append(parts, string(scope)+": "+cmp.Or(strings.Join(names, " "), "-"))
	}
	return strings.Join(parts, "; ")
}

// DatapathFrontend returns the datapath's key for a frontend, and false
// when the datapath does not balance its protocol (SCTP: decided, and
// explained, but not translated).
func DatapathFrontend(k topology.Key) (maps.Frontend, bool) {
	fe := maps.Frontend{Addr: k.Addr}
	switch k.Protocol {
	case v1.ProtocolTCP:
		fe.Proto = maps.TCP
	case v1.ProtocolUDP:
		fe.Proto = maps.UDP
	default:
		return maps.Frontend{}, false
	}
	fe.Scope = datapathScope(k.Scope)
	return fe, true
}

// datapathScope returns the datapath's scope for a decision's.
func datapathScope(s topology.Scope) maps.Scope {
	if s == topology.ScopeExternal {
		return maps.ScopeExternal
	}
	return maps.ScopeInternal
}

// DatapathService returns what the datapath programs for f on node:
//   - its active backends, marked node- and zone-local, each with its
//     weight (all 0, meaning equal, when the decision's weights are equal);
//   - its draining backends, which keep their established flows;
//   - ClientIP affinity with the owning port's timeout, or none;
//   - Reject when an empty active set must be refused rather than dropped;
//   - the source ranges of a load-balancer IP (topology.Frontend.SourceRanges);
//   - the owning port's name (ServiceName), for readers of the pinned maps.
func DatapathService(f topology.Frontend, node topology.Node) maps.Service {
	s := maps.Service{
		Backends: make([]maps.Backend, 0, len(f.Backends)+len(f.Draining)),
		Reject:   f.WhenEmpty == topology.EmptyReject,
		Name:     ServiceName(f.Port),
	}
	s.SourceRanges, s.SourceRangesNode = f.SourceRanges(node)
	weights := integerWeights(f.Weights)
	for i, ep := range f.Backends {
		b := backend(ep, node)
		if weights != nil {
			b.Weight = weights[i]
		}
		s.Backends = append(s.Backends, b)
	}
	for _, ep := range f.Draining {
		b := backend(ep, node)
		b.Draining = true
		s.Backends = append(s.Backends, b)
	}
	if a := f.Port.Affinity; a.ClientIP {
		s.Affinity = time.Duration(a.TimeoutSeconds) * time.Second
	}
	return s
}

// ServiceName names a service port as the pinned maps record it:
// "namespace/name:port", or "namespace/name" for an unnamed port.
func ServiceName(p topology.ServicePort) string {
	if p.Name == "" {
		return p.Service.String()
	}
	return p.Service.String() + ":" + p.Name
}

// backend converts one endpoint, marking it node-local and zone-local as
// seen from node.
func backend(ep topology.Endpoint, node topology.Node) maps.Backend {
	zone := node.Zone()
	return maps.Backend{
		Addr:      ep.Addr,
		NodeLocal: ep.NodeName != "" && ep.NodeName == node.Name,
		ZoneLocal: zone != "" && ep.Zone == zone,
	}
}

// integerWeights scales fractions to positive integers, or returns nil when
// they are all equal (the datapath's one-slot-per-backend table, which keeps
// single-endpoint changes to a few writes).
func integerWeights(ws []float64) []uint32 {
	if topology.EqualWeights(ws) {
		return nil
	}
	out := make([]uint32, len(ws))
	for i, w := range ws {
		out[i] = uint32(max(1, math.Round(w*weightScale)))
	}
	return out
}

// ReportKey returns the key under which DebugState.Programmed lists the
// frontend an explain report decided ("ip:port/PROTO", with "/external"
// for the external scope), and false for a protocol the datapath does not
// balance. It is how a decision and the kernel's contents are compared
// (`topolbctl explain --agent`, tests).
func ReportKey(f topology.FrontendReport) (string, bool) {
	addr, err := netip.ParseAddrPort(f.Address)
	if err != nil {
		return "", false
	}
	fe, ok := DatapathFrontend(topology.Key{Addr: addr, Protocol: v1.Protocol(f.Protocol), Scope: f.Scope})
	if !ok {
		return "", false
	}
	return fe.String(), true
}
