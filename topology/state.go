package topology

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sort"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
)

// State is a snapshot of the cluster objects decisions are made from. Both
// `topolbctl explain` (NewState, all at once) and the agent (the Set and
// Delete methods, one change at a time) build and decide through it, so the
// same objects give the same decisions in both.
type State struct {
	// Nodes holds every node by name.
	Nodes map[string]Node
	// FromSummary says that Nodes holds, besides the deciding node, only
	// what Summary stands for (Summary.Nodes): an agent that watches its
	// own Node only. A port whose policy reads what Summary lacks (nil:
	// none read yet) is then decided by hints and says so (Input.Lacking).
	FromSummary bool
	Summary     *Summary
	// SummaryNote, when not "", says why Summary may be out of date
	// (Input.SummaryNote).
	SummaryNote string
	// Services holds every Service by namespace and name.
	Services map[types.NamespacedName]*v1.Service
	// Slices holds the EndpointSlices of each Service, by the Service's
	// namespace and the slice's kubernetes.io/service-name label, sorted by
	// slice name. It is derived from the slices stored by SetSlice: change
	// it through SetSlice and DeleteSlice only.
	Slices map[types.NamespacedName][]*discovery.EndpointSlice

	// slices holds every EndpointSlice by its own namespace and name: a
	// slice of that name replaces the previous one, whichever Service
	// either belongs to. bySvc indexes the same slices by Service, then
	// slice name; Slices is derived from it.
	slices map[types.NamespacedName]*discovery.EndpointSlice
	bySvc  map[types.NamespacedName]map[types.NamespacedName]*discovery.EndpointSlice
}

// NewEmptyState returns a State without objects.
func NewEmptyState() *State {
	return &State{
		Nodes:    map[string]Node{},
		Services: map[types.NamespacedName]*v1.Service{},
		Slices:   map[types.NamespacedName][]*discovery.EndpointSlice{},
		slices:   map[types.NamespacedName]*discovery.EndpointSlice{},
		bySvc:    map[types.NamespacedName]map[types.NamespacedName]*discovery.EndpointSlice{},
	}
}

// NewState indexes cluster objects. keepLabel selects the node labels to
// retain (nil keeps all). Slices without a service-name label are ignored;
// of two slices with one namespace and name, the later one is kept, as
// SetSlice does.
func NewState(nodes []*v1.Node, services []*v1.Service, epSlices []*discovery.EndpointSlice, keepLabel func(string) bool) *State {
	s := NewEmptyState()
	for _, n := range nodes {
		s.Nodes[n.Name] = NodeFromObject(n, keepLabel)
	}
	for _, svc := range services {
		s.SetService(svc)
	}
	for _, es := range epSlices {
		s.SetSlice(es)
	}
	return s
}

// SetService stores svc, replacing the Service of that namespace and name.
func (s *State) SetService(svc *v1.Service) {
	s.Services[types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}] = svc
}

// DeleteService removes the Service nn; its slices stay (they may outlive
// it, as in a cluster).
func (s *State) DeleteService(nn types.NamespacedName) { delete(s.Services, nn) }

// SetSlice stores es under its own namespace and name, replacing the slice
// of that name, and returns the Services whose slice lists changed: the one
// es belongs to, and the one the replaced slice belonged to if that
// differs. A slice without a service-name label is stored (so a later
// delete or relabel finds it) but belongs to no Service.
func (s *State) SetSlice(es *discovery.EndpointSlice) []types.NamespacedName {
	key := types.NamespacedName{Namespace: es.Namespace, Name: es.Name}
	affected := s.DeleteSlice(key)
	s.slices[key] = es
	if nn, ok := SliceService(es); ok {
		if s.bySvc[nn] == nil {
			s.bySvc[nn] = map[types.NamespacedName]*discovery.EndpointSlice{}
		}
		s.bySvc[nn][key] = es
		s.rebuildSlices(nn)
		if !slices.Contains(affected, nn) {
			affected = append(affected, nn)
		}
	}
	return affected
}

