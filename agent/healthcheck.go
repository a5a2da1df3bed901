package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/topology"
)

// HealthChecks serves kube-proxy's service health checks: for every
// LoadBalancer Service with externalTrafficPolicy Local, an HTTP server on
// its healthCheckNodePort at each of this node's NodePort addresses that
// answers 200 while the node has ready local endpoints and the agent keeps
// up, 503 otherwise, with kube-proxy's headers and JSON body — so a cloud
// load balancer sends traffic only to nodes that can serve it. A
// dual-stack Service has one check per family (topology.HealthCheck.Family),
// each on that family's addresses with that family's count, as kube-proxy's
// proxier of each family serves its own. Safe for concurrent use.
type HealthChecks struct {
	// Healthy reports whether the agent keeps up (serviceProxyHealthy);
	// nil counts as healthy.
	Healthy func() bool
	Log     *slog.Logger
	// Listen opens a listener; nil means net.Listen.
	Listen func(network, addr string) (net.Listener, error)

	mu       sync.Mutex
	services map[hcKey]*hcService
}

// hcKey names one Service's health check in one family.
type hcKey struct {
	nn     types.NamespacedName
	family v1.IPFamily
}

// hcService is one Service's health check and its servers.
type hcService struct {
	port    uint16
	addrs   []netip.Addr
	count   atomic.Int64 // read by the handlers without a lock
	servers []*http.Server
}

// HealthCheckBody is the JSON kube-proxy answers a health check with.
type HealthCheckBody struct {
	Service struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"service"`
	LocalEndpoints      int  `json:"localEndpoints"`
	ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
}

// Set makes nn's health check in hc.Family serve hc on addrs: it
// (re)starts the servers when the port or the addresses change and updates
// the count otherwise. A port that cannot be opened is logged and tried
// again at the next Set.
func (h *HealthChecks) Set(nn types.NamespacedName, hc topology.HealthCheck, addrs []netip.Addr) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.services == nil {
		h.services = map[hcKey]*hcService{}
	}
	key := hcKey{nn, hc.Family}
	s := h.services[key]
	if s != nil && s.port == hc.Port && slices.Equal(s.addrs, addrs) && len(s.servers) == len(addrs) {
		s.count.Store(int64(hc.LocalEndpoints))
		return
	}
	if s != nil {
		h.stop(s)
	}
	s = &hcService{port: hc.Port, addrs: slices.Clone(addrs)}
	s.count.Store(int64(hc.LocalEndpoints))
	h.services[key] = s
	if err := h.start(nn, s); err != nil {
		h.log().Error("health check port not served; retried at the next change", "service", nn, "family", hc.Family, "port", hc.Port, "err", err)
	}
}

// Delete stops nn's health checks in every family, if any.
func (h *HealthChecks) Delete(nn types.NamespacedName) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for key, s := range h.services {
		if key.nn == nn {
			h.stop(s)
			delete(h.services, key)
		}
	}
}

// DeleteFamily stops nn's health check in family, if any.
func (h *HealthChecks) DeleteFamily(nn types.NamespacedName, family v1.IPFamily) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if s := h.services[hcKey{nn, family}]; s != nil {
		h.stop(s)
		delete(h.services, hcKey{nn, family})
	}
}

// Close stops every health check.
func (h *HealthChecks) Close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for key, s := range h.services {
		h.stop(s)
		delete(h.services, key)
	}
}

// start opens a listener per address; on any failure it closes what it
// opened, so a retry starts clean.
func (h *HealthChecks) start(nn types.NamespacedName, s *hcService) error {
	listen := h.Listen
	if listen == nil {
		listen = net.Listen
	}
	for _, a := range s.addrs {
		ln, err := listen("tcp", net.JoinHostPort(a.String(), strconv.Itoa(int(s.port))))
		if err != nil {
			h.stop(s)
			return fmt.Errorf("listen on %s port %d: %w", a, s.port, err)
		}
		srv := &http.Server{Handler: h.handler(nn, s), ReadHeaderTimeout: 5 * time.Second}
		s.servers = append(s.servers, srv)
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				h.log().Error("health check server", "service", nn, "err", err)
			}
		}()
	}
	return nil
}

func (h *HealthChecks) stop(s *hcService) {
	for _, srv := range s.servers {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = srv.Shutdown(ctx)
		cancel()
	}
	s.servers = nil
}

// handler answers as kube-proxy's service health server does.
func (h *HealthChecks) handler(nn types.NamespacedName, s *hcService) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		count := int(s.count.Load())
		healthy := h.Healthy == nil || h.Healthy()
		var body HealthCheckBody
		body.Service.Namespace, body.Service.Name = nn.Namespace, nn.Name
		body.LocalEndpoints, body.ServiceProxyHealthy = count, healthy
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("X-Load-Balancing-Endpoint-Weight", strconv.Itoa(count))
		if count > 0 && healthy {
			w.WriteHeader(http.StatusOK)
		} else {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(body)
	})
}

func (h *HealthChecks) log() *slog.Logger {
	if h.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return h.Log
}
