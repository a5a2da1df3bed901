// Package hintsim simulates what the Kubernetes EndpointSlice controller
// (v1.37) would do with the topology hints of Services' EndpointSlices, and
// estimates how traffic would spread over the endpoints if the hints the
// slices carry now were followed.
//
// The allocation is never re-implemented here: Services with the
// topology-mode Auto annotation go through k8s.io/endpointslice/topologycache
// and Services with spec.trafficDistribution through
// k8s.io/endpointslice/trafficdist, called the way the reconciler calls them.
// What this package adds is what those only log or keep to themselves: which
// node makes the node information insufficient, the per-zone CPU ratios, the
// difference between current and computed hints, and the expected load.
//
// Simulate is pure: its report is a function of the objects and options
// passed in.
package hintsim

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"slices"
	"sort"
	"strings"

	"github.com/go-logr/logr"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/endpointslice/topologycache"
	"k8s.io/endpointslice/trafficdist"

	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// ControllerName is the endpointslice.kubernetes.io/managed-by value of the
// slices the EndpointSlice controller owns.
const ControllerName = "endpointslice-controller.k8s.io"

// overloadThreshold is the topology cache's: an endpoint should carry at
// most 20% more than an even share.
const overloadThreshold = 0.2

// reasonDisabled is the reason of the event the controller records when it
// removes hints.
const reasonDisabled = "TopologyAwareHintsDisabled"

// Options are the switches the simulation honors.
type Options struct {
	// PreferSameTrafficDistribution mirrors the feature gate of that name
	// (GA and locked on since v1.35): the controller accepts
	// trafficDistribution PreferSameZone and PreferSameNode, not only
	// PreferClose, and kube-proxy honors node hints.
	PreferSameTrafficDistribution bool
}

// DefaultOptions returns the options a v1.37 cluster runs with.
func DefaultOptions() Options {
	return Options{PreferSameTrafficDistribution: true}
}

// Simulate runs the EndpointSlice controller's hint logic over the objects:
// the topology cache is fed every Node, then each Service's slices are
// reconciled, one address type (IP family) at a time as the controller's
// reconcileByAddressType does, as if nothing but hints could change (every slice is passed as
// unchanged, so current hints the controller accepts are kept, as they would
// be on a resync). only restricts the report to one Service; nil reports all.
//
// The manifests need not be exactly what the controller writes:
//   - an endpoint whose ready condition is nil counts as ready (the API's
//     default for consumers; the controller always sets it);
//   - a slice without the endpointslice.kubernetes.io/managed-by label is
//     taken to be the controller's; one managed by anything else is left
//     alone, as the controller lists only its own.
//
// A dual-stack Service is reported once per family it has slices of (a
// Service without slices, in its primary family), each family on its own:
// its hints, its endpoints, its loads. Warnings name the slices the
// simulation skipped (FQDN). The error
// wraps ErrBadCPU when a Node's allocatable CPU is negative or absurd (more
// than topology.MaxNodeCPUCores): the controller would turn it into a
// negative or meaningless CPU ratio, so no simulation is made.
func Simulate(objs *kube.Objects, only *types.NamespacedName, opts Options) (Report, []string, error) {
	nodes := slices.Clone(objs.Nodes)
	slices.SortFunc(nodes, func(a, b *v1.Node) int { return cmp.Compare(a.Name, b.Name) })
	if err := checkCPU(nodes); err != nil {
		return Report{}, nil, err
	}
	info, sources, total := nodeInfo(nodes)
	cache := topologycache.NewTopologyCache()
	cache.SetNodes(logr.Discard(), nodes)

	s := &sim{state: objs.State(nil), cache: cache, info: info, sources: sources, totalCPU: total, opts: opts}
	names := make([]types.NamespacedName, 0, len(s.state.Services))
	for nn := range s.state.Services {
		if only == nil || nn == *only {
			names = append(names, nn)
		}
	}
	sort.Slice(names, func(i, j int) bool { return names[i].String() < names[j].String() })

	rep := Report{Nodes: info, Services: []Service{}}
	var warnings []string
	for _, nn := range names {
		svc := s.state.Services[nn]
		families, w := s.families(svc, nn)
		warnings = append(warnings, w...)
		for _, family := range families {
			out, ok := s.service(svc, family)
			if ok {
				rep.Services = append(rep.Services, out)
			}
		}
	}
	return rep, warnings, nil
}

