package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/tools/testbed"
)

// The dashboard and the alert rules under deploy/.
const (
	dashboardFile = "deploy/grafana/topolb.json"
	rulesFile     = "deploy/prometheus/topolb-rules.yaml"
	rulesTestFile = "deploy/prometheus/topolb-rules.test.yaml"
)

// requireProgram returns the path of a program on $PATH, and otherwise
// skips t, or fails it under TOPOLB_KUBE_REQUIRED (make test, which
// installs it first).
func requireProgram(t testing.TB, name, how string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv(kubetest.EnvRequired) != "" {
			t.Fatalf("%s: %v (%s; %s is set)", name, err, how, kubetest.EnvRequired)
		}
		t.Skipf("%s: %v (%s)", name, err, how)
	}
	return path
}

// repoFile is the path of a file of the repository.
func repoFile(t testing.TB, rel string) string {
	t.Helper()
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, rel)
}

// alertRule is one rule of deploy/prometheus's rule file.
type alertRule struct {
	Alert string `json:"alert"`
	Expr  string `json:"expr"`
}

// alertRules reads the rule file's alerts.
func alertRules(t testing.TB) []alertRule {
	t.Helper()
	data, err := os.ReadFile(repoFile(t, rulesFile))
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Groups []struct {
			Rules []alertRule `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(data, &f); err != nil {
		t.Fatalf("%s: %v", rulesFile, err)
	}
	var rules []alertRule
	for _, g := range f.Groups {
		rules = append(rules, g.Rules...)
	}
	if len(rules) == 0 {
		t.Fatalf("%s has no rules", rulesFile)
	}
	return rules
}

// splitComparison splits an alert expression MEASURE > THRESHOLD at its
// last comparison outside parentheses, braces, brackets and strings.
func splitComparison(expr string) (measure string, ok bool) {
	depth, inString := 0, false
	at := -1
	for i := 0; i < len(expr); i++ {
		switch c := expr[i]; {
		case c == '"':
			inString = !inString
		case inString:
			if c == '\\' {
				i++
			}
		case strings.ContainsRune("({[", rune(c)):
			depth++
		case strings.ContainsRune(")}]", rune(c)):
			depth--
		case depth == 0 && strings.HasPrefix(expr[i:], " > "):
			at = i
		}
	}
	if at < 0 {
		return "", false
	}
	if _, err := strconv.ParseFloat(strings.TrimSpace(expr[at+3:]), 64); err != nil {
		return "", false
	}
	return strings.TrimSpace(expr[:at]), true
}

// TestAlertRules checks the alert rules with promtool (check rules) and
// runs their unit tests (test rules), and requires a unit test in which
// each alert fires, and each expression of the form MEASURE > THRESHOLD
// (which TestMonitoring relies on).
func TestAlertRules(t *testing.T) {
	promtool := requireProgram(t, "promtool", "Debian's package prometheus; make deps installs it")
	for _, args := range [][]string{{"check", "rules", filepath.Base(rulesFile)}, {"test", "rules", filepath.Base(rulesTestFile)}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = filepath.Dir(repoFile(t, rulesFile))
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
			continue
		}
		t.Logf("promtool %s:\n%s", strings.Join(args, " "), out)
	}

	data, err := os.ReadFile(repoFile(t, rulesTestFile))
	if err != nil {
		t.Fatal(err)
	}
	var tests struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string           `json:"alertname"`
				ExpAlerts []map[string]any `json:"exp_alerts"`
			} `json:"alert_rule_test"`
		} `json:"tests"`
	}
	if err := yaml.Unmarshal(data, &tests); err != nil {
		t.Fatalf("%s: %v", rulesTestFile, err)
	}
	fires := map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			}
		}
	}
	for _, r := range alertRules(t) {
		if r.Alert == "" {
			continue
		}
		if !fires[r.Alert] {
			t.Errorf("%s: no unit test in %s in which it fires", r.Alert, rulesTestFile)
		}
		if _, ok := splitComparison(r.Expr); !ok {
			t.Errorf("%s: expression %q is not MEASURE > THRESHOLD", r.Alert, r.Expr)
		}
	}
}

// dashboardQueries returns every query of the Grafana dashboard, by panel
// title and query id.
func dashboardQueries(t testing.TB) map[string]string {
	t.Helper()
	data, err := os.ReadFile(repoFile(t, dashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	type target struct {
		Expr  string `json:"expr"`
		RefID string `json:"refId"`
	}
	type panel struct {
		Title   string   `json:"title"`
		Targets []target `json:"targets"`
		Panels  []panel  `json:"panels"`
	}
	var d struct {
		Panels     []panel `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	qs := map[string]string{}
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				if tg.Expr == "" {
					t.Errorf("%s: panel %q query %s has no expression", dashboardFile, p.Title, tg.RefID)
					continue
				}
				qs[p.Title+" "+tg.RefID] = tg.Expr
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	if len(qs) < 10 {
		t.Fatalf("%s: %d queries, expected the whole dashboard", dashboardFile, len(qs))
	}
	return qs
}

// grafanaVars replaces the dashboard's variables with what Grafana would
// send for "all nodes" and a short range.
var grafanaVars = strings.NewReplacer(`$instance`, `.*`, `$__rate_interval`, `10s`)

// prometheus is a Prometheus server the test started.
type prometheus struct {
	url string
}

// startPrometheus runs Prometheus on a free port of 127.0.0.1, scraping
// targets (address → instance label) every second and evaluating
// deploy/prometheus's rules every second, until the test ends.
func startPrometheus(t *testing.T, bin string, targets map[string]string) *prometheus {
	t.Helper()
	dir := t.TempDir()
	type staticConfig struct {
		Targets []string          `json:"targets"`
		Labels  map[string]string `json:"labels"`
	}
	var statics []staticConfig
	for addr, instance := range targets {
		statics = append(statics, staticConfig{Targets: []string{addr}, Labels: map[string]string{"instance": instance}})
	}
	cfg := map[string]any{
		"global":     map[string]any{"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
		"rule_files": []string{repoFile(t, rulesFile)},
		"scrape_configs": []any{map[string]any{
			"job_name":       "topolb",
			"static_configs": statics,
		}},
	}
	data, err := yaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, data, 0o644); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	logPath := filepath.Join(dir, "prometheus.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config.file="+cfgPath, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		if err := cmd.Process.Signal(os.Interrupt); err == nil {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				cmd.Process.Kill()
				<-done
			}
		}
		logf.Close()
		if t.Failed() {
			if log, err := os.ReadFile(logPath); err == nil {
				t.Logf("prometheus log:\n%s", log)
			}
		}
	})
	p := &prometheus{url: "http://" + addr}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(p.url + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		select {
		case err := <-done:
			log, _ := os.ReadFile(logPath)
			t.Fatalf("prometheus exited: %v\n%s", err, log)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("prometheus not ready after 30 s: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// apiResponse is the envelope of Prometheus' HTTP API.
type apiResponse struct {
	Status string          `json:"status"`
	Error  string          `json:"error"`
	Data   json.RawMessage `json:"data"`
}

// get calls an API path and decodes its data into out.
func (p *prometheus) get(ctx context.Context, path string, q url.Values, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.url+path+"?"+q.Encode(), nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var r apiResponse
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return fmt.Errorf("%s: status %d: %w", path, resp.StatusCode, err)
	}
	if r.Status != "success" {
		return fmt.Errorf("%s: %s", path, r.Error)
	}
	return json.Unmarshal(r.Data, out)
}

// series evaluates expr over [from, now] at a 1 s step and returns how
// many series it gave.
func (p *prometheus) series(ctx context.Context, expr string, from time.Time) (int, error) {
	var data struct {
		Result []json.RawMessage `json:"result"`
	}
	now := time.Now()
	q := url.Values{"query": {expr}, "start": {strconv.FormatInt(from.Unix(), 10)}, "end": {strconv.FormatInt(now.Unix(), 10)}, "step": {"1"}}
	if err := p.get(ctx, "/api/v1/query_range", q, &data); err != nil {
		return 0, err
	}
	return len(data.Result), nil
}

// serveMetrics relays each agent's /metrics, which it serves on its
// node's loopback address, to a port of the test's 127.0.0.1, where
// Prometheus scrapes it; it returns address → node name.
func serveMetrics(t *testing.T, agents []*testbed.Agent) map[string]string {
	t.Helper()
	targets := map[string]string{}
	for _, a := range agents {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, err := a.Metrics(r.Context())
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
			fmt.Fprint(w, body)
		})}
		go srv.Serve(l)
		t.Cleanup(func() { srv.Close() })
		targets[l.Addr().String()] = a.Node.Name
	}
	return targets
}

