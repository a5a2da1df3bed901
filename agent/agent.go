// Package agent joins the decision engine to the datapath: it keeps the
// cluster objects a node needs, decides every changed service for this node
// and writes only the difference into the BPF maps.
package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// Datapath is what the agent needs of the maps: maps.Datapath implements it;
// unit tests use an in-memory fake.
type Datapath interface {
	// SetBackends makes fe's permitted backends exactly backends, with the
	// fewest atomic writes, and returns how many writes it made.
	SetBackends(fe maps.Frontend, backends []maps.Backend) (int, error)
	// DeleteFrontend removes fe; deleting an absent frontend is no error.
	DeleteFrontend(fe maps.Frontend) (int, error)
	// Frontends returns what is programmed.
	Frontends() map[maps.Frontend][]maps.Backend
}

// EventSink receives the decisions operators should hear about on the
// Service object. Implementations aggregate and rate-limit.
type EventSink interface {
	// ModeChanged reports that this node's mode for a service port changed.
	ModeChanged(svc *v1.Service, port string, from, to topology.Mode, reason string)
	// ProgramFailed reports that a service's backends could not be written
	// and its previous backends keep serving.
	ProgramFailed(svc *v1.Service, err error)
}

// Config configures an Agent.
type Config struct {
	// NodeName is the node the agent runs on and decides for.
	NodeName string
	// Options are the decision options.
	Options topology.Options
	// Logger receives structured logs; nil discards.
	Logger *slog.Logger
	// Metrics, if set, is updated on every sync.
	Metrics *Metrics
	// Events, if set, receives mode changes and programming failures.
	Events EventSink
	// HealthTimeout is how long a change may wait, or a sync run, before
	// Health reports the agent unhealthy; 0 means DefaultHealthTimeout.
	HealthTimeout time.Duration
}

// Agent holds the cluster state for one node and programs the datapath.
// Apply is called by one goroutine at a time (Run); the read-side methods
// are safe to call concurrently with it.
type Agent struct {
	cfg Config
	dp  Datapath
	log *slog.Logger
	// live records the sync loop's progress for Health; now is its clock.
	live liveness
	now  func() time.Time

	mu    sync.RWMutex
	state *topology.State
	// slices holds every EndpointSlice by its own namespace and name.
	slices map[types.NamespacedName]*discovery.EndpointSlice
	// bySvc indexes slices by service, then slice name.
	bySvc map[types.NamespacedName]map[types.NamespacedName]*discovery.EndpointSlice
	// owned holds the frontends programmed for each service.
	owned map[types.NamespacedName]map[maps.Frontend]bool
	// owner maps each programmed frontend to its service.
	owner map[maps.Frontend]types.NamespacedName
	// decisions holds the last decisions per service.
	decisions map[types.NamespacedName][]topology.PortDecision
	// failed holds services whose last write failed; they are retried on
	// every sync until it succeeds.
	failed map[types.NamespacedName]bool
	// waiting holds, per frontend, the services that want it while another
	// service owns it.
	waiting map[maps.Frontend]map[types.NamespacedName]bool
	// rejected remembers the rejection reason logged per service, so each
	// is logged once.
	rejected map[types.NamespacedName]string
	synced   bool
	// totalWrites counts map writes since New.
	totalWrites int
}

// New returns an agent that programs dp for cfg.NodeName. Nothing is written
// until the first Apply with a resync.
func New(cfg Config, dp Datapath) *Agent {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Agent{
		cfg: cfg, dp: dp, log: log, now: time.Now,
		state:     &topology.State{Nodes: map[string]topology.Node{}, Services: map[types.NamespacedName]*v1.Service{}, Slices: map[types.NamespacedName][]*discovery.EndpointSlice{}},
		slices:    map[types.NamespacedName]*discovery.EndpointSlice{},
		bySvc:     map[types.NamespacedName]map[types.NamespacedName]*discovery.EndpointSlice{},
		owned:     map[types.NamespacedName]map[maps.Frontend]bool{},
		owner:     map[maps.Frontend]types.NamespacedName{},
		decisions: map[types.NamespacedName][]topology.PortDecision{},
		failed:    map[types.NamespacedName]bool{},
		waiting:   map[maps.Frontend]map[types.NamespacedName]bool{},
		rejected:  map[types.NamespacedName]string{},
	}
}

