package hintsim

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/endpointslice/topologycache"
	"k8s.io/utils/ptr"

	"github.com/topolb/topolb/kube"
)

// node builds a Ready node; zone "" leaves the label out, cpu "" leaves
// allocatable CPU out.
func node(name, zone, cpu string, mods ...func(*v1.Node)) *v1.Node {
	n := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
	if zone != "" {
		n.Labels[v1.LabelTopologyZone] = zone
	}
	if cpu != "" {
		n.Status.Allocatable = v1.ResourceList{v1.ResourceCPU: resource.MustParse(cpu)}
	}
	n.Status.Conditions = []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue}}
	for _, m := range mods {
		m(n)
	}
	return n
}

func controlPlane(n *v1.Node) { n.Labels["node-role.kubernetes.io/control-plane"] = "" }
func notReady(n *v1.Node)     { n.Status.Conditions[0].Status = v1.ConditionFalse }
func noConditions(n *v1.Node) { n.Status.Conditions = nil }

func TestNodeInfo(t *testing.T) {
	tests := []struct {
		name  string
		nodes []*v1.Node
		// wantSufficient, wantNode and wantReason are NodeInfo's fields;
		// wantReason is matched as a substring.
		wantSufficient bool
		wantNode       string
		wantReason     string
		// wantRatios are the zones' CPU ratios, "zone=ratio" sorted by
		// zone; nil ratios print as "zone=-".
		wantRatios []string
		// wantIgnored are "node (reason)", sorted by node.
		wantIgnored []string
	}{
		{
			name:           "three zones, control plane and not-Ready nodes left out",
			nodes:          []*v1.Node{node("cp", "zone-a", "16", controlPlane), node("a1", "zone-a", "4"), node("a2", "zone-a", "4"), node("b1", "zone-b", "4"), node("c1", "zone-c", "4"), node("c2", "zone-c", "64", notReady)},
			wantSufficient: true,
			wantRatios:     []string{"zone-a=0.5", "zone-b=0.25", "zone-c=0.25"},
			wantIgnored:    []string{"c2 (not Ready)", "cp (control-plane)"},
		},
		{
			name:           "master label excludes too",
			nodes:          []*v1.Node{node("m", "", "", func(n *v1.Node) { n.Labels["node-role.kubernetes.io/master"] = "true" }), node("a1", "zone-a", "1"), node("b1", "zone-b", "3")},
			wantSufficient: true,
			wantRatios:     []string{"zone-a=0.25", "zone-b=0.75"},
			wantIgnored:    []string{"m (control-plane)"},
		},
		{
			name:       "missing zone label names the first node by name",
			nodes:      []*v1.Node{node("z-late", "", "4"), node("b1", "zone-b", "4"), node("a1", "zone-a", "4"), node("m-nozone", "", "4")},
			wantNode:   "m-nozone",
			wantReason: "node m-nozone has no topology.kubernetes.io/zone label",
			wantRatios: []string{"zone-a=-", "zone-b=-"},
		},
		{
			name:       "empty zone label",
			nodes:      []*v1.Node{node("a1", "zone-a", "4"), node("b1", "zone-b", "4", func(n *v1.Node) { n.Labels[v1.LabelTopologyZone] = "" })},
			wantNode:   "b1",
			wantReason: "node b1 has an empty topology.kubernetes.io/zone label",
			wantRatios: []string{"zone-a=-"},
		},
		{
			name:       "missing allocatable CPU",
			nodes:      []*v1.Node{node("a1", "zone-a", "4"), node("b1", "zone-b", ""), node("c1", "zone-c", "4")},
			wantNode:   "b1",
			wantReason: "node b1 has no allocatable CPU",
			wantRatios: []string{"zone-a=-", "zone-c=-"},
		},
		{
			name:       "zero CPU counts as missing",
			nodes:      []*v1.Node{node("a1", "zone-a", "4"), node("b1", "zone-b", "0")},
			wantNode:   "b1",
			wantReason: "no allocatable CPU",
			wantRatios: []string{"zone-a=-"},
		},
		{
			name:        "a not-Ready node without a zone does not count against",
			nodes:       []*v1.Node{node("a1", "zone-a", "4"), node("b1", "zone-b", "4"), node("x", "", "", notReady)},
			wantRatios:  []string{"zone-a=0.5", "zone-b=0.5"},
			wantIgnored: []string{"x (not Ready)"},

			wantSufficient: true,
		},
		{
			name:        "fewer than 2 zones",
			nodes:       []*v1.Node{node("a1", "zone-a", "4"), node("a2", "zone-a", "4"), node("cp", "zone-b", "4", controlPlane)},
			wantReason:  "fewer than 2 zones: only zone-a",
			wantRatios:  []string{"zone-a=-"},
			wantIgnored: []string{"cp (control-plane)"},
		},
		{
			name:        "no Ready condition at all (hand-written manifests)",
			nodes:       []*v1.Node{node("a1", "zone-a", "4", noConditions), node("b1", "zone-b", "4", noConditions)},
			wantReason:  "no Ready node outside the control plane",
			wantRatios:  []string{},
			wantIgnored: []string{"a1 (no Ready condition)", "b1 (no Ready condition)"},
		},
		{
			name:       "no nodes",
			wantReason: "no Ready node",
			wantRatios: []string{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rep, _ := mustSimulate(t, &kube.Objects{Nodes: tt.nodes}, nil, DefaultOptions())
			info := rep.Nodes
			if info.Sufficient != tt.wantSufficient || info.Node != tt.wantNode || !strings.Contains(info.Reason, tt.wantReason) || (tt.wantReason == "") != (info.Reason == "") {
				t.Errorf("got sufficient=%v node=%q reason=%q, want %v %q %q", info.Sufficient, info.Node, info.Reason, tt.wantSufficient, tt.wantNode, tt.wantReason)
			}
			ratios := []string{}
			for _, z := range info.Zones {
				r := "-"
				if z.CPURatio != nil {
					r = fmt.Sprint(*z.CPURatio)
				}
				ratios = append(ratios, z.Zone+"="+r)
			}
			if fmt.Sprint(ratios) != fmt.Sprint(tt.wantRatios) {
				t.Errorf("ratios %v, want %v", ratios, tt.wantRatios)
			}
			ignored := []string{}
			for _, i := range info.Ignored {
				ignored = append(ignored, fmt.Sprintf("%s (%s)", i.Node, i.Reason))
			}
			if fmt.Sprint(ignored) != fmt.Sprint(nonNil(tt.wantIgnored)) {
				t.Errorf("ignored %v, want %v", ignored, tt.wantIgnored)
			}
		})
	}
}

