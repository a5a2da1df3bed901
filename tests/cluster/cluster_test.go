// Package cluster is topolb's end-to-end suite on a real cluster: real
// kubelets, containerd and CNI, the real EndpointSlice controller's hints,
// topolb deployed from deploy/ as a DaemonSet. `make test-cluster` brings
// up the local cluster of tools/cluster, runs it and tears it down; any
// other cluster with topolb installed and nodes in three zones works too:
//
//	TOPOLB_E2E_KUBECONFIG=path go test ./tests/cluster
//
// Environment: TOPOLB_E2E_ECHO_IMAGE, the test backend's image
// (tools/cluster/echo; default localhost/topolb-echo:dev);
// TOPOLB_E2E_OUTSIDE_NETNS, a network namespace outside the cluster that
// reaches the nodes' InternalIPs (the local cluster's fabric), for
// NodePort tests.
package cluster

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/topolb/topolb/internal/netns"
)

// TestPreferSameZone: the real controller hints every endpoint of a
// PreferSameZone Service for its own zone, and a client in each zone is
// answered only by the backends `topolbctl explain` lists for its node,
// which are exactly the ready endpoints of its zone. Then, under steady load
// from every zone, a rolling restart of the backends and one of topolb's
// agents: no request fails, none is reset.
func TestPreferSameZone(t *testing.T) {
	e := newEnv(t)
	replicas := int32(2 * len(e.zones))
	e.deploy("web", replicas)
	svc := e.service("web", func(s *corev1.Service) {
		s.Spec.TrafficDistribution = ptr.To(corev1.ServiceTrafficDistributionPreferSameZone)
	})
	url := fmt.Sprintf("http://%s/", svc.Spec.ClusterIP)
	clients := e.clients()

	e.poll("every endpoint hinted for its own zone", 60*time.Second, func() error {
		eps, err := e.readyEndpoints("web")
		if err != nil {
			return err
		}
		if len(eps) != int(replicas) {
			return fmt.Errorf("%d ready endpoints, want %d", len(eps), replicas)
		}
		for addr, ep := range eps {
			zone := ptr.Deref(ep.Zone, "")
			if ep.Hints == nil || len(ep.Hints.ForZones) != 1 || ep.Hints.ForZones[0].Name != zone {
				return fmt.Errorf("endpoint %s in zone %q: hints %+v", addr, zone, ep.Hints)
			}
		}
		return nil
	})

	t.Run("lands in its zone", func(t *testing.T) {
		eps, err := e.readyEndpoints("web")
		if err != nil {
			t.Fatal(err)
		}
		for _, zone := range e.zones {
			pod := clients[zone]
			node := e.podNode(pod)
			var want []string
			for addr, ep := range eps {
				if ptr.Deref(ep.Zone, "") == zone {
					want = append(want, net.JoinHostPort(addr, "8080"))
				}
			}
			sort.Strings(want)
			x := e.explain(node, "web")
			got := slices.Sorted(slices.Values(x.Backends))
			if !slices.Equal(got, want) {
				t.Errorf("explain %s (zone %s): backends %v (%s, %s), want the zone's endpoints %v", node, zone, got, x.Mode, x.Reason, want)
			}
			r := e.answeredBy(t, pod, url, want)
			t.Logf("%s on %s (%s): %v", pod, node, zone, r.ByNode)
		}
	})

	// A host-network pod is one of the node's own processes: its
	// connections are balanced by the socket hooks on the node's cgroup
	// v2 root, with the node's decisions.
	t.Run("host network lands in its zone", func(t *testing.T) {
		zone := e.zones[len(e.zones)-1]
		pod := e.hostClient(zone)
		node := e.podNode(pod)
		x := e.explain(node, "web")
		r := e.answeredBy(t, pod, url, x.Backends)
		for n := range r.ByNode {
			if e.zoneOf[n] != zone {
				t.Errorf("%s in %s: answered from %s in %s", pod, zone, n, e.zoneOf[n])
			}
		}
		t.Logf("%s on %s (%s): %v", pod, node, zone, r.ByNode)
	})

	t.Run("rollout restart under load", func(t *testing.T) {
		e.underLoad(t, clients, url, func() error {
			if _, err := e.kubectlRun("rollout", "restart", "deploy/web"); err != nil {
				return err
			}
			_, err := e.kubectlRun("rollout", "status", "deploy/web", "--timeout=120s")
			return err
		})
	})

	// The datapath is pinned: while a node's agent is replaced, its maps
	// keep forwarding, and the new agent adopts them.
	t.Run("agents restarted under load", func(t *testing.T) {
		e.underLoad(t, clients, url, func() error {
			if _, err := e.kubectlRun("-n", "topolb-system", "rollout", "restart", "ds/topolb-agent"); err != nil {
				return err
			}
			_, err := e.kubectlRun("-n", "topolb-system", "rollout", "status", "ds/topolb-agent", "--timeout=180s")
			return err
		})
	})
}

