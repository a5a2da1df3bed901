package e2e

import (
	"context"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	topolbagent "github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// datapath is who programs the nodes in a test: topolb-agent on every node,
// or the testbed's in-process datapath (maps/ driven straight from
// DecideNode), which isolates the datapath from the agent.
type datapath struct {
	name  string
	start func(t *testing.T, tb *testbed.Testbed)
}

var (
	withAgents = datapath{"agent", func(t *testing.T, tb *testbed.Testbed) {
		bin := requireAgent(t)
		ctx, cancel := agentsCtx(t)
		defer cancel()
		if _, err := tb.StartAgents(ctx, testbed.AgentOptions{Binary: bin, Verbosity: 5}); err != nil {
			t.Fatal(err)
		}
	}}
	// withAgentsAndAPIServer serves the cluster from a real kube-apiserver
	// (internal/kubetest; skipped without `make kube-bins`) that the agents
	// watch through a relay in each node.
	withAgentsAndAPIServer = datapath{"agent-apiserver", func(t *testing.T, tb *testbed.Testbed) {
		startAgentsOnAPIServer(t, tb, testbed.AgentOptions{Binary: requireAgent(t), Verbosity: 5})
	}}
	// withAgentsAndDualStackAPIServer is withAgentsAndAPIServer with an
	// apiserver that has an IPv6 service range too
	// (kubetest.WithDualStackServices).
	withAgentsAndDualStackAPIServer = datapath{"agent-apiserver-dualstack", func(t *testing.T, tb *testbed.Testbed) {
		startAgentsOnAPIServer(t, tb, testbed.AgentOptions{Binary: requireAgent(t), Verbosity: 5}, kubetest.WithDualStackServices())
	}}
	withDirect = datapath{"direct", func(t *testing.T, tb *testbed.Testbed) {
		if _, err := tb.AttachDirect(); err != nil {
			t.Fatal(err)
		}
	}}
	datapaths = []datapath{withAgents, withDirect}
)

// startAgentsOnAPIServer serves tb's cluster from a real kube-apiserver
// started with opts (internal/kubetest; skipped without `make
// kube-bins`) and starts agents with o on every node, which watch it
// through a relay in each node.
func startAgentsOnAPIServer(t *testing.T, tb *testbed.Testbed, o testbed.AgentOptions, opts ...kubetest.Option) []*testbed.Agent {
	t.Helper()
	cluster := kubetest.Start(t, opts...)
	// Cleanups run last-in first-out: stop the agents before the
	// apiserver, so it has no watches to drain. Close is idempotent.
	t.Cleanup(func() {
		if err := tb.Close(); err != nil {
			t.Errorf("teardown: %v", err)
		}
	})
	ctx, cancel := agentsCtx(t)
	defer cancel()
	if err := tb.ConnectAPIServer(ctx, cluster.Config); err != nil {
		t.Fatal(err)
	}
	agents, err := tb.StartAgents(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	return agents
}

// apply makes svcs the cluster's Services and waits until every agent's
// decisions equal DecideNode's for its node (at once without agents: the
// in-process datapath is programmed synchronously).
func apply(t *testing.T, tb *testbed.Testbed, svcs []testbed.ServiceSpec) {
	t.Helper()
	if _, err := tb.Apply(t.Context(), svcs); err != nil {
		t.Fatal(err)
	}
	if err := tb.WaitAgents(t.Context(), scaled(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
}

// scaled is testbed.ScaleTimeout(d): a bound set for a real machine,
// longer where the environment says it is slower (TCG in the kernel
// matrix), unchanged elsewhere.
func scaled(t testing.TB, d time.Duration) time.Duration {
	t.Helper()
	d, err := testbed.ScaleTimeout(d)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// checkLandings fails the test for every way the landings depart from the
// decisions they were measured against, and from want when want is not
// nil.
func checkLandings(t *testing.T, landings []testbed.Landing, want []string) {
	t.Helper()
	for _, l := range landings {
		label := string(l.Decision.Protocol) + " " + l.Decision.Service + " from " + l.Client.ClientName()
		if want != nil {
			w := slices.Clone(want)
			slices.Sort(w)
			if !slices.Equal(l.Decision.Backends, w) {
				t.Errorf("%s: DecideNode permits %v, the spec expects %v", label, l.Decision.Backends, w)
			}
		}
		for _, p := range l.Problems() {
			t.Errorf("%s: %s", label, p)
		}
		t.Logf("%s: mode %s, landed %v, failed %d", label, l.Decision.Mode, l.Tally.Landed, l.Tally.Failed)
	}
}

// noChecksumErrors fails the test if any namespace counted a TCP or UDP
// checksum error: the wire's senders compute checksums in software, so a
// wrong checksum written by the datapath is counted by the receiver.
func noChecksumErrors(t *testing.T, tb *testbed.Testbed) {
	t.Helper()
	errs, err := tb.ChecksumErrors()
	if err != nil {
		t.Fatal(err)
	}
	for ns, c := range errs {
		t.Errorf("%s: checksum errors %+v", ns, c)
	}
}

// service returns a copy of the named Service of a spec's scenario, with
// its endpoint list cloned so a test can change it.
func service(t testing.TB, spec *testbed.Spec, scenario, name string) testbed.ServiceSpec {
	t.Helper()
	sc, err := spec.Scenario(scenario)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range sc.Services {
		if s.Name == name {
			s.Endpoints = slices.Clone(s.Endpoints)
			return s
		}
	}
	t.Fatalf("scenario %s has no service %s", scenario, name)
	return testbed.ServiceSpec{}
}

// without returns svc without the named endpoints.
func without(svc testbed.ServiceSpec, pods ...string) testbed.ServiceSpec {
	svc.Endpoints = slices.DeleteFunc(slices.Clone(svc.Endpoints), func(e testbed.EndpointSpec) bool {
		return slices.Contains(pods, e.Pod)
	})
	return svc
}

// with returns svc with eps added.
func with(svc testbed.ServiceSpec, eps ...testbed.EndpointSpec) testbed.ServiceSpec {
	svc.Endpoints = append(slices.Clone(svc.Endpoints), eps...)
	return svc
}

func demoSpec(t testing.TB) *testbed.Spec {
	t.Helper()
	spec, err := testbed.DemoSpec()
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// apiserverTestbed creates a testbed from spec without its Services, serves
// it from cluster's apiserver and applies svcs there. The context it
// returns ends after three minutes or with the test.
func apiserverTestbed(t *testing.T, spec *testbed.Spec, cluster *kubetest.Cluster, svcs []testbed.ServiceSpec) (*testbed.Testbed, context.Context) {
	t.Helper()
	spec.Services = nil
	tb := newTestbed(t, spec)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	t.Cleanup(cancel)
	if err := tb.ConnectAPIServer(ctx, cluster.Config); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.Apply(ctx, svcs); err != nil {
		t.Fatal(err)
	}
	return tb, ctx
}

// agentsCtx bounds a test's start of its agents: the testbed's readiness
// limit (testbed.AgentReadyTimeout, longer under TCG in the kernel
// matrix) and a minute more for the rest.
func agentsCtx(t *testing.T) (context.Context, context.CancelFunc) {
	t.Helper()
	limit, err := testbed.AgentReadyTimeout()
	if err != nil {
		t.Fatal(err)
	}
	return context.WithTimeout(t.Context(), limit+time.Minute)
}

// bothFamilies are a dual-stack Service's ipFamilies, IPv4 primary.
var bothFamilies = []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}

// programmedFamilies returns the IP families tb's datapath programs per
// scope, as it says itself (Testbed.ProgrammedFamilies), and fails the
// test unless it serves IPv4 to pods, as it always must.
func programmedFamilies(t *testing.T, tb *testbed.Testbed) topolbagent.ScopeFamilies {
	t.Helper()
	served, err := tb.ProgrammedFamilies(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if !served.Programs(v1.IPv4Protocol, topology.ScopeInternal) {
		t.Fatalf("the datapath does not serve IPv4: programmed families %s", served)
	}
	return served
}

// inEachFamily runs check in a subtest per IP family (topology.Families)
// on a dual-stack testbed, skipping with the reason a family tb's
// datapath does not serve in scope, as it says itself; IPv4 always runs.
func inEachFamily(t *testing.T, tb *testbed.Testbed, scope topology.Scope, check func(t *testing.T, family v1.IPFamily)) {
	t.Helper()
	served := programmedFamilies(t, tb)
	for _, family := range topology.Families {
		t.Run(string(family), func(t *testing.T) {
			if !served.Programs(family, scope) {
				skipUnserved(t, family, scope, served)
			}
			check(t, family)
		})
	}
}

// servedFamilies returns the IP families tb's datapath serves in scope
// (topology.Families' order, IPv4 always), for a test that runs its
// families' traffic together rather than one after the other (as
// inEachFamily does); each family it leaves out shows as a skipped
// subtest with the reason.
func servedFamilies(t *testing.T, tb *testbed.Testbed, scope topology.Scope) []v1.IPFamily {
	t.Helper()
	served := programmedFamilies(t, tb)
	var out []v1.IPFamily
	for _, family := range topology.Families {
		if served.Programs(family, scope) {
			out = append(out, family)
			continue
		}
		t.Run(string(family), func(t *testing.T) { skipUnserved(t, family, scope, served) })
	}
	return out
}

// skipUnserved skips t: its datapath, which programs served, does not
// serve family in scope.
func skipUnserved(t *testing.T, family v1.IPFamily, scope topology.Scope, served topolbagent.ScopeFamilies) {
	t.Helper()
	t.Skipf("the datapath does not serve %s in scope %s yet: it programs %s", family, scope, served)
}