// TestNodeInfoAgreesWithCache checks the walk against the topology cache
// itself: an Auto Service is refused for insufficient node information
// exactly when the walk says the information is insufficient.
func TestNodeInfoAgreesWithCache(t *testing.T) {
	clusters := map[string][]*v1.Node{
		"ok":           {node("a1", "zone-a", "4"), node("b1", "zone-b", "4")},
		"no zone":      {node("a1", "zone-a", "4"), node("b1", "", "4")},
		"no cpu":       {node("a1", "zone-a", "4"), node("b1", "zone-b", "")},
		"one zone":     {node("a1", "zone-a", "4"), node("a2", "zone-a", "4")},
		"not ready":    {node("a1", "zone-a", "4"), node("b1", "zone-b", "4", notReady)},
		"control only": {node("a1", "zone-a", "4", controlPlane), node("b1", "zone-b", "4", controlPlane)},
		"excluded bad": {node("a1", "zone-a", "4"), node("b1", "zone-b", "4"), node("cp", "", "", controlPlane)},
	}
	for name, nodes := range clusters {
		t.Run(name, func(t *testing.T) {
			objs := &kube.Objects{
				Nodes:    nodes,
				Services: []*v1.Service{autoService("web")},
				Slices:   []*discovery.EndpointSlice{slice("web-1", "web", ep("10.0.0.1", "zone-a", "zone-a"), ep("10.0.0.2", "zone-b", "zone-b"), ep("10.0.0.3", "zone-a", "zone-a"), ep("10.0.0.4", "zone-b", "zone-b"))},
			}
			rep, _ := mustSimulate(t, objs, nil, DefaultOptions())
			refused := strings.HasPrefix(rep.Services[0].DisabledReason, topologycache.InsufficientNodeInfo)
			if refused == rep.Nodes.Sufficient {
				t.Errorf("walk says sufficient=%v, cache says %q", rep.Nodes.Sufficient, rep.Services[0].DisabledReason)
			}
			if refused && rep.Services[0].DisabledDetail != rep.Nodes.Reason {
				t.Errorf("detail %q, want the node reason %q", rep.Services[0].DisabledDetail, rep.Nodes.Reason)
			}
		})
	}
}

