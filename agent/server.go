package agent

import (
	"bufio"
	"encoding/json"
	"io"
	stdmaps "maps"
	"net/http"
	"slices"
	"sort"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// DebugState is the JSON served at /debug/state: the agent's current
// decisions in the `topolbctl explain -o json` contract (including the
// frontends those decisions program), and what the datapath maps hold, read
// back from the kernel — not from the agent's memory.
type DebugState struct {
	topology.Report
	// Synced is true once the first full sync has been written.
	Synced bool `json:"synced"`
	// Families are the IP families the agent programs into its datapath
	// in every scope (ScopeFamilies.Everywhere), as an agent that
	// programmed per family only said; FamiliesByScope says more.
	Families []v1.IPFamily `json:"families"`
	// FamiliesByScope are the IP families the agent programs per scope
	// (ProgrammedFamilies); the Report decides every family, and its
	// frontends of other families or scopes are decided but not
	// programmed. An agent that programmed per family only omits it.
	FamiliesByScope ScopeFamilies `json:"familiesByScope,omitempty"`
	// Programmed maps frontends, as "ip:port/PROTO" (internal scope) or
	// "ip:port/PROTO/external", to the active backends the kernel maps
	// hold for them, sorted. Nil when the maps could not be read.
	Programmed map[string][]string `json:"programmed"`
	// Datapath holds every frontend the kernel maps hold, keyed as
	// Programmed, in full.
	Datapath map[string]ProgrammedFrontend `json:"datapath"`
	// DatapathError says why the maps could not be read; "" when they
	// were.
	DatapathError string `json:"datapathError,omitempty"`
	// Uplinks are the uplinks and the path each uses (XDP or tc), read
	// back from the kernel: the programs attached to them.
	Uplinks []maps.UplinkStatus `json:"uplinks,omitempty"`
	// UplinksError says why the uplinks could not be read; "" when they
	// were.
	UplinksError string `json:"uplinksError,omitempty"`
	// Kernel is the kernel's release and the features the datapath
	// found at load; nil before a datapath probed one.
	Kernel *maps.KernelReport `json:"kernel,omitempty"`
}

// ProgrammedFamilies returns the families the state says the agent
// programs per scope: FamiliesByScope; from an agent that programmed per
// family only, its Families in every scope; from one older than dual
// stack, which does not say, IPv4.
func (st DebugState) ProgrammedFamilies() ScopeFamilies {
	if st.FamiliesByScope != nil {
		return st.FamiliesByScope
	}
	families := st.Families
	if len(families) == 0 {
		families = []v1.IPFamily{v1.IPv4Protocol}
	}
	out := make(ScopeFamilies, len(Scopes))
	for _, scope := range Scopes {
		out[scope] = families
	}
	return out
}

// ProgrammedFrontend is one frontend as the kernel maps hold it.
type ProgrammedFrontend struct {
	// Backends are the active backends, sorted "ip:port".
	Backends []string `json:"backends"`
	// Slots gives each active backend's number of slots in the
	// frontend's table (its weight as programmed).
	Slots map[string]uint32 `json:"slots"`
	// DrainingBackends are backends whose established flows are kept,
	// sorted "ip:port".
	DrainingBackends       []string `json:"drainingBackends"`
	AffinityTimeoutSeconds int64    `json:"affinityTimeoutSeconds"`
	Reject                 bool     `json:"reject"`
	// SourceRanges are the prefixes new flows must come from, sorted;
	// omitted when any source may. NodePasses: the node's processes
	// pass them.
	SourceRanges []string `json:"sourceRanges,omitempty"`
	NodePasses   bool     `json:"nodePasses,omitempty"`
	// Problems are inconsistencies found reading the frontend back (a
	// missing slot, an id standing for two backends, ...): the periodic
	// verification repairs them.
	Problems []string `json:"problems,omitempty"`
}

// State returns the agent's current decisions, decided again from the
// objects it holds (the agent keeps no copy of them), and what the kernel
// maps hold.
func (a *Agent) State() DebugState {
	st := a.debugDecisions()
	a.readDatapath(&st)
	return st
}

// debugDecisions returns the decisions half of the state: Report and
// Synced.
func (a *Agent) debugDecisions() DebugState {
	ds, skipped, node, synced := a.decideAgain()
	st := DebugState{Report: topology.NewReportOptions(node, ds, a.cfg.Options), Synced: synced, Families: a.families.Everywhere(), FamiliesByScope: a.families}
	st.Skipped = skipped
	return st
}

// decideAgain decides every service for this node from the objects the
// agent holds, lists those it does not proxy, and says whether the first
// full sync has been written.
func (a *Agent) decideAgain() (ds []topology.PortDecision, skipped []topology.SkippedService, node topology.Node, synced bool) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	ds, _ = a.state.DecideNode(a.cfg.NodeName, a.cfg.Options)
	node, _ = a.state.Node(a.cfg.NodeName)
	return ds, a.state.Skipped(), node, a.synced
}

