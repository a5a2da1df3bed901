package agent

import (
	"encoding/json"
	"net/http"
	"time"

	v1 "k8s.io/api/core/v1"
)

// DefaultProxyHealthAddress is kube-proxy's --healthz-bind-address default:
// cloud load balancers (GKE, DigitalOcean, ...) probe this port on every
// node to decide which nodes get traffic.
const DefaultProxyHealthAddress = "0.0.0.0:10256"

// ProxyHealth is the body of the proxy health server's /healthz and
// /livez, kube-proxy's ProxyHealth (pkg/proxy/healthcheck/proxy_health.go,
// v1.37) field for field, so clients written for kube-proxy read it.
type ProxyHealth struct {
	// LastUpdated is now when healthy (kube-proxy keeps "recent means
	// healthy" for older clients), else when the last sync finished
	// (zero before the first).
	LastUpdated time.Time `json:"lastUpdated"`
	CurrentTime time.Time `json:"currentTime"`
	// NodeEligible is set by /healthz only: false while this node is
	// unknown, being deleted or tainted by the cluster autoscaler.
	NodeEligible *bool `json:"nodeEligible,omitempty"`
	Healthy      bool  `json:"healthy"`
	// Status is the health per IP family the agent programs in some scope
	// (ScopeFamilies.Anywhere): IPv4, and IPv6 where the datapath serves
	// it, as kube-proxy reports each of its proxiers. One sync loop serves
	// both families, so both have its health.
	Status map[v1.IPFamily]ProxierHealth `json:"status,omitempty"`
}

// ProxierHealth is one IP family's health, kube-proxy's ProxierHealth.
type ProxierHealth struct {
	LastUpdated time.Time `json:"lastUpdated"`
	Healthy     bool      `json:"healthy"`
}

// proxyHealth is ProxyHealth from the agent's own Health (the sync loop
// keeps up), without NodeEligible.
func (a *Agent) proxyHealth() ProxyHealth {
	h := a.Health()
	ph := ProxyHealth{CurrentTime: a.now(), Healthy: h.Healthy}
	if h.LastSync != nil {
		ph.LastUpdated = *h.LastSync
	}
	ph.Status = map[v1.IPFamily]ProxierHealth{}
	for _, family := range a.families.Anywhere() {
		ph.Status[family] = ProxierHealth{LastUpdated: ph.LastUpdated, Healthy: h.Healthy}
	}
	return ph
}

// nodeEligible reports whether this node should get load-balancer traffic:
// it is known and not leaving (topology.Node.Leaving).
func (a *Agent) nodeEligible() bool {
	a.live.mu.Lock()
	defer a.live.mu.Unlock()
	return a.live.self != nil && a.live.self.Leaving == ""
}

// ProxyHealthHandler serves kube-proxy's health endpoints, with its
// semantics, status codes and JSON (ProxyHealth):
//   - /healthz: 200 when the sync loop keeps up (Health) and this node is
//     eligible (known, not being deleted, not tainted
//     ToBeDeletedByClusterAutoscaler), else 503; load balancers probe it
//     to pick nodes, so a leaving node is drained before it goes;
//   - /livez: 200 when the sync loop keeps up, whatever the node, else
//     503; for a liveness probe.
func (a *Agent) ProxyHealthHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		ph := a.proxyHealth()
		eligible := a.nodeEligible()
		ph.NodeEligible = &eligible
		writeProxyHealth(w, a.now(), ph, ph.Healthy && eligible)
	})
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) {
		ph := a.proxyHealth()
		writeProxyHealth(w, a.now(), ph, ph.Healthy)
	})
	return mux
}

// writeProxyHealth answers as kube-proxy does: JSON without a trailing
// newline, 503 when not ok, and, when ok, lastUpdated set to now.
func writeProxyHealth(w http.ResponseWriter, now time.Time, ph ProxyHealth, ok bool) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if ok {
		ph.LastUpdated = now
		w.WriteHeader(http.StatusOK)
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	out, _ := json.Marshal(ph)
	_, _ = w.Write(out)
}