func autoService(name string) *v1.Service {
	return service(name, func(s *v1.Service) { s.Annotations = map[string]string{v1.AnnotationTopologyMode: "Auto"} })
}

func service(name string, mods ...func(*v1.Service)) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: v1.ServiceSpec{
			Selector:  map[string]string{"app": name},
			ClusterIP: "10.96.0.1",
			Ports:     []v1.ServicePort{{Port: 80, Protocol: v1.ProtocolTCP}},
		},
	}
	for _, m := range mods {
		m(s)
	}
	return s
}

// ep builds a ready endpoint in zone with zone hints (none when hints is
// empty); mods adjust it.
func ep(addr, zone string, hints ...string) discovery.Endpoint {
	e := discovery.Endpoint{Addresses: []string{addr}}
	if zone != "" {
		e.Zone = ptr.To(zone)
		e.NodeName = ptr.To("node-" + zone)
	}
	if len(hints) > 0 {
		e.Hints = &discovery.EndpointHints{}
		for _, h := range hints {
			e.Hints.ForZones = append(e.Hints.ForZones, discovery.ForZone{Name: h})
		}
	}
	return e
}

func slice(name, svc string, eps ...discovery.Endpoint) *discovery.EndpointSlice {
	return &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "default", Labels: map[string]string{discovery.LabelServiceName: svc}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Port: ptr.To[int32](80), Protocol: ptr.To(v1.ProtocolTCP), Name: ptr.To("")}},
		Endpoints:   eps,
	}
}

func TestChooseMethod(t *testing.T) {
	td := func(v string) func(*v1.Service) {
		return func(s *v1.Service) { s.Spec.TrafficDistribution = ptr.To(v) }
	}
	ann := func(kv ...string) func(*v1.Service) {
		return func(s *v1.Service) {
			s.Annotations = map[string]string{}
			for i := 0; i < len(kv); i += 2 {
				s.Annotations[kv[i]] = kv[i+1]
			}
		}
	}
	const mode, deprecated = v1.AnnotationTopologyMode, v1.DeprecatedAnnotationTopologyAwareHints
	tests := []struct {
		name        string
		svc         *v1.Service
		opts        Options
		wantMethod  Method
		wantTrigger string
		// wantNote is a substring of some note; "" means no notes.
		wantNote string
	}{
		{name: "nothing", svc: service("s"), opts: DefaultOptions(), wantMethod: MethodNone},
		{name: "topology-mode Auto", svc: service("s", ann(mode, "Auto")), opts: DefaultOptions(), wantMethod: MethodTopologyCache, wantTrigger: mode + "=Auto"},
		{name: "topology-mode auto", svc: service("s", ann(mode, "auto")), opts: DefaultOptions(), wantMethod: MethodTopologyCache, wantTrigger: mode + "=auto"},
		{name: "topology-mode AUTO is not Auto", svc: service("s", ann(mode, "AUTO")), opts: DefaultOptions(), wantMethod: MethodNone, wantNote: "only Auto does"},
		{name: "topology-mode Disabled", svc: service("s", ann(mode, "Disabled")), opts: DefaultOptions(), wantMethod: MethodNone},
		{name: "deprecated auto", svc: service("s", ann(deprecated, "auto")), opts: DefaultOptions(), wantMethod: MethodTopologyCache, wantTrigger: deprecated + "=auto"},
		{name: "deprecated hides topology-mode", svc: service("s", ann(deprecated, "disabled", mode, "Auto")), opts: DefaultOptions(), wantMethod: MethodNone, wantNote: "is ignored: while"},
		{name: "deprecated hides even when empty", svc: service("s", ann(deprecated, "", mode, "Auto")), opts: DefaultOptions(), wantMethod: MethodNone, wantNote: "is ignored: while"},
		{name: "annotation wins over trafficDistribution", svc: service("s", ann(mode, "Auto"), td("PreferClose")), opts: DefaultOptions(), wantMethod: MethodTopologyCache, wantTrigger: mode + "=Auto"},
		{name: "annotation Disabled leaves trafficDistribution", svc: service("s", ann(mode, "Disabled"), td("PreferClose")), opts: DefaultOptions(), wantMethod: MethodTrafficDistribution, wantTrigger: "trafficDistribution=PreferClose"},
		{name: "PreferClose", svc: service("s", td("PreferClose")), opts: Options{}, wantMethod: MethodTrafficDistribution, wantTrigger: "trafficDistribution=PreferClose"},
		{name: "PreferSameZone", svc: service("s", td("PreferSameZone")), opts: DefaultOptions(), wantMethod: MethodTrafficDistribution, wantTrigger: "trafficDistribution=PreferSameZone"},
		{name: "PreferSameNode", svc: service("s", td("PreferSameNode")), opts: DefaultOptions(), wantMethod: MethodTrafficDistribution, wantTrigger: "trafficDistribution=PreferSameNode"},
		{name: "PreferSameZone without the gate", svc: service("s", td("PreferSameZone")), opts: Options{}, wantMethod: MethodNone, wantNote: "without the PreferSameTrafficDistribution feature gate"},
		{name: "unknown trafficDistribution", svc: service("s", td("Nearby")), opts: DefaultOptions(), wantMethod: MethodNone, wantNote: "not a value the controller knows"},
		{name: "no selector", svc: service("s", ann(mode, "Auto"), func(s *v1.Service) { s.Spec.Selector = nil }), opts: DefaultOptions(), wantMethod: MethodUnmanaged, wantTrigger: mode + "=Auto", wantNote: "no selector"},
		{name: "empty selector is a selector", svc: service("s", td("PreferClose"), func(s *v1.Service) { s.Spec.Selector = map[string]string{} }), opts: DefaultOptions(), wantMethod: MethodTrafficDistribution, wantTrigger: "trafficDistribution=PreferClose"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, trigger, notes := chooseMethod(tt.svc, tt.opts)
			if m != tt.wantMethod || trigger != tt.wantTrigger {
				t.Errorf("got %s %q, want %s %q", m, trigger, tt.wantMethod, tt.wantTrigger)
			}
			joined := strings.Join(notes, "\n")
			if (tt.wantNote == "") != (joined == "") || !strings.Contains(joined, tt.wantNote) {
				t.Errorf("notes %q, want one containing %q", notes, tt.wantNote)
			}
		})
	}
}

