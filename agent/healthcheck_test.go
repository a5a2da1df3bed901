package agent

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
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
	if got := fmt.Sprint(hcs.services[types.NamespacedName{Namespace: "default", Name: "lb"}]); got != "<nil>" {
		t.Errorf("health check still registered: %s", got)
	}
}