// monitoringSpec is the every-node testbed (a client on every node) with
// an outside client that enters at node-b1.
func monitoringSpec(t *testing.T) *testbed.Spec {
	t.Helper()
	data, err := os.ReadFile(repoFile(t, "tools/testbed/examples/every-node.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	spec, err := testbed.ParseSpec(append(data, "\noutside: {ingressNode: node-b1, clients: [{name: ext1}]}\n"...))
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// TestMonitoring runs Debian's Prometheus against agents on the testbed,
// served by a real kube-apiserver, and sends traffic that gives every
// panel something to show: a zone-weighted Service from a client on every
// node (zone × zone flow shares, per-frontend rates), an outside client
// through node-b1's NodePort to backends on node-b1 and node-b2 (SNAT
// ports), and to a load-balancer IP whose source ranges exclude it
// (source range drops); and deletes a backend slot behind node-a1's agent,
// which must repair it and count the repair. Then every query of the Grafana dashboard must
// evaluate without error and return series over the test's time; every
// alert rule must be healthy in Prometheus' own evaluation, and its
// measure (the expression without its threshold) must return series.
func TestMonitoring(t *testing.T) {
	requireRoot(t)
	promBin := requireProgram(t, "prometheus", "Debian's package prometheus; make deps installs it")
	bin := requireAgent(t)
	spec := monitoringSpec(t)
	tb := newTestbed(t, spec)
	// Sweeps and verifications every second or two, so conntrack and
	// SNAT figures and drift counters reach Prometheus within the test.
	agents := startAgentsOnAPIServer(t, tb, testbed.AgentOptions{Binary: bin, Args: []string{"--conntrack-sweep-interval=1s", "--verify-interval=2s"}})
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	start := time.Now()
	prom := startPrometheus(t, promBin, serveMetrics(t, agents))

	weighted := spec.Services[0]
	weighted.Name, weighted.ClusterIP, weighted.Hints = "weighted", "", testbed.HintsNone
	weighted.Annotations = map[string]string{"topolb.io/zone-weighted": "true"}
	weighted.Endpoints = nil
	for _, p := range []string{"web-a1", "web-a2", "web-a3", "web-b1", "web-b2", "web-c1"} {
		weighted.Endpoints = append(weighted.Endpoints, testbed.EndpointSpec{Pod: p})
	}
	lbRanges := netip.MustParseAddr("198.51.100.9")
	svcs := []testbed.ServiceSpec{
		weighted,
		{Name: "np", Type: v1.ServiceTypeNodePort, Hints: testbed.HintsZone, Ports: nsPorts,
			Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-a2"}, {Pod: "web-b1"}, {Pod: "web-b2"}, {Pod: "web-c1"}}},
		{Name: "lb-ranges", Type: v1.ServiceTypeLoadBalancer, LoadBalancerIPs: []string{lbRanges.String()},
			LoadBalancerSourceRanges: []string{"192.0.2.1/32"}, Ports: []testbed.PortSpec{{Name: "http", Port: 80}},
			Endpoints: []testbed.EndpointSpec{{Pod: "web-b1"}}},
	}
	apply(t, tb, svcs)

	for _, client := range tb.Clients() {
		if _, err := tb.Measure(ctx, client, "weighted", testbed.MeasureOptions{Requests: 60, Parallel: 8}); err != nil {
			t.Fatal(err)
		}
	}
	ext := tb.External("ext1")
	landings, err := tb.MeasureNodePort(ctx, ext, "node-b1", "np", testbed.MeasureOptions{Requests: 60})
	if err != nil {
		t.Fatal(err)
	}
	checkLandings(t, landings, nil)
	refusedCtx, cancelRefused := context.WithTimeout(ctx, 500*time.Millisecond)
	if _, err := ext.Request(refusedCtx, v1.ProtocolTCP, netip.AddrPortFrom(lbRanges, 80)); err == nil {
		t.Error("ext1 reached a load-balancer IP whose source ranges exclude it")
	}
	cancelRefused()

	// Drift: a backend slot of node-a1 deleted behind its agent's back,
	// which its next verification (every 2 s) repairs and counts.
	deleteOneSlot(t, tb.BPFFS("node-a1"))
	repaired := `sum(topolb_datapath_drift_repaired_total{instance="node-a1"}) > 0`

	// Every query must find series; the figures of the last sweep and
	// scrape may take a few seconds to arrive.
	queries := dashboardQueries(t)
	measures := map[string]string{}
	for _, r := range alertRules(t) {
		if m, ok := splitComparison(r.Expr); ok {
			measures[r.Alert] = m
		}
	}
	missing := func() map[string]error {
		out := map[string]error{}
		check := func(name, expr string) {
			n, err := prom.series(ctx, expr, start)
			if err == nil && n == 0 {
				err = fmt.Errorf("no series: %s", expr)
			}
			if err != nil {
				out[name] = err
			}
		}
		for name, q := range queries {
			check("dashboard "+name, grafanaVars.Replace(q))
		}
		for name, m := range measures {
			check("alert "+name, m)
		}
		check("the drift repair on node-a1", repaired)
		return out
	}
	var left map[string]error
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Second) {
		if left = missing(); len(left) == 0 || time.Now().After(deadline) {
			break
		}
	}
	for name, err := range left {
		t.Errorf("%s: %v", name, err)
	}
	total := len(queries) + len(measures) + 1
	t.Logf("%d of %d dashboard queries, alert measures and the drift check returned series", total-len(left), total)

	// Prometheus' own evaluation of the rules: every one healthy, and
	// every alert expression evaluates as a query too.
	var rules struct {
		Groups []struct {
			Rules []struct {
				Name           string    `json:"name"`
				Health         string    `json:"health"`
				LastError      string    `json:"lastError"`
				LastEvaluation time.Time `json:"lastEvaluation"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := prom.get(ctx, "/api/v1/rules", nil, &rules); err != nil {
		t.Fatal(err)
	}
	evaluated := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			evaluated++
			if r.Health != "ok" || r.LastError != "" || r.LastEvaluation.Before(start) {
				t.Errorf("rule %s: health %q, last error %q, last evaluated %v", r.Name, r.Health, r.LastError, r.LastEvaluation)
			}
		}
	}
	if want := len(alertRules(t)); evaluated != want {
		t.Errorf("prometheus evaluates %d rules, the rule file has %d", evaluated, want)
	}
	for _, r := range alertRules(t) {
		if _, err := prom.series(ctx, r.Expr, start); err != nil {
			t.Errorf("alert %s: %v", r.Alert, err)
		}
	}
	// A healthy testbed fires none of them.
	var alerts struct {
		Alerts []struct {
			Labels map[string]string `json:"labels"`
			State  string            `json:"state"`
		} `json:"alerts"`
	}
	if err := prom.get(ctx, "/api/v1/alerts", nil, &alerts); err != nil {
		t.Fatal(err)
	}
	for _, a := range alerts.Alerts {
		t.Errorf("alert %s is %s on a healthy testbed: %v", a.Labels["alertname"], a.State, a.Labels)
	}
}

// deleteOneSlot deletes one entry of the backend slots map pinned in
// pinDir.
func deleteOneSlot(t *testing.T, pinDir string) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "tlb_backends"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var k, v []byte
	it := m.Iterate()
	if !it.Next(&k, &v) {
		t.Fatalf("no backend slot in %s to delete: %v", pinDir, it.Err())
	}
	if err := m.Delete(k); err != nil {
		t.Fatal(err)
	}
}

// metricName matches the topolb metrics an expression refers to, and
// those agent/metrics.go defines.
var metricName = regexp.MustCompile(`topolb_[a-z_]+`)

// TestMonitoringMetricNames: every metric the dashboard and the alert
// rules refer to is one agent/metrics.go defines (a histogram's by its
// _bucket series). TestMonitoring checks the same on live agents; this
// runs without root.
func TestMonitoringMetricNames(t *testing.T) {
	src, err := os.ReadFile(repoFile(t, "agent/metrics.go"))
	if err != nil {
		t.Fatal(err)
	}
	defined := map[string]bool{}
	for _, m := range regexp.MustCompile(`"(topolb_[a-z_]+)"`).FindAllSubmatch(src, -1) {
		defined[string(m[1])] = true
	}
	used := map[string]string{}
	for name, q := range dashboardQueries(t) {
		for _, m := range metricName.FindAllString(q, -1) {
			used[m] = "dashboard " + name
		}
	}
	for _, r := range alertRules(t) {
		for _, m := range metricName.FindAllString(r.Expr, -1) {
			used[m] = "alert " + r.Alert
		}
	}
	for m, where := range used {
		if !defined[strings.TrimSuffix(m, "_bucket")] {
			t.Errorf("%s: %s is not a metric of agent/metrics.go", where, m)
		}
	}
}