// families returns the IP families to simulate svc in: those it has IPv4
// or IPv6 slices of, in topology.Families' order, or, without any, its
// primary family (spec.ipFamilies, else its cluster IP's, else IPv4); and
// a warning for each slice of another address type (FQDN), which the
// controller does not manage either.
func (s *sim) families(svc *v1.Service, nn types.NamespacedName) ([]v1.IPFamily, []string) {
	var warnings []string
	seen := map[v1.IPFamily]bool{}
	for _, es := range s.state.Slices[nn] {
		switch es.AddressType {
		case discovery.AddressTypeIPv4, discovery.AddressTypeIPv6:
			seen[v1.IPFamily(es.AddressType)] = true
		default:
			warnings = append(warnings, fmt.Sprintf("endpointslice %s/%s: addressType %s is not simulated (IPv4 and IPv6 only)", es.Namespace, es.Name, es.AddressType))
		}
	}
	var out []v1.IPFamily
	for _, family := range topology.Families {
		if seen[family] {
			out = append(out, family)
		}
	}
	if len(out) > 0 {
		return out, warnings
	}
	if len(svc.Spec.IPFamilies) > 0 {
		return svc.Spec.IPFamilies[:1], warnings
	}
	if ip, err := netip.ParseAddr(svc.Spec.ClusterIP); err == nil {
		return []v1.IPFamily{topology.FamilyOf(ip.Unmap())}, warnings
	}
	return []v1.IPFamily{v1.IPv4Protocol}, warnings
}

// ErrBadCPU is wrapped by Simulate's error for a Node whose allocatable CPU
// cannot be a weight.
var ErrBadCPU = errors.New("allocatable CPU is not a usable weight")

// checkCPU refuses nodes whose allocatable CPU is negative or more than
// topology.MaxNodeCPUCores, naming the first (by name).
func checkCPU(nodes []*v1.Node) error {
	for _, n := range nodes {
		q, ok := n.Status.Allocatable[v1.ResourceCPU]
		switch {
		case !ok:
		case q.Sign() < 0:
			return fmt.Errorf("node %s: allocatable cpu %s is negative: %w", n.Name, q.String(), ErrBadCPU)
		case q.CmpInt64(topology.MaxNodeCPUCores) > 0:
			return fmt.Errorf("node %s: allocatable cpu %s is more than %d cores: %w", n.Name, q.String(), topology.MaxNodeCPUCores, ErrBadCPU)
		}
	}
	return nil
}

// sim is one simulation's shared state.
type sim struct {
	state    *topology.State
	cache    *topologycache.TopologyCache
	info     NodeInfo
	sources  []source
	totalCPU int64
	opts     Options
}

