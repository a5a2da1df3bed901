package agent

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/topolb/topolb/kube"
	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

type fakeEvents struct{ modes, failures, refusals []string }

func (e *fakeEvents) ModeChanged(svc *v1.Service, port string, from, to topology.Mode, _ string) {
	e.modes = append(e.modes, fmt.Sprintf("%s/%s:%s %s->%s", svc.Namespace, svc.Name, port, from, to))
}
func (e *fakeEvents) ProgramFailed(svc *v1.Service, err error) {
	e.failures = append(e.failures, svc.Name+": "+err.Error())
}
func (e *fakeEvents) ServiceRefused(svc *v1.Service, r topology.Refusal) {
	e.refusals = append(e.refusals, svc.Name+": "+r.String())
}

func node(name, zone string) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{topology.LabelZone: zone, topology.LabelHostname: name}}}
}

func service(name, ip string, ann map[string]string) *v1.Service {
	return &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, Annotations: ann},
		Spec: v1.ServiceSpec{ClusterIP: ip, ClusterIPs: []string{ip}, Ports: []v1.ServicePort{
			{Name: "http", Port: 80, Protocol: v1.ProtocolTCP},
			{Name: "dns", Port: 53, Protocol: v1.ProtocolUDP},
		}},
	}
}

type endpoint struct {
	ip, node, zone string
	hint           string // zone hint, "" for none
	ready          bool
}

func epSlice(svc, name string, eps ...endpoint) *discovery.EndpointSlice {
	tcp, udp := v1.ProtocolTCP, v1.ProtocolUDP
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: name, Labels: map[string]string{discovery.LabelServiceName: svc}},
		AddressType: discovery.AddressTypeIPv4,
		Ports: []discovery.EndpointPort{
			{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: &tcp},
			{Name: ptr.To("dns"), Port: ptr.To[int32](5353), Protocol: &udp},
		},
	}
	for _, e := range eps {
		de := discovery.Endpoint{Addresses: []string{e.ip}, NodeName: ptr.To(e.node), Zone: ptr.To(e.zone),
			Conditions: discovery.EndpointConditions{Ready: ptr.To(e.ready)}}
		if e.hint != "" {
			de.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: e.hint}}}
		}
		s.Endpoints = append(s.Endpoints, de)
	}
	return s
}

