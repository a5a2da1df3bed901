package topology

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/api/validate/content"
)

// Input is everything one decision reads.
type Input struct {
	// Node is the node the decision is for.
	Node Node
	// Nodes holds every known node by name; TopologyKeys reads the labels
	// of endpoints' nodes from it. Nil is treated as empty.
	Nodes map[string]Node
	// Port is the service port.
	Port ServicePort
	// Endpoints are the port's endpoints, deduplicated by address.
	Endpoints []Endpoint
	// Demand is ZoneDemand(Nodes), which the ZoneWeighted policy reads;
	// nil means Decide computes it. Callers deciding many ports on one
	// snapshot of the nodes pass it to save the work.
	Demand *Demand
	// Lacking, when not "", says that Nodes comes from a topology summary
	// that lacks what the port's policy reads of other nodes
	// (Summary.Lacks): the policy is not applied on guesses, the port is
	// decided by hints until the summary has it, and the reason says so.
	Lacking string
	// SummaryNote, when not "", says why the summary Nodes comes from may
	// be out of date (its writer is down): a policy that reads other nodes
	// decides from its last known inputs and its reason says so.
	SummaryNote string
}

// Decide returns, for one node and one service port, the policy and mode that
// apply, the reason, and the internal and external backends.
//
// The cluster set is chosen by the first policy whose annotation is valid:
//   - topolb.io/topology-aware "false": Disabled, every usable endpoint.
//   - topolb.io/topology-keys: TopologyKeys, the endpoints matching the first
//     key with a match (none when nothing matches: traffic is dropped).
//   - topolb.io/zone-threshold: ZoneThreshold, the local zone's usable
//     endpoints if there are at least N of them, else every usable one.
//   - topolb.io/zone-weighted "true": ZoneWeighted, the usable endpoints
//     weighted so that each zone keeps the share of its traffic its
//     endpoints can carry and spills the rest where there is room
//     (zoneWeighted, weights.go).
//   - otherwise Hints, exactly as kube-proxy applies topology hints: one mode
//     per service and node, never a per-endpoint filter.
//
// What each policy reads of this node and of other nodes is declared in
// ServicePort.Reads (reads.go), which the agent uses to know which Node
// changes need a new decision: a policy that starts reading more of the
// nodes must say so there too.
//
// Usable endpoints are the ready ones, or the serving-terminating ones when
// none is ready. The local set (endpoints on this node, ready else
// serving-terminating) is never filtered by topology. Internal traffic uses
// the local set under internalTrafficPolicy Local, external traffic under
// externalTrafficPolicy Local; otherwise both use the cluster set. Every set
// comes with the fraction of new flows each backend gets: equal shares,
// except for the cluster set of the ZoneWeighted policy.
func Decide(in Input, opts Options) Decision {
	p := in.Port
	var cluster weighted
	policy, mode, reason := PolicyHints, ModeNone, ""

	if p.UsesClusterEndpoints() {
		policy, mode, reason, cluster = chooseCluster(in, opts)
	} else {
		var notes []string
		policy, _, notes = choosePolicy(p.Annotations)
		reason = joinReason(strings.Join(notes, "; "), "internalTrafficPolicy is Local and the port is not externally accessible: topology does not apply")
	}

	var local weighted
	if p.UsesLocalEndpoints() {
		local = equalShares(localEndpoints(in.Endpoints, in.Node.Name))
	}

	d := Decision{Policy: policy, Mode: mode, Reason: reason}
	internal := cluster
	if p.InternalPolicyLocal {
		internal = local
		d.Reason = joinReason(d.Reason, fmt.Sprintf("internal traffic uses %s (internalTrafficPolicy Local)", endpoints(len(local.eps), "local")))
	}
	serving := filter(in.Endpoints, Endpoint.serving)
	d.WhenEmpty = EmptyDrop
	if len(serving) == 0 {
		d.WhenEmpty = EmptyReject
	}
	if p.UsesClusterEndpoints() {
		d.ClusterBackends, d.ClusterWeights = nonNil(cluster.eps), nonNilWeights(cluster.w)
		d.ClusterDraining = nonNil(without(serving, cluster.eps))
	}
	d.Backends, d.Weights = nonNil(internal.eps), nonNilWeights(internal.w)
	d.Draining = nonNil(without(serving, internal.eps))
	if p.ExternallyAccessible {
		external := cluster
		if p.ExternalPolicyLocal {
			external = local
			d.Reason = joinReason(d.Reason, fmt.Sprintf("external traffic uses %s (externalTrafficPolicy Local)", endpoints(len(local.eps), "local")))
		}
		d.ExternalBackends, d.ExternalWeights = nonNil(external.eps), nonNilWeights(external.w)
		d.ExternalDraining = nonNil(without(serving, external.eps))
	}
	d.Reason = boundReason(d.Reason)
	return d
}