// readDatapath fills the datapath half of st from the kernel: Programmed
// and Datapath, or DatapathError; Uplinks, or UplinksError.
func (a *Agent) readDatapath(st *DebugState) {
	if k := a.dp.Kernel(); k.Release != "" {
		st.Kernel = &k
	}
	if up, err := a.dp.Uplinks(); err != nil {
		st.UplinksError = err.Error()
	} else {
		st.Uplinks = up
	}
	prog, err := a.dp.Programmed()
	if err != nil {
		st.DatapathError = err.Error()
		return
	}
	st.Programmed = make(map[string][]string, len(prog))
	st.Datapath = make(map[string]ProgrammedFrontend, len(prog))
	for f, ps := range prog {
		pf := ProgrammedFrontend{Slots: map[string]uint32{}, Backends: []string{}, DrainingBackends: []string{},
			AffinityTimeoutSeconds: int64(ps.Affinity.Seconds()), Reject: ps.Reject, Problems: ps.Problems,
			NodePasses: ps.SourceRangesNode}
		for _, p := range ps.SourceRanges {
			pf.SourceRanges = append(pf.SourceRanges, p.String())
		}
		for _, b := range ps.Backends {
			if b.Draining {
				pf.DrainingBackends = append(pf.DrainingBackends, b.Addr.String())
				continue
			}
			pf.Backends = append(pf.Backends, b.Addr.String())
			pf.Slots[b.Addr.String()] = b.Weight
		}
		sort.Strings(pf.Backends)
		sort.Strings(pf.DrainingBackends)
		st.Datapath[f.String()] = pf
		st.Programmed[f.String()] = pf.Backends
	}
}

// BackendZones maps the address of every endpoint of every Service to its
// zone. A metrics scrape calls it: the lock is held only to copy the
// lists of slices (the State replaces a Service's list, and the slices
// themselves, rather than change them), and the map of 100,000 addresses
// is built after, so that a sync never waits for it (issue 38).
func (a *Agent) BackendZones() map[string]string {
	a.mu.RLock()
	lists := make([][]*discovery.EndpointSlice, 0, len(a.state.Slices))
	for _, list := range a.state.Slices {
		lists = append(lists, list)
	}
	a.mu.RUnlock()
	out := map[string]string{}
	for _, list := range lists {
		for _, es := range list {
			for _, e := range es.Endpoints {
				if len(e.Addresses) > 0 && e.Zone != nil {
					out[e.Addresses[0]] = *e.Zone
				}
			}
		}
	}
	return out
}

// The addresses the agent serves on by default (topolb-agent's
// --health-address and --metrics-address, deploy/ and the chart's values):
// localhost only, since /debug/state and the metrics name every Service.
const (
	// DefaultHealthAddress serves HealthHandler.
	DefaultHealthAddress = "127.0.0.1:9966"
	// DefaultMetricsAddress serves the Prometheus metrics.
	DefaultMetricsAddress = "127.0.0.1:9965"
)

// HealthHandler serves /healthz (the sync loop keeps up, see Health: 200,
// else 503, with the Health as JSON), /readyz (the first full sync has been
// written) and /debug/state.
func (a *Agent) HealthHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		h := a.Health()
		w.Header().Set("Content-Type", "application/json")
		if !h.Healthy {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(h)
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !a.Synced() {
			http.Error(w, "first sync not written yet", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /debug/state", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = a.writeDebug(w)
	})
	return mux
}

// ZoneShares returns, for every programmed frontend whose weights are not
// all equal, the decided share of new flows per backend zone.
func (a *Agent) ZoneShares() map[maps.Frontend]map[string]float64 {
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := make(map[maps.Frontend]map[string]float64, len(a.shares))
	for key, shares := range a.shares {
		if fe, ok := DatapathFrontend(key); ok {
			out[fe] = cloneMap(shares)
		}
	}
	return out
}

// NodeZone returns this agent's node name and the zone of its Node as last
// seen ("" before the Node is seen or when it has no zone label).
func (a *Agent) NodeZone() (node, zone string) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	n, _ := a.state.Node(a.cfg.NodeName)
	return a.cfg.NodeName, n.Zone()
}

// reportWalker yields a topology.Report one entry at a time.
type reportWalker struct {
	node, zone string
	skipped    []topology.SkippedService
	// walk hands every port report to service, then every frontend
	// report to frontend, and returns the warnings.
	walk func(service func(topology.PortReport), frontend func(topology.FrontendReport)) []string
}

