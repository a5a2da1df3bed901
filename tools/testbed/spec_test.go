package testbed

import (
	"bytes"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// TestDemoSpecAgreesWithDecisions checks that every expectation written in
// examples/demo.yaml is what the decision engine decides, so the demo and
// the end-to-end tests start from a consistent description.
func TestDemoSpecAgreesWithDecisions(t *testing.T) {
	spec, err := DemoSpec()
	if err != nil {
		t.Fatal(err)
	}
	if len(spec.Scenarios) != 12 {
		t.Errorf("%d scenarios, want 12", len(spec.Scenarios))
	}
	checkScenarioDecisions(t, spec, map[string]topology.Mode{
		"zone-hints":             topology.ModePreferSameZone,
		"missing-hint":           topology.ModeNone,
		"prefer-same-node":       topology.ModePreferSameNode,
		"hostname-keys-no-local": topology.ModeNone,
		"zone-threshold-not-met": topology.ModeNone,
		"zone-threshold-met":     topology.ModePreferSameZone,
		"terminating":            topology.ModePreferSameZone,
		"hints-give-up":          topology.ModeNone,
		"zone-weighted":          topology.ModeZoneWeighted,
		"nodeport-zone-b":        topology.ModePreferSameZone,
	})
}

// TestDualStackSpecAgreesWithDecisions: the dual-stack example's
// expectations, family by family, are what DecideNode decides, and its
// two families decide different modes.
func TestDualStackSpecAgreesWithDecisions(t *testing.T) {
	spec, err := DualStackSpec()
	if err != nil {
		t.Fatal(err)
	}
	checkScenarioDecisions(t, spec, map[string]topology.Mode{
		"dual-stack-modes/IPv4": topology.ModePreferSameZone,
		"dual-stack-modes/IPv6": topology.ModeNone,
	})
}

// checkScenarioDecisions checks that every expectation of spec's scenarios
// is what DecideNode decides, on objects that round-trip through the
// agent's loader, in the expectation's family (every family when it names
// none), and that the mode is wantModes' for "scenario" or
// "scenario/family", where it names one.
func checkScenarioDecisions(t *testing.T, spec *Spec, wantModes map[string]topology.Mode) {
	t.Helper()
	l := mustLayout(t, spec, nil)
	for _, sc := range spec.Scenarios {
		t.Run(sc.Name, func(t *testing.T) {
			objs, err := l.Objects(sc.Services)
			if err != nil {
				t.Fatal(err)
			}
			// The manifest round-trips through the loader the agent uses.
			back := roundTrip(t, objs)
			if len(sc.Expect) == 0 {
				t.Fatal("scenario has no expectation")
			}
			for _, e := range sc.Expect {
				// The node that decides: the client pod's (or node's),
				// or the one whose NodePort the client uses.
				node, outside := l.HeldTo(e), l.External(e.Client) != nil
				ds, _ := l.Decide(back, node)
				for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
					d := FindDecisionOf(ds, e.Service, proto, e.Family)
					if d == nil {
						t.Fatalf("no %s %s decision for %s", e.Family, proto, e.Service)
					}
					if e.Via != "" && !d.NodePort.IsValid() {
						t.Fatalf("%s %s: no NodePort on %s", e.Service, proto, e.Via)
					}
					got := d.Backends
					if outside {
						got = d.ExternalBackends
					}
					want := slices.Clone(e.Backends)
					slices.Sort(want)
					if !slices.Equal(got, want) {
						t.Errorf("%s %s from %s on %s: decided %v, spec expects %v (%s)", e.Service, proto, e.Client, node, got, want, d.Reason)
					}
					m, ok := wantModes[sc.Name]
					if fm, fok := wantModes[sc.Name+"/"+string(d.Family)]; fok {
						m, ok = fm, true
					}
					if ok && d.Mode != m {
						t.Errorf("%s %s %s: mode %s, want %s", e.Service, d.Family, proto, d.Mode, m)
					}
				}
			}
		})
	}
}

