package agent

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/topolb/topolb/kube"
	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// nodeWithIP is node() with an InternalIP, so NodePorts are served on it.
func nodeWithIP(name, zone, ip string) *v1.Node {
	n := node(name, zone)
	n.Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: ip}}
	return n
}

// external is service() as a NodePort Service with an external IP and the
// given externalTrafficPolicy.
func external(name, ip string, etp v1.ServiceExternalTrafficPolicy) *v1.Service {
	s := service(name, ip, nil)
	s.Spec.Type = v1.ServiceTypeNodePort
	s.Spec.ExternalTrafficPolicy = etp
	s.Spec.ExternalIPs = []string{"198.51.100.7"}
	s.Spec.Ports[0].NodePort = 30080
	s.Spec.Ports[1].NodePort = 30053
	return s
}

// syncAll applies objects to a fresh agent for node a1 (10.250.0.2) and
// returns the agent, its fake datapath and tracker.
func syncAll(t *testing.T, objs ...any) (*Agent, *fakeDP, *kube.Tracker) {
	t.Helper()
	dp := newFakeDP()
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions()}, dp)
	tr := kube.NewTracker()
	for _, o := range objs {
		switch o := o.(type) {
		case *v1.Node:
			tr.NodeChanged(nil, o)
		case *v1.Service:
			tr.ServiceChanged(nil, o)
		case *discovery.EndpointSlice:
			tr.SliceChanged(nil, o)
		default:
			t.Fatalf("unexpected object %T", o)
		}
	}
	tr.Resync()
	if res := a.Apply(tr.Drain()); len(res.Errors) > 0 {
		t.Fatalf("apply: %v", res.Errors)
	}
	return a, dp, tr
}

// TestAgentExternalTrafficPolicyLocal: with externalTrafficPolicy Local,
// traffic arriving from outside (external scope) may only reach this node's
// endpoints, while traffic from inside the node to the same external
// addresses uses the cluster set (kube-proxy's short-circuit), and the
// cluster IP the internal set.
func TestAgentExternalTrafficPolicyLocal(t *testing.T) {
	local := endpoint{"10.0.1.1", "a1", "zone-a", "", true}
	remote := endpoint{"10.0.2.1", "b1", "zone-b", "", true}
	_, dp, _ := syncAll(t, nodeWithIP("a1", "zone-a", "10.250.0.2"), nodeWithIP("b1", "zone-b", "10.250.0.3"),
		external("web", "10.96.0.1", v1.ServiceExternalTrafficPolicyLocal), epSlice("web", "web-1", local, remote))
	both := []string{"10.0.1.1:8080", "10.0.2.1:8080"}
	want := map[string][]string{
		"10.96.0.1:80/TCP":              both,
		"198.51.100.7:80/TCP":           both,
		"198.51.100.7:80/TCP/external":  {"10.0.1.1:8080"},
		"10.250.0.2:30080/TCP":          both,
		"10.250.0.2:30080/TCP/external": {"10.0.1.1:8080"},
	}
	got := dp.programmed()
	for fe, bes := range want {
		if !slices.Equal(got[fe], bes) {
			t.Errorf("%s: %v, want %v", fe, got[fe], bes)
		}
	}
	// The remote endpoint still serves: from outside it drains (flows
	// that reached it keep it), it is not gone.
	if d := dp.draining()["10.250.0.2:30080/TCP/external"]; !slices.Equal(d, []string{"10.0.2.1:8080"}) {
		t.Errorf("external NodePort draining %v, want the remote endpoint", d)
	}
	if n := len(got); n != 10 {
		t.Errorf("%d frontends programmed, want 10 (cluster IP, external IP ×2 scopes, NodePort ×2 scopes, for TCP and UDP): %v", n, got)
	}
}

// TestAgentBackendFlags: node-local and zone-local are as seen from this
// node, and never zone-local when this node has no zone.
func TestAgentBackendFlags(t *testing.T) {
	for _, tc := range []struct {
		name, zone string
		want       map[string][2]bool // backend -> {node-local, zone-local}
	}{
		{"zoned node", "zone-a", map[string][2]bool{"10.0.1.1:8080": {true, true}, "10.0.1.2:8080": {false, true}, "10.0.2.1:8080": {false, false}, "10.0.3.1:8080": {false, false}}},
		{"node without zone", "", map[string][2]bool{"10.0.1.1:8080": {true, false}, "10.0.1.2:8080": {false, false}, "10.0.2.1:8080": {false, false}, "10.0.3.1:8080": {false, false}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := node("a1", tc.zone)
			if tc.zone == "" {
				delete(n.Labels, topology.LabelZone)
			}
			_, dp, _ := syncAll(t, n, service("web", "10.96.0.1", nil), epSlice("web", "web-1",
				endpoint{"10.0.1.1", "a1", "zone-a", "", true},
				endpoint{"10.0.1.2", "a2", "zone-a", "", true},
				endpoint{"10.0.2.1", "b1", "zone-b", "", true},
				endpoint{"10.0.3.1", "c1", "", "", true})) // no zone: never zone-local
			got := map[string][2]bool{}
			for _, b := range dp.fes[tcpFE("10.96.0.1:80")].Backends {
				got[b.Addr.String()] = [2]bool{b.NodeLocal, b.ZoneLocal}
			}
			if !maps.Equal(got, tc.want) {
				t.Errorf("flags %v, want %v", got, tc.want)
			}
		})
	}
}