func TestSimulateService(t *testing.T) {
	threeZones := []*v1.Node{node("node-zone-a", "zone-a", "4"), node("node-zone-b", "zone-b", "4"), node("node-zone-c", "zone-c", "4")}
	tests := []struct {
		name  string
		nodes []*v1.Node
		svc   *v1.Service
		eps   []discovery.Endpoint
		// wantReported is false when the Service should be left out.
		wantReported bool
		wantEnabled  bool
		// wantDisabled is a prefix of DisabledReason ("" for none).
		wantDisabled string
		// wantDetail is DisabledDetail.
		wantDetail string
		// wantAlloc is "zone=allocation" per zone; wantLoad is
		// "zone=expectedLoad" with "-" for null.
		wantAlloc, wantLoad string
		// wantChanged counts endpoints whose hints change.
		wantChanged int
	}{
		{
			name:         "balanced Auto keeps its hints",
			nodes:        threeZones,
			svc:          autoService("web"),
			eps:          []discovery.Endpoint{ep("10.0.0.1", "zone-a", "zone-a"), ep("10.0.0.2", "zone-b", "zone-b"), ep("10.0.0.3", "zone-c", "zone-c")},
			wantReported: true, wantEnabled: true,
			wantAlloc: "zone-a=1 zone-b=1 zone-c=1", wantLoad: "zone-a=1 zone-b=1 zone-c=1",
		},
		{
			name:         "Auto adds missing hints",
			nodes:        threeZones,
			svc:          autoService("web"),
			eps:          []discovery.Endpoint{ep("10.0.0.1", "zone-a"), ep("10.0.0.2", "zone-b"), ep("10.0.0.3", "zone-c")},
			wantReported: true, wantEnabled: true,
			wantAlloc: "zone-a=1 zone-b=1 zone-c=1", wantLoad: "zone-a=- zone-b=- zone-c=-",
			wantChanged: 3,
		},
		{
			name:         "Auto with an endpoint without zone",
			nodes:        threeZones,
			svc:          autoService("web"),
			eps:          []discovery.Endpoint{ep("10.0.0.1", "zone-a", "zone-a"), ep("10.0.0.2", "zone-a", "zone-a"), ep("10.0.0.3", "zone-b", "zone-b"), ep("10.0.0.4", "zone-b"), ep("10.0.0.5", "zone-c"), ep("10.0.0.6", "")},
			wantReported: true, wantDisabled: topologycache.NoZoneSpecified, wantDetail: "endpoint 10.0.0.6 (slice s-1) has no zone",
			wantAlloc: "zone-a=0 zone-b=0 zone-c=0", wantLoad: "zone-a=1 zone-b=1 zone-c=-",
			wantChanged: 3,
		},
		{
			name:         "Auto with fewer endpoints than zones",
			nodes:        threeZones,
			svc:          autoService("web"),
			eps:          []discovery.Endpoint{ep("10.0.0.1", "zone-a"), ep("10.0.0.2", "zone-b")},
			wantReported: true, wantDisabled: topologycache.InsufficientNumberOfEndpoints,
			wantAlloc: "zone-a=0 zone-b=0 zone-c=0", wantLoad: "zone-a=- zone-b=- zone-c=-",
		},
		{
			name:  "unready endpoints do not count",
			nodes: threeZones,
			svc:   autoService("web"),
			eps: []discovery.Endpoint{ep("10.0.0.1", "zone-a"), ep("10.0.0.2", "zone-b"), func() discovery.Endpoint {
				e := ep("10.0.0.3", "zone-c")
				e.Conditions.Ready = ptr.To(false)
				return e
			}()},
			wantReported: true, wantDisabled: topologycache.InsufficientNumberOfEndpoints,
			wantAlloc: "zone-a=0 zone-b=0 zone-c=0", wantLoad: "zone-a=- zone-b=- zone-c=-",
		},
		{
			name:         "PreferClose hints each endpoint for its own zone, overload or not",
			nodes:        threeZones,
			svc:          service("web", func(s *v1.Service) { s.Spec.TrafficDistribution = ptr.To("PreferClose") }),
			eps:          []discovery.Endpoint{ep("10.0.0.1", "zone-a", "zone-a"), ep("10.0.0.2", "zone-a", "zone-a"), ep("10.0.0.3", "zone-b", "zone-b"), ep("10.0.0.4", "zone-c", "zone-c")},
			wantReported: true, wantEnabled: true,
			wantAlloc: "zone-a=2 zone-b=1 zone-c=1", wantLoad: "zone-a=0.6667 zone-b=1.3333 zone-c=1.3333",
		},
		{
			name:         "no trigger and no hints: not reported",
			nodes:        threeZones,
			svc:          service("web"),
			eps:          []discovery.Endpoint{ep("10.0.0.1", "zone-a")},
			wantReported: false,
		},
		{
			name:         "no trigger with hints: removed",
			nodes:        threeZones,
			svc:          service("web"),
			eps:          []discovery.Endpoint{ep("10.0.0.1", "zone-a", "zone-a"), ep("10.0.0.2", "zone-b", "zone-b"), ep("10.0.0.3", "zone-c", "zone-c")},
			wantReported: true,
			wantAlloc:    "zone-a=0 zone-b=0 zone-c=0", wantLoad: "zone-a=1 zone-b=1 zone-c=1",
			wantChanged: 3,
		},
		{
			name:  "headless: hints simulated, no load estimate",
			nodes: threeZones,
			svc: service("web", func(s *v1.Service) {
				s.Spec.TrafficDistribution = ptr.To("PreferClose")
				s.Spec.ClusterIP = v1.ClusterIPNone
			}),
			eps:          []discovery.Endpoint{ep("10.0.0.1", "zone-a", "zone-a")},
			wantReported: true, wantEnabled: true,
			wantAlloc: "zone-a=1 zone-b=0 zone-c=0", wantLoad: "zone-a=- zone-b=- zone-c=-",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			objs := &kube.Objects{Nodes: tt.nodes, Services: []*v1.Service{tt.svc}, Slices: []*discovery.EndpointSlice{slice("s-1", tt.svc.Name, tt.eps...)}}
			rep, _ := mustSimulate(t, objs, nil, DefaultOptions())
			if got := len(rep.Services) == 1; got != tt.wantReported {
				t.Fatalf("reported %v, want %v", got, tt.wantReported)
			}
			if !tt.wantReported {
				return
			}
			s := rep.Services[0]
			if s.HintsEnabled != tt.wantEnabled {
				t.Errorf("hintsEnabled %v, want %v", s.HintsEnabled, tt.wantEnabled)
			}
			if (tt.wantDisabled == "") != (s.DisabledReason == "") || !strings.HasPrefix(s.DisabledReason, tt.wantDisabled) {
				t.Errorf("disabledReason %q, want prefix %q", s.DisabledReason, tt.wantDisabled)
			}
			if s.DisabledDetail != tt.wantDetail {
				t.Errorf("disabledDetail %q, want %q", s.DisabledDetail, tt.wantDetail)
			}
			var alloc, load []string
			for _, z := range s.Zones {
				alloc = append(alloc, fmt.Sprintf("%s=%d", z.Zone, z.Allocation))
				l := "-"
				if z.ExpectedLoad != nil {
					l = fmt.Sprint(*z.ExpectedLoad)
				}
				load = append(load, z.Zone+"="+l)
			}
			if got := strings.Join(alloc, " "); got != tt.wantAlloc {
				t.Errorf("allocation %s, want %s", got, tt.wantAlloc)
			}
			if got := strings.Join(load, " "); got != tt.wantLoad {
				t.Errorf("load %s, want %s", got, tt.wantLoad)
			}
			changed := 0
			for _, e := range s.Endpoints {
				if e.Changed {
					changed++
				}
			}
			if changed != tt.wantChanged {
				t.Errorf("%d endpoints changed, want %d", changed, tt.wantChanged)
			}
		})
	}
}

