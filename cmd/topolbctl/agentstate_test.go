package main

import (
	"bytes"
	"errors"
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
type memDP map[dpmaps.Frontend]dpmaps.Service

func (m memDP) SetService(fe dpmaps.Frontend, s dpmaps.Service) (int, error) {
	m[fe] = s
	return 1, nil
}
func (m memDP) DeleteFrontend(fe dpmaps.Frontend) (int, error) { delete(m, fe); return 1, nil }
func (m memDP) Services() map[dpmaps.Frontend]dpmaps.Service {
	return maps.Clone(map[dpmaps.Frontend]dpmaps.Service(m))
}

// Uplinks: the in-memory datapath has none.
func (m memDP) Uplinks() ([]dpmaps.UplinkStatus, error) { return nil, nil }

// Kernel: the in-memory datapath has no kernel to probe.
func (m memDP) Kernel() dpmaps.KernelReport { return dpmaps.KernelReport{} }

// IPv6: the in-memory datapath answers as maps.Datapath does.
func (m memDP) IPv6(scope dpmaps.Scope) bool { return dpmaps.ServesIPv6(scope) }

// Programmed hands the services back as the kernel would hold them.
func (m memDP) Programmed() (map[dpmaps.Frontend]dpmaps.ProgrammedService, error) {
	out := map[dpmaps.Frontend]dpmaps.ProgrammedService{}
	for fe, s := range m {
		ps := dpmaps.ProgrammedService{Affinity: s.Affinity, Reject: s.Reject, SourceRanges: s.SourceRanges, SourceRangesNode: s.SourceRangesNode}
		for _, b := range s.Backends {
			ps.Backends = append(ps.Backends, dpmaps.ProgrammedBackend{Backend: b})
		}
		out[fe] = ps
	}
	return out, nil
}

// serveAgent runs a real agent for node-a1 over the manifest at path,
// programming dp, and serves its health handler until the test ends; it
// returns the handler's URL.
func serveAgent(t *testing.T, path string, dp agent.Datapath) string {
	t.Helper()
	a := agent.New(agent.Config{NodeName: "node-a1", Options: topology.DefaultOptions()}, dp)
	tr := kube.NewTracker()
	w := &kube.FileWatcher{Path: path, Tracker: tr}
	if err := w.Load(); err != nil {
		t.Fatal(err)
	}
	a.Apply(tr.Drain())
	srv := httptest.NewServer(a.HealthHandler())
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestExplainAgent runs a real agent over testdata/cluster.yaml, serves its
// health handler, and checks `explain --agent` shows its decisions and maps,
// and flags a frontend whose programmed backends differ from the decision.
func TestExplainAgent(t *testing.T) {
	dp := memDP{}
	url := serveAgent(t, "testdata/cluster.yaml", dp)

	var stdout, stderr bytes.Buffer
	if code := run([]string{"explain", "--agent", url}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{
		"default/web  http/TCP  IPv4    Hints         PreferSameZone",
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
	dp[fe] = dpmaps.Service{Backends: []dpmaps.Backend{{Addr: netip.MustParseAddrPort("10.244.3.9:8080")}}}
	stdout.Reset()
	if code := run([]string{"explain", "--agent", url, "--service", "default/web"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "10.96.0.10:80/TCP -> [10.244.3.9:8080]   MISMATCH: decided [10.244.1.5:8080 10.244.2.7:8080]") {
		t.Errorf("mismatch not flagged:\n%s", stdout.String())
	}
	if strings.Contains(stdout.String(), "default/api") {
		t.Errorf("--service filter ignored:\n%s", stdout.String())
	}

	// A frontend deleted behind the agent's back is decided but missing.
	delete(dp, fe)
	stdout.Reset()
	if code := run([]string{"explain", "--agent", url, "--service", "default/web"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "10.96.0.10:80/TCP -> []   MISSING: decided but not in the maps") {
		t.Errorf("missing frontend not flagged:\n%s", stdout.String())
	}

	// An agent that is not there is an error, not an empty table.
	if code := run([]string{"explain", "--agent", "127.0.0.1:1"}, &stdout, &stderr); code == 0 {
		t.Errorf("unreachable agent: exit 0")
	}
}

// uplinkDP is memDP with uplinks, or an error reading them.
type uplinkDP struct {
	memDP
	ups    []dpmaps.UplinkStatus
	err    error
	kernel dpmaps.KernelReport
}

func (u uplinkDP) Uplinks() ([]dpmaps.UplinkStatus, error) { return u.ups, u.err }
func (u uplinkDP) Kernel() dpmaps.KernelReport             { return u.kernel }

// TestExplainAgentUplinks: the uplinks and their paths follow the maps,
// as the agent read them back, or why they could not be read; the
// kernel's features as the datapath probed them.
func TestExplainAgentUplinks(t *testing.T) {
	for _, c := range []struct {
		name string
		dp   uplinkDP
		want []string
	}{
		{"paths", uplinkDP{memDP: memDP{}, ups: []dpmaps.UplinkStatus{
			{Interface: "eth0", Path: "tc", Programs: []string{"tc_uplink_lb", "tc_lb_egress"}, Reason: "veth peer veth1 has no native XDP program"},
			{Interface: "eth1", Path: "xdp", Programs: []string{"xdp_lb/driver", "tc_uplink", "tc_lb_egress"}},
		}}, []string{
			"uplinks, read back from the kernel",
			"INTERFACE  PATH  PROGRAMS                              REASON",
			"eth0       tc    tc_uplink_lb tc_lb_egress             veth peer veth1 has no native XDP program",
			"eth1       xdp   xdp_lb/driver tc_uplink tc_lb_egress  -",
		}},
		{"error", uplinkDP{memDP: memDP{}, err: errors.New("load pinned link: permission denied")}, []string{
			"uplinks: cannot be read: load pinned link: permission denied",
		}},
		{"kernel", uplinkDP{memDP: memDP{}, kernel: dpmaps.KernelReport{Release: "6.1.0-50-amd64", Features: []dpmaps.KernelFeature{
			{Name: "BPF_FIB_LOOKUP_SRC", Since: "6.7", Without: "flows dropped"},
			{Name: "tcx links", Since: "6.6", Present: false, Without: "clsact filters", Path: "tc"},
		}}}, []string{
			"kernel 6.1.0-50-amd64, probed at load",
			"FEATURE             SINCE  PRESENT  PATH  WITHOUT IT",
			"BPF_FIB_LOOKUP_SRC  6.7    no       -     flows dropped",
			"tcx links           6.6    no       tc    clsact filters",
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := agent.New(agent.Config{NodeName: "node-a1", Options: topology.DefaultOptions()}, c.dp)
			srv := httptest.NewServer(a.HealthHandler())
			defer srv.Close()
			var stdout, stderr bytes.Buffer
			if code := run([]string{"explain", "--agent", srv.URL}, &stdout, &stderr); code != 0 {
				t.Fatalf("exit %d: %s", code, stderr.String())
			}
			for _, want := range c.want {
				if !strings.Contains(stdout.String(), want) {
					t.Errorf("output lacks %q:\n%s", want, stdout.String())
				}
			}
		})
	}
}

// TestExplainAgentRefusesOtherInputs: with --agent, the flags that select
// another node or other inputs would be ignored; they are refused instead.
func TestExplainAgentRefusesOtherInputs(t *testing.T) {
	for _, flag := range [][]string{
		{"--node", "node-b1"},
		{"--from-file", "testdata/cluster.yaml"},
		{"--kubeconfig", "/dev/null"},
		{"--nodeport-addresses", "10.0.0.0/8"},
		{"--service-node-port-range", "30000-30100"},
	} {
		var stdout, stderr bytes.Buffer
		args := append([]string{"explain", "--agent", "127.0.0.1:1"}, flag...)
		code := run(args, &stdout, &stderr)
		if code == 0 || !strings.Contains(stderr.String(), flag[0]+" does not apply with --agent") {
			t.Errorf("%v: exit %d, stderr %q; want a usage error naming %s", args, code, stderr.String(), flag[0])
		}
	}
}

// TestExplainAgentSourceRanges: explain --agent shows no mismatch while the
// maps hold the decided source ranges of testdata/frontends.yaml's
// load-balancer IP, and flags one when they hold others.
func TestExplainAgentSourceRanges(t *testing.T) {
	dp := memDP{}
	url := serveAgent(t, "testdata/frontends.yaml", dp)
	explain := func() string {
		t.Helper()
		var stdout, stderr bytes.Buffer
		if code := run([]string{"explain", "--agent", url, "--service", "default/web"}, &stdout, &stderr); code != 0 {
			t.Fatalf("exit %d: %s", code, stderr.String())
		}
		return stdout.String()
	}
	if out := explain(); strings.Contains(out, "MISMATCH") || !strings.Contains(out, "203.0.113.0/24 192.0.2.0/25") {
		t.Errorf("want the ranges listed and no mismatch:\n%s", out)
	}
	fe := dpmaps.Frontend{Addr: netip.MustParseAddrPort("198.51.100.20:80"), Proto: dpmaps.TCP, Scope: dpmaps.ScopeExternal}
	s, ok := dp[fe]
	if !ok || len(s.SourceRanges) != 2 {
		t.Fatalf("%s programmed %+v (%v), want two source ranges", fe, s, ok)
	}
	s.SourceRanges = s.SourceRanges[:1]
	dp[fe] = s
	if out := explain(); !strings.Contains(out, "MISMATCH: source ranges [203.0.113.0/24] (node passes: false), decided [192.0.2.0/25 203.0.113.0/24] (false)") {
		t.Errorf("a lost range not flagged:\n%s", out)
	}
}

// TestExplainAgentDualStack: `explain --agent` shows a dual-stack Service
// in both families and the families programmed per scope, and marks the
// IPv6 frontends the agent decided but does not program (its datapath
// serves IPv6 on pods and host processes only, while
// maps.UplinksServeIPv6 is false) as such, not as missing.
func TestExplainAgentDualStack(t *testing.T) {
	url := serveAgent(t, "testdata/dual-stack.yaml", memDP{})
	var stdout, stderr bytes.Buffer
	if code := run([]string{"explain", "--agent", url}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	out := stdout.String()
	wants := []string{
		"default/web  http/TCP  IPv4",
		"default/web  http/TCP  IPv6",
		"10.96.0.10:80/TCP -> [10.244.1.5:8080]\n",
		"[fd00:10:96::10]:80/TCP -> [[fd00:244:1::5]:8080]\n",
		"[fd00:250::2]:30080/TCP -> [[fd00:244:1::5]:8080]\n",
		"10.250.0.2:30080/TCP/external -> [10.244.1.5:8080]\n",
	}
	if dpmaps.UplinksServeIPv6 {
		wants = append(wants, "families programmed: internal: IPv4 IPv6; external: IPv4 IPv6)",
			"[fd00:250::2]:30080/TCP/external -> [[fd00:244:1::5]:8080]\n")
	} else {
		wants = append(wants, "families programmed: internal: IPv4 IPv6; external: IPv4)",
			"[fd00:250::2]:30080/TCP/external -> []   (decided, not programmed: the agent's datapath does not serve IPv6 in scope external)")
	}
	for _, want := range wants {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "MISSING") {
		t.Errorf("an IPv6 frontend the agent does not program is reported missing:\n%s", out)
	}
}
