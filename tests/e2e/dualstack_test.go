package e2e

import (
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"

	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// dualStackSpec is the demo testbed with IPv6 beside IPv4 on every node,
// pod, the wire and the outside network.
func dualStackSpec(t testing.TB) *testbed.Spec {
	t.Helper()
	spec, err := testbed.ParseSpec(append(testbed.DemoYAML(), "\ndualStack: true\nkubeProxy: none\n"...))
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// dualStackServices: "web" is a dual-stack NodePort Service (IPv4
// primary) with zone hints, so node-a1's client and processes reach a
// local and a remote backend in either family; "six" is IPv6 only;
// "empty" is dual stack without any endpoint, refused in both families.
func dualStackServices() []testbed.ServiceSpec {
	ports := []testbed.PortSpec{{Name: "http", Port: 80}, {Name: "echo", Protocol: v1.ProtocolUDP, Port: 53}}
	return []testbed.ServiceSpec{
		{Name: "web", IPFamilies: bothFamilies, Type: v1.ServiceTypeNodePort, Hints: testbed.HintsZone, Ports: ports,
			Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-a2"}, {Pod: "web-b1"}, {Pod: "web-b2"}, {Pod: "web-c1"}, {Pod: "web-c2"}}},
		{Name: "six", IPFamilies: []v1.IPFamily{v1.IPv6Protocol}, Ports: ports,
			Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-b1"}}},
		{Name: "empty", IPFamilies: bothFamilies, Ports: ports},
	}
}

// dualStackCase is one traffic check, run once per IP family the
// datapath serves in the scope of the frontends it reaches.
type dualStackCase struct {
	name string
	// scope is where the traffic reaches its frontends from: internal
	// (pods and the node's processes) or external (an uplink).
	scope topology.Scope
	run   func(t *testing.T, tb *testbed.Testbed, family v1.IPFamily)
}

var dualStackCases = []dualStackCase{
	{"pod to cluster IP", topology.ScopeInternal, func(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
		landings, err := tb.Measure(t.Context(), tb.Pod("client"), "web", testbed.MeasureOptions{Requests: 120, Families: []v1.IPFamily{family}})
		if err != nil {
			t.Fatal(err)
		}
		checkFamilyLandings(t, tb, "node-a1", family, landings)
		checkLocalAndRemote(t, tb, "node-a1", "web", family)
	}},
	{"pod to its node's NodePort", topology.ScopeInternal, func(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
		checkNodePortOf(t, tb, tb.Pod("client"), "node-a1", family)
	}},
	{"outside client to NodePort", topology.ScopeExternal, func(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
		checkNodePortOf(t, tb, tb.External("ext1"), "node-b1", family)
	}},
	{"host process to cluster IP and NodePort", topology.ScopeInternal, func(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
		hls, err := tb.MeasureHost(t.Context(), "node-a1", "web", testbed.MeasureOptions{Requests: 120, Families: []v1.IPFamily{family}})
		if err != nil {
			t.Fatal(err)
		}
		var landings []testbed.Landing
		kinds := map[string]bool{}
		for _, hl := range hls {
			kinds[hl.Target.Kind] = true
			if hl.Target.Kind == "ClusterIP" {
				landings = append(landings, hl.Landing)
			}
		}
		if !kinds["ClusterIP"] || !kinds["NodePort"] {
			t.Errorf("measured %v from the host, want the cluster IP and the NodePort", kinds)
		}
		checkFamilyLandings(t, tb, "node-a1", family, landings)
		// The NodePort from inside the node takes the cluster set.
		var nodePorts []testbed.Landing
		for _, hl := range hls {
			if hl.Target.Kind == "NodePort" {
				nodePorts = append(nodePorts, hl.Landing)
			}
		}
		checkLandings(t, nodePorts, nil)
	}},
	{"IPv6-only Service", topology.ScopeInternal, func(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
		landings, err := tb.Measure(t.Context(), tb.Pod("client"), "six", testbed.MeasureOptions{Requests: 60, Families: []v1.IPFamily{family}})
		if family == v1.IPv4Protocol {
			// No IPv4 decision at all: Measure finds no port to measure.
			if err == nil {
				t.Fatalf("an IPv6-only Service has IPv4 decisions: %+v", landings)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		checkFamilyLandings(t, tb, "node-a1", family, landings)
		hls, err := tb.MeasureHost(t.Context(), "node-b1", "six", testbed.MeasureOptions{Requests: 60, Families: []v1.IPFamily{family}})
		if err != nil {
			t.Fatal(err)
		}
		for _, hl := range hls {
			checkFamilyLandings(t, tb, "node-b1", family, []testbed.Landing{hl.Landing})
		}
	}},
	{"drain", topology.ScopeInternal, func(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
		// A stream on web-a1 keeps it after web-a1 turns terminating, as
		// in a rollout; new flows avoid it. The Services are restored
		// after (while the test's context lives).
		defer apply(t, tb, dualStackServices())
		stream, err := tb.OpenStreamOf(t.Context(), tb.Pod("client"), "web", "web-a1", family)
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		svcs := dualStackServices()
		for i, ep := range svcs[0].Endpoints {
			if ep.Pod == "web-a1" {
				svcs[0].Endpoints[i].Condition = testbed.Terminating
			}
		}
		apply(t, tb, svcs)
		if err := testbed.StreamStays(t.Context(), stream, "web-a1", 10); err != nil {
			t.Error(err)
		}
		// New flows only from here: a UDP request reusing the source port
		// of an earlier one to web-a1 is that flow, which keeps its
		// draining backend (as with kube-proxy).
		if err := tb.ForgetFlows(); err != nil {
			t.Fatal(err)
		}
		landings, err := tb.Measure(t.Context(), tb.Pod("client"), "web", testbed.MeasureOptions{Requests: 60, Families: []v1.IPFamily{family}})
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range landings {
			if slices.Contains(l.Decision.Backends, "web-a1") {
				t.Errorf("%s %s: the decision still permits the terminating web-a1: %v", family, l.Decision.Protocol, l.Decision.Backends)
			}
		}
		checkFamilyLandings(t, tb, "node-a1", family, landings)
	}},
	{"rejects", topology.ScopeInternal, func(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
		for _, client := range []testbed.Client{tb.Pod("client"), tb.Host("node-a1")} {
			t.Run(client.ClientName(), func(t *testing.T) {
				for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
					checkRefused(t, client, proto, decisionOnOf(t, tb, "node-a1", "empty", proto, family).Frontend)
				}
			})
		}
	}},
}

// TestDualStack reaches Services in each IP family, with no kube-proxy
// anywhere: a dual-stack Service from a pod and from a process of the
// node itself at its cluster IP and the node's NodePort (a local and a
// remote backend, landing exactly on the decision, which every agent's
// explain reports for that family), from outside at another node's
// NodePort, an IPv6-only Service (absent in IPv4), a drain (a stream
// keeps its backend after the backend turns terminating, new flows avoid
// it), and a dual-stack Service without endpoints refused in both. A
// family the datapath does not serve yet in a case's scope, as the agents
// (or the in-process datapath) say themselves, skips with that reason
// (IPv6 from outside while maps.UplinksServeIPv6 is false); IPv4 always
// runs. With agents it also runs against a real kube-apiserver with both
// service ranges, which takes the dual-stack and IPv6-only Services.
func TestDualStack(t *testing.T) {
	requireRoot(t)
	for _, dp := range append(datapaths, withAgentsAndDualStackAPIServer) {
		t.Run(dp.name, func(t *testing.T) {
			spec := dualStackSpec(t)
			spec.Services = dualStackServices()
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			apply(t, tb, dualStackServices())
			if err := tb.CheckNoKubeProxy(t.Context()); err != nil {
				t.Fatal(err)
			}
			served := programmedFamilies(t, tb)
			for _, family := range topology.Families {
				t.Run(string(family), func(t *testing.T) {
					for _, c := range dualStackCases {
						t.Run(c.name, func(t *testing.T) {
							if !served.Programs(family, c.scope) {
								t.Skipf("the datapath does not serve %s in scope %s yet (maps.UplinksServeIPv6 is %v): it programs %s", family, c.scope, dpmaps.UplinksServeIPv6, served)
							}
							c.run(t, tb, family)
						})
					}
				})
			}
			noChecksumErrors(t, tb)
		})
	}
}

// checkNodePortOf measures client through node's NodePorts of "web" in
// family: each landing is at a NodePort of that family and exactly on
// node's decision (the cluster set from a pod, the external set from
// outside).
func checkNodePortOf(t *testing.T, tb *testbed.Testbed, client testbed.Client, node string, family v1.IPFamily) {
	t.Helper()
	landings, err := tb.MeasureNodePort(t.Context(), client, node, "web", testbed.MeasureOptions{Requests: 120, Families: []v1.IPFamily{family}})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range landings {
		if l.Decision.NodePort.Addr().Is4() != (family == v1.IPv4Protocol) {
			t.Errorf("%s %s: measured NodePort %s", family, l.Decision.Protocol, l.Decision.NodePort)
		}
	}
	checkLandings(t, landings, nil)
}

// checkFamilyLandings checks landings measured from node in family: each
// is of that family, lands exactly on its decision (checkLandings), and
// that decision is the one node's agent explains for the port in that
// family (when agents run).
func checkFamilyLandings(t *testing.T, tb *testbed.Testbed, node string, family v1.IPFamily, landings []testbed.Landing) {
	t.Helper()
	if len(landings) == 0 {
		t.Fatalf("nothing measured in %s", family)
	}
	for _, l := range landings {
		if l.Decision.Family != family || (l.Decision.Frontend.Addr().Is4() != (family == v1.IPv4Protocol)) {
			t.Errorf("%s %s: measured frontend %s of family %s", l.Decision.Service, l.Decision.Protocol, l.Decision.Frontend, l.Decision.Family)
		}
		if len(l.Decision.Backends) == 0 {
			t.Errorf("%s %s: the decision permits no backend: the test needs some", l.Decision.Service, l.Decision.Protocol)
		}
	}
	checkLandings(t, landings, nil)
	a := tb.Agent(node)
	if a == nil {
		return
	}
	st, err := a.State(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range landings {
		d := l.Decision
		i := slices.IndexFunc(st.Services, func(p topology.PortReport) bool {
			return p.Service == d.Service && p.Port == d.Port && p.Protocol == string(d.Protocol) && p.Family == family
		})
		if i < 0 {
			t.Errorf("agent on %s explains no %s decision for %s %s", node, family, d.Service, d.Protocol)
			continue
		}
		p := st.Services[i]
		if !slices.Equal(p.Backends, d.Addrs) || string(p.Mode) != string(d.Mode) {
			t.Errorf("agent on %s explains %s %s %s as %s %v; measured against %s %v", node, family, d.Service, d.Protocol, p.Mode, p.Backends, d.Mode, d.Addrs)
		}
	}
}