// SyncResult says what one Apply did.
type SyncResult struct {
	// Services is the number of services decided.
	Services int
	// Writes is the number of map writes (updates and deletes).
	Writes int
	// Errors holds one error per service that could not be programmed.
	Errors []error
}

// Synced reports whether the first full sync has been written.
func (a *Agent) Synced() bool {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return a.synced
}

// Run applies the tracker's batches until ctx is done. After each
// notification it waits coalesce so that a burst of events becomes one sync.
// Services whose write failed are retried every retry interval.
func (a *Agent) Run(ctx context.Context, t *kube.Tracker, coalesce, retry time.Duration) {
	a.live.watch(t)
	tick := time.NewTicker(retry)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.Notify():
			if coalesce > 0 {
				select {
				case <-ctx.Done():
					return
				case <-time.After(coalesce):
				}
			}
		case <-tick.C:
		}
		b := t.Drain()
		if b.Empty() && !a.hasFailed() {
			continue
		}
		a.Apply(b)
	}
}

func (a *Agent) hasFailed() bool {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return len(a.failed) > 0
}

// Apply folds a batch into the agent's state, decides every service the
// batch affects (all of them on a resync), and writes the differences into
// the datapath. The first resync also removes frontends left in the maps by
// a previous agent that are no longer desired; before it, nothing is ever
// deleted, so a restarting agent never makes the datapath worse.
func (a *Agent) Apply(b kube.Batch) SyncResult {
	start := time.Now()
	a.live.begin(a.now())
	defer func() { a.live.end(a.now()) }()
	a.mu.Lock()
	defer a.mu.Unlock()

	affected := a.fold(b)
	if b.Resync {
		for nn := range a.state.Services {
			affected[nn] = true
		}
		for nn := range a.owned {
			affected[nn] = true
		}
	}
	for nn := range a.failed {
		affected[nn] = true
	}
	names := make([]types.NamespacedName, 0, len(affected))
	for nn := range affected {
		names = append(names, nn)
	}
	slices.SortFunc(names, func(x, y types.NamespacedName) int {
		return cmp.Or(cmp.Compare(x.Namespace, y.Namespace), cmp.Compare(x.Name, y.Name))
	})

	var res SyncResult
	for _, nn := range names {
		w, err := a.syncService(nn)
		res.Writes += w
		res.Services++
		if err != nil {
			res.Errors = append(res.Errors, err)
		}
	}
	if b.Resync && !a.synced {
		res.Writes += a.removeStale()
		a.synced = true
		a.log.Info("first sync written", "services", len(a.state.Services), "frontends", len(a.owner), "writes", res.Writes)
	}
	a.totalWrites += res.Writes
	if m := a.cfg.Metrics; m != nil {
		m.observeSync(start, b.Since, res)
	}
	return res
}

// fold applies the batch to the stored objects and returns the services
// whose decisions may have changed.
func (a *Agent) fold(b kube.Batch) map[types.NamespacedName]bool {
	affected := map[types.NamespacedName]bool{}
	for nn, svc := range b.Services {
		if svc == nil {
			delete(a.state.Services, nn)
		} else {
			a.state.Services[nn] = svc
		}
		affected[nn] = true
	}
	for key, es := range b.Slices {
		if prev, ok := a.slices[key]; ok {
			a.unindex(key, prev, affected)
		}
		if es == nil {
			delete(a.slices, key)
			continue
		}
		a.slices[key] = es
		if nn, ok := topology.SliceService(es); ok {
			if a.bySvc[nn] == nil {
				a.bySvc[nn] = map[types.NamespacedName]*discovery.EndpointSlice{}
			}
			a.bySvc[nn][key] = es
			a.rebuildSlices(nn)
			affected[nn] = true
		}
	}
	for name, n := range b.Nodes {
		if n == nil {
			delete(a.state.Nodes, name)
		} else {
			a.state.Nodes[name] = topology.NodeFromObject(n, nil)
		}
		a.nodeAffects(name, affected)
	}
	return affected
}

