package agent

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// loopbackListens stands in for the node's addresses: every listen goes to
// a free port on 127.0.0.1, and the address asked for is recorded with the
// one served.
type loopbackListens struct {
	mu     sync.Mutex
	served map[string]string // asked "ip:port" -> served "127.0.0.1:port"
}

func (l *loopbackListens) listen(network, addr string) (net.Listener, error) {
	ln, err := net.Listen(network, "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.served[addr] = ln.Addr().String()
	return ln, nil
}

func (l *loopbackListens) addr(asked string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.served[asked]
}

// check asks a health check and returns the status and body.
func check(t *testing.T, addr string) (int, HealthCheckBody, http.Header) {
	t.Helper()
	c := &http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + addr + "/")
	if err != nil {
		t.Fatalf("health check %s: %v", addr, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var body HealthCheckBody
	if err := json.Unmarshal(raw, &body); err != nil {
		t.Fatalf("body %q: %v", raw, err)
	}
	return resp.StatusCode, body, resp.Header
}

// TestAgentHealthCheckNodePort: a LoadBalancer Service with
// externalTrafficPolicy Local gets kube-proxy's health check on each of this
// node's NodePort addresses: 200 with the count of ready local endpoints,
// 503 when there is none (terminating ones do not count) or the agent does
// not keep up; stopped when the Service stops asking for it.
func TestAgentHealthCheckNodePort(t *testing.T) {
	ll := &loopbackListens{served: map[string]string{}}
	healthy := true
	hcs := &HealthChecks{Listen: ll.listen, Healthy: func() bool { return healthy }}
	t.Cleanup(hcs.Close)
	dp := newFakeDP()
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), HealthChecks: hcs}, dp)
	tr := kube.NewTracker()

	svc := service("lb", "10.96.0.1", nil)
	svc.Spec.Type = v1.ServiceTypeLoadBalancer
	svc.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	svc.Spec.HealthCheckNodePort = 32100
	svc.Spec.Ports[0].NodePort = 30080
	svc.Spec.Ports[1].NodePort = 30053
	local := epSlice("lb", "lb-1", endpoint{"10.0.1.1", "a1", "zone-a", "", true}, endpoint{"10.0.2.1", "b1", "zone-b", "", true})
	tr.NodeChanged(nil, nodeWithIP("a1", "zone-a", "10.250.0.2"))
	tr.ServiceChanged(nil, svc)
	tr.SliceChanged(nil, local)
	tr.Resync()
	a.Apply(tr.Drain())

	addr := ll.addr("10.250.0.2:32100")
	if addr == "" {
		t.Fatalf("no health check on the node's address: %v", ll.served)
	}
	code, body, hdr := check(t, addr)
	if code != http.StatusOK || body.LocalEndpoints != 1 || !body.ServiceProxyHealthy ||
		body.Service.Namespace != "default" || body.Service.Name != "lb" {
		t.Errorf("with a local endpoint: %d %+v", code, body)
	}
	if hdr.Get("X-Load-Balancing-Endpoint-Weight") != "1" || hdr.Get("Content-Type") != "application/json" {
		t.Errorf("headers %v", hdr)
	}

	healthy = false
	if code, body, _ := check(t, addr); code != http.StatusServiceUnavailable || body.ServiceProxyHealthy {
		t.Errorf("agent unhealthy: %d %+v", code, body)
	}
	healthy = true

	// The local endpoint terminating: it does not count, the node fails.
	terminating := local.DeepCopy()
	terminating.Endpoints[0].Conditions = discovery.EndpointConditions{Ready: ptr.To(false), Serving: ptr.To(true), Terminating: ptr.To(true)}
	tr.SliceChanged(local, terminating)
	a.Apply(tr.Drain())
	if code, body, _ := check(t, addr); code != http.StatusServiceUnavailable || body.LocalEndpoints != 0 {
		t.Errorf("only a terminating local endpoint: %d %+v", code, body)
	}

	// externalTrafficPolicy Cluster: no health check any more.
	cluster := svc.DeepCopy()
	cluster.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyCluster
	tr.ServiceChanged(svc, cluster)
	a.Apply(tr.Drain())
	c := &http.Client{Timeout: time.Second}
	if resp, err := c.Get("http://" + addr + "/"); err == nil {
		resp.Body.Close()
		t.Errorf("health check still served after the Service stopped asking: %d", resp.StatusCode)
	}
	if got := fmt.Sprint(hcs.services[hcKey{types.NamespacedName{Namespace: "default", Name: "lb"}, v1.IPv4Protocol}]); got != "<nil>" {
		t.Errorf("health check still registered: %s", got)
	}
}