// service simulates one Service in one IP family, from that family's
// slices only. ok is false when the Service neither would get hints nor
// carries any in the family.
func (s *sim) service(svc *v1.Service, family v1.IPFamily) (out Service, ok bool) {
	if svc.Spec.Type == v1.ServiceTypeExternalName {
		return Service{}, false
	}
	nn := types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
	method, trigger, notes := chooseMethod(svc, s.opts)
	addressType := discovery.AddressType(family)

	all := slices.Clone(s.state.Slices[nn])
	slices.SortFunc(all, func(a, b *discovery.EndpointSlice) int { return cmp.Compare(a.Name, b.Name) })
	var ofFamily, managed []*discovery.EndpointSlice
	for _, es := range all {
		if es.AddressType != addressType {
			continue
		}
		ofFamily = append(ofFamily, es)
		if mb, ok := es.Labels[discovery.LabelManagedBy]; ok && mb != ControllerName && method != MethodUnmanaged {
			notes = append(notes, fmt.Sprintf("slice %s is managed by %s, not the EndpointSlice controller: its hints stay as they are", es.Name, mb))
			continue
		}
		managed = append(managed, normalized(es))
	}
	if trigger == "" && !anyHints(ofFamily) {
		return Service{}, false
	}

	out = Service{Service: nn.String(), Family: family, Method: method, Trigger: trigger, Zones: []ServiceZone{}, Endpoints: []Endpoint{}}
	var result []*discovery.EndpointSlice
	switch method {
	case MethodTopologyCache:
		// As reconcileByAddressType does for the Auto annotation.
		si := &topologycache.SliceInfo{ServiceKey: nn.String(), AddressType: addressType, Unchanged: managed}
		toCreate, toUpdate, events := s.cache.AddHints(logr.Discard(), si)
		result = slices.Concat(toCreate, toUpdate, si.Unchanged)
		for _, ev := range events {
			if ev.Reason == reasonDisabled && out.DisabledReason == "" {
				out.DisabledReason = ev.Message
				out.DisabledDetail = s.disabledDetail(ev.Message, managed)
			}
		}
	case MethodTrafficDistribution:
		// As reconcileByAddressType does when canUseTrafficDistribution.
		_, toUpdate, unchanged := trafficdist.ReconcileHints(svc.Spec.TrafficDistribution, nil, nil, managed)
		result = slices.Concat(toUpdate, unchanged)
		if ep, ok := firstReadyWithoutZone(managed); ok {
			notes = append(notes, fmt.Sprintf("endpoint %s has no zone: the controller gives it no zone hint, so kube-proxy ignores the Service's zone hints", ep))
		}
	case MethodNone:
		// As reconcileByAddressType does when neither applies.
		si := &topologycache.SliceInfo{ServiceKey: nn.String(), AddressType: addressType, Unchanged: managed}
		_, toUpdate := topologycache.RemoveHintsFromSlices(si)
		result = slices.Concat(toUpdate, si.Unchanged)
		notes = append(notes, "neither spec.trafficDistribution nor the topology-mode Auto annotation is set: the controller removes the hints")
	case MethodUnmanaged:
		// The controller does not touch the slices.
	}
	byName := make(map[string]*discovery.EndpointSlice, len(result))
	for _, es := range result {
		byName[es.Name] = es
	}

	est := s.estimate(svc, nn, family)
	notes = append(notes, est.notes...)
	for _, es := range ofFamily {
		after := byName[es.Name]
		for i, e := range es.Endpoints {
			ep := Endpoint{
				Slice:        es.Name,
				Zone:         deref(e.Zone),
				Node:         deref(e.NodeName),
				Ready:        e.Conditions.Ready == nil || *e.Conditions.Ready,
				CurrentHints: hintsOf(e.Hints),
			}
			ep.ControllerHints = ep.CurrentHints
			managedByController := after != nil && i < len(after.Endpoints)
			if managedByController {
				ep.ControllerHints = hintsOf(after.Endpoints[i].Hints)
			}
			ep.Changed = !ep.CurrentHints.equal(ep.ControllerHints)
			if len(e.Addresses) > 0 {
				ep.Address = e.Addresses[0]
			}
			if ip, err := netip.ParseAddr(ep.Address); err == nil && ep.Ready && est.eligible[ip] {
				if est.hints != nil {
					l := est.hints[ip]
					ep.ExpectedLoad = rounded(l)
					ep.Overloaded = overloaded(l)
				}
				if est.weighted != nil {
					ep.ZoneWeightedLoad = rounded(est.weighted[ip])
				}
			}
			if ep.Ready {
				out.ReadyEndpoints++
				if managedByController && !ep.ControllerHints.empty() {
					out.HintsEnabled = true
				}
			}
			if ep.Changed {
				out.Warnings = append(out.Warnings, fmt.Sprintf("current hints differ from the controller's for %s (slice %s): %s now, %s after its next sync",
					orNone(ep.Address), ep.Slice, ep.CurrentHints, ep.ControllerHints))
			}
			out.Endpoints = append(out.Endpoints, ep)
		}
	}
	out.Zones = s.zones(out.Endpoints, est)
	notes = append(notes, currentHintNotes(out.Endpoints, out.Zones, est.hints != nil)...)
	for _, z := range out.Zones {
		if z.Overloaded {
			out.Warnings = append(out.Warnings, fmt.Sprintf("%s: the %d %s hinted for it now would carry up to %.2f× an even share (limit %.2f×)",
				z.Zone, z.CurrentHints, plural(z.CurrentHints, "endpoint", "endpoints"), *z.ExpectedLoad, 1+overloadThreshold))
		}
	}
	out.Notes = nonNil(notes)
	out.Warnings = nonNil(out.Warnings)
	return out, true
}

