package agent

import (
	"encoding/json"
	"net/http"
	"sort"

	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// DebugState is the JSON served at /debug/state: the agent's current
// decisions in the `topolbctl explain -o json` contract, and what the
// datapath maps hold.
type DebugState struct {
	topology.Report
	// Synced is true once the first full sync has been written.
	Synced bool `json:"synced"`
	// Programmed maps "ip:port/PROTO" frontends to their programmed
	// backends, sorted.
	Programmed map[string][]string `json:"programmed"`
}

// State returns the agent's current decisions and programmed frontends.
func (a *Agent) State() DebugState {
	a.mu.RLock()
	defer a.mu.RUnlock()
	var ds []topology.PortDecision
	for _, d := range a.decisions {
		ds = append(ds, d...)
	}
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
	node, _ := a.state.Node(a.cfg.NodeName)
	st := DebugState{Report: topology.NewReport(node, ds), Synced: a.synced, Programmed: map[string][]string{}}
	for f, bes := range a.dp.Frontends() {
		st.Programmed[f.String()] = backendStrings(bes)
	}
	return st
}

// BackendZones maps each programmed backend IP to its endpoint zone.
func (a *Agent) BackendZones() map[string]string {
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := map[string]string{}
	for _, ds := range a.decisions {
		for _, d := range ds {
			for _, ep := range d.Decision.Backends {
				out[ep.Addr.Addr().String()] = ep.Zone
			}
			for _, ep := range d.Decision.ExternalBackends {
				out[ep.Addr.Addr().String()] = ep.Zone
			}
		}
	}
	return out
}

func backendStrings(bes []maps.Backend) []string {
	out := make([]string, 0, len(bes))
	for _, b := range bes {
		out = append(out, b.Addr.String())
	}
	sort.Strings(out)
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