func tcpFE(addr string) dpmaps.Frontend {
	return dpmaps.Frontend{Addr: netip.MustParseAddrPort(addr), Proto: dpmaps.TCP}
}

// TestAgentDraining: serving-terminating endpoints while ready ones exist,
// and serving endpoints the mode leaves out, are programmed draining; an
// endpoint removed from the slice is not programmed at all.
func TestAgentDraining(t *testing.T) {
	hinted := epSlice("web", "web-1",
		endpoint{"10.0.1.1", "a1", "zone-a", "zone-a", true},
		endpoint{"10.0.2.1", "b1", "zone-b", "zone-b", true})
	terminating := hinted.DeepCopy()
	terminating.Endpoints = append(terminating.Endpoints, discovery.Endpoint{Addresses: []string{"10.0.1.9"},
		NodeName: ptr.To("a1"), Zone: ptr.To("zone-a"), Hints: &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: "zone-a"}}},
		Conditions: discovery.EndpointConditions{Ready: ptr.To(false), Serving: ptr.To(true), Terminating: ptr.To(true)}})
	a, dp, tr := syncAll(t, node("a1", "zone-a"), service("web", "10.96.0.1", nil), terminating)
	if got := dp.programmed()["10.96.0.1:80/TCP"]; !slices.Equal(got, []string{"10.0.1.1:8080"}) {
		t.Errorf("active %v, want the zone-a ready endpoint", got)
	}
	if got := dp.draining()["10.96.0.1:80/TCP"]; !slices.Equal(got, []string{"10.0.1.9:8080", "10.0.2.1:8080"}) {
		t.Errorf("draining %v, want the terminating endpoint and the other zone's", got)
	}
	tr.SliceChanged(terminating, hinted)
	a.Apply(tr.Drain())
	if got := dp.draining()["10.96.0.1:80/TCP"]; !slices.Equal(got, []string{"10.0.2.1:8080"}) {
		t.Errorf("after removal draining %v: the removed endpoint must be gone", got)
	}
}

// TestAgentOtherNodeChanges: a Node other than this one matters to the
// services whose policy reads other nodes — topology-keys (their labels)
// and zone-weighted (their zone, CPU and readiness) — and to no other.
func TestAgentOtherNodeChanges(t *testing.T) {
	keys := service("keys", "10.96.0.2", map[string]string{topology.AnnotationTopologyKeys: "rack,*"})
	hints := service("hints", "10.96.0.3", nil)
	rack := func(n *v1.Node, r string) *v1.Node { n.Labels["rack"] = r; return n }
	a1, b1 := rack(node("a1", "zone-a"), "r1"), rack(node("b1", "zone-b"), "r2")
	a, dp, tr := syncAll(t, a1, b1, keys, hints,
		epSlice("keys", "keys-1", endpoint{"10.0.1.1", "a1", "zone-a", "", true}, endpoint{"10.0.2.1", "b1", "zone-b", "", true}),
		epSlice("hints", "hints-1", endpoint{"10.0.1.2", "a1", "zone-a", "", true}))
	if got := dp.programmed()["10.96.0.2:80/TCP"]; !slices.Equal(got, []string{"10.0.1.1:8080"}) {
		t.Fatalf("rack r1: %v", got)
	}
	tr.NodeChanged(b1, rack(node("b1", "zone-b"), "r1"))
	res := a.Apply(tr.Drain())
	if got := dp.programmed()["10.96.0.2:80/TCP"]; !slices.Equal(got, []string{"10.0.1.1:8080", "10.0.2.1:8080"}) {
		t.Errorf("after b1 moved to rack r1: %v, want both", got)
	}
	if res.Services != 1 {
		t.Errorf("another node's label change decided %d services, want 1 (only topology-keys reads it)", res.Services)
	}
}