// writeDebug writes /debug/state for the agent's current decisions and
// maps, holding as little of it at a time as it can: the decisions, but
// never their whole report, and the maps only once the decisions are
// written and let go.
func (a *Agent) writeDebug(w io.Writer) error {
	ds, skipped, node, synced := a.decideAgain()
	st := DebugState{Synced: synced, Families: a.families.Everywhere(), FamiliesByScope: a.families}
	rw := reportWalker{node: node.Name, zone: node.Zone(), skipped: skipped, walk: func(service func(topology.PortReport), frontend func(topology.FrontendReport)) []string {
		warnings := topology.WalkReport(node, ds, a.cfg.Options, service, frontend)
		ds = nil
		return warnings
	}}
	return writeDebugState(w, rw, &st, a.readDatapath)
}

// writeDebugState writes the document json.Marshal would make of a
// DebugState whose Report is the one rw walks and whose other fields are
// st's, compact, one element at a time: at 10,000 services the document is
// megabytes, and building it whole (let alone indented, which copies it
// again) would be the agent's largest allocation. It calls fill, when not
// nil, to read the maps into st only after the decisions are written.
// TestWriteDebugStateIsMarshal keeps the two the same.
func writeDebugState(w io.Writer, rw reportWalker, st *DebugState, fill func(*DebugState)) error {
	j := &jsonStream{w: bufio.NewWriter(w)}
	j.raw(`{"node":`)
	j.value(rw.node)
	j.raw(`,"zone":`)
	j.value(rw.zone)
	j.raw(`,"services":[`)
	services, frontends, inFrontends := 0, 0, false
	openFrontends := func() {
		if !inFrontends {
			j.raw(`],"frontends":[`)
			inFrontends = true
		}
	}
	warnings := rw.walk(func(p topology.PortReport) {
		if services > 0 {
			j.raw(",")
		}
		j.value(p)
		services++
	}, func(f topology.FrontendReport) {
		openFrontends()
		if frontends > 0 {
			j.raw(",")
		}
		j.value(f)
		frontends++
	})
	openFrontends()
	j.raw(`],"warnings":`)
	if warnings == nil {
		warnings = []string{}
	}
	j.value(warnings)
	if len(rw.skipped) > 0 {
		j.raw(`,"skipped":`)
		j.value(rw.skipped)
	}
	j.raw(`,"synced":`)
	j.value(st.Synced)
	j.raw(`,"families":`)
	j.value(st.Families)
	if st.FamiliesByScope != nil {
		j.raw(`,"familiesByScope":`)
		j.value(st.FamiliesByScope)
	}
	if fill != nil {
		fill(st)
	}
	j.raw(`,"programmed":`)
	streamObject(j, st.Programmed)
	j.raw(`,"datapath":`)
	streamObject(j, st.Datapath)
	if st.DatapathError != "" {
		j.raw(`,"datapathError":`)
		j.value(st.DatapathError)
	}
	if len(st.Uplinks) > 0 {
		j.raw(`,"uplinks":`)
		j.value(st.Uplinks)
	}
	if st.UplinksError != "" {
		j.raw(`,"uplinksError":`)
		j.value(st.UplinksError)
	}
	if st.Kernel != nil {
		j.raw(`,"kernel":`)
		j.value(st.Kernel)
	}
	j.raw("}\n")
	if j.err != nil {
		return j.err
	}
	return j.w.Flush()
}

// jsonStream writes a JSON document piece by piece. The first error is
// kept in err and turns every later write into a no-op.
type jsonStream struct {
	w   *bufio.Writer
	err error
}

// raw writes s as it is.
func (j *jsonStream) raw(s string) {
	if j.err == nil {
		_, j.err = j.w.WriteString(s)
	}
}

// value writes v as json.Marshal encodes it.
func (j *jsonStream) value(v any) {
	if j.err != nil {
		return
	}
	var b []byte
	if b, j.err = json.Marshal(v); j.err == nil {
		_, j.err = j.w.Write(b)
	}
}

// items writes open, then n elements separated by commas (elem writes
// the i-th), then close.
func (j *jsonStream) items(open, close string, n int, elem func(i int)) {
	j.raw(open)
	for i := range n {
		if i > 0 {
			j.raw(",")
		}
		elem(i)
	}
	j.raw(close)
}

// streamObject writes m as json.Marshal would (null when nil, keys
// sorted), one entry at a time.
func streamObject[V any](j *jsonStream, m map[string]V) {
	if m == nil {
		j.raw("null")
		return
	}
	keys := slices.Sorted(stdmaps.Keys(m))
	j.items("{", "}", len(keys), func(i int) {
		j.value(keys[i])
		j.raw(":")
		j.value(m[keys[i]])
	})
}