// without returns the endpoints of all that are not in active, in order.
func without(all, active []Endpoint) []Endpoint {
	in := make(map[netip.AddrPort]bool, len(active))
	for _, ep := range active {
		in[ep.Addr] = true
	}
	return filter(all, func(ep Endpoint) bool { return !in[ep.Addr] })
}

// policyChoice is a parsed, valid annotation and the notes about invalid
// annotations that were skipped on the way to it.
type policyChoice struct {
	zoneThreshold int
	keys          []string
}

// choosePolicy returns the policy the Service's annotations select, its
// parameters, and a note for every invalid annotation that was ignored.
func choosePolicy(ann map[string]string) (Policy, policyChoice, []string) {
	var notes []string
	if v, ok := ann[AnnotationTopologyAware]; ok {
		switch strings.ToLower(strings.TrimSpace(v)) {
		case "false":
			return PolicyDisabled, policyChoice{}, notes
		case "true":
		default:
			notes = append(notes, fmt.Sprintf("ignoring invalid %s %s (want true or false)", AnnotationTopologyAware, quoteBounded(v)))
		}
	}
	if v, ok := ann[AnnotationTopologyKeys]; ok {
		keys, err := ParseTopologyKeys(v)
		if err == nil {
			return PolicyTopologyKeys, policyChoice{keys: keys}, notes
		}
		notes = append(notes, fmt.Sprintf("ignoring invalid %s %s: %v", AnnotationTopologyKeys, quoteBounded(v), err))
	}
	if v, ok := ann[AnnotationZoneThreshold]; ok {
		n, err := ParseZoneThreshold(v)
		if err == nil {
			return PolicyZoneThreshold, policyChoice{zoneThreshold: n}, notes
		}
		notes = append(notes, fmt.Sprintf("ignoring invalid %s %s: %v", AnnotationZoneThreshold, quoteBounded(v), err))
	}
	if v, ok := ann[AnnotationZoneWeighted]; ok {
		if strings.ToLower(strings.TrimSpace(v)) == "true" {
			return PolicyZoneWeighted, policyChoice{}, notes
		}
		notes = append(notes, fmt.Sprintf("ignoring invalid %s %s (want true)", AnnotationZoneWeighted, quoteBounded(v)))
	}
	return PolicyHints, policyChoice{}, notes
}

// ParseTopologyKeys parses a topology-keys annotation: 1 to 16
// comma-separated label keys (surrounding spaces trimmed), none empty or
// repeated, "*" only as the last key.
func ParseTopologyKeys(v string) ([]string, error) {
	parts := strings.Split(v, ",")
	if len(parts) > MaxTopologyKeys {
		return nil, fmt.Errorf("%d keys, at most %d allowed", len(parts), MaxTopologyKeys)
	}
	seen := make(map[string]bool, len(parts))
	keys := make([]string, 0, len(parts))
	for i, k := range parts {
		k = strings.TrimSpace(k)
		switch {
		case k == "":
			return nil, fmt.Errorf("key %d is empty", i+1)
		case seen[k]:
			return nil, fmt.Errorf("key %s repeated", quoteBounded(k))
		case k == "*" && i != len(parts)-1:
			return nil, fmt.Errorf(`"*" must be the last key`)
		case k != "*":
			if errs := content.IsLabelKey(k); len(errs) > 0 {
				// The first clause says what is wrong; the rest is
				// examples and the regular expression.
				msg, _, _ := strings.Cut(errs[0], " (e.g.")
				return nil, fmt.Errorf("key %s is not a label key: %s", quoteBounded(k), msg)
			}
		}
		seen[k] = true
		keys = append(keys, k)
	}
	return keys, nil
}