// underLoad runs change while every zone's client makes requests to url,
// one new connection every 20 ms, from 3 s before the change until 5 s
// after it, and requires that none failed or was reset. How long the
// change takes is the cluster's business (a DaemonSet rollout on a loaded
// machine takes longer); the load covers it by construction, up to
// maxLoad.
func (e *env) underLoad(t *testing.T, clients map[string]string, url string, change func() error) {
	const (
		maxLoad = 4 * time.Minute
		before  = 3 * time.Second
		after   = 5 * time.Second
	)
	stopFile := fmt.Sprintf("/tmp/load-stop-%d", time.Now().UnixNano())
	var wg sync.WaitGroup
	results := make([]result, len(e.zones))
	errs := make([]error, len(e.zones))
	for i, zone := range e.zones {
		wg.Go(func() {
			results[i], errs[i] = e.get(clients[zone], url, "-duration", maxLoad.String(), "-stop-file", stopFile, "-interval", "20ms", "-timeout", "3s")
		})
	}
	start := time.Now()
	time.Sleep(before)
	changeErr := change()
	took := time.Since(start) - before
	time.Sleep(after)
	var stopErrs []error
	for _, zone := range e.zones {
		if _, err := e.kubectlRun("exec", clients[zone], "--", "/echo", "stop", "-file", stopFile); err != nil {
			stopErrs = append(stopErrs, err)
		}
	}
	wg.Wait()
	if changeErr != nil {
		t.Fatal(changeErr)
	}
	if err := errors.Join(stopErrs...); err != nil {
		t.Fatalf("ending the load: %v", err)
	}
	if took+before+after > maxLoad {
		t.Errorf("the change took %s, longer than the %s the load can cover", took, maxLoad-before-after)
	}
	for i, zone := range e.zones {
		r := results[i]
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		t.Logf("%s: %d requests, the change took %s: %d failed, %d reset; by node %v", clients[zone], r.Requests, took.Round(time.Second), r.Failed, r.Resets, r.ByNode)
		if r.Requests < 100 || r.Failed > 0 || r.Resets > 0 {
			t.Errorf("%s: %d requests, %d failed, %d reset: %v", clients[zone], r.Requests, r.Failed, r.Resets, r.Errors)
		}
	}
}

// TestHintsRemoved: with topology-mode Auto the controller allocates
// endpoints to zones by their share of allocatable CPU. With fewer
// endpoints than zones it removes every hint, and traffic spreads over all
// endpoints, as `topolbctl explain` says.
func TestHintsRemoved(t *testing.T) {
	e := newEnv(t)
	e.deploy("auto", int32(len(e.zones)))
	svc := e.service("auto", func(s *corev1.Service) {
		s.Annotations = map[string]string{corev1.AnnotationTopologyMode: "Auto"}
	})
	url := fmt.Sprintf("http://%s/", svc.Spec.ClusterIP)
	clients := e.clients()
	// hinted: n ready endpoints, all with zone hints or none.
	hinted := func(want bool, n int) func() error {
		return func() error {
			eps, err := e.readyEndpoints("auto")
			if err != nil {
				return err
			}
			if len(eps) != n {
				return fmt.Errorf("%d ready endpoints, want %d", len(eps), n)
			}
			for addr, ep := range eps {
				if has := ep.Hints != nil && len(ep.Hints.ForZones) > 0; has != want {
					return fmt.Errorf("endpoint %s: hints %+v", addr, ep.Hints)
				}
			}
			return nil
		}
	}
	e.poll("hints on every endpoint", 60*time.Second, hinted(true, len(e.zones)))

	e.scale("auto", int32(len(e.zones)-1))
	e.poll("hints removed", 60*time.Second, hinted(false, len(e.zones)-1))
	eps, err := e.readyEndpoints("auto")
	if err != nil {
		t.Fatal(err)
	}
	var all []string
	for addr := range eps {
		all = append(all, net.JoinHostPort(addr, "8080"))
	}
	sort.Strings(all)
	for _, zone := range e.zones {
		pod := clients[zone]
		x := e.explain(e.podNode(pod), "auto")
		if got := slices.Sorted(slices.Values(x.Backends)); !slices.Equal(got, all) {
			t.Errorf("explain for %s: backends %v (%s), want every endpoint %v", pod, got, x.Reason, all)
		}
		r, err := e.get(pod, url, "-n", "40")
		if err != nil {
			t.Fatal(err)
		}
		if r.Failed > 0 {
			t.Errorf("%s: %d failed: %v", pod, r.Failed, r.Errors)
		}
		for _, b := range all {
			ip, _, _ := net.SplitHostPort(b)
			if r.ByIP[ip] == 0 {
				t.Errorf("%s: no answer from %s in 40 requests (%v): traffic does not spread", pod, ip, r.ByIP)
			}
		}
	}
}