// TestAgentZoneWeighted: unequal weights reach the datapath as integers in
// the decision's proportions; a change of another node's CPU re-decides.
func TestAgentZoneWeighted(t *testing.T) {
	cpu := func(n *v1.Node, c string) *v1.Node {
		n.Status.Allocatable = v1.ResourceList{v1.ResourceCPU: resourceQuantity(c)}
		return n
	}
	svc := service("web", "10.96.0.1", map[string]string{topology.AnnotationZoneWeighted: "true"})
	b1 := cpu(node("b1", "zone-b"), "4")
	a, dp, tr := syncAll(t, cpu(node("a1", "zone-a"), "4"), b1, svc, epSlice("web", "web-1",
		endpoint{"10.0.1.1", "a1", "zone-a", "", true},
		endpoint{"10.0.2.1", "b1", "zone-b", "", true},
		endpoint{"10.0.2.2", "b1", "zone-b", "", true}))
	// zone-a has 1 of 3 endpoints and half the demand: it keeps 2/3 and
	// sends 1/6 to each zone-b endpoint (issue 13's example).
	got := weightsOf(dp.fes[tcpFE("10.96.0.1:80")])
	want := map[string]uint32{"10.0.1.1:8080": 666667, "10.0.2.1:8080": 166667, "10.0.2.2:8080": 166667}
	if !maps.Equal(got, want) {
		t.Errorf("weights %v, want %v", got, want)
	}
	// zone-b growing to 3 times zone-a's CPU: zone-a's share of demand
	// falls to 1/4, below its 1/3 of the endpoints, so it keeps all.
	tr.NodeChanged(b1, cpu(node("b1", "zone-b"), "12"))
	a.Apply(tr.Drain())
	if got := dp.programmed()["10.96.0.1:80/TCP"]; !slices.Equal(got, []string{"10.0.1.1:8080"}) {
		t.Errorf("after zone-b's CPU grew: active %v, want only the zone-a endpoint", got)
	}
}

func weightsOf(s dpmaps.Service) map[string]uint32 {
	out := map[string]uint32{}
	for _, b := range s.Backends {
		if !b.Draining {
			out[b.Addr.String()] = b.Weight
		}
	}
	return out
}

// TestAgentSettings: session affinity with its timeout, and reject when the
// Service has no usable endpoint anywhere, but drop when the policy leaves
// this node without backends.
func TestAgentSettings(t *testing.T) {
	aff := service("aff", "10.96.0.1", nil)
	aff.Spec.SessionAffinity = v1.ServiceAffinityClientIP
	aff.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](60)}}
	empty := service("empty", "10.96.0.2", nil)
	local := service("local", "10.96.0.3", nil)
	local.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)
	_, dp, _ := syncAll(t, node("a1", "zone-a"), aff, empty, local,
		epSlice("aff", "aff-1", endpoint{"10.0.1.1", "a1", "zone-a", "", true}),
		epSlice("local", "local-1", endpoint{"10.0.2.1", "b1", "zone-b", "", true}))
	for _, tc := range []struct {
		fe       string
		affinity time.Duration
		reject   bool
	}{
		{"10.96.0.1:80", time.Minute, false},
		{"10.96.0.2:80", 0, true},
		{"10.96.0.3:80", 0, false},
	} {
		s, ok := dp.fes[tcpFE(tc.fe)]
		if !ok {
			t.Errorf("%s not programmed", tc.fe)
			continue
		}
		if s.Affinity != tc.affinity || s.Reject != tc.reject {
			t.Errorf("%s: affinity %v reject %v, want %v %v", tc.fe, s.Affinity, s.Reject, tc.affinity, tc.reject)
		}
	}
}

// TestAgentClaimOrder: whichever order the agent learns two claims on one
// frontend in, the claim that ranks first (the older Service) ends up
// owning it, as explain says.
func TestAgentClaimOrder(t *testing.T) {
	older := service("zz-older", "10.96.0.5", nil)
	older.CreationTimestamp = metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	newer := service("aa-newer", "10.96.0.5", nil)
	newer.CreationTimestamp = metav1.NewTime(time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC))
	eps := []*discovery.EndpointSlice{
		epSlice("zz-older", "o", endpoint{"10.0.0.1", "a1", "zone-a", "", true}),
		epSlice("aa-newer", "n", endpoint{"10.0.0.2", "a1", "zone-a", "", true}),
	}
	for _, first := range []*v1.Service{newer, older} {
		t.Run(fmt.Sprintf("%s first", first.Name), func(t *testing.T) {
			dp := newFakeDP()
			a := New(Config{NodeName: "a1", Options: topology.DefaultOptions()}, dp)
			tr := kube.NewTracker()
			tr.NodeChanged(nil, node("a1", "zone-a"))
			for _, es := range eps {
				tr.SliceChanged(nil, es)
			}
			tr.ServiceChanged(nil, first)
			tr.Resync()
			a.Apply(tr.Drain())
			for _, s := range []*v1.Service{newer, older} {
				if s != first {
					tr.ServiceChanged(nil, s)
				}
			}
			a.Apply(tr.Drain())
			if got := dp.programmed()["10.96.0.5:80/TCP"]; !slices.Equal(got, []string{"10.0.0.1:8080"}) {
				t.Errorf("owner's backends %v, want the older Service's", got)
			}
			// The owner gone, the newer Service gets the frontend in the
			// same sync, whether it lost it to a takeover or never had it.
			tr.ServiceChanged(older, nil)
			a.Apply(tr.Drain())
			if got := dp.programmed()["10.96.0.5:80/TCP"]; !slices.Equal(got, []string{"10.0.0.2:8080"}) {
				t.Errorf("after the owner was deleted: %v, want the newer Service's backends", got)
			}
		})
	}
}