// ParseZoneThreshold parses a zone-threshold annotation: an integer ≥ 1.
func ParseZoneThreshold(v string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil {
		return 0, fmt.Errorf("not an integer")
	}
	if n < 1 {
		return 0, fmt.Errorf("must be at least 1")
	}
	return n, nil
}

// chooseCluster returns the policy, mode, reason and weighted cluster set
// for a port that uses cluster endpoints.
func chooseCluster(in Input, opts Options) (Policy, Mode, string, weighted) {
	policy, choice, notes := choosePolicy(in.Port.Annotations)
	if in.Lacking != "" && (policy == PolicyTopologyKeys || policy == PolicyZoneWeighted) {
		notes = append(notes, fmt.Sprintf("%s needs data of other nodes, but %s: deciding by hints until it has it", policy, in.Lacking))
		policy = PolicyHints
	}
	if in.SummaryNote != "" && (policy == PolicyTopologyKeys || policy == PolicyZoneWeighted) {
		notes = append(notes, in.SummaryNote+": deciding from its last known inputs")
	}
	var mode Mode
	var reason string
	var eps []Endpoint
	switch policy {
	case PolicyDisabled:
		var what string
		eps, what = usable(in.Endpoints)
		mode, reason = ModeNone, fmt.Sprintf("topology disabled by %s; using %s", AnnotationTopologyAware, what)
	case PolicyTopologyKeys:
		mode, reason, eps = topologyKeys(in, choice.keys)
	case PolicyZoneThreshold:
		mode, reason, eps = zoneThreshold(in, choice.zoneThreshold)
	case PolicyZoneWeighted:
		var cluster weighted
		mode, reason, cluster = zoneWeighted(in)
		return policy, mode, joinReason(strings.Join(notes, "; "), reason), cluster
	default:
		mode, reason, eps = hints(in, opts)
	}
	return policy, mode, joinReason(strings.Join(notes, "; "), reason), equalShares(eps)
}

// hints applies topology hints the way kube-proxy does: the mode is chosen
// over the ready endpoints as a whole, and only then applied.
func hints(in Input, opts Options) (Mode, string, []Endpoint) {
	mode, reason := hintsMode(in.Endpoints, in.Node.Name, in.Node.Zone(), opts)
	var cluster []Endpoint
	for _, ep := range in.Endpoints {
		if ep.Ready && availableForMode(ep, mode, in.Node.Name, in.Node.Zone()) {
			cluster = append(cluster, ep)
		}
	}
	if len(cluster) == 0 {
		cluster = filter(in.Endpoints, Endpoint.servingTerminating)
		if len(cluster) > 0 {
			return ModeNone, fmt.Sprintf("no ready endpoints; using %s without topology", endpoints(len(cluster), "serving-terminating")), cluster
		}
		return ModeNone, "no ready or serving-terminating endpoints", nil
	}
	return mode, reason, cluster
}