// chooseMethod returns how the controller manages svc's hints, the trigger
// and notes on annotations or fields it ignores. It mirrors, in order:
//   - the controller's syncService (k8s.io/kubernetes
//     pkg/controller/endpointslice/endpointslice_controller.go), which
//     leaves Services without a selector alone;
//   - hintsEnabled (k8s.io/endpointslice utils.go): the deprecated
//     service.kubernetes.io/topology-aware-hints annotation, when present,
//     is the only one read; else service.kubernetes.io/topology-mode; the
//     value must be "Auto" or "auto";
//   - Reconciler.validTrafficDistribution and canUseTrafficDistribution
//     (reconciler.go): PreferClose always, PreferSameZone and
//     PreferSameNode with the PreferSameTrafficDistribution gate, and only
//     when the annotation does not enable hints.
func chooseMethod(svc *v1.Service, opts Options) (Method, string, []string) {
	method, trigger, notes := requestedMethod(svc, opts)
	if svc.Spec.Selector == nil {
		return MethodUnmanaged, trigger, append(notes, "the Service has no selector, so the EndpointSlice controller does not manage its slices: their hints stay as their owner wrote them")
	}
	return method, trigger, notes
}

// requestedMethod is chooseMethod for a Service with a selector.
func requestedMethod(svc *v1.Service, opts Options) (Method, string, []string) {
	var notes []string
	key := v1.AnnotationTopologyMode
	val, ok := svc.Annotations[v1.DeprecatedAnnotationTopologyAwareHints]
	if ok {
		key = v1.DeprecatedAnnotationTopologyAwareHints
		if mode, both := svc.Annotations[v1.AnnotationTopologyMode]; both && val != "Auto" && val != "auto" {
			notes = append(notes, fmt.Sprintf("%s=%q is ignored: while %s is set, the controller reads only it", v1.AnnotationTopologyMode, mode, v1.DeprecatedAnnotationTopologyAwareHints))
		}
	} else {
		val, ok = svc.Annotations[v1.AnnotationTopologyMode]
	}
	if ok {
		if val == "Auto" || val == "auto" {
			return MethodTopologyCache, key + "=" + val, notes
		}
		if !strings.EqualFold(val, "disabled") && val != "" {
			notes = append(notes, fmt.Sprintf("%s=%q does not enable hints: only Auto does", key, val))
		}
	}
	if td := svc.Spec.TrafficDistribution; td != nil {
		switch *td {
		case v1.ServiceTrafficDistributionPreferClose:
			return MethodTrafficDistribution, "trafficDistribution=" + *td, notes
		case v1.ServiceTrafficDistributionPreferSameZone, v1.ServiceTrafficDistributionPreferSameNode:
			if opts.PreferSameTrafficDistribution {
				return MethodTrafficDistribution, "trafficDistribution=" + *td, notes
			}
			notes = append(notes, fmt.Sprintf("trafficDistribution %s is ignored without the PreferSameTrafficDistribution feature gate", *td))
		default:
			notes = append(notes, fmt.Sprintf("trafficDistribution %q is not a value the controller knows: ignored", *td))
		}
	}
	return MethodNone, "", notes
}

// disabledDetail names what a TopologyAwareHintsDisabled message does not.
func (s *sim) disabledDetail(msg string, managed []*discovery.EndpointSlice) string {
	switch {
	case strings.HasPrefix(msg, topologycache.InsufficientNodeInfo):
		return s.info.Reason
	case strings.HasPrefix(msg, topologycache.NoZoneSpecified):
		if ep, ok := firstReadyWithoutZone(managed); ok {
			return fmt.Sprintf("endpoint %s has no zone", ep)
		}
	}
	return ""
}