// unindex removes a slice from its service's index.
func (a *Agent) unindex(key types.NamespacedName, es *discovery.EndpointSlice, affected map[types.NamespacedName]bool) {
	nn, ok := topology.SliceService(es)
	if !ok {
		return
	}
	delete(a.bySvc[nn], key)
	a.rebuildSlices(nn)
	affected[nn] = true
}

// rebuildSlices recomputes the slice list of one service from its index.
func (a *Agent) rebuildSlices(nn types.NamespacedName) {
	idx := a.bySvc[nn]
	if len(idx) == 0 {
		delete(a.bySvc, nn)
		delete(a.state.Slices, nn)
		return
	}
	list := make([]*discovery.EndpointSlice, 0, len(idx))
	for _, es := range idx {
		list = append(list, es)
	}
	a.state.Slices[nn] = list
}

// nodeAffects marks the services a change of node name may affect: all of
// them when it is this node (its zone or labels moved), else those whose
// topology-keys compare other nodes' labels.
func (a *Agent) nodeAffects(name string, affected map[types.NamespacedName]bool) {
	for nn, svc := range a.state.Services {
		if name == a.cfg.NodeName {
			affected[nn] = true
			continue
		}
		if _, ok := svc.Annotations[topology.AnnotationTopologyKeys]; ok {
			affected[nn] = true
		}
	}
}

// syncService decides one service and programs its frontends. On error the
// service's previous frontends keep serving and it is retried later.
func (a *Agent) syncService(nn types.NamespacedName) (int, error) {
	svc := a.state.Services[nn]
	var ds []topology.PortDecision
	if svc != nil {
		var warnings []string
		ds, warnings = a.state.DecideService(a.cfg.NodeName, nn, a.cfg.Options)
		a.noteRejections(nn, warnings)
	} else {
		delete(a.rejected, nn)
	}
	a.reportModes(nn, svc, ds)

	node, _ := a.state.Node(a.cfg.NodeName)
	desired := map[maps.Frontend][]maps.Backend{}
	for _, d := range ds {
		proto, ok := protocol(d.Port.Protocol)
		if !ok {
			continue
		}
		for i, fe := range d.Port.Frontends() {
			eps := d.Decision.Backends
			if i > 0 { // externalIPs and load-balancer IPs
				eps = d.Decision.ExternalBackends
			}
			f := maps.Frontend{Addr: fe, Proto: proto}
			if other, taken := a.owner[f]; taken && other != nn {
				if !a.waiting[f][nn] {
					a.log.Warn("frontend already used by another service; skipped until it is released", "service", nn, "frontend", f, "owner", other)
				}
				if a.waiting[f] == nil {
					a.waiting[f] = map[types.NamespacedName]bool{}
				}
				a.waiting[f][nn] = true
				continue
			}
			desired[f] = backends(eps, node)
		}
	}

	writes := 0
	var errs []error
	owned := a.owned[nn]
	if owned == nil {
		owned = map[maps.Frontend]bool{}
	}
	for _, f := range sortedFrontends(desired) {
		w, err := a.dp.SetBackends(f, desired[f])
		writes += w
		if err != nil {
			errs = append(errs, fmt.Errorf("program %s: %w", f, err))
			continue
		}
		owned[f] = true
		a.owner[f] = nn
	}
	for f := range owned {
		if _, keep := desired[f]; keep {
			continue
		}
		w, err := a.dp.DeleteFrontend(f)
		writes += w
		if err != nil {
			errs = append(errs, fmt.Errorf("delete %s: %w", f, err))
			continue
		}
		delete(owned, f)
		delete(a.owner, f)
		// Services that wanted the frontend get it at the next retry.
		for w := range a.waiting[f] {
			a.failed[w] = true
		}
		delete(a.waiting, f)
	}
	if len(owned) == 0 {
		delete(a.owned, nn)
	} else {
		a.owned[nn] = owned
	}
	// Keep the decisions, not the endpoint lists they were made from: the
	// slices hold those already.
	for i := range ds {
		ds[i].Endpoints = nil
	}
	if a.cfg.Metrics != nil {
		a.cfg.Metrics.serviceDecided(nn, a.decisions[nn], ds)
	}
	if len(ds) == 0 {
		delete(a.decisions, nn)
	} else {
		a.decisions[nn] = ds
	}
	if err := errors.Join(errs...); err != nil {
		a.failed[nn] = true
		a.log.Error("service not fully programmed; previous backends keep serving", "service", nn, "err", err)
		if a.cfg.Metrics != nil {
			a.cfg.Metrics.programErrors(err)
		}
		if a.cfg.Events != nil && svc != nil {
			a.cfg.Events.ProgramFailed(svc, err)
		}
		return writes, fmt.Errorf("service %s: %w", nn, err)
	}
	delete(a.failed, nn)
	return writes, nil
}