// hintsMode chooses PreferSameNode, PreferSameZone or None for the ready
// endpoints as a whole, and says why.
func hintsMode(eps []Endpoint, node, zone string, opts Options) (Mode, string) {
	var ready, forNode, forZone int
	var missingNode, missingZone *Endpoint
	for i := range eps {
		ep := &eps[i]
		if !ep.Ready {
			continue
		}
		ready++
		if len(ep.NodeHints) == 0 {
			if missingNode == nil {
				missingNode = ep
			}
		} else if slices.Contains(ep.NodeHints, node) {
			forNode++
		}
		if len(ep.ZoneHints) == 0 {
			if missingZone == nil {
				missingZone = ep
			}
		} else if slices.Contains(ep.ZoneHints, zone) {
			forZone++
		}
	}
	if ready == 0 {
		return ModeNone, "no ready endpoints"
	}
	var nodeNote string
	if opts.PreferSameTrafficDistribution {
		switch {
		case missingNode == nil && forNode > 0:
			return ModePreferSameNode, fmt.Sprintf("%s carry node hints; %d %s hinted for node %s", allReadyN(ready), forNode, isAre(forNode), node)
		case missingNode == nil:
			nodeNote = fmt.Sprintf("no endpoint is hinted for node %s", node)
		case countNodeHinted(eps) > 0:
			nodeNote = fmt.Sprintf("node hints ignored: endpoint %s has none", describe(*missingNode))
		}
	}
	var reason string
	mode := ModeNone
	switch {
	case missingZone != nil && countZoneHinted(eps) == 0:
		reason = fmt.Sprintf("no ready endpoint carries a zone hint; %s used", allReady(ready))
	case missingZone != nil:
		reason = fmt.Sprintf("endpoint %s has no zone hint; hints apply only when every ready endpoint has one, so %s used", describe(*missingZone), allReady(ready))
	case forZone > 0:
		mode = ModePreferSameZone
		reason = fmt.Sprintf("%s carry zone hints; %d %s hinted for %s", allReadyN(ready), forZone, isAre(forZone), zone)
	case zone == "":
		reason = fmt.Sprintf("node %s has no %s label; %s used", node, LabelZone, allReady(ready))
	default:
		reason = fmt.Sprintf("%s carry zone hints but none is hinted for %s; all are used", allReadyN(ready), zone)
	}
	if nodeNote != "" {
		reason = nodeNote + "; " + reason
	}
	return mode, reason
}

// countZoneHinted counts ready endpoints that carry a zone hint.
func countZoneHinted(eps []Endpoint) int {
	n := 0
	for _, ep := range eps {
		if ep.Ready && len(ep.ZoneHints) > 0 {
			n++
		}
	}
	return n
}

// allReadyN renders "all 3 ready endpoints" or "the 1 ready endpoint".
func allReadyN(n int) string {
	if n == 1 {
		return "the 1 ready endpoint"
	}
	return fmt.Sprintf("all %d ready endpoints", n)
}

// allReady renders "all 3 ready endpoints are" or "the 1 ready endpoint is".
func allReady(n int) string {
	if n == 1 {
		return "the 1 ready endpoint is"
	}
	return fmt.Sprintf("all %d ready endpoints are", n)
}

// endpoints renders "1 endpoint" or "3 endpoints".
func endpoints(n int, adj string) string {
	if n == 1 {
		return "1 " + adj + " endpoint"
	}
	return fmt.Sprintf("%d %s endpoints", n, adj)
}

// countNodeHinted counts ready endpoints that carry a node hint.
func countNodeHinted(eps []Endpoint) int {
	n := 0
	for _, ep := range eps {
		if ep.Ready && len(ep.NodeHints) > 0 {
			n++
		}
	}
	return n
}

// availableForMode reports whether an endpoint serves a node under mode.
func availableForMode(ep Endpoint, mode Mode, node, zone string) bool {
	switch mode {
	case ModePreferSameNode:
		return slices.Contains(ep.NodeHints, node)
	case ModePreferSameZone:
		return slices.Contains(ep.ZoneHints, zone)
	default:
		return true
	}
}