// estimate is the expected load of each eligible endpoint under two ways
// of routing, relative to an even share (1.0).
type estimate struct {
	// eligible are the endpoints that can have a load: the ready
	// endpoints of the Service's first port.
	eligible map[netip.Addr]bool
	// hints are the loads if every node routes by the hints the slices
	// carry now, as kube-proxy does; nil when there is no estimate.
	hints map[netip.Addr]float64
	// weighted are the loads under topolb's ZoneWeighted policy; nil when
	// there is no estimate.
	weighted map[netip.Addr]float64
	// inZone maps each zone with a sending node to the share of its new
	// flows ZoneWeighted keeps in the zone.
	inZone map[string]float64
	notes  []string
}

// estimate computes the loads of svc's ready endpoints. Every sending node
// originates traffic in proportion to its weight and spreads it over the
// backends topology.Decide gives it, by their weights:
//   - under the current hints (the Hints policy: node hints, then zone
//     hints, only when every ready endpoint carries one), with the
//     controller's model of who sends: every counted node, by allocatable
//     CPU, so each zone sends its CPU ratio;
//   - under ZoneWeighted, with the same model when the controller has one,
//     and otherwise with ZoneWeighted's own (topology.ZoneDemand: nodes with
//     a zone that are not Ready=False), so the comparison is made on one
//     model whenever it can be.
//
// topolb annotations and traffic policies are set aside: the question is
// what each rule does. The Service's first port (by name, protocol, number)
// in family stands for all.
func (s *sim) estimate(svc *v1.Service, nn types.NamespacedName, family v1.IPFamily) estimate {
	var est estimate
	ports, _, err := topology.ServicePorts(svc)
	ports = slices.DeleteFunc(ports, func(p topology.ServicePort) bool { return p.Family != family })
	if len(ports) == 0 && err == nil {
		err = fmt.Errorf("no %s cluster IP", family)
	}
	if len(ports) == 0 {
		if err == nil {
			err = fmt.Errorf("no ports")
		}
		est.notes = append(est.notes, fmt.Sprintf("no load estimate: %v", err))
		return est
	}
	slices.SortFunc(ports, func(a, b topology.ServicePort) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Port, b.Port))
	})
	p := ports[0]
	p.Annotations, p.InternalPolicyLocal, p.ExternallyAccessible, p.ExternalPolicyLocal = nil, false, false, false
	eps, _ := topology.EndpointsForPort(p, s.state.Slices[nn], "")
	est.eligible = map[netip.Addr]bool{}
	for _, ep := range eps {
		if ep.Ready {
			est.eligible[ep.Addr.Addr()] = true
		}
	}
	if len(est.eligible) == 0 {
		est.notes = append(est.notes, "no load estimate: no ready endpoints")
		return est
	}
	topts := topology.Options{PreferSameTrafficDistribution: s.opts.PreferSameTrafficDistribution}
	demand := topology.ZoneDemand(s.state.Nodes)
	sources, total := s.sources, s.totalCPU
	if len(sources) == 0 {
		est.notes = append(est.notes, "no load estimate for the current hints: the node information gives no CPU ratios")
		sources, total = nil, demand.Total
		for name, units := range demand.Nodes {
			sources = append(sources, source{name: name, cpuMillis: units})
		}
		slices.SortFunc(sources, func(a, b source) int { return cmp.Compare(a.name, b.name) })
		if len(sources) > 0 {
			est.notes = append(est.notes, "zone-weighted loads assume ZoneWeighted's own demand: nodes with a zone that are not Ready=False, weighed "+demandUnit(demand))
		}
	} else {
		est.hints = s.spread(p, eps, sources, total, topts, &demand, nil)
	}
	if len(sources) == 0 {
		est.notes = append(est.notes, "no zone-weighted estimate: no node with a zone label that is not Ready=False")
		return est
	}
	wp := p
	wp.Annotations = map[string]string{topology.AnnotationZoneWeighted: "true"}
	est.inZone = map[string]float64{}
	est.weighted = s.spread(wp, eps, sources, total, topts, &demand, est.inZone)
	for ip := range est.hints {
		est.hints[ip] *= float64(len(est.eligible))
	}
	for ip := range est.weighted {
		est.weighted[ip] *= float64(len(est.eligible))
	}
	return est
}