// DeleteSlice removes the slice key (namespace and slice name) and returns
// the Service whose slice list changed, if any.
func (s *State) DeleteSlice(key types.NamespacedName) []types.NamespacedName {
	if s.slices == nil {
		// A State built as a literal (tests): start the index empty.
		s.slices = map[types.NamespacedName]*discovery.EndpointSlice{}
		s.bySvc = map[types.NamespacedName]map[types.NamespacedName]*discovery.EndpointSlice{}
	}
	prev, ok := s.slices[key]
	if !ok {
		return nil
	}
	delete(s.slices, key)
	nn, ok := SliceService(prev)
	if !ok {
		return nil
	}
	delete(s.bySvc[nn], key)
	s.rebuildSlices(nn)
	return []types.NamespacedName{nn}
}

// rebuildSlices recomputes the slice list of Service nn, sorted by name.
func (s *State) rebuildSlices(nn types.NamespacedName) {
	idx := s.bySvc[nn]
	if len(idx) == 0 {
		delete(s.bySvc, nn)
		delete(s.Slices, nn)
		return
	}
	list := make([]*discovery.EndpointSlice, 0, len(idx))
	for _, es := range idx {
		list = append(list, es)
	}
	slices.SortFunc(list, func(a, b *discovery.EndpointSlice) int { return cmp.Compare(a.Name, b.Name) })
	s.Slices[nn] = list
}

// SliceService returns the Service an EndpointSlice belongs to, from its
// kubernetes.io/service-name label.
func SliceService(es *discovery.EndpointSlice) (types.NamespacedName, bool) {
	name := es.Labels[discovery.LabelServiceName]
	if name == "" {
		return types.NamespacedName{}, false
	}
	return types.NamespacedName{Namespace: es.Namespace, Name: name}, true
}

// PortDecision is the decision for one service port, with the model it was
// made from.
type PortDecision struct {
	Port      ServicePort
	Endpoints []Endpoint
	Decision  Decision
}

// Node returns the named node and a warning for each of its InternalIP or
// ExternalIP addresses that cannot serve NodePorts (AddrProblem); or, when
// the node is unknown, a node with that name and no labels and a warning.
func (s *State) Node(name string) (Node, []string) {
	n, ok := s.Nodes[name]
	if !ok {
		return Node{Name: name}, []string{fmt.Sprintf("node %s not found: deciding as if it had no labels", name)}
	}
	var warnings []string
	for _, a := range n.Addresses {
		if a.Type != v1.NodeInternalIP && a.Type != v1.NodeExternalIP {
			continue
		}
		if problem := AddrProblem(a.Addr); problem != "" {
			warnings = append(warnings, fmt.Sprintf("node %s: %s %s is %s: no NodePorts on it", name, a.Type, a.Addr, problem))
		}
	}
	return n, warnings
}

// Skipped lists the Services that are not proxied (SkipReason), sorted by
// service; nil when there are none.
func (s *State) Skipped() []SkippedService {
	var out []SkippedService
	for nn, svc := range s.Services {
		if reason := SkipReason(svc); reason != "" {
			out = append(out, SkippedService{Service: nn.String(), Reason: reason})
		}
	}
	slices.SortFunc(out, func(a, b SkippedService) int { return cmp.Compare(a.Service, b.Service) })
	return out
}

// DecideNode decides every proxied port of every Service for nodeName, in
// each of the Service's IP families. The result is sorted by service, port
// name, protocol and family. Warnings name what was
// skipped; they never stop the other decisions.
func (s *State) DecideNode(nodeName string, opts Options) ([]PortDecision, []string) {
	names := make([]types.NamespacedName, 0, len(s.Services))
	for nn := range s.Services {
		names = append(names, nn)
	}
	sort.Slice(names, func(i, j int) bool { return names[i].String() < names[j].String() })
	node, warnings := s.Node(nodeName)
	demand := ZoneDemand(s.Nodes)
	var out []PortDecision
	for _, nn := range names {
		ds, w := s.decideService(node, nn, opts, &demand)
		out = append(out, ds...)
		warnings = append(warnings, w...)
	}
	return out, dedupe(warnings)
}

// ServicePlan is everything one node does for one Service, decided once
// per port and family, for every reader to share: the agent programs its
// Claims, ranks them against other Services' (CompareClaims), reports its
// decisions (modes, metrics, what they read of Nodes) and serves its
// HealthChecks from one plan per sync.
type ServicePlan struct {
	// Ports are the decisions, one per port and family, sorted as
	// DecideService sorts them; nil when the Service is not proxied.
	Ports []PortDecision
	// Claims are every frontend the decisions claim on the node (Claims),
	// before conflicts with other Services are resolved; nil when none.
	Claims []Frontend
	// HealthChecks are the health checks the node serves for the Service,
	// one per family it is decided in (ServiceHealthCheck); nil when it
	// asks for none.
	HealthChecks []HealthCheck
	// Warnings are the decisions' and the claims' warnings, each once.
	Warnings []string
	// Refused, when set, is why the Service is refused on the node
	// (Caps): Claims and HealthChecks are then nil, and Warnings say so.
	Refused *Refusal
}

