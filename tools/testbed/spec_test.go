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
	l, err := NewLayout(spec)
	if err != nil {
		t.Fatal(err)
	}
	if len(spec.Scenarios) != 7 {
		t.Errorf("%d scenarios, want 7", len(spec.Scenarios))
	}
	wantModes := map[string]topology.Mode{
		"zone-hints":             topology.ModePreferSameZone,
		"missing-hint":           topology.ModeNone,
		"prefer-same-node":       topology.ModePreferSameNode,
		"hostname-keys-no-local": topology.ModeNone,
		"zone-threshold-not-met": topology.ModeNone,
		"zone-threshold-met":     topology.ModePreferSameZone,
		"terminating":            topology.ModePreferSameZone,
	}
	for _, sc := range spec.Scenarios {
		t.Run(sc.Name, func(t *testing.T) {
			objs, err := l.Objects(sc.Services)
			if err != nil {
				t.Fatal(err)
			}
			// The manifest round-trips through the loader the agent uses.
			data, err := EncodeManifest(objs)
			if err != nil {
				t.Fatal(err)
			}
			back, warnings, err := kube.DecodeManifests("manifest", data)
			if err != nil || len(warnings) > 0 {
				t.Fatalf("decode manifest: %v %v", err, warnings)
			}
			if len(sc.Expect) == 0 {
				t.Fatal("scenario has no expectation")
			}
			for _, e := range sc.Expect {
				client := l.Pod(e.Client)
				ds, _ := l.Decide(back, client.Node.Name)
				for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
					d := FindDecision(ds, e.Service, proto)
					if d == nil {
						t.Fatalf("no %s decision for %s", proto, e.Service)
					}
					want := slices.Clone(e.Backends)
					slices.Sort(want)
					if !slices.Equal(d.Backends, want) {
						t.Errorf("%s %s: decided %v, spec expects %v (%s)", e.Service, proto, d.Backends, want, d.Reason)
					}
					if m, ok := wantModes[sc.Name]; ok && d.Mode != m {
						t.Errorf("%s %s: mode %s, want %s", e.Service, proto, d.Mode, m)
					}
				}
			}
		})
	}
}

func TestLayoutAddresses(t *testing.T) {
	spec, err := DemoSpec()
	if err != nil {
		t.Fatal(err)
	}
	l, err := NewLayout(spec)
	if err != nil {
		t.Fatal(err)
	}
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