func TestAgentApply(t *testing.T) {
	dp := newFakeDP()
	ev := &fakeEvents{}
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), Events: ev}, dp)
	tr := kube.NewTracker()

	// A frontend left by a previous agent must survive until the first
	// full sync, then be removed.
	stale := dpmaps.Frontend{Addr: netip.MustParseAddrPort("10.96.9.9:80"), Proto: dpmaps.TCP}
	dp.fes[stale] = dpmaps.Service{Backends: []dpmaps.Backend{{Addr: netip.MustParseAddrPort("10.0.9.9:80")}}}

	for _, n := range []*v1.Node{node("a1", "zone-a"), node("b1", "zone-b")} {
		tr.NodeChanged(nil, n)
	}
	tr.ServiceChanged(nil, service("web", "10.96.0.1", nil))
	web1 := epSlice("web", "web-1",
		endpoint{"10.0.1.1", "a1", "zone-a", "zone-a", true},
		endpoint{"10.0.2.1", "b1", "zone-b", "zone-b", true})
	tr.SliceChanged(nil, web1)
	a.Apply(tr.Drain())
	if _, ok := dp.fes[stale]; !ok {
		t.Fatalf("stale frontend removed before the first full sync")
	}
	if a.Synced() {
		t.Fatalf("synced before a resync")
	}
	tr.Resync()
	a.Apply(tr.Drain())
	want := map[string][]string{
		"10.96.0.1:80/TCP": {"10.0.1.1:8080"},
		"10.96.0.1:53/UDP": {"10.0.1.1:5353"},
	}
	if got := dp.programmed(); !maps.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("after first sync: %v, want %v", got, want)
	}
	if !a.Synced() {
		t.Fatalf("not synced after resync")
	}
	// Every frontend is named by its Service port, for readers of the
	// pinned maps (topolbctl maps).
	for fe, wantName := range map[string]string{"10.96.0.1:80/TCP": "default/web:http", "10.96.0.1:53/UDP": "default/web:dns"} {
		var name string
		for f, s := range dp.fes {
			if f.String() == fe {
				name = s.Name
			}
		}
		if name != wantName {
			t.Errorf("%s named %q, want %q", fe, name, wantName)
		}
	}

	// One endpoint losing its hint flips the whole service to all
	// endpoints (never a per-endpoint filter) and emits an event per port.
	web1b := epSlice("web", "web-1",
		endpoint{"10.0.1.1", "a1", "zone-a", "zone-a", true},
		endpoint{"10.0.2.1", "b1", "zone-b", "", true})
	tr.SliceChanged(web1, web1b)
	a.Apply(tr.Drain())
	want = map[string][]string{
		"10.96.0.1:80/TCP": {"10.0.1.1:8080", "10.0.2.1:8080"},
		"10.96.0.1:53/UDP": {"10.0.1.1:5353", "10.0.2.1:5353"},
	}
	if got := dp.programmed(); !maps.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("after hint removal: %v, want %v", got, want)
	}
	wantEvents := []string{"default/web:dns PreferSameZone->None", "default/web:http PreferSameZone->None"}
	slices.Sort(ev.modes)
	if !slices.Equal(ev.modes, wantEvents) {
		t.Errorf("events %v, want %v", ev.modes, wantEvents)
	}

	// A no-op update (same content, new object) costs nothing.
	before := dp.writes
	tr.SliceChanged(web1b, web1b.DeepCopy())
	if b := tr.Drain(); !b.Empty() {
		t.Errorf("no-op slice update not dropped: %+v", b)
	}
	a.Apply(kube.Batch{})
	if dp.writes != before {
		t.Errorf("no-op cost %d writes", dp.writes-before)
	}

	// This node moving to zone-b changes its decisions.
	tr.SliceChanged(web1b, web1)
	tr.NodeChanged(node("a1", "zone-a"), node("a1", "zone-b"))
	a.Apply(tr.Drain())
	if got := dp.programmed()["10.96.0.1:80/TCP"]; !slices.Equal(got, []string{"10.0.2.1:8080"}) {
		t.Errorf("after node moved to zone-b: %v", got)
	}

	// A failed write keeps the previous backends and is retried.
	fe := dpmaps.Frontend{Addr: netip.MustParseAddrPort("10.96.0.1:80"), Proto: dpmaps.TCP}
	dp.fail[fe] = fmt.Errorf("update: %w", dpmaps.ErrMapFull)
	tr.NodeChanged(node("a1", "zone-b"), node("a1", "zone-a"))
	res := a.Apply(tr.Drain())
	if len(res.Errors) != 1 || !errors.Is(res.Errors[0], dpmaps.ErrMapFull) {
		t.Fatalf("errors %v, want one map-full", res.Errors)
	}
	if got := dp.programmed()["10.96.0.1:80/TCP"]; !slices.Equal(got, []string{"10.0.2.1:8080"}) {
		t.Errorf("failed write changed the frontend: %v", got)
	}
	if got := dp.programmed()["10.96.0.1:53/UDP"]; !slices.Equal(got, []string{"10.0.1.1:5353"}) {
		t.Errorf("other frontend of the service not programmed: %v", got)
	}
	if len(ev.failures) != 1 {
		t.Errorf("failure events %v", ev.failures)
	}
	delete(dp.fail, fe)
	a.Apply(kube.Batch{}) // the retry tick
	if got := dp.programmed()["10.96.0.1:80/TCP"]; !slices.Equal(got, []string{"10.0.1.1:8080"}) {
		t.Errorf("retry did not program: %v", got)
	}

	// Deleting the service deletes its frontends.
	tr.ServiceChanged(service("web", "10.96.0.1", nil), nil)
	a.Apply(tr.Drain())
	if len(dp.fes) != 0 {
		t.Errorf("frontends left after delete: %v", dp.programmed())
	}
}

func TestAgentSingleEndpointChangeIsIncremental(t *testing.T) {
	dp := newFakeDP()
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions()}, dp)
	tr := kube.NewTracker()
	tr.NodeChanged(nil, node("a1", "zone-a"))
	for i := range 50 {
		tr.ServiceChanged(nil, service(fmt.Sprintf("s%d", i), fmt.Sprintf("10.96.1.%d", i), nil))
		tr.SliceChanged(nil, epSlice(fmt.Sprintf("s%d", i), fmt.Sprintf("s%d-1", i),
			endpoint{fmt.Sprintf("10.1.%d.1", i), "a1", "zone-a", "", true},
			endpoint{fmt.Sprintf("10.1.%d.2", i), "a1", "zone-a", "", true}))
	}
	tr.Resync()
	a.Apply(tr.Drain())
	old := epSlice("s7", "s7-1",
		endpoint{"10.1.7.1", "a1", "zone-a", "", true},
		endpoint{"10.1.7.2", "a1", "zone-a", "", true})
	cur := epSlice("s7", "s7-1",
		endpoint{"10.1.7.1", "a1", "zone-a", "", true},
		endpoint{"10.1.7.2", "a1", "zone-a", "", true},
		endpoint{"10.1.7.3", "a1", "zone-a", "", true})
	tr.SliceChanged(old, cur)
	res := a.Apply(tr.Drain())
	if res.Services != 1 {
		t.Errorf("one endpoint change decided %d services, want 1", res.Services)
	}
	// Two frontends (TCP and UDP) gain one backend each: one slot write and
	// one flip per frontend in the fake's accounting.
	if res.Writes != 4 {
		t.Errorf("writes = %d, want 4", res.Writes)
	}
}

