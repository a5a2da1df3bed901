package main

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

// TestProxyHealthServer runs the agent binary with kube-proxy's default
// --healthz-bind-address (0.0.0.0:10256) and probes it as a cloud load
// balancer does, over the network from another namespace: /healthz is 200
// with nodeEligible true, turns 503 once the manifest taints this node
// ToBeDeletedByClusterAutoscaler, while /livez stays 200, and is 200 again
// when the taint goes.
func TestProxyHealthServer(t *testing.T) {
	b := newBed(t)
	b.start()
	probe := func(path string) (int, map[string]any, error) {
		resp, err := b.client.HTTPClient(2 * time.Second).Get("http://10.1.0.1:10256" + path)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return 0, nil, err
		}
		var out map[string]any
		if err := json.Unmarshal(body, &out); err != nil {
			t.Fatalf("%s: not JSON: %v: %s", path, err, body)
		}
		return resp.StatusCode, out, nil
	}
	waitCode := func(what, path string, code int, eligible any) {
		t.Helper()
		var last string
		waitFor(t, what, func() bool {
			got, body, err := probe(path)
			last = strings.TrimSpace(strings.Join([]string{http.StatusText(got), jsonString(body)}, " "))
			if err != nil {
				last = err.Error()
			}
			return err == nil && got == code && body["nodeEligible"] == eligible
		})
		t.Logf("%s: %s", what, last)
	}
	waitCode("healthz of an eligible node", "/healthz", 200, true)
	waitCode("livez", "/livez", 200, nil)

	tainted := strings.Replace(manifest, "metadata: {name: n1, labels: {topology.kubernetes.io/zone: zone-a}}",
		"metadata: {name: n1, labels: {topology.kubernetes.io/zone: zone-a}}\nspec: {taints: [{key: ToBeDeletedByClusterAutoscaler, value: \"1700000000\", effect: NoSchedule}]}", 1)
	if tainted == manifest {
		t.Fatal("the manifest's node n1 changed: update this test")
	}
	b.writeRaw(tainted, "", "")
	waitCode("healthz of a node tainted by the autoscaler", "/healthz", 503, false)
	if code, body, err := probe("/livez"); err != nil || code != 200 {
		t.Errorf("livez of a tainted node: %d %v %v, want 200 (the sync loop keeps up)", code, body, err)
	}
	b.writeManifest("", "")
	waitCode("healthz once the taint is gone", "/healthz", 200, true)
}

// TestProxyHealthPortTaken: beside kube-proxy, which holds 10256, the
// agent with the default --healthz-bind-address exits with an error that
// names the flag, and with it empty it runs and leaves the port alone.
func TestProxyHealthPortTaken(t *testing.T) {
	b := newBed(t)
	b.node.ServeHTTPName(t, "127.0.0.1:10256", "kube-proxy")
	cmd := b.startUnready()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("the agent exited 0 with its health port taken")
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the agent still runs with its health port taken")
	}
	log, err := os.ReadFile(b.log)
	must(t, err)
	if !strings.Contains(string(log), "--healthz-bind-address") || !strings.Contains(string(log), "address already in use") {
		t.Errorf("the agent's error does not name the flag and the cause:\n%s", log)
	}
	b.start("--healthz-bind-address=")
	if got, err := b.get("127.0.0.1:10256/healthz"); err != nil || got != "kube-proxy" {
		t.Errorf("with --healthz-bind-address empty, 10256 answers %q, %v; want kube-proxy's server untouched", got, err)
	}
}

func jsonString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