// TestLoadFollowsKubeProxy checks the load model on the cases where
// kube-proxy does not simply keep each zone's traffic on its hinted
// endpoints.
func TestLoadFollowsKubeProxy(t *testing.T) {
	twoZones := []*v1.Node{node("node-zone-a", "zone-a", "4"), node("node-zone-b", "zone-b", "4")}
	withNode := func(e discovery.Endpoint, nodes ...string) discovery.Endpoint {
		for _, n := range nodes {
			e.Hints.ForNodes = append(e.Hints.ForNodes, discovery.ForNode{Name: n})
		}
		return e
	}
	tests := []struct {
		name string
		eps  []discovery.Endpoint
		// wantLoads are the endpoints' expected loads, in slice order.
		wantLoads string
	}{
		{
			name:      "partial hints are ignored: even spread",
			eps:       []discovery.Endpoint{ep("10.0.0.1", "zone-a", "zone-a"), ep("10.0.0.2", "zone-a"), ep("10.0.0.3", "zone-b", "zone-b")},
			wantLoads: "1 1 1",
		},
		{
			name: "a zone with no endpoint hinted for it spreads over all",
			// zone-b's half goes to both; zone-a's half to 10.0.0.1 only.
			eps:       []discovery.Endpoint{ep("10.0.0.1", "zone-a", "zone-a"), ep("10.0.0.2", "zone-a", "zone-c")},
			wantLoads: "1.5 0.5",
		},
		{
			name:      "an endpoint hinted for two zones",
			eps:       []discovery.Endpoint{ep("10.0.0.1", "zone-a", "zone-a", "zone-b"), ep("10.0.0.2", "zone-b", "zone-b")},
			wantLoads: "1.5 0.5",
		},
		{
			name: "node hints win where they name the node",
			// node-zone-a sends to 10.0.0.1 by its node hint; node-zone-b
			// has no node hint and falls back to its zone: 10.0.0.2 and 10.0.0.3.
			eps:       []discovery.Endpoint{withNode(ep("10.0.0.1", "zone-a", "zone-a"), "node-zone-a"), withNode(ep("10.0.0.2", "zone-b", "zone-b"), "node-x"), withNode(ep("10.0.0.3", "zone-b", "zone-b"), "node-y")},
			wantLoads: "1.5 0.75 0.75",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			svc := service("web", func(s *v1.Service) { s.Spec.Selector = nil })
			objs := &kube.Objects{Nodes: twoZones, Services: []*v1.Service{svc}, Slices: []*discovery.EndpointSlice{slice("s-1", "web", tt.eps...)}}
			rep, _ := mustSimulate(t, objs, nil, DefaultOptions())
			var loads []string
			for _, e := range rep.Services[0].Endpoints {
				l := "-"
				if e.ExpectedLoad != nil {
					l = fmt.Sprint(*e.ExpectedLoad)
				}
				loads = append(loads, l)
			}
			if got := strings.Join(loads, " "); got != tt.wantLoads {
				t.Errorf("loads %s, want %s", got, tt.wantLoads)
			}
		})
	}
}

