package main

import (
	"bytes"
	"maps"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	"github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/kube"
	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// memDP is an in-memory datapath for a real agent.
type memDP map[dpmaps.Frontend][]dpmaps.Backend

func (m memDP) SetBackends(fe dpmaps.Frontend, bes []dpmaps.Backend) (int, error) {
	m[fe] = bes
	return 1, nil
}
func (m memDP) DeleteFrontend(fe dpmaps.Frontend) (int, error) { delete(m, fe); return 1, nil }
func (m memDP) Frontends() map[dpmaps.Frontend][]dpmaps.Backend {
	return maps.Clone(map[dpmaps.Frontend][]dpmaps.Backend(m))
}

// TestExplainAgent runs a real agent over testdata/cluster.yaml, serves its
// health handler, and checks `explain --agent` shows its decisions and maps,
// and flags a frontend whose programmed backends differ from the decision.
func TestExplainAgent(t *testing.T) {
	dp := memDP{}
	a := agent.New(agent.Config{NodeName: "node-a1", Options: topology.DefaultOptions()}, dp)
	tr := kube.NewTracker()
	w := &kube.FileWatcher{Path: "testdata/cluster.yaml", Tracker: tr}
	if err := w.Load(); err != nil {
		t.Fatal(err)
	}
	a.Apply(tr.Drain())
	srv := httptest.NewServer(a.HealthHandler())
	defer srv.Close()

	var stdout, stderr bytes.Buffer
	if code := run([]string{"explain", "--agent", srv.URL}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{
		"default/web  http/TCP  Hints         PreferSameZone",
		"10.96.0.10:80/TCP -> [10.244.1.5:8080 10.244.2.7:8080]",
		"first sync written: true",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "MISMATCH") {
		t.Errorf("unexpected mismatch:\n%s", out)
	}

	// Something else rewrote the map behind the agent's back.
	fe := dpmaps.Frontend{Addr: netip.MustParseAddrPort("10.96.0.10:80"), Proto: dpmaps.TCP}
	dp[fe] = []dpmaps.Backend{{Addr: netip.MustParseAddrPort("10.244.3.9:8080")}}
	stdout.Reset()
	if code := run([]string{"explain", "--agent", srv.URL, "--service", "default/web"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "10.96.0.10:80/TCP -> [10.244.3.9:8080]   MISMATCH: decided [10.244.1.5:8080 10.244.2.7:8080]") {
		t.Errorf("mismatch not flagged:\n%s", stdout.String())
	}
	if strings.Contains(stdout.String(), "default/api") {
		t.Errorf("--service filter ignored:\n%s", stdout.String())
	}

	// An agent that is not there is an error, not an empty table.
	if code := run([]string{"explain", "--agent", "127.0.0.1:1"}, &stdout, &stderr); code == 0 {
		t.Errorf("unreachable agent: exit 0")
	}
}
