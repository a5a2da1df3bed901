// Package agent joins the decision engine to the datapath: it keeps the
// cluster objects a node needs, decides every changed service for this node
// and writes only the difference into the BPF maps.
package agent

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// Datapath is what the agent needs of the maps: maps.Datapath implements it;
// unit tests use an in-memory fake.
type Datapath interface {
	// SetService makes fe serve s (its active and draining backends and
	// settings) with the fewest atomic writes, and returns how many writes
	// it made.
	SetService(fe maps.Frontend, s maps.Service) (int, error)
	// DeleteFrontend removes fe; deleting an absent frontend is no error.
	DeleteFrontend(fe maps.Frontend) (int, error)
	// Services returns what this process holds as programmed (its mirror,
	// including what it adopted at load).
	Services() map[maps.Frontend]maps.Service
	// Programmed reads every frontend back from the kernel maps.
	Programmed() (map[maps.Frontend]maps.ProgrammedService, error)
	// Uplinks reads every uplink's path back from the kernel.
	Uplinks() ([]maps.UplinkStatus, error)
	// Kernel is what the datapath found the kernel offers at load.
	Kernel() maps.KernelReport
	// IPv6 reports whether the datapath serves IPv6 frontends (and their
	// backends) in scope. The agent decides, explains, counts and
	// health-checks both families regardless; it programs an IPv6
	// frontend only when this is true for its scope (Programs). The agent
	// reads it once, in New.
	IPv6(scope maps.Scope) bool
}

// EventSink receives the decisions operators should hear about on the
// Service object. Implementations aggregate and rate-limit.
type EventSink interface {
	// ModeChanged reports that this node's mode for a service port changed.
	ModeChanged(svc *v1.Service, port string, from, to topology.Mode, reason string)
	// ProgramFailed reports that a service's backends could not be written
	// and its previous backends keep serving.
	ProgramFailed(svc *v1.Service, err error)
	// ServiceRefused reports that a service is over one of the per-Service
	// caps (topology.Caps) and none of its frontends is served on this
	// node.
	ServiceRefused(svc *v1.Service, r topology.Refusal)
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
	// HealthChecks, if set, serves the health check NodePorts of
	// LoadBalancer Services with externalTrafficPolicy Local.
	HealthChecks *HealthChecks
	// HealthTimeout is how long a change may wait, or a sync run, before
	// Health reports the agent unhealthy; 0 means DefaultHealthTimeout.
	HealthTimeout time.Duration
	// NodesFromSummary says that the batches carry this node's Node only
	// and the topology summary for the others (kube.NodeWatchOwn): other
	// nodes are what the summary stands for, and a port whose policy
	// needs what it lacks is decided by hints (topology.State.FromSummary).
	NodesFromSummary bool
}