// TestSimulatePerFamilyAndFilters: each family's slices are simulated on
// their own, as the controller reconciles each address type (the IPv6
// slices' hints are the IPv6 entry's, with its own loads); FQDN slices are
// skipped with a warning; --service filters.
func TestSimulatePerFamilyAndFilters(t *testing.T) {
	nodes := []*v1.Node{node("a", "zone-a", "4"), node("b", "zone-b", "4")}
	v6 := slice("web-v6", "web", ep("fd00::1", "zone-a", "zone-a"), ep("fd00::2", "zone-b", "zone-a"), ep("fd00::3", "zone-b", "zone-a"))
	v6.AddressType = discovery.AddressTypeIPv6
	fqdn := slice("web-fqdn", "web", ep("web.example", "zone-a"))
	fqdn.AddressType = discovery.AddressTypeFQDN
	web := service("web", func(s *v1.Service) {
		s.Annotations = map[string]string{v1.AnnotationTopologyMode: "Auto"}
		s.Spec.ClusterIPs = []string{"10.96.0.1", "fd00:10:96::1"}
	})
	objs := &kube.Objects{
		Nodes:    nodes,
		Services: []*v1.Service{web, autoService("api")},
		Slices:   []*discovery.EndpointSlice{v6, fqdn, slice("web-1", "web", ep("10.0.0.1", "zone-a"), ep("10.0.0.2", "zone-b")), slice("api-1", "api", ep("10.0.1.1", "zone-a"), ep("10.0.1.2", "zone-b"))},
	}
	rep, warnings := mustSimulate(t, objs, nil, DefaultOptions())
	var got []string
	for _, svc := range rep.Services {
		got = append(got, fmt.Sprintf("%s %s %d", svc.Service, svc.Family, len(svc.Endpoints)))
	}
	if want := []string{"default/api IPv4 2", "default/web IPv4 2", "default/web IPv6 3"}; !slices.Equal(got, want) {
		t.Fatalf("services %q, want %q", got, want)
	}
	// The IPv6 slice's hints all name zone-a: the controller would give
	// zone-b its own, so some IPv6 endpoints change. The IPv4 slice has
	// no hints and is decided apart.
	v6svc := rep.Services[2]
	for _, e := range v6svc.Endpoints {
		if !strings.HasPrefix(e.Address, "fd00::") {
			t.Errorf("IPv6 entry lists %s", e.Address)
		}
	}
	if !slices.ContainsFunc(v6svc.Endpoints, func(e Endpoint) bool { return e.Changed }) {
		t.Errorf("IPv6 hints all for zone-a: the controller would change some; endpoints %+v", v6svc.Endpoints)
	}
	if slices.ContainsFunc(rep.Services[1].Endpoints, func(e Endpoint) bool { return strings.Contains(e.Address, ":") }) {
		t.Errorf("IPv4 entry lists IPv6 endpoints: %+v", rep.Services[1].Endpoints)
	}
	if len(warnings) != 1 || !strings.Contains(warnings[0], "web-fqdn: addressType FQDN is not simulated") {
		t.Errorf("warnings %q, want one about web-fqdn", warnings)
	}
	rep, warnings = mustSimulate(t, objs, &types.NamespacedName{Namespace: "default", Name: "api"}, DefaultOptions())
	if len(rep.Services) != 1 || rep.Services[0].Service != "default/api" {
		t.Errorf("filtered services %+v, want default/api only", rep.Services)
	}
	if len(warnings) != 0 {
		t.Errorf("filtered warnings %q, want none (web-fqdn belongs to another Service)", warnings)
	}
}