// TestAgentSameServiceClaims: two ports of one Service that claim one
// frontend (here the same nodePort, which the API refuses but a manifest
// can hold) give it to the port that ranks first: the first in spec.ports.
func TestAgentSameServiceClaims(t *testing.T) {
	svc := service("web", "10.96.0.1", nil)
	svc.Spec.Type = v1.ServiceTypeNodePort
	svc.Spec.Ports = []v1.ServicePort{
		{Name: "http", Port: 80, Protocol: v1.ProtocolTCP, NodePort: 30080},
		{Name: "alt", Port: 81, Protocol: v1.ProtocolTCP, NodePort: 30080},
	}
	es := epSlice("web", "web-1", endpoint{"10.0.1.1", "a1", "zone-a", "", true})
	es.Ports = append(es.Ports, discovery.EndpointPort{Name: ptr.To("alt"), Port: ptr.To[int32](9090), Protocol: ptr.To(v1.ProtocolTCP)})
	_, dp, _ := syncAll(t, nodeWithIP("a1", "zone-a", "10.250.0.2"), svc, es)
	got := dp.programmed()
	for fe, want := range map[string][]string{
		"10.96.0.1:80/TCP":              {"10.0.1.1:8080"},
		"10.96.0.1:81/TCP":              {"10.0.1.1:9090"},
		"10.250.0.2:30080/TCP":          {"10.0.1.1:8080"},
		"10.250.0.2:30080/TCP/external": {"10.0.1.1:8080"},
	} {
		if !slices.Equal(got[fe], want) {
			t.Errorf("%s: %v, want %v (port http owns the nodePort)", fe, got[fe], want)
		}
	}
}

func resourceQuantity(s string) resource.Quantity { return resource.MustParse(s) }

// TestAgentSourceRanges: loadBalancerSourceRanges reach the datapath on the
// load-balancer IP's frontends, both scopes, and nowhere else; the node
// passes when a range holds its address.
func TestAgentSourceRanges(t *testing.T) {
	lb := external("lb", "10.96.0.1", v1.ServiceExternalTrafficPolicyCluster)
	lb.Spec.Type = v1.ServiceTypeLoadBalancer
	lb.Spec.LoadBalancerSourceRanges = []string{"203.0.113.0/24", "10.250.0.0/16"}
	lb.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "198.51.100.20"}}
	_, dp, _ := syncAll(t, nodeWithIP("a1", "zone-a", "10.250.0.2"), lb,
		epSlice("lb", "lb-1", endpoint{"10.0.1.1", "a1", "zone-a", "", true}))
	want := []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24"), netip.MustParsePrefix("10.250.0.0/16"), netip.MustParsePrefix("198.51.100.20/32")}
	restricted := 0
	for fe, s := range dp.fes {
		isLB := fe.Addr.Addr() == netip.MustParseAddr("198.51.100.20")
		switch {
		case isLB && (!slices.Equal(s.SourceRanges, want) || !s.SourceRangesNode):
			t.Errorf("%s: source ranges %v node %v, want %v and the node passing", fe, s.SourceRanges, s.SourceRangesNode, want)
		case !isLB && (s.SourceRanges != nil || s.SourceRangesNode):
			t.Errorf("%s: source ranges %v on a frontend that is not a load-balancer IP", fe, s.SourceRanges)
		case isLB:
			restricted++
		}
	}
	if restricted != 4 { // TCP and UDP, internal and external
		t.Errorf("%d load-balancer IP frontends restricted, want 4", restricted)
	}
}

// TestServiceName: a frontend is named "namespace/name:port", or
// "namespace/name" for the one unnamed port a Service may have.
func TestServiceName(t *testing.T) {
	for _, tt := range []struct {
		name string
		port topology.ServicePort
		want string
	}{
		{name: "named", port: topology.ServicePort{Service: types.NamespacedName{Namespace: "default", Name: "web"}, Name: "http"}, want: "default/web:http"},
		{name: "unnamed", port: topology.ServicePort{Service: types.NamespacedName{Namespace: "kube-system", Name: "dns"}}, want: "kube-system/dns"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := ServiceName(tt.port); got != tt.want {
				t.Errorf("ServiceName = %q, want %q", got, tt.want)
			}
		})
	}
}
