package agent

import (
	"encoding/json"
	"net/http"
	"sort"

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
	// Problems are inconsistencies found reading the frontend back (a
	// missing slot, an id standing for two backends, ...): the periodic
	// verification repairs them.
	Problems []string `json:"problems,omitempty"`
}

// State returns the agent's current decisions and what the kernel maps
// hold.
func (a *Agent) State() DebugState {
	a.mu.RLock()
	var ds []topology.PortDecision
	for _, d := range a.decisions {
		ds = append(ds, d...)
	}
	node, _ := a.state.Node(a.cfg.NodeName)
	synced := a.synced
	a.mu.RUnlock()
	sort.Slice(ds, func(i, j int) bool {
		x, y := ds[i].Port, ds[j].Port
		if x.Service != y.Service {
			return x.Service.String() < y.Service.String()
		}
		if x.Name != y.Name {
			return x.Name < y.Name
		}
		return x.Protocol < y.Protocol
	})
	st := DebugState{Report: topology.NewReportOptions(node, ds, a.cfg.Options), Synced: synced}
	prog, err := a.dp.Programmed()
	if err != nil {
		st.DatapathError = err.Error()
		return st
	}
	st.Programmed = make(map[string][]string, len(prog))
	st.Datapath = make(map[string]ProgrammedFrontend, len(prog))
	for f, ps := range prog {
		pf := ProgrammedFrontend{Slots: map[string]uint32{}, Backends: []string{}, DrainingBackends: []string{},
			AffinityTimeoutSeconds: int64(ps.Affinity.Seconds()), Reject: ps.Reject, Problems: ps.Problems}
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
	return st
}

// BackendZones maps each backend IP the decisions name to its endpoint
// zone.
func (a *Agent) BackendZones() map[string]string {
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := map[string]string{}
	for _, ds := range a.decisions {
		for _, d := range ds {
			for _, set := range [][]topology.Endpoint{d.Decision.Backends, d.Decision.ExternalBackends, d.Decision.ClusterBackends,
				d.Decision.Draining, d.Decision.ExternalDraining, d.Decision.ClusterDraining} {
				for _, ep := range set {
					out[ep.Addr.Addr().String()] = ep.Zone
				}
			}
		}
	}
	return out
}

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
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(a.State())
	})
	return mux
}

// ZoneShares returns, for every programmed frontend whose weights are not
// all equal, the decided share of new flows per backend zone.
func (a *Agent) ZoneShares() map[maps.Frontend]map[string]float64 {
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := map[maps.Frontend]map[string]float64{}
	for key, f := range a.owner {
		if integerWeights(f.Weights) == nil {
			continue
		}
		fe, ok := DatapathFrontend(key)
		if !ok {
			continue
		}
		shares := map[string]float64{}
		for i, ep := range f.Backends {
			shares[ep.Zone] += f.Weights[i]
		}
		out[fe] = shares
	}
	return out
}