// removeStale deletes programmed frontends no service owns (left by a
// previous agent).
func (a *Agent) removeStale() int {
	writes := 0
	for f := range a.dp.Frontends() {
		if _, ok := a.owner[f]; ok {
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

// noteRejections logs what the decision engine could not use, once per
// distinct message set, and counts it.
func (a *Agent) noteRejections(nn types.NamespacedName, warnings []string) {
	key := fmt.Sprint(warnings)
	if len(warnings) == 0 {
		delete(a.rejected, nn)
		return
	}
	if a.rejected[nn] == key {
		return
	}
	a.rejected[nn] = key
	for _, w := range warnings {
		a.log.Warn("input skipped", "service", nn, "reason", w)
		if a.cfg.Metrics != nil {
			a.cfg.Metrics.Rejected.Inc()
		}
	}
}

// reportModes logs, counts and emits an event for every port whose mode
// changed since the last decision.
func (a *Agent) reportModes(nn types.NamespacedName, svc *v1.Service, ds []topology.PortDecision) {
	prev := map[string]topology.Mode{}
	for _, d := range a.decisions[nn] {
		prev[portKey(d.Port)] = d.Decision.Mode
	}
	for _, d := range ds {
		from, seen := prev[portKey(d.Port)]
		to := d.Decision.Mode
		if seen && from == to {
			continue
		}
		a.log.Info("service mode changed", "service", nn, "port", d.Port.Name, "protocol", d.Port.Protocol,
			"policy", d.Decision.Policy, "from", from, "to", to, "reason", d.Decision.Reason)
		if seen && a.cfg.Events != nil && svc != nil {
			a.cfg.Events.ModeChanged(svc, d.Port.Name, from, to, d.Decision.Reason)
		}
		if a.cfg.Metrics != nil && seen {
			a.cfg.Metrics.ModeChanges.Inc()
		}
	}
}

func portKey(p topology.ServicePort) string { return p.Name + "/" + string(p.Protocol) }

// protocol maps a service protocol to the datapath's; SCTP is not balanced.
func protocol(p v1.Protocol) (maps.Protocol, bool) {
	switch p {
	case v1.ProtocolTCP:
		return maps.TCP, true
	case v1.ProtocolUDP:
		return maps.UDP, true
	}
	return 0, false
}

// backends converts decided endpoints to datapath backends, marking those on
// this node and in its zone.
func backends(eps []topology.Endpoint, node topology.Node) []maps.Backend {
	out := make([]maps.Backend, 0, len(eps))
	zone := node.Zone()
	for _, ep := range eps {
		out = append(out, maps.Backend{
			Addr:      ep.Addr,
			NodeLocal: ep.NodeName != "" && ep.NodeName == node.Name,
			ZoneLocal: zone != "" && ep.Zone == zone,
		})
	}
	return out
}

func sortedFrontends(m map[maps.Frontend][]maps.Backend) []maps.Frontend {
	out := make([]maps.Frontend, 0, len(m))
	for f := range m {
		out = append(out, f)
	}
	slices.SortFunc(out, func(x, y maps.Frontend) int {
		return cmp.Or(x.Addr.Compare(y.Addr), cmp.Compare(x.Proto, y.Proto))
	})
	return out
}
