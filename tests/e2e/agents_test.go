package e2e

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// TestAgentRestartUnderLoad sends new TCP and UDP flows from the client,
// in IPv4 and IPv6 at once on one dual-stack testbed, without pause while
// every agent is killed with SIGKILL and started again, and then while the
// client node's agent is stopped with SIGTERM and started again; a change
// made while no agent runs is picked up after the restart. The pinned
// datapath must keep serving throughout, in each family: zero failed
// requests, every answer from a backend the decision permits, both
// permitted backends used, and the restarted agents agreeing with
// DecideNode (decisions and map contents) on the changed objects. A family
// the agents do not program (as they say themselves) is skipped with the
// reason.
func TestAgentRestartUnderLoad(t *testing.T) {
	testAgentRestartUnderLoad(t, nil, nil)
}

// TestAgentRestartUnderLoadTCAttach is TestAgentRestartUnderLoad with the
// tc programs attached as direct-action filters on clsact qdiscs
// (--tc-attach=tc), as on kernels without tcx links (Linux < 6.6): every
// agent reports that path (/debug/state, /metrics), every pod veth of its
// node carries topolb's filters before and after the restarts, and the
// restarts under load lose nothing.
func TestAgentRestartUnderLoadTCAttach(t *testing.T) {
	testAgentRestartUnderLoad(t, []string{"--tc-attach=tc"}, func(t *testing.T, tb *testbed.Testbed) {
		checkTCAttach(t, tb, maps.TCAttachTC)
	})
}