// topologyKeys applies the legacy topologyKeys preference list to the usable
// endpoints: the first key whose value on this node matches at least one
// endpoint's node wins; "*" matches every endpoint; no match drops traffic.
func topologyKeys(in Input, keys []string) (Mode, string, []Endpoint) {
	cands, what := usable(in.Endpoints)
	anyLast := keys[len(keys)-1] == "*"
	if len(in.Node.Labels) == 0 {
		if anyLast {
			return ModeAny, fmt.Sprintf("node %s has no labels; %q matches all: using %s", in.Node.Name, "*", what), cands
		}
		return ModeNone, fmt.Sprintf("node %s has no labels and the keys do not end in %q: traffic is dropped", in.Node.Name, "*"), nil
	}
	var tried []string
	for _, key := range keys {
		if key == "*" {
			return ModeAny, joinReason(triedNote(tried), fmt.Sprintf("%q matches all: using %s", "*", what)), cands
		}
		want, ok := in.Node.Labels[key]
		if !ok {
			tried = append(tried, fmt.Sprintf("node lacks %s", key))
			continue
		}
		var match []Endpoint
		for _, ep := range cands {
			if n, ok := in.Nodes[ep.NodeName]; ok {
				if v, ok := n.Labels[key]; ok && v == want {
					match = append(match, ep)
				}
			}
		}
		if len(match) > 0 {
			return Mode(key), joinReason(triedNote(tried), fmt.Sprintf("%d of %s match %s=%s", len(match), what, key, want)), match
		}
		tried = append(tried, fmt.Sprintf("no endpoint with %s=%s", key, want))
	}
	return ModeNone, joinReason(triedNote(tried), "no topology key matched: traffic is dropped"), nil
}

func triedNote(tried []string) string {
	if len(tried) == 0 {
		return ""
	}
	return "skipped: " + strings.Join(tried, ", ")
}

// zoneThreshold keeps traffic in this node's zone when the zone has at least
// n usable endpoints, and uses every usable endpoint otherwise.
func zoneThreshold(in Input, n int) (Mode, string, []Endpoint) {
	cands, what := usable(in.Endpoints)
	zone := in.Node.Zone()
	if zone == "" {
		return ModeNone, fmt.Sprintf("node %s has no %s label, so the zone threshold %d is never met; using %s", in.Node.Name, LabelZone, n, what), cands
	}
	inZone := filter(cands, func(ep Endpoint) bool { return ep.Zone == zone })
	if len(inZone) >= n {
		return ModePreferSameZone, fmt.Sprintf("%s has %s, threshold %d met", zone, endpoints(len(inZone), "usable"), n), inZone
	}
	return ModeNone, fmt.Sprintf("%s has %s, below threshold %d; using %s", zone, endpoints(len(inZone), "usable"), n, what), cands
}

// usable returns the ready endpoints, or the serving-terminating ones when
// none is ready, and a phrase describing which.
func usable(eps []Endpoint) ([]Endpoint, string) {
	if r := filter(eps, func(ep Endpoint) bool { return ep.Ready }); len(r) > 0 {
		return r, endpoints(len(r), "ready")
	}
	if st := filter(eps, Endpoint.servingTerminating); len(st) > 0 {
		return st, endpoints(len(st), "serving-terminating") + " (none ready)"
	}
	return nil, "no endpoints (none ready or serving-terminating)"
}

// localEndpoints returns the ready endpoints on node, or its
// serving-terminating ones when none is ready.
func localEndpoints(eps []Endpoint, node string) []Endpoint {
	onNode := filter(eps, func(ep Endpoint) bool { return ep.NodeName == node && node != "" })
	r, _ := usable(onNode)
	return r
}

func filter(eps []Endpoint, keep func(Endpoint) bool) []Endpoint {
	var out []Endpoint
	for _, ep := range eps {
		if keep(ep) {
			out = append(out, ep)
		}
	}
	return out
}

func nonNilWeights(w []float64) []float64 {
	if w == nil {
		return []float64{}
	}
	return w
}

func nonNil(eps []Endpoint) []Endpoint {
	if eps == nil {
		return []Endpoint{}
	}
	return eps
}

func describe(ep Endpoint) string {
	if ep.NodeName != "" {
		return fmt.Sprintf("%s (node %s)", ep.Addr, ep.NodeName)
	}
	return ep.Addr.String()
}

func isAre(n int) string {
	if n == 1 {
		return "is"
	}
	return "are"
}

func joinReason(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "; " + b
}