// mustLayout plans the layout of a spec parsed with err, failing the
// test on either error.
func mustLayout(t *testing.T, spec *Spec, err error) *Layout {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	l, err := NewLayout(spec)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestLayoutAddresses(t *testing.T) {
	spec, err := DemoSpec()
	l := mustLayout(t, spec, err)
	for _, tc := range []struct {
		pod, node, addr, gw, wire string
	}{
		{"client", "node-a1", "10.244.1.2", "10.244.1.1", "10.250.0.2/24"},
		{"web-a1", "node-a1", "10.244.1.3", "10.244.1.1", "10.250.0.2/24"},
		{"web-a3", "node-a2", "10.244.2.3", "10.244.2.1", "10.250.0.3/24"},
		{"web-c2", "node-c2", "10.244.6.2", "10.244.6.1", "10.250.0.7/24"},
	} {
		p := l.Pod(tc.pod)
		if p == nil || p.Node.Name != tc.node || p.Addr.String() != tc.addr || p.Node.Gateway.String() != tc.gw || p.Node.WireAddr.String() != tc.wire {
			t.Errorf("pod %s: got %+v", tc.pod, p)
		}
	}
	if l.FabricAddr.String() != "10.250.0.1/24" {
		t.Errorf("fabric %s", l.FabricAddr)
	}
}

func TestParseSpecErrors(t *testing.T) {
	for _, tc := range []struct {
		name, yaml, want string
	}{
		{"no zones", `name: x`, "no zones"},
		{"unknown field", "zones: [{name: a, nodes: [{name: n1}]}]\nbogus: 1", "bogus"},
		{"repeated node", "zones: [{name: a, nodes: [{name: n1}, {name: n1}]}]", "repeated"},
		{"bad role", "zones: [{name: a, nodes: [{name: n1, pods: [{name: p, role: db}]}]}]", "role"},
		{"endpoint not a backend", `
zones: [{name: a, nodes: [{name: n1, pods: [{name: c, role: client}]}]}]
services: [{name: s, ports: [{port: 80}], endpoints: [{pod: c}]}]`, "not a backend"},
		{"clusterIP outside the range", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, clusterIP: 10.0.0.1, ports: [{port: 80}]}]`, "clusterIP"},
		{"expectation on a missing service", `
zones: [{name: a, nodes: [{name: n1, pods: [{name: c, role: client}]}]}]
scenarios: [{name: x, services: [], expect: [{client: c, service: s, backends: []}]}]`, "not in the scenario"},
		{"node client through another node's NodePorts", `
zones: [{name: a, nodes: [{name: n1}, {name: n2}]}]
services: [{name: s, ports: [{port: 80}]}]
scenarios: [{name: x, services: [{name: s, ports: [{port: 80}]}], expect: [{client: n1, via: n2, service: s, backends: []}]}]`, "drop via"},
		{"bad type", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, type: ExternalName, ports: [{port: 80}]}]`, "type"},
		{"nodePort on a ClusterIP", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, ports: [{port: 80, nodePort: 30080}]}]`, "nodePort with type ClusterIP"},
		{"nodePort out of range", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, type: NodePort, ports: [{port: 80, nodePort: 80}]}]`, "outside 30000-32767"},
		{"nodePort used twice", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, type: NodePort, ports: [{port: 80, nodePort: 30080}]}, {name: t, type: NodePort, ports: [{port: 80, nodePort: 30080}]}]`, "already used"},
		{"loadBalancerIPs on a NodePort", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, type: NodePort, loadBalancerIPs: [192.0.2.1], ports: [{port: 80}]}]`, "need type LoadBalancer"},
		{"external IP in the service range", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, externalIPs: [10.96.5.5], ports: [{port: 80}]}]`, "cluster IP range"},
		{"externalTrafficPolicy on an internal service", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, externalTrafficPolicy: Local, ports: [{port: 80}]}]`, "not reachable from outside"},
		{"affinity timeout without ClientIP", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, sessionAffinityTimeout: 30, ports: [{port: 80}]}]`, "without sessionAffinity ClientIP"},
		{"health check port without eTP Local", `
zones: [{name: a, nodes: [{name: n1}]}]
services: [{name: s, type: LoadBalancer, healthCheckNodePort: 31000, ports: [{port: 80}]}]`, "healthCheckNodePort"},
		{"wire MTU too small", `