// checkTCAttach checks every agent reports tc attach mode want, and, for
// the tc mode, that topolb's filters are on its node's pod veths.
func checkTCAttach(t *testing.T, tb *testbed.Testbed, want maps.TCAttach) {
	t.Helper()
	for _, a := range tb.Agents() {
		st, err := a.State(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		path := ""
		if st.Kernel != nil {
			for _, f := range st.Kernel.Features {
				if f.Name == "tcx links" {
					path = f.Path
				}
			}
		}
		if path != string(want) {
			t.Errorf("agent on %s: /debug/state says tcx links path %q, want %q (%+v)", a.Node.Name, path, want, st.Kernel)
		}
		m, err := a.Metrics(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if line := `topolb_datapath_path{feature="tcx links",path="` + string(want) + `"} 1`; !strings.Contains(m, line) {
			t.Errorf("agent on %s: /metrics lacks %s", a.Node.Name, line)
		}
		if want != maps.TCAttachTC {
			continue
		}
		nl := a.Node.NS.Netlink()
		for _, p := range a.Node.Pods {
			l, err := nl.LinkByName(p.HostVeth)
			if err != nil {
				t.Fatal(err)
			}
			for parent, name := range map[uint32]string{netlink.HANDLE_MIN_INGRESS: "topolb_tc", netlink.HANDLE_MIN_EGRESS: "topolb_tcegress"} {
				fs, err := nl.FilterList(l, parent)
				if err != nil {
					t.Fatalf("%s %s: list tc filters: %v", a.Node.Name, p.HostVeth, err)
				}
				if !slices.ContainsFunc(fs, func(f netlink.Filter) bool {
					bf, ok := f.(*netlink.BpfFilter)
					return ok && bf.Name == name && bf.DirectAction
				}) {
					t.Errorf("%s %s (pod %s): no direct-action filter %s: %+v", a.Node.Name, p.HostVeth, p.Name, name, fs)
				}
			}
		}
	}
}

// testAgentRestartUnderLoad is TestAgentRestartUnderLoad with the agents
// given args; check, when not nil, runs once the agents first synced and
// again after the restarts.
func testAgentRestartUnderLoad(t *testing.T, args []string, check func(*testing.T, *testbed.Testbed)) {
	requireRoot(t)
	bin := requireAgent(t) // skip before building a testbed
	spec := dualStackSpec(t)
	tb := newTestbed(t, spec)
	if args == nil {
		withAgents.start(t, tb)
	} else {
		ctx, cancel := agentsCtx(t)
		defer cancel()
		if _, err := tb.StartAgents(ctx, testbed.AgentOptions{Binary: bin, Verbosity: 5, Args: args}); err != nil {
			t.Fatal(err)
		}
	}
	base := service(t, spec, "zone-hints", "web")
	base.IPFamilies = bothFamilies
	apply(t, tb, []testbed.ServiceSpec{base})
	if check != nil {
		check(t, tb)
	}
	families := servedFamilies(t, tb, topology.ScopeInternal)
	client := tb.Pod("client")

	// TCP and UDP loads in each family the agents program, all through
	// the same restarts; 2 requests in flight each (background), 8 in all
	// as with IPv4 alone before.
	stops := map[v1.IPFamily]func() map[v1.Protocol][]testbed.Record{}
	for _, family := range families {
		stops[family] = background(t, client, targetsOf(t, tb, client, family))
	}
	recs := map[v1.IPFamily]map[v1.Protocol][]testbed.Record{}
	stopLoad := func() {
		for family, stop := range stops {
			recs[family] = stop()
		}
	}

	time.Sleep(500 * time.Millisecond)
	for _, a := range tb.Agents() {
		if err := a.Kill(); err != nil {
			stopLoad()
			t.Fatal(err)
		}
	}
	t.Log("all agents killed (SIGKILL)")
	// A change while no agent runs, which the restarted agents must pick
	// up; the client's permitted set stays web-a1, web-a2.
	if _, err := tb.Apply(t.Context(), []testbed.ServiceSpec{without(base, "web-c2")}); err != nil {
		stopLoad()
		t.Fatal(err)
	}
	time.Sleep(time.Second) // no agent at all: the pinned datapath serves alone
	for _, a := range tb.Agents() {
		if err := a.Start(t.Context()); err != nil {
			stopLoad()
			t.Fatal(err)
		}
	}
	for _, a := range tb.Agents() {
		if err := a.WaitReady(t.Context()); err != nil {
			stopLoad()
			t.Fatal(err)
		}
	}
	t.Log("all agents restarted and ready")
	time.Sleep(500 * time.Millisecond)

	a := tb.Agent(client.Node.Name)
	if err := a.Stop(); err != nil {
		stopLoad()
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if err := a.Start(t.Context()); err != nil {
		stopLoad()
		t.Fatal(err)
	}
	if err := a.WaitReady(t.Context()); err != nil {
		stopLoad()
		t.Fatal(err)
	}
	t.Logf("agent on %s stopped (SIGTERM) and restarted", client.Node.Name)
	time.Sleep(500 * time.Millisecond)
	stopLoad()

	if err := tb.WaitAgents(t.Context(), scaled(t, 10*time.Second)); err != nil {
		t.Error(err)
	}
	permitted := []string{"web-a1", "web-a2"}
	for _, family := range families {
		t.Run(string(family), func(t *testing.T) {
			for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
				rs := recs[family][proto]
				tally := testbed.Summarize(client, rs)
				var slowest time.Duration
				for _, r := range rs {
					slowest = max(slowest, r.Took)
				}
				t.Logf("%s: %d requests: landed %v, failed %d, slowest %v", proto, len(rs), tally.Landed, tally.Failed, slowest)
				if tally.Failed > 0 {
					t.Errorf("%s: %d of %d requests failed: %v", proto, tally.Failed, len(rs), tally.Errors)
				}
				if got := tally.Backends(); !slices.Equal(got, permitted) {
					t.Errorf("%s: landed on %v, want exactly %v", proto, got, permitted)
				}
				if tally.WrongSource > 0 {
					t.Errorf("%s: %d answers saw another source than the client", proto, tally.WrongSource)
				}
				if len(rs) < 100 {
					t.Errorf("%s: only %d requests in 3 s: the load did not run", proto, len(rs))
				}
			}
		})
	}
	noChecksumErrors(t, tb)
	if check != nil {
		check(t, tb)
	}
}

// TestAgentsOnEveryNode runs an agent on every node and a client on every
// node (tools/testbed/examples/every-node.yaml: five Services, one per
// policy), and asserts that each client lands on exactly the backends that
// DecideNode permits for its own node, for every Service over TCP and UDP,
// and that each agent reports and programs exactly that decision. The
// decisions differ from node to node, so a node using another node's
// decision (or a reply reverse-NATed on the wrong node) shows.
func TestAgentsOnEveryNode(t *testing.T) {
	requireRoot(t)
	for _, dp := range datapaths {
		t.Run(dp.name, func(t *testing.T) {
			spec, err := testbed.EveryNodeSpec()
			if err != nil {
				t.Fatal(err)
			}
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			apply(t, tb, spec.Services)

			objs, _ := tb.Current()
			distinct := map[string]map[string]bool{} // service → distinct backend sets
			for _, client := range tb.Clients() {
				ds, _ := tb.Decide(objs, client.Node.Name)
				for _, svc := range spec.Services {
					landings, err := tb.Measure(t.Context(), client, svc.Name, testbed.MeasureOptions{Requests: 120, Parallel: 32})
					if err != nil {
						t.Fatal(err)
					}
					checkLandings(t, landings, nil)
					d := testbed.FindDecision(ds, svc.Name, v1.ProtocolTCP)
					if distinct[svc.Name] == nil {
						distinct[svc.Name] = map[string]bool{}
					}
					distinct[svc.Name][strings.Join(d.Backends, ",")] = true
				}
			}
			// The spec is only a test of per-node decisions if they differ.
			for _, name := range []string{"zone-hints", "node-hints", "keys", "threshold"} {
				if len(distinct[name]) < 3 {
					t.Errorf("service %s: only %d distinct backend sets over all nodes; the spec no longer tells nodes apart", name, len(distinct[name]))
				}
			}
			noChecksumErrors(t, tb)
		})
	}
}

// scenarioServices returns the Services of a demo scenario.
func scenarioServices(t *testing.T, spec *testbed.Spec, scenario string) []testbed.ServiceSpec {
	t.Helper()
	sc, err := spec.Scenario(scenario)
	if err != nil {
		t.Fatal(err)
	}
	return sc.Services
}

// TestWaitAgentsFailsOnExitedAgent kills one agent and checks that
// WaitAgents reports it instead of counting it as converged.
func TestWaitAgentsFailsOnExitedAgent(t *testing.T) {
	requireRoot(t)
	requireAgent(t)
	spec, err := testbed.ParseSpec([]byte(`
name: waitexit
zones:
- name: z1
  nodes:
  - {name: n1, pods: [{name: c, role: client}, {name: b1}]}
  - {name: n2, pods: [{name: b2}]}
services:
- {name: s, ports: [{port: 80}], endpoints: [{pod: b1}, {pod: b2}]}
`))
	if err != nil {
		t.Fatal(err)
	}
	tb := newTestbed(t, spec)
	withAgents.start(t, tb)
	if err := tb.WaitAgents(t.Context(), 10*time.Second); err != nil {
		t.Fatalf("before the kill: %v", err)
	}
	if err := tb.Agent("n2").Kill(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = tb.WaitAgents(t.Context(), 10*time.Second)
	if err == nil || !strings.Contains(err.Error(), "agent on n2 is not running") {
		t.Fatalf("WaitAgents with a killed agent: %v, want an error naming it", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("WaitAgents took %v to notice the dead agent", took)
	}
}