// Families returns the IP families the plan decides, in Families' order.
func (p ServicePlan) Families() []v1.IPFamily {
	var out []v1.IPFamily
	for _, family := range Families {
		if slices.ContainsFunc(p.Ports, func(d PortDecision) bool { return d.Port.Family == family }) {
			out = append(out, family)
		}
	}
	return out
}

// PlanService plans Service nn on node: it decides each of its ports in
// each of its families, and derives the frontends they claim and the
// health checks from those decisions. A Service that does not exist (or is
// not proxied) plans nothing. The warnings about node itself (State.Node)
// are the caller's.
func (s *State) PlanService(node Node, nn types.NamespacedName, opts Options) ServicePlan {
	svc, ok := s.Services[nn]
	if !ok {
		return ServicePlan{}
	}
	var plan ServicePlan
	plan.Ports, plan.Warnings = s.decideService(node, nn, opts, nil)
	for _, d := range plan.Ports {
		claims, w := Claims(node, d, opts)
		plan.Claims = append(plan.Claims, claims...)
		plan.Warnings = append(plan.Warnings, w...)
	}
	if r, refused := opts.Caps.Refusal(plan.Claims); refused {
		plan.Refused, plan.Claims = &r, nil
		plan.Warnings = append(plan.Warnings, fmt.Sprintf("%s: %s", nn, r))
		plan.Warnings = dedupe(plan.Warnings)
		return plan
	}
	for _, family := range plan.Families() {
		if hc, ok := ServiceHealthCheck(svc, s.Slices[nn], node.Name, family); ok {
			plan.HealthChecks = append(plan.HealthChecks, hc)
		}
	}
	plan.Warnings = dedupe(plan.Warnings)
	return plan
}

// DecideService decides every proxied port of one Service for nodeName.
func (s *State) DecideService(nodeName string, nn types.NamespacedName, opts Options) ([]PortDecision, []string) {
	node, warnings := s.Node(nodeName)
	ds, w := s.decideService(node, nn, opts, nil)
	return ds, dedupe(append(warnings, w...))
}

// decideService decides one Service's ports; demand is ZoneDemand(s.Nodes),
// or nil to have Decide compute it when a port needs it.
func (s *State) decideService(node Node, nn types.NamespacedName, opts Options, demand *Demand) ([]PortDecision, []string) {
	svc, ok := s.Services[nn]
	if !ok {
		return nil, nil
	}
	ports, warnings, err := ServicePorts(svc)
	if err != nil && !errors.Is(err, ErrNotProxied) {
		warnings = append(warnings, err.Error())
	}
	slices.SortFunc(ports, func(a, b ServicePort) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Port, b.Port), cmp.Compare(a.Family, b.Family))
	})
	out := make([]PortDecision, 0, len(ports))
	for _, p := range ports {
		eps, w := EndpointsForPort(p, s.Slices[nn], node.Name)
		warnings = append(warnings, w...)
		for _, ep := range eps {
			// Before a summary is read, other nodes are not known yet: their
			// endpoints are no news.
			if _, known := s.Nodes[ep.NodeName]; ep.NodeName != "" && !known && (!s.FromSummary || s.Summary != nil) {
				warnings = append(warnings, fmt.Sprintf("%s: endpoint %s is on node %s, which is not known", nn, ep.Addr, ep.NodeName))
			}
		}
		in := Input{Node: node, Nodes: s.Nodes, Port: p, Endpoints: eps, Demand: demand}
		if s.FromSummary {
			in.Lacking, in.SummaryNote = s.Summary.Lacks(p), s.SummaryNote
		}
		d := Decide(in, opts)
		out = append(out, PortDecision{Port: p, Endpoints: eps, Decision: d})
	}
	return out, warnings
}

func dedupe(ss []string) []string {
	seen := make(map[string]bool, len(ss))
	out := ss[:0]
	for _, s := range ss {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}