// Agent holds the cluster state for one node and programs the datapath.
// Apply is called by one goroutine at a time (Run); the read-side methods
// are safe to call concurrently with it.
type Agent struct {
	cfg Config
	dp  Datapath
	log *slog.Logger
	// up is the datapath upkeep (RunUpkeep), nil before it starts.
	up atomic.Pointer[upkeep]
	// live records the sync loop's progress for Health; now is its clock.
	live liveness
	now  func() time.Time

	mu    sync.RWMutex
	state *topology.State
	// owner holds, for every frontend this agent programmed, the claim that
	// owns it; owned indexes the same by service. waiting holds, per
	// frontend, the services whose claim on it lost to the owner's
	// (topology.CompareClaims), and waitsFor the reverse.
	owner    map[topology.Key]topology.Claim
	owned    map[types.NamespacedName]map[topology.Key]bool
	waiting  map[topology.Key]map[types.NamespacedName]bool
	waitsFor map[types.NamespacedName]map[topology.Key]bool
	// ports holds what the agent must remember of each service's last
	// decisions (modes for change reports, what they read of Nodes,
	// metrics); the decisions themselves are derivable from state and are
	// not kept (/debug/state decides again).
	ports map[types.NamespacedName][]portSummary
	// shares holds, for the frontends programmed with unequal weights, the
	// decided share of new flows per backend zone (metrics).
	shares map[topology.Key]map[string]float64
	// pending holds the services with a port whose policy needs what the
	// topology summary lacks (NodesFromSummary), decided by hints meanwhile.
	pending map[types.NamespacedName]bool
	// failed holds services whose last write failed; they are retried on
	// every sync until it succeeds.
	failed map[types.NamespacedName]bool
	// refused holds the services over a per-Service cap (topology.Caps),
	// whose frontends are not programmed, and why.
	refused map[types.NamespacedName]topology.Refusal
	// healthChecked holds the services whose health check is served.
	healthChecked map[types.NamespacedName]bool
	// rejected remembers the warnings logged per service (and, under "",
	// about this node), so each set is logged once.
	rejected map[types.NamespacedName]string
	// unprogrammed remembers, per service, the families and scopes it has
	// frontends in but not programmed (notProgrammed), so each set is
	// logged once.
	unprogrammed map[types.NamespacedName]string
	// families are the families the agent programs per scope, from the
	// datapath's IPv6 at New.
	families ScopeFamilies
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
	families := ProgrammedFamilies(dp.IPv6)
	if cfg.Metrics != nil {
		cfg.Metrics.setFamilies(families)
	}
	state := topology.NewEmptyState()
	state.FromSummary = cfg.NodesFromSummary
	return &Agent{
		cfg: cfg, dp: dp, log: log, now: time.Now, families: families,
		state:    state,
		pending:  map[types.NamespacedName]bool{},
		owner:    map[topology.Key]topology.Claim{},
		owned:    map[types.NamespacedName]map[topology.Key]bool{},
		waiting:  map[topology.Key]map[types.NamespacedName]bool{},
		waitsFor: map[types.NamespacedName]map[topology.Key]bool{},
		ports:    map[types.NamespacedName][]portSummary{},
		shares:   map[topology.Key]map[string]float64{},
		failed:   map[types.NamespacedName]bool{},
		refused:  map[types.NamespacedName]topology.Refusal{},
		rejected: map[types.NamespacedName]string{},

		unprogrammed: map[types.NamespacedName]string{},

		healthChecked: map[types.NamespacedName]bool{},
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
// the datapath. Before the first resync it only folds: the informers'
// initial lists are still arriving (a Service can come before its
// EndpointSlices, and deciding it then would write an empty, rejecting
// frontend over the working one a previous agent left). The first resync
// decides every service and removes the frontends left in the maps by a
// previous agent that are no longer desired, so a restarting agent never
// makes the datapath worse.
func (a *Agent) Apply(b kube.Batch) SyncResult {
	start := time.Now()
	a.live.begin(a.now())
	defer func() { a.live.end(a.now()) }()
	a.mu.Lock()
	defer a.mu.Unlock()

	affected := a.fold(b)
	if !b.Resync && !a.synced {
		return SyncResult{}
	}
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
	// A service that releases a frontend hands it to the services waiting
	// for it, which are synced in the same batch. Each service is synced at
	// most twice per batch: once for the batch, once for a handover.
	synced := map[types.NamespacedName]int{}
	for len(names) > 0 {
		nn := names[0]
		names = names[1:]
		if synced[nn] >= 2 {
			continue
		}
		synced[nn]++
		w, released, err := a.syncService(nn)
		res.Writes += w
		res.Services++
		if err != nil {
			res.Errors = append(res.Errors, err)
		}
		names = append(names, released...)
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
// whose decisions may have changed. Which Node changes matter to a service
// is the decision engine's to say (topology.ServicePort.Reads).
func (a *Agent) fold(b kube.Batch) map[types.NamespacedName]bool {
	affected := map[types.NamespacedName]bool{}
	for nn, svc := range b.Services {
		if svc == nil {
			a.state.DeleteService(nn)
		} else {
			a.state.SetService(svc)
		}
		affected[nn] = true
	}
	for key, es := range b.Slices {
		var changed []types.NamespacedName
		if es == nil {
			changed = a.state.DeleteSlice(key)
		} else {
			changed = a.state.SetSlice(es)
		}
		for _, nn := range changed {
			affected[nn] = true
		}
	}
	for name, n := range b.Nodes {
		var prev, cur *topology.Node
		if p, ok := a.state.Nodes[name]; ok {
			prev = &p
		}
		if n == nil {
			delete(a.state.Nodes, name)
		} else {
			node := topology.NodeFromObject(n, nil)
			a.state.Nodes[name] = node
			cur = &node
		}
		self := name == a.cfg.NodeName
		if self {
			a.live.setSelf(cur)
			if cur != nil && cur.Leaving != "" && (prev == nil || prev.Leaving == "") {
				a.log.Info("this node is leaving the cluster: the proxy health server's /healthz fails so load balancers drain it", "node", name, "why", cur.Leaving)
			}
		}
		a.nodeAffects(self, prev, cur, affected)
	}
	if b.Summary != nil {
		a.foldSummary(*b.Summary, affected)
	}
	return affected
}

// foldSummary replaces the other nodes with those the topology summary
// stands for (this node's own Node comes from its watch) and marks the
// services it affects: those whose last decisions read what changed of
// the other nodes, and, when what the summary lacks for them or the note
// on its age changes, those whose policy reads other nodes at all.
// Services that read nothing of other nodes (hints, zone threshold) are
// never decided again for a summary. An agent that watches every Node
// ignores it.
func (a *Agent) foldSummary(sc kube.SummaryChange, affected map[types.NamespacedName]bool) {
	if !a.state.FromSummary {
		return
	}
	prev, prevNote := a.state.Summary, a.state.SummaryNote
	a.state.Summary, a.state.SummaryNote = sc.Summary, sc.Note
	if m := a.cfg.Metrics; m != nil && sc.Summary != nil {
		m.summaryWritten(sc.Summary.Written)
	}
	switch {
	case sc.Note != "" && sc.Note != prevNote:
		a.log.Warn("topology summary out of date: Services whose policy reads other nodes keep their last known inputs", "reason", sc.Note)
	case sc.Note == "" && prevNote != "":
		a.log.Info("topology summary up to date again")
	case prev == nil && sc.Summary != nil:
		a.log.Info("topology summary read", "written", sc.Summary.Written, "labelKeys", sc.Summary.LabelKeys())
	}
	var changed []nodeChange
	if sc.Summary != prev {
		changed = a.replaceOtherNodes(sc.Summary.Nodes())
	}
	for nn, ps := range a.ports {
		for _, p := range ps {
			if p.reads.Capacity || len(p.reads.OtherLabels) > 0 {
				if sc.Note != prevNote || prev.LacksFor(p.reads) != sc.Summary.LacksFor(p.reads) ||
					slices.ContainsFunc(changed, func(c nodeChange) bool { return p.reads.Affected(false, c.prev, c.cur) }) {
					affected[nn] = true
					break
				}
			}
		}
	}
}

// nodeChange is one other node's model before and after a summary (nil:
// absent).
type nodeChange struct{ prev, cur *topology.Node }

// replaceOtherNodes sets every node but this one to next's, and returns
// the nodes that changed.
func (a *Agent) replaceOtherNodes(next map[string]topology.Node) []nodeChange {
	var changed []nodeChange
	for name, n := range a.state.Nodes {
		if _, ok := next[name]; !ok && name != a.cfg.NodeName {
			delete(a.state.Nodes, name)
			changed = append(changed, nodeChange{prev: &n})
		}
	}
	for name, n := range next {
		if name == a.cfg.NodeName {
			continue
		}
		p, ok := a.state.Nodes[name]
		if ok && reflect.DeepEqual(p, n) {
			continue
		}
		a.state.Nodes[name] = n
		c := nodeChange{cur: &n}
		if ok {
			c.prev = &p
		}
		changed = append(changed, c)
	}
	return changed
}

// nodeAffects marks the services whose last decisions read what changed
// between two versions of a Node (nil: absent), and, when this node's
// addresses changed, those whose health check listens on them.
func (a *Agent) nodeAffects(self bool, prev, cur *topology.Node, affected map[types.NamespacedName]bool) {
	if self && (prev == nil || cur == nil || !slices.Equal(prev.Addresses, cur.Addresses)) {
		for nn := range a.healthChecked {
			affected[nn] = true
		}
	}
	for nn, ps := range a.ports {
		for _, p := range ps {
			if p.reads.Affected(self, prev, cur) {
				affected[nn] = true
				break
			}
		}
	}
}

// noteRejections logs what the decision engine could not use, once per
// distinct message set, and counts it.
func (a *Agent) noteRejections(nn types.NamespacedName, warnings []string) {
	if !newSet(a.rejected, nn, warnings) {
		return
	}
	for _, w := range warnings {
		a.log.Warn("input skipped", "service", nn, "reason", w)
		if a.cfg.Metrics != nil {
			a.cfg.Metrics.Rejected.Inc()
		}
	}
}

// reportModes logs, counts and emits an event for every port whose mode
// changed since the last decision; the event of a dual-stack Service names
// the family too.
func (a *Agent) reportModes(nn types.NamespacedName, svc *v1.Service, ds []topology.PortDecision) {
	prev := map[string]topology.Mode{}
	for _, p := range a.ports[nn] {
		prev[p.key] = p.mode
	}
	dualStack := slices.ContainsFunc(ds, func(d topology.PortDecision) bool { return d.Port.Family != ds[0].Port.Family })
	for _, d := range ds {
		from, seen := prev[portKey(d.Port)]
		to := d.Decision.Mode
		if seen && from == to {
			continue
		}
		a.log.Info("service mode changed", "service", nn, "port", d.Port.Name, "protocol", d.Port.Protocol, "family", d.Port.Family,
			"policy", d.Decision.Policy, "from", from, "to", to, "reason", d.Decision.Reason)
		if seen && a.cfg.Events != nil && svc != nil {
			port := d.Port.Name
			if dualStack {
				// The Service's event names the family whose mode changed.
				port += " (" + string(d.Port.Family) + ")"
			}
			a.cfg.Events.ModeChanged(svc, port, from, to, d.Decision.Reason)
		}
		if a.cfg.Metrics != nil && seen {
			a.cfg.Metrics.ModeChanges.Inc()
		}
	}
}

// newSet records set as nn's latest in seen and reports whether it is not
// empty and differs from the one recorded before: what the agent logs once
// per distinct set. An empty set forgets nn.
func newSet[T any](seen map[types.NamespacedName]string, nn types.NamespacedName, set []T) bool {
	if len(set) == 0 {
		delete(seen, nn)
		return false
	}
	key := fmt.Sprint(set)
	if seen[nn] == key {
		return false
	}
	seen[nn] = key
	return true
}

func portKey(p topology.ServicePort) string {
	return p.Name + "/" + string(p.Protocol) + "/" + string(p.Family)
}

// SummaryLabelKeys returns the label keys the topology-keys of the
// Services it knows name: what the topology summary must cover
// (kube.SummaryWriter.LabelKeys).
func (a *Agent) SummaryLabelKeys() []string {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return a.state.SummaryLabelKeys()
}

// Programs reports whether the agent programs frontends of family in
// scope into its datapath (ProgrammedFamilies). A frontend it does not
// program is still decided, explained, counted in metrics and
// health-checked; DebugState.FamiliesByScope says what is programmed.
func (a *Agent) Programs(family v1.IPFamily, scope topology.Scope) bool {
	return a.families.Programs(family, scope)
}