// spread sums, over the sources, each source's share of the traffic times
// the weight its decision gives each backend. When inZone is not nil, it
// records for each source's zone the share of its flows kept in the zone.
func (s *sim) spread(p topology.ServicePort, eps []topology.Endpoint, sources []source, total int64, topts topology.Options, demand *topology.Demand, inZone map[string]float64) map[netip.Addr]float64 {
	loads := map[netip.Addr]float64{}
	for _, src := range sources {
		node := s.state.Nodes[src.name]
		d := topology.Decide(topology.Input{Node: node, Nodes: s.state.Nodes, Port: p, Endpoints: eps, Demand: demand}, topts)
		share := float64(src.cpuMillis) / float64(total)
		kept := 0.0
		for i, b := range d.Backends {
			loads[b.Addr.Addr()] += share * d.Weights[i]
			if b.Zone != "" && b.Zone == node.Zone() {
				kept += d.Weights[i]
			}
		}
		if inZone != nil && node.Zone() != "" {
			inZone[node.Zone()] = kept
		}
	}
	return loads
}

// demandUnit says what weighs a node in ZoneWeighted's demand.
func demandUnit(d topology.Demand) string {
	if d.ByNodeCount {
		return "by node count (" + d.Lacking + ")"
	}
	return "by allocatable CPU"
}

// zones summarizes the endpoints per zone: the cluster's zones, the
// endpoints' zones and the zones of their hints.
func (s *sim) zones(eps []Endpoint, est estimate) []ServiceZone {
	haveLoads := est.hints != nil
	ratios := map[string]*float64{}
	for _, z := range s.info.Zones {
		ratios[z.Zone] = z.CPURatio
	}
	byZone := map[string]*ServiceZone{}
	get := func(z string) *ServiceZone {
		if byZone[z] == nil {
			byZone[z] = &ServiceZone{Zone: z, CPURatio: ratios[z]}
		}
		return byZone[z]
	}
	for z := range ratios {
		get(z)
	}
	for z := range est.inZone {
		get(z)
	}
	maxLoad := map[string]float64{}
	maxWeighted := map[string]float64{}
	over := map[string]bool{}
	for _, ep := range eps {
		if !ep.Ready {
			continue
		}
		if ep.Zone != "" {
			get(ep.Zone).Endpoints++
			if ep.ZoneWeightedLoad != nil {
				maxWeighted[ep.Zone] = max(maxWeighted[ep.Zone], *ep.ZoneWeightedLoad)
			}
		}
		for _, z := range ep.CurrentHints.Zones {
			get(z).CurrentHints++
			if haveLoads && ep.ExpectedLoad != nil {
				maxLoad[z] = max(maxLoad[z], *ep.ExpectedLoad)
				over[z] = over[z] || ep.Overloaded
			}
		}
		for _, z := range ep.ControllerHints.Zones {
			get(z).Allocation++
		}
	}
	out := make([]ServiceZone, 0, len(byZone))
	for z, sz := range byZone {
		if l, ok := maxLoad[z]; ok {
			sz.ExpectedLoad = &l
			sz.Overloaded = over[z]
		}
		if share, ok := est.inZone[z]; ok {
			sz.ZoneWeightedShare = rounded(share)
		}
		if l, ok := maxWeighted[z]; ok {
			sz.ZoneWeightedLoad = &l
		}
		out = append(out, *sz)
	}
	slices.SortFunc(out, func(a, b ServiceZone) int { return cmp.Compare(a.Zone, b.Zone) })
	return out
}