zones: [{name: a, nodes: [{name: n1, wireMTU: 100}]}]`, "wireMTU"},
		{"wire MTU below IPv6's minimum in dual stack", `
dualStack: true
zones: [{name: a, nodes: [{name: n1, wireMTU: 1200}]}]`, "IPv6's minimum"},
		{"outside overlaps the wire", `
zones: [{name: a, nodes: [{name: n1}]}]
outside: {cidr: 10.250.0.0/24, clients: [{name: x}]}`, "overlaps"},
		{"outside without clients", `
zones: [{name: a, nodes: [{name: n1}]}]
outside: {}`, "no clients"},
		{"outside ingress not a node", `
zones: [{name: a, nodes: [{name: n1}]}]
outside: {ingressNode: n9, clients: [{name: x}]}`, "not a node"},
		{"outside client named like a pod", `
zones: [{name: a, nodes: [{name: n1, pods: [{name: x}]}]}]
outside: {clients: [{name: x}]}`, "name of a pod"},
		{"bad kubeProxy", `
zones: [{name: a, nodes: [{name: n1}]}]
kubeProxy: sometimes`, "kubeProxy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseSpec([]byte(tc.yaml))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestDefaultClusterIPsAreStable(t *testing.T) {
	s, err := ParseSpec([]byte(`
zones: [{name: a, nodes: [{name: n1, pods: [{name: b}]}]}]
services: [{name: one, ports: [{port: 80}]}, {name: two, ports: [{port: 80}]}]
scenarios:
- {name: x, services: [{name: two, ports: [{port: 81}]}, {name: three, ports: [{port: 80}]}]}
`))
	if err != nil {
		t.Fatal(err)
	}
	got := []string{s.Services[0].ClusterIP, s.Services[1].ClusterIP, s.Scenarios[0].Services[0].ClusterIP, s.Scenarios[0].Services[1].ClusterIP}
	want := []string{"10.96.0.10", "10.96.0.11", "10.96.0.11", "10.96.0.12"}
	if !slices.Equal(got, want) {
		t.Errorf("cluster IPs %v, want %v", got, want)
	}
	if !bytes.Contains(DemoYAML(), []byte("zone-hints")) {
		t.Error("demo YAML not embedded")
	}
}

// TestServiceTypesInObjects checks that what a spec says about reaching a
// Service from outside reaches the Service object, survives the
// manifest round trip the agent reads, and gives the decisions their
// external frontends; node ports are assigned stably when left out.
func TestServiceTypesInObjects(t *testing.T) {
	s, err := ParseSpec([]byte(`
zones:
- {name: z1, nodes: [{name: n1, pods: [{name: b1}]}, {name: n2, pods: [{name: b2}]}]}
outside: {ingressNode: n2, clients: [{name: ext1}, {name: ext2}]}
services:
- name: lb
  type: LoadBalancer
  externalTrafficPolicy: Local
  externalIPs: [198.51.100.7]
  loadBalancerIPs: [198.51.100.8]
  sessionAffinity: ClientIP
  ports: [{name: http, port: 80}, {name: dns, protocol: UDP, port: 53, nodePort: 31053}]
  endpoints: [{pod: b1}, {pod: b2}]