// lbLocal is a LoadBalancer Service with externalTrafficPolicy Local and
// the health check NodePort hcPort, with one endpoint on a1.
func lbLocal(hcPort int32) (*v1.Service, *discovery.EndpointSlice) {
	svc := service("lb", "10.96.0.1", nil)
	svc.Spec.Type = v1.ServiceTypeLoadBalancer
	svc.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	svc.Spec.HealthCheckNodePort = hcPort
	return svc, epSlice("lb", "lb-1", endpoint{"10.0.1.1", "a1", "zone-a", "", true})
}

// refused reports whether nothing answers at addr.
func refused(addr string) bool {
	c := &http.Client{Timeout: time.Second}
	resp, err := c.Get("http://" + addr + "/")
	if err == nil {
		resp.Body.Close()
	}
	return err != nil
}

// TestAgentHealthCheckFollowsChanges: the health check servers move to a
// new healthCheckNodePort, and to this node's new address — also for a
// Service without NodePorts (allocateLoadBalancerNodePorts false), whose
// decisions read nothing of the node's addresses.
func TestAgentHealthCheckFollowsChanges(t *testing.T) {
	ll := &loopbackListens{served: map[string]string{}}
	hcs := &HealthChecks{Listen: ll.listen}
	t.Cleanup(hcs.Close)
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), HealthChecks: hcs}, newFakeDP())
	tr := kube.NewTracker()
	svc, es := lbLocal(32100)
	n := nodeWithIP("a1", "zone-a", "10.250.0.2")
	tr.NodeChanged(nil, n)
	tr.ServiceChanged(nil, svc)
	tr.SliceChanged(nil, es)
	tr.Resync()
	a.Apply(tr.Drain())
	first := ll.addr("10.250.0.2:32100")
	if first == "" {
		t.Fatalf("no health check on the node's address: %v", ll.served)
	}

	moved := svc.DeepCopy()
	moved.Spec.HealthCheckNodePort = 32101
	tr.ServiceChanged(svc, moved)
	a.Apply(tr.Drain())
	second := ll.addr("10.250.0.2:32101")
	if second == "" {
		t.Fatalf("no health check on the new port: %v", ll.served)
	}
	if code, body, _ := check(t, second); code != http.StatusOK || body.LocalEndpoints != 1 {
		t.Errorf("new port: %d %+v", code, body)
	}
	if !refused(first) {
		t.Errorf("the old port still answers")
	}

	renumbered := nodeWithIP("a1", "zone-a", "10.250.0.9")
	tr.NodeChanged(n, renumbered)
	a.Apply(tr.Drain())
	third := ll.addr("10.250.0.9:32101")
	if third == "" {
		t.Fatalf("no health check on the node's new address: %v", ll.served)
	}
	if code, body, _ := check(t, third); code != http.StatusOK || body.LocalEndpoints != 1 {
		t.Errorf("new address: %d %+v", code, body)
	}
	if !refused(second) {
		t.Errorf("the old address still answers")
	}
}

// TestHealthChecksRetry: when one address cannot be listened on, the
// health check serves on none (the listeners opened are closed, so a load
// balancer sees the node fail as a whole), and the next Set with the same
// check tries again.
func TestHealthChecksRetry(t *testing.T) {
	ll := &loopbackListens{served: map[string]string{}}
	failing := map[string]bool{"10.250.0.3:32100": true}
	hcs := &HealthChecks{Listen: func(network, addr string) (net.Listener, error) {
		if failing[addr] {
			return nil, fmt.Errorf("listen %s: address in use", addr)
		}
		return ll.listen(network, addr)
	}}
	t.Cleanup(hcs.Close)
	nn := types.NamespacedName{Namespace: "default", Name: "lb"}
	addrs := []netip.Addr{netip.MustParseAddr("10.250.0.2"), netip.MustParseAddr("10.250.0.3")}
	hc := topology.HealthCheck{Port: 32100, LocalEndpoints: 2}

	hcs.Set(nn, hc, addrs)
	opened := ll.addr("10.250.0.2:32100")
	if opened == "" {
		t.Fatalf("the first address was never listened on: %v", ll.served)
	}
	if !refused(opened) {
		t.Errorf("the first address answers although the second failed")
	}

	delete(failing, "10.250.0.3:32100")
	hcs.Set(nn, hc, addrs)
	for _, asked := range []string{"10.250.0.2:32100", "10.250.0.3:32100"} {
		served := ll.addr(asked)
		if served == "" {
			t.Errorf("%s not listened on again by the retry: %v", asked, ll.served)
			continue
		}
		if code, body, _ := check(t, served); code != http.StatusOK || body.LocalEndpoints != 2 {
			t.Errorf("%s after the retry: %d %+v", asked, code, body)
		}
	}
}