// TestNodePortFromOutside: a NodePort from a client outside the cluster
// (TOPOLB_E2E_OUTSIDE_NETNS, the local cluster's fabric), to a node with a
// local backend: externalTrafficPolicy Local answers from that node only;
// Cluster from a node without a backend reaches one on another node: the
// nodes' uplinks are plain veths (their peers on the fabric bridge have no
// XDP program), where XDP_TX would black-hole the frames, so the agents
// must have chosen the tc path by themselves.
func TestNodePortFromOutside(t *testing.T) {
	outside := os.Getenv("TOPOLB_E2E_OUTSIDE_NETNS")
	if outside == "" {
		t.Skip("no outside network namespace: set TOPOLB_E2E_OUTSIDE_NETNS (make test-cluster does)")
	}
	e := newEnv(t)
	e.deploy("np", 1)
	local := e.service("np-local", func(s *corev1.Service) {
		s.Spec.Selector = map[string]string{"app": "np"}
		s.Spec.Type = corev1.ServiceTypeNodePort
		s.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	})
	cluster := e.service("np-cluster", func(s *corev1.Service) {
		s.Spec.Selector = map[string]string{"app": "np"}
		s.Spec.Type = corev1.ServiceTypeNodePort
	})
	pods, err := e.cs.CoreV1().Pods(e.ns).List(e.ctx(), metav1.ListOptions{LabelSelector: "app=np"})
	if err != nil || len(pods.Items) != 1 {
		t.Fatalf("np pods: %v (%d)", err, len(pods.Items))
	}
	backendNode := pods.Items[0].Spec.NodeName
	var otherNode string
	for n := range e.nodeIP {
		if n != backendNode {
			otherNode = n
			break
		}
	}
	get := func(node string, port int32) error {
		addr := net.JoinHostPort(e.nodeIP[node], fmt.Sprint(port))
		var lastErr error
		for range 10 {
			var body string
			body, lastErr = getFrom(outside, addr)
			if lastErr == nil {
				if !strings.Contains(body, `"node":"`+backendNode+`"`) {
					return fmt.Errorf("%s answered %q, want the backend on %s", addr, body, backendNode)
				}
				return nil
			}
			time.Sleep(time.Second)
		}
		return fmt.Errorf("GET http://%s/ from %s: %w", addr, outside, lastErr)
	}
	t.Run("eTP Local, local backend", func(t *testing.T) {
		if err := get(backendNode, local.Spec.Ports[0].NodePort); err != nil {
			t.Error(err)
		}
	})
	t.Run("eTP Cluster, local backend", func(t *testing.T) {
		if err := get(backendNode, cluster.Spec.Ports[0].NodePort); err != nil {
			t.Error(err)
		}
	})
	t.Run("eTP Cluster, remote backend", func(t *testing.T) {
		if err := get(otherNode, cluster.Spec.Ports[0].NodePort); err != nil {
			t.Error(err)
		}
	})
}

// getFrom makes one HTTP GET to addr on a connection from the network
// namespace ns and returns the body. The connection is dialled on a thread
// in ns (a socket stays in the namespace it was made in); net/http would
// dial on a goroutine of its own, on any thread.
func getFrom(ns, addr string) (string, error) {
	var c net.Conn
	err := netns.RunIn(ns, func() (err error) {
		c, err = net.DialTimeout("tcp", addr, 2*time.Second)
		return err
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(3 * time.Second)); err != nil {
		return "", err
	}
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+"/", nil)
	if err != nil {
		return "", err
	}
	if err := req.Write(c); err != nil {
		return "", err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("GET http://%s/: %s", addr, resp.Status)
	}
	return string(b), err
}