func TestAgentFrontendConflict(t *testing.T) {
	dp := newFakeDP()
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions()}, dp)
	tr := kube.NewTracker()
	tr.NodeChanged(nil, node("a1", "zone-a"))
	tr.ServiceChanged(nil, service("first", "10.96.0.5", nil))
	tr.ServiceChanged(nil, service("second", "10.96.0.5", nil))
	tr.SliceChanged(nil, epSlice("first", "f", endpoint{"10.0.0.1", "a1", "zone-a", "", true}))
	tr.SliceChanged(nil, epSlice("second", "s", endpoint{"10.0.0.2", "a1", "zone-a", "", true}))
	tr.Resync()
	a.Apply(tr.Drain())
	// Neither Service has a creationTimestamp, so the claim order
	// (topology.CompareClaims) falls back to the name: "first" owns the
	// frontend and "second" cannot take it over.
	if got := dp.programmed()["10.96.0.5:80/TCP"]; !slices.Equal(got, []string{"10.0.0.1:8080"}) {
		t.Errorf("conflicting frontend: %v", got)
	}
	// Once "first" releases the frontend, "second" takes it in the same
	// sync.
	tr.ServiceChanged(service("first", "10.96.0.5", nil), nil)
	a.Apply(tr.Drain())
	if got := dp.programmed()["10.96.0.5:80/TCP"]; !slices.Equal(got, []string{"10.0.0.2:8080"}) {
		t.Errorf("released frontend not taken over: %v", got)
	}
}

func TestAgentMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	// Every reason of program errors is there from the start, at 0.
	if n := testutil.CollectAndCount(m.ProgramErrors); n != len(programErrorReasons) {
		t.Errorf("%d program error series before any error, want %d (one per reason)", n, len(programErrorReasons))
	}
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), Metrics: m}, newFakeDP())
	tr := kube.NewTracker()
	tr.NodeChanged(nil, node("a1", "zone-a"))
	tr.ServiceChanged(nil, service("web", "10.96.0.1", nil))
	hinted := epSlice("web", "web-1",
		endpoint{"10.0.1.1", "a1", "zone-a", "zone-a", true},
		endpoint{"10.0.1.2", "a2", "zone-a", "zone-a", true},
		endpoint{"10.0.2.1", "b1", "zone-b", "zone-b", true})
	tr.SliceChanged(nil, hinted)
	tr.Resync()
	a.Apply(tr.Drain())
	if got := testutil.ToFloat64(m.Services.WithLabelValues("Hints", "PreferSameZone", "IPv4")); got != 2 {
		t.Errorf("Hints/PreferSameZone ports = %v, want 2 (http and dns)", got)
	}
	if got := testutil.ToFloat64(m.Backends.WithLabelValues("default/web", "IPv4", "zone-a")); got != 4 {
		t.Errorf("zone-a backends = %v, want 4 (2 per port)", got)
	}
	unhinted := epSlice("web", "web-1",
		endpoint{"10.0.1.1", "a1", "zone-a", "", true},
		endpoint{"10.0.2.1", "b1", "zone-b", "", true})
	tr.SliceChanged(hinted, unhinted)
	a.Apply(tr.Drain())
	if got := testutil.ToFloat64(m.Services.WithLabelValues("Hints", "PreferSameZone", "IPv4")); got != 0 {
		t.Errorf("Hints/PreferSameZone ports = %v after hints went away, want 0", got)
	}
	if got := testutil.ToFloat64(m.Services.WithLabelValues("Hints", "None", "IPv4")); got != 2 {
		t.Errorf("Hints/None ports = %v, want 2", got)
	}
	if got := testutil.ToFloat64(m.Backends.WithLabelValues("default/web", "IPv4", "zone-b")); got != 2 {
		t.Errorf("zone-b backends = %v, want 2", got)
	}
	if got := testutil.ToFloat64(m.ModeChanges); got != 2 {
		t.Errorf("mode changes = %v, want 2", got)
	}
	tr.ServiceChanged(service("web", "10.96.0.1", nil), nil)
	a.Apply(tr.Drain())
	if n := testutil.CollectAndCount(m.Backends); n != 0 {
		t.Errorf("%d backend series left after the service was deleted", n)
	}
}