// currentHintNotes says how kube-proxy would treat the current zone hints,
// when that is not simply "each zone uses the endpoints hinted for it".
func currentHintNotes(eps []Endpoint, zones []ServiceZone, haveLoads bool) []string {
	var notes []string
	ready, withNode := 0, 0
	var missing *Endpoint
	for i := range eps {
		ep := &eps[i]
		if !ep.Ready {
			continue
		}
		ready++
		if len(ep.CurrentHints.Nodes) > 0 {
			withNode++
		}
		if len(ep.CurrentHints.Zones) == 0 && missing == nil {
			missing = ep
		}
	}
	if ready == 0 {
		return nil
	}
	if withNode == ready {
		notes = append(notes, "every ready endpoint carries a node hint now: a node with an endpoint hinted for it keeps its traffic on that node")
	}
	if missing != nil {
		if !anyCurrentZoneHint(eps) {
			if withNode == 0 {
				return append(notes, "no ready endpoint carries a hint now: every node sends to every ready endpoint")
			}
			return notes
		}
		return append(notes, fmt.Sprintf("kube-proxy ignores the current zone hints: endpoint %s (slice %s) has none", orNone(missing.Address), missing.Slice))
	}
	for _, z := range zones {
		if z.CurrentHints == 0 && z.CPURatio != nil && *z.CPURatio > 0 && haveLoads {
			notes = append(notes, fmt.Sprintf("no endpoint is hinted for %s now: its nodes send to every ready endpoint", z.Zone))
		}
	}
	return notes
}

func anyCurrentZoneHint(eps []Endpoint) bool {
	for _, ep := range eps {
		if ep.Ready && len(ep.CurrentHints.Zones) > 0 {
			return true
		}
	}
	return false
}

// normalized returns a copy of es that the controller's code reads as a
// consumer would: a nil ready condition becomes true.
func normalized(es *discovery.EndpointSlice) *discovery.EndpointSlice {
	c := es.DeepCopy()
	for i := range c.Endpoints {
		if c.Endpoints[i].Conditions.Ready == nil {
			t := true
			c.Endpoints[i].Conditions.Ready = &t
		}
	}
	return c
}

func anyHints(ess []*discovery.EndpointSlice) bool {
	for _, es := range ess {
		for _, e := range es.Endpoints {
			if !hintsOf(e.Hints).empty() {
				return true
			}
		}
	}
	return false
}

// firstReadyWithoutZone describes the first ready endpoint without a zone.
func firstReadyWithoutZone(ess []*discovery.EndpointSlice) (string, bool) {
	for _, es := range ess {
		for _, e := range es.Endpoints {
			if topologycache.EndpointReady(e) && deref(e.Zone) == "" {
				addr := "(no address)"
				if len(e.Addresses) > 0 {
					addr = e.Addresses[0]
				}
				return fmt.Sprintf("%s (slice %s)", addr, es.Name), true
			}
		}
	}
	return "", false
}

func hintsOf(h *discovery.EndpointHints) Hints {
	out := Hints{Zones: []string{}, Nodes: []string{}}
	if h == nil {
		return out
	}
	for _, z := range h.ForZones {
		out.Zones = append(out.Zones, z.Name)
	}
	for _, n := range h.ForNodes {
		out.Nodes = append(out.Nodes, n.Name)
	}
	return out
}

func (h Hints) empty() bool { return len(h.Zones) == 0 && len(h.Nodes) == 0 }

func (h Hints) equal(o Hints) bool {
	return slices.Equal(h.Zones, o.Zones) && slices.Equal(h.Nodes, o.Nodes)
}

// String renders hints for people: "zones [zone-a]", "zones [zone-a],
// nodes [node-a1]" or "no hints".
func (h Hints) String() string {
	var parts []string
	if len(h.Zones) > 0 {
		parts = append(parts, fmt.Sprintf("zones %v", h.Zones))
	}
	if len(h.Nodes) > 0 {
		parts = append(parts, fmt.Sprintf("nodes %v", h.Nodes))
	}
	if len(parts) == 0 {
		return "no hints"
	}
	return strings.Join(parts, ", ")
}

func overloaded(load float64) bool { return load > 1+overloadThreshold+1e-9 }

func round4(f float64) float64 { return math.Round(f*1e4) / 1e4 }

func rounded(f float64) *float64 {
	r := round4(f)
	return &r
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func orNone(addr string) string {
	if addr == "" {
		return "(no address)"
	}
	return addr
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func nonNil(ss []string) []string {
	if ss == nil {
		return []string{}
	}
	return ss
}