// TestZoneWeightedEstimate checks the zone-weighted columns: the in-zone
// share each zone's nodes keep and the loads, against the example
// and a cluster whose node information the controller cannot use.
func TestZoneWeightedEstimate(t *testing.T) {
	tests := []struct {
		name  string
		nodes []*v1.Node
		eps   []discovery.Endpoint
		// wantShares are "zone=share" per zone, "-" for none; wantLoads
		// the endpoints' zone-weighted loads in slice order.
		wantShares, wantLoads string
		// wantHintLoads are the endpoints' loads under the current hints.
		wantHintLoads string
		wantNote      string
	}{
		{
			name:  "issue example: zone-a keeps 2/3, zone-b everything, every endpoint 1.0",
			nodes: []*v1.Node{node("a1", "zone-a", "4"), node("b1", "zone-b", "4")},
			eps:   []discovery.Endpoint{ep("10.0.0.1", "zone-a", "zone-a"), ep("10.0.0.2", "zone-b", "zone-b"), ep("10.0.0.3", "zone-b", "zone-b")},
			// Hints: zone-a's half all on 10.0.0.1.
			wantShares: "zone-a=0.6667 zone-b=1", wantLoads: "1 1 1", wantHintLoads: "1.5 0.75 0.75",
		},
		{
			name: "insufficient node information: ZoneWeighted's own demand, by node count",
			// b1 has no CPU: the controller gives up; ZoneWeighted counts nodes.
			nodes: []*v1.Node{node("a1", "zone-a", "4"), node("a2", "zone-a", "4"), node("b1", "zone-b", "")},
			eps:   []discovery.Endpoint{ep("10.0.0.1", "zone-a"), ep("10.0.0.2", "zone-b")},
			// D_a = 2/3, S_a = 1/2: zone-a keeps 3/4, spills 1/4 to zone-b.
			wantShares: "zone-a=0.75 zone-b=1", wantLoads: "1 1", wantHintLoads: "- -",
			wantNote: "zone-weighted loads assume ZoneWeighted's own demand: nodes with a zone that are not Ready=False, weighed by node count (node b1 has no allocatable CPU)",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			svc := autoService("web")
			objs := &kube.Objects{Nodes: tt.nodes, Services: []*v1.Service{svc}, Slices: []*discovery.EndpointSlice{slice("s-1", "web", tt.eps...)}}
			rep, _ := mustSimulate(t, objs, nil, DefaultOptions())
			s := rep.Services[0]
			var shares, loads, hintLoads []string
			for _, z := range s.Zones {
				shares = append(shares, z.Zone+"="+optString(z.ZoneWeightedShare))
			}
			for _, e := range s.Endpoints {
				loads = append(loads, optString(e.ZoneWeightedLoad))
				hintLoads = append(hintLoads, optString(e.ExpectedLoad))
			}
			if got := strings.Join(shares, " "); got != tt.wantShares {
				t.Errorf("in-zone shares %s, want %s", got, tt.wantShares)
			}
			if got := strings.Join(loads, " "); got != tt.wantLoads {
				t.Errorf("zone-weighted loads %s, want %s", got, tt.wantLoads)
			}
			if got := strings.Join(hintLoads, " "); got != tt.wantHintLoads {
				t.Errorf("current-hint loads %s, want %s", got, tt.wantHintLoads)
			}
			if tt.wantNote != "" && !slices.Contains(s.Notes, tt.wantNote) {
				t.Errorf("notes %q lack %q", s.Notes, tt.wantNote)
			}
		})
	}
}