func mustAddrPort(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

// TestAgentSkipsServicesNotOurs: a Service kube-proxy skips programs
// nothing, and one that becomes such a Service (as a manifest edit shows
// it; the informers deliver a delete instead) loses its frontends, and
// gets them back when it stops being one.
func TestAgentSkipsServicesNotOurs(t *testing.T) {
	cases := []struct {
		name string
		mut  func(*v1.Service)
	}{
		{"service-proxy-name naming another proxy", func(s *v1.Service) { s.Labels = map[string]string{topology.LabelServiceProxyName: "other"} }},
		{"service-proxy-name empty", func(s *v1.Service) { s.Labels = map[string]string{topology.LabelServiceProxyName: ""} }},
		{"headless", func(s *v1.Service) {
			s.Spec.ClusterIP, s.Spec.ClusterIPs = v1.ClusterIPNone, []string{v1.ClusterIPNone}
		}},
		{"no cluster IP", func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "", nil }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dp := newFakeDP()
			a := New(Config{NodeName: "a1", Options: topology.DefaultOptions()}, dp)
			tr := kube.NewTracker()
			tr.NodeChanged(nil, node("a1", "zone-a"))
			plain := service("web", "10.96.0.1", nil)
			skipped := service("web", "10.96.0.1", nil)
			tc.mut(skipped)
			tr.ServiceChanged(nil, skipped)
			tr.SliceChanged(nil, epSlice("web", "web-1", endpoint{"10.0.1.1", "a1", "zone-a", "", true}))
			tr.Resync()
			a.Apply(tr.Drain())
			if got := dp.programmed(); len(got) != 0 {
				t.Fatalf("skipped service programmed: %v", got)
			}
			if st := a.State(); len(st.Skipped) != 1 || st.Skipped[0].Service != "default/web" {
				t.Errorf("/debug/state skipped %+v, want default/web", st.Skipped)
			}
			tr.ServiceChanged(skipped, plain)
			a.Apply(tr.Drain())
			if got := dp.programmed(); len(got) != 2 {
				t.Fatalf("service no longer skipped: programmed %v, want its 2 ports", got)
			}
			tr.ServiceChanged(plain, skipped)
			a.Apply(tr.Drain())
			if got := dp.programmed(); len(got) != 0 {
				t.Errorf("service skipped again: programmed %v, want nothing", got)
			}
		})
	}
}

// TestAgentDecidesNothingBeforeTheFirstResync: a restarted agent's
// informers deliver their initial lists one object at a time, a Service
// possibly before its EndpointSlices. Deciding it then would write an
// empty, rejecting frontend over the one the previous agent left working
// (a refused connection in tests/cluster's agent restart): until the
// first resync the agent only folds what arrives.
func TestAgentDecidesNothingBeforeTheFirstResync(t *testing.T) {
	dp := newFakeDP()
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), Events: &fakeEvents{}}, dp)
	tr := kube.NewTracker()
	dp.fes[dpmaps.Frontend{Addr: netip.MustParseAddrPort("10.96.0.1:80"), Proto: dpmaps.TCP}] = dpmaps.Service{
		Backends: []dpmaps.Backend{{Addr: netip.MustParseAddrPort("10.0.1.1:8080")}}}
	dp.fes[dpmaps.Frontend{Addr: netip.MustParseAddrPort("10.96.0.1:53"), Proto: dpmaps.UDP}] = dpmaps.Service{
		Backends: []dpmaps.Backend{{Addr: netip.MustParseAddrPort("10.0.1.1:5353")}}}
	left := map[string][]string{
		"10.96.0.1:80/TCP": {"10.0.1.1:8080"},
		"10.96.0.1:53/UDP": {"10.0.1.1:5353"},
	}
	tr.NodeChanged(nil, node("a1", "zone-a"))
	tr.ServiceChanged(nil, service("web", "10.96.0.1", nil))
	a.Apply(tr.Drain())
	if got := dp.programmed(); !maps.EqualFunc(got, left, slices.Equal) {
		t.Fatalf("the Service before its EndpointSlices: %v, want what the previous agent left %v", got, left)
	}
	tr.SliceChanged(nil, epSlice("web", "web-1",
		endpoint{"10.0.1.1", "a1", "zone-a", "", true},
		endpoint{"10.0.2.1", "b1", "zone-b", "", true}))
	tr.Resync()
	a.Apply(tr.Drain())
	want := map[string][]string{
		"10.96.0.1:80/TCP": {"10.0.1.1:8080", "10.0.2.1:8080"},
		"10.96.0.1:53/UDP": {"10.0.1.1:5353", "10.0.2.1:5353"},
	}
	if got := dp.programmed(); !maps.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("after the first resync: %v, want %v", got, want)
	}
}
