package agent

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// getProxyHealth fetches path from the proxy health server and returns the
// status code and the body as generic JSON, checking kube-proxy's headers.
func getProxyHealth(t *testing.T, url, path string) (int, map[string]any) {
	t.Helper()
	resp, err := http.Get(url + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if ct, nosniff := resp.Header.Get("Content-Type"), resp.Header.Get("X-Content-Type-Options"); ct != "application/json" || nosniff != "nosniff" {
		t.Errorf("%s: Content-Type %q, X-Content-Type-Options %q", path, ct, nosniff)
	}
	var out map[string]any
	if err := json.Unmarshal(body, &out); err != nil {
		t.Fatalf("%s: body is not JSON: %v: %s", path, err, body)
	}
	return resp.StatusCode, out
}

// TestProxyHealthServer: /healthz and /livez with kube-proxy's semantics,
// status codes and fields, through the agent's own sync (Apply) of this
// node's versions: /healthz is 503 while the node is unknown, being deleted
// or tainted by the cluster autoscaler, /livez only follows the sync loop,
// and a change waiting past the timeout fails both.
func TestProxyHealthServer(t *testing.T) {
	now := metav1.Now()
	tainted := node("a1", "zone-a")
	tainted.Spec.Taints = []v1.Taint{{Key: topology.ToBeDeletedTaint, Value: "1700000000", Effect: v1.TaintEffectNoSchedule}}
	deleting := node("a1", "zone-a")
	deleting.DeletionTimestamp = &now
	otherTaint := node("a1", "zone-a")
	otherTaint.Spec.Taints = []v1.Taint{{Key: "node.kubernetes.io/unschedulable", Effect: v1.TaintEffectNoSchedule}}
	cases := []struct {
		name string
		// self is this node's version; nil: never seen.
		self *v1.Node
		// stuck leaves a change waiting past the health timeout.
		stuck            bool
		healthz, livez   int
		eligible, health bool
	}{
		{name: "eligible and in sync", self: node("a1", "zone-a"), healthz: 200, livez: 200, eligible: true, health: true},
		{name: "other taints do not matter", self: otherTaint, healthz: 200, livez: 200, eligible: true, health: true},
		{name: "node not known", self: nil, healthz: 503, livez: 200, eligible: false, health: true},
		{name: "tainted ToBeDeletedByClusterAutoscaler", self: tainted, healthz: 503, livez: 200, eligible: false, health: true},
		{name: "being deleted", self: deleting, healthz: 503, livez: 200, eligible: false, health: true},
		{name: "sync loop behind", self: node("a1", "zone-a"), stuck: true, healthz: 503, livez: 503, eligible: true, health: false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), HealthTimeout: time.Minute}, newFakeDP())
			skew := time.Duration(0)
			a.now = func() time.Time { return time.Now().Add(skew) }
			tr := kube.NewTracker()
			a.live.watch(tr)
			tr.NodeChanged(nil, node("b1", "zone-b"))
			if tc.self != nil {
				tr.NodeChanged(nil, tc.self)
			}
			tr.Resync()
			a.Apply(tr.Drain())
			if tc.stuck {
				tr.ServiceChanged(nil, service("web", "10.96.0.1", nil))
				skew = 2 * time.Minute
			}
			srv := httptest.NewServer(a.ProxyHealthHandler())
			defer srv.Close()

			code, body := getProxyHealth(t, srv.URL, "/healthz")
			if code != tc.healthz || body["healthy"] != tc.health || body["nodeEligible"] != tc.eligible {
				t.Errorf("/healthz: %d %v, want %d healthy=%v nodeEligible=%v", code, body, tc.healthz, tc.health, tc.eligible)
			}
			checkTimes(t, "/healthz", body, code == 200, a.now())
			code, body = getProxyHealth(t, srv.URL, "/livez")
			if _, ok := body["nodeEligible"]; code != tc.livez || body["healthy"] != tc.health || ok {
				t.Errorf("/livez: %d %v, want %d healthy=%v and no nodeEligible", code, body, tc.livez, tc.health)
			}
			checkTimes(t, "/livez", body, code == 200, a.now())
		})
	}
}

// checkTimes checks kube-proxy's time fields: currentTime is now,
// lastUpdated is now when the answer is 200 and the last sync otherwise,
// and status.IPv4 holds the family's health.
func checkTimes(t *testing.T, path string, body map[string]any, ok bool, now time.Time) {
	t.Helper()
	parse := func(field string, v any) time.Time {
		s, _ := v.(string)
		ts, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			t.Errorf("%s: %s %v: %v", path, field, v, err)
		}
		return ts
	}
	current := parse("currentTime", body["currentTime"])
	last := parse("lastUpdated", body["lastUpdated"])
	if d := now.Sub(current); d < 0 || d > 10*time.Second {
		t.Errorf("%s: currentTime %s, now %s", path, current, now)
	}
	status, _ := body["status"].(map[string]any)
	ipv4, _ := status["IPv4"].(map[string]any)
	if ipv4 == nil || ipv4["healthy"] != body["healthy"] {
		t.Errorf("%s: status %v, want IPv4 with healthy=%v", path, body["status"], body["healthy"])
	}
	synced := parse("status.IPv4.lastUpdated", ipv4["lastUpdated"])
	switch {
	case synced.IsZero() || now.Sub(synced) < 0:
		t.Errorf("%s: the last sync %s, want one before now %s", path, synced, now)
	case ok && (last.Before(synced) || now.Sub(last) > 10*time.Second):
		t.Errorf("%s: 200 with lastUpdated %s, want now %s (kube-proxy: recent means healthy)", path, last, now)
	case !ok && !last.Equal(synced):
		t.Errorf("%s: 503 with lastUpdated %s, want the last sync %s", path, last, synced)
	}
}