func optString(f *float64) string {
	if f == nil {
		return "-"
	}
	return fmt.Sprint(*f)
}

// mustSimulate runs Simulate and fails the test on an error.
func mustSimulate(t *testing.T, objs *kube.Objects, only *types.NamespacedName, opts Options) (Report, []string) {
	t.Helper()
	rep, warnings, err := Simulate(objs, only, opts)
	if err != nil {
		t.Fatalf("Simulate: %v", err)
	}
	return rep, warnings
}

func TestSimulateRefusesBadCPU(t *testing.T) {
	for _, tc := range []struct {
		name, cpu, want string
	}{
		{name: "negative", cpu: "-4", want: "node b1: allocatable cpu -4 is negative"},
		{name: "absurd", cpu: "100001", want: "node b1: allocatable cpu 100001 is more than 100000 cores"},
		{name: "absurd exponent", cpu: "1e30", want: "node b1: allocatable cpu 1e30 is more than 100000 cores"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objs := &kube.Objects{Nodes: []*v1.Node{node("a1", "zone-a", "4"), node("b1", "zone-b", tc.cpu)}}
			_, _, err := Simulate(objs, nil, DefaultOptions())
			if !errors.Is(err, ErrBadCPU) || err.Error() != tc.want+": "+ErrBadCPU.Error() {
				t.Errorf("error = %v, want %q wrapping ErrBadCPU", err, tc.want)
			}
		})
	}
	// The largest sensible CPU and zero are accepted (zero is the
	// controller's "no CPU", reported as insufficient information).
	objs := &kube.Objects{Nodes: []*v1.Node{node("a1", "zone-a", "100000"), node("b1", "zone-b", "0")}}
	rep, _ := mustSimulate(t, objs, nil, DefaultOptions())
	if rep.Nodes.Sufficient || rep.Nodes.Node != "b1" {
		t.Errorf("node info %+v, want insufficient because of b1", rep.Nodes)
	}
}