- {name: np, type: NodePort, ports: [{port: 8080}], endpoints: [{pod: b2}]}
`))
	if err != nil {
		t.Fatal(err)
	}
	l, err := NewLayout(s)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := l.Objects(s.Services)
	if err != nil {
		t.Fatal(err)
	}
	back := roundTrip(t, objs)
	lb := back.Services[0]
	if lb.Spec.Type != v1.ServiceTypeLoadBalancer || lb.Spec.ExternalTrafficPolicy != v1.ServiceExternalTrafficPolicyLocal ||
		lb.Spec.SessionAffinity != v1.ServiceAffinityClientIP || *lb.Spec.SessionAffinityConfig.ClientIP.TimeoutSeconds != DefaultSessionAffinityTimeout ||
		lb.Spec.HealthCheckNodePort != 30001 || lb.Spec.Ports[0].NodePort != 30000 || lb.Spec.Ports[1].NodePort != 31053 ||
		!slices.Equal(lb.Spec.ExternalIPs, []string{"198.51.100.7"}) || len(lb.Status.LoadBalancer.Ingress) != 1 || lb.Status.LoadBalancer.Ingress[0].IP != "198.51.100.8" {
		t.Errorf("LoadBalancer Service: %+v %+v", lb.Spec, lb.Status)
	}
	if np := back.Services[1]; np.Spec.Ports[0].NodePort != 30002 {
		t.Errorf("NodePort Service: node port %d, want 30002", np.Spec.Ports[0].NodePort)
	}
	if a := back.Nodes[1].Status.Addresses; len(a) != 1 || a[0].Type != v1.NodeInternalIP || a[0].Address != "10.250.0.3" {
		t.Errorf("node n2 addresses %v", a)
	}
	ds, _ := l.Decide(back, "n1")
	d := FindDecision(ds, "lb", v1.ProtocolTCP)
	if d == nil {
		t.Fatal("no decision for lb/TCP")
	}
	wantExternal := []string{"10.250.0.2:30000", "198.51.100.7:80", "198.51.100.8:80"}
	var gotExternal []string
	for _, fe := range d.External {
		gotExternal = append(gotExternal, fe.String())
	}
	if d.NodePort.String() != "10.250.0.2:30000" || !slices.Equal(gotExternal, wantExternal) ||
		!slices.Equal(d.ExternalBackends, []string{"b1"}) || !d.ExternalPolicyLocal || !slices.Equal(d.Backends, []string{"b1", "b2"}) {
		t.Errorf("decision on n1: nodePort %s, external %v, external backends %v (local %v), backends %v; want %v, %v, [b1], true, [b1 b2]",
			d.NodePort, gotExternal, d.ExternalBackends, d.ExternalPolicyLocal, d.Backends, "10.250.0.2:30000", wantExternal)
	}
	if r := l.Router; r == nil || r.Ingress.Name != "n2" || r.WireAddr.String() != "10.250.0.254/24" || r.Gateway.String() != "203.0.113.1" {
		t.Errorf("router %+v", r)
	}
	if e := l.External("ext2"); e == nil || e.Addr.String() != "203.0.113.11" || e.RouterIf != "x1" {
		t.Errorf("ext2: %+v", e)
	}
}

// roundTrip encodes objs as the manifest and decodes it with the loader
// the agent uses, which must not warn.
func roundTrip(t *testing.T, objs *kube.Objects) *kube.Objects {
	t.Helper()
	data, err := EncodeManifest(objs)
	if err != nil {
		t.Fatal(err)
	}
	back, warnings, err := kube.DecodeManifests("manifest", data)
	if err != nil || len(warnings) > 0 {
		t.Fatalf("decode manifest: %v %v", err, warnings)
	}
	return back
}

// TestExpectationHeldToAndScope: an expectation is held to its client
// pod's node, the node whose processes are the client, or the node it goes
// through, and reaches frontends of scope external only from outside.
func TestExpectationHeldToAndScope(t *testing.T) {
	spec, err := DemoSpec()
	l := mustLayout(t, spec, err)
	for _, tc := range []struct {
		name  string
		e     Expectation
		node  string
		scope topology.Scope
	}{
		{"pod to the cluster IP", Expectation{Client: "client"}, "node-a1", topology.ScopeInternal},
		{"pod through a NodePort", Expectation{Client: "client", Via: "node-b1"}, "node-b1", topology.ScopeInternal},
		{"node's processes to the cluster IP", Expectation{Client: "node-b2"}, "node-b2", topology.ScopeInternal},
		{"outside client through a NodePort", Expectation{Client: "ext1", Via: "node-b1"}, "node-b1", topology.ScopeExternal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if node := l.HeldTo(tc.e); node != tc.node {
				t.Errorf("held to %q, want %q", node, tc.node)
			}
			if scope := l.Scope(tc.e); scope != tc.scope {
				t.Errorf("scope %s, want %s", scope, tc.scope)
			}
		})
	}
}
