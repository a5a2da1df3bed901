package agent

import (
	"cmp"
	"errors"
	"fmt"
	"slices"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// syncService decides one service, claims its frontends and programs them,
// and returns the map writes it made and the services that may take over a
// frontend it released. On error the service's previous frontends keep
// serving and it is retried later.
//
// Ownership follows topology.CompareClaims, the rule `topolbctl explain`
// applies to the whole node at once (topology.NodeFrontends): whichever
// order the agent learns the claims in, the frontend ends with the same
// owner. A claim that ranks before the current owner's takes the frontend
// over; one that ranks after waits until the owner releases it.
//
// The service is decided once per port and family into one plan
// (topology.State.PlanService), which the claims, the mode reports, the
// metrics and the health checks all read.
func (a *Agent) syncService(nn types.NamespacedName) (int, []types.NamespacedName, error) {
	svc := a.state.Services[nn]
	node, _ := a.node()
	plan := a.state.PlanService(node, nn, a.cfg.Options)
	warnings := plan.Warnings
	a.reportModes(nn, svc, plan.Ports)

	a.noteRefusal(nn, svc, plan.Refused)
	claims := a.claims(plan.Claims)
	a.notProgrammed(nn, plan.Claims)
	a.unwait(nn)
	desired := map[topology.Key]topology.Frontend{}
	for _, c := range claims {
		if cur, ok := a.owner[c.Key()]; ok && cur.Service != nn && topology.CompareClaims(cur, c.Claim()) < 0 {
			a.wait(c.Key(), nn)
			warnings = append(warnings, fmt.Sprintf("%s %s/%s (%s) is owned by %s port %s: not served for port %s until it is released",
				c.Kind, c.Addr, c.Protocol, c.Scope, cur.Service, cur.Port, c.Claim().Port))
			continue
		}
		desired[c.Key()] = c
	}
	a.noteRejections(nn, warnings)

	writes, errs := a.program(nn, node, desired)
	w2, released, errs2 := a.release(nn, desired)
	writes += w2
	errs = append(errs, errs2...)

	a.remember(nn, plan.Ports)
	a.syncHealthChecks(nn, plan, node)
	if err := errors.Join(errs...); err != nil {
		a.failed[nn] = true
		a.log.Error("service not fully programmed; previous backends keep serving", "service", nn, "err", err)
		if a.cfg.Metrics != nil {
			a.cfg.Metrics.programErrors(err)
		}
		if a.cfg.Events != nil && svc != nil {
			a.cfg.Events.ProgramFailed(svc, err)
		}
		return writes, released, fmt.Errorf("service %s: %w", nn, err)
	}
	delete(a.failed, nn)
	return writes, released, nil
}

// noteRefusal records whether nn is refused over a per-Service cap (r,
// nil when it is not; its plan then claims nothing, so its frontends are
// released), and on a change logs it, emits an Event on the Service and
// moves the metric. Refusal is not a failure: nothing is retried until
// the Service changes.
func (a *Agent) noteRefusal(nn types.NamespacedName, svc *v1.Service, r *topology.Refusal) {
	prev, was := a.refused[nn]
	switch {
	case r == nil && !was, r != nil && was && prev == *r:
		return
	case r == nil:
		delete(a.refused, nn)
		a.log.Info("service no longer over a per-Service cap: served again", "service", nn)
	default:
		a.refused[nn] = *r
		a.log.Warn("service over a per-Service cap: refused, none of its frontends is served", "service", nn, "cap", r.Cap, "count", r.Count, "limit", r.Limit)
		if a.cfg.Events != nil && svc != nil {
			a.cfg.Events.ServiceRefused(svc, *r)
		}
	}
	if a.cfg.Metrics != nil {
		a.cfg.Metrics.setRefused(a.refused)
	}
}

// node returns this node's model and the warnings about it, which it logs
// once (under the empty name) rather than with every service decided.
func (a *Agent) node() (topology.Node, []string) {
	node, warnings := a.state.Node(a.cfg.NodeName)
	a.noteRejections(types.NamespacedName{}, warnings)
	return node, warnings
}

// claims returns the frontends of a service's plan the datapath can serve
// (its protocol, and a family the agent programs in its scope), one per key: of two
// ports of one Service claiming one frontend, the first by CompareClaims.
func (a *Agent) claims(planned []topology.Frontend) []topology.Frontend {
	byKey := map[topology.Key]topology.Frontend{}
	for _, c := range planned {
		if _, ok := DatapathFrontend(c.Key()); !ok || !a.Programs(c.Port.Family, c.Scope) {
			continue
		}
		if prev, dup := byKey[c.Key()]; dup && topology.CompareClaims(prev.Claim(), c.Claim()) <= 0 {
			continue
		}
		byKey[c.Key()] = c
	}
	out := make([]topology.Frontend, 0, len(byKey))
	for _, c := range byKey {
		out = append(out, c)
	}
	slices.SortFunc(out, compareKeys)
	return out
}

// notProgrammed logs, once per service and set, the families and scopes
// a service has frontends in that the agent does not program (Programs):
// they are explained and counted, but the datapath does not serve them.
func (a *Agent) notProgrammed(nn types.NamespacedName, planned []topology.Frontend) {
	var skipped []string
	for _, c := range planned {
		if _, ok := DatapathFrontend(c.Key()); !ok || a.Programs(c.Port.Family, c.Scope) {
			continue
		}
		if s := string(c.Port.Family) + " " + string(c.Scope); !slices.Contains(skipped, s) {
			skipped = append(skipped, s)
		}
	}
	slices.Sort(skipped)
	if !newSet(a.unprogrammed, nn, skipped) {
		return
	}
	a.log.Info("service decided but not programmed in these families and scopes: the datapath does not serve them", "service", nn, "families", skipped)
}

func compareKeys(x, y topology.Frontend) int {
	return cmp.Or(x.Addr.Compare(y.Addr), cmp.Compare(x.Protocol, y.Protocol), cmp.Compare(x.Scope, y.Scope))
}

// program writes every desired frontend of nn. A frontend taken over from
// another service makes that service wait for it.
func (a *Agent) program(nn types.NamespacedName, node topology.Node, desired map[topology.Key]topology.Frontend) (int, []error) {
	writes := 0
	var errs []error
	fronts := make([]topology.Frontend, 0, len(desired))
	for _, c := range desired {
		fronts = append(fronts, c)
	}
	slices.SortFunc(fronts, compareKeys)
	for _, c := range fronts {
		fe, _ := DatapathFrontend(c.Key())
		w, err := a.dp.SetService(fe, DatapathService(c, node))
		writes += w
		if err != nil {
			errs = append(errs, fmt.Errorf("program %s: %w", fe, err))
			continue
		}
		if prev, ok := a.owner[c.Key()]; ok && prev.Service != nn {
			delete(a.owned[prev.Service], c.Key())
			a.wait(c.Key(), prev.Service)
			a.log.Warn("frontend taken over by the service that ranks first", "frontend", fe, "service", nn, "previous", prev.Service)
		}
		a.owner[c.Key()] = c.Claim()
		if shares := zoneShares(c); shares != nil {
			a.shares[c.Key()] = shares
		} else {
			delete(a.shares, c.Key())
		}
		if a.owned[nn] == nil {
			a.owned[nn] = map[topology.Key]bool{}
		}
		a.owned[nn][c.Key()] = true
	}
	return writes, errs
}

// release deletes the frontends nn owns but no longer wants, and returns
// the services waiting for them.
func (a *Agent) release(nn types.NamespacedName, desired map[topology.Key]topology.Frontend) (int, []types.NamespacedName, []error) {
	writes := 0
	var errs []error
	var released []types.NamespacedName
	for key := range a.owned[nn] {
		if _, keep := desired[key]; keep {
			continue
		}
		fe, _ := DatapathFrontend(key)
		w, err := a.dp.DeleteFrontend(fe)
		writes += w
		if err != nil {
			errs = append(errs, fmt.Errorf("delete %s: %w", fe, err))
			continue
		}
		delete(a.owned[nn], key)
		delete(a.owner, key)
		delete(a.shares, key)
		for w := range a.waiting[key] {
			released = append(released, w)
		}
	}
	if len(a.owned[nn]) == 0 {
		delete(a.owned, nn)
	}
	slices.SortFunc(released, func(x, y types.NamespacedName) int { return cmp.Compare(x.String(), y.String()) })
	return writes, released, errs
}

// wait records that nn wants key, which another service owns.
func (a *Agent) wait(key topology.Key, nn types.NamespacedName) {
	if a.waiting[key] == nil {
		a.waiting[key] = map[types.NamespacedName]bool{}
	}
	a.waiting[key][nn] = true
	if a.waitsFor[nn] == nil {
		a.waitsFor[nn] = map[topology.Key]bool{}
	}
	a.waitsFor[nn][key] = true
}

// unwait forgets every frontend nn waits for; its sync records them again.
func (a *Agent) unwait(nn types.NamespacedName) {
	for key := range a.waitsFor[nn] {
		delete(a.waiting[key], nn)
		if len(a.waiting[key]) == 0 {
			delete(a.waiting, key)
		}
	}
	delete(a.waitsFor, nn)
}

// portSummary is what the agent remembers of one port's last decision.
type portSummary struct {
	key    string // portKey
	family v1.IPFamily
	policy topology.Policy
	mode   topology.Mode
	// reads is what the decision read of the Nodes (ServicePort.Reads).
	reads topology.NodeReads
	// zones counts the internal backends per endpoint zone.
	zones []zoneCount
}

// zoneCount is a number of backends in one zone.
type zoneCount struct {
	zone string
	n    int
}

// remember keeps a summary of the decisions and moves the service's
// metrics to them.
func (a *Agent) remember(nn types.NamespacedName, ds []topology.PortDecision) {
	ps := make([]portSummary, 0, len(ds))
	for _, d := range ds {
		var zones []zoneCount
		for _, ep := range d.Decision.Backends {
			if i := slices.IndexFunc(zones, func(z zoneCount) bool { return z.zone == ep.Zone }); i >= 0 {
				zones[i].n++
			} else {
				zones = append(zones, zoneCount{ep.Zone, 1})
			}
		}
		ps = append(ps, portSummary{key: portKey(d.Port), family: d.Port.Family, policy: d.Decision.Policy, mode: d.Decision.Mode, reads: d.Port.Reads(), zones: zones})
	}
	if a.state.FromSummary && slices.ContainsFunc(ps, func(p portSummary) bool { return a.state.Summary.LacksFor(p.reads) != "" }) {
		a.pending[nn] = true
	} else {
		delete(a.pending, nn)
	}
	if a.cfg.Metrics != nil {
		a.cfg.Metrics.serviceDecided(nn, a.ports[nn], ps)
		a.cfg.Metrics.SummaryPending.Set(float64(len(a.pending)))
	}
	if len(ps) == 0 {
		delete(a.ports, nn)
		return
	}
	a.ports[nn] = ps
}

// zoneShares sums a frontend's weights per backend zone, or returns nil
// when they are all equal.
func zoneShares(c topology.Frontend) map[string]float64 {
	if integerWeights(c.Weights) == nil {
		return nil
	}
	shares := map[string]float64{}
	for i, ep := range c.Backends {
		shares[ep.Zone] += c.Weights[i]
	}
	return shares
}

// removeStale deletes programmed frontends no service owns (left by a
// previous agent).
func (a *Agent) removeStale() int {
	owned := map[maps.Frontend]bool{}
	for key := range a.owner {
		if fe, ok := DatapathFrontend(key); ok {
			owned[fe] = true
		}
	}
	writes := 0
	for f := range a.dp.Services() {
		if owned[f] {
			continue
		}
		w, err := a.dp.DeleteFrontend(f)
		writes += w
		if err != nil {
			a.log.Error("remove stale frontend", "frontend", f, "err", err)
			continue
		}
		a.log.Info("removed stale frontend", "frontend", f)
	}
	return writes
}

// syncHealthChecks serves, stops or updates nn's health check NodePort in
// each family of its plan, on this node's NodePort addresses of that
// family, as kube-proxy's proxier of each family serves its own. A family
// is health-checked whether or not the agent programs it: the count is of
// the family's ready local endpoints, as the decision sees them.
func (a *Agent) syncHealthChecks(nn types.NamespacedName, plan topology.ServicePlan, node topology.Node) {
	hcs := a.cfg.HealthChecks
	if hcs == nil {
		return
	}
	if len(plan.HealthChecks) == 0 {
		if a.healthChecked[nn] {
			hcs.Delete(nn)
			delete(a.healthChecked, nn)
		}
		return
	}
	for _, family := range topology.Families {
		i := slices.IndexFunc(plan.HealthChecks, func(hc topology.HealthCheck) bool { return hc.Family == family })
		if i < 0 {
			hcs.DeleteFamily(nn, family)
			continue
		}
		hcs.Set(nn, plan.HealthChecks[i], topology.NodePortAddresses(node, family, a.cfg.Options))
	}
	a.healthChecked[nn] = true
}
