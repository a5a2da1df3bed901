package agent

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/topolb/topolb/kube"
	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// ipv6Rows are the datapath capabilities the dual-stack tests run with:
// none, this build's (maps.ServesIPv6: IPv6 on pods and host processes,
// and on the uplinks when maps.UplinksServeIPv6), and every scope. v6
// says, per scope, whether IPv6 frontends are programmed there.
var ipv6Rows = []struct {
	name string
	ipv6 func(dpmaps.Scope) bool
	v6   map[topology.Scope]bool
}{
	{name: "datapath serves IPv4 only", ipv6: func(dpmaps.Scope) bool { return false }, v6: map[topology.Scope]bool{}},
	{name: "this build's datapath", ipv6: dpmaps.ServesIPv6, v6: map[topology.Scope]bool{topology.ScopeInternal: true, topology.ScopeExternal: dpmaps.UplinksServeIPv6}},
	{name: "datapath serves IPv6 in every scope", ipv6: func(dpmaps.Scope) bool { return true }, v6: map[topology.Scope]bool{topology.ScopeInternal: true, topology.ScopeExternal: true}},
}

// TestAgentDualStack: a dual-stack Service is decided, explained, counted
// and health-checked in both families whatever the datapath serves; its
// IPv6 frontends are programmed in the scopes where the datapath serves
// IPv6 (its cluster IP and the NodePort from inside the node on pods and
// host processes, the NodePort from outside on the uplinks), and the debug
// state, /livez and topolb_programmed say so.
func TestAgentDualStack(t *testing.T) {
	for _, tc := range ipv6Rows {
		t.Run(tc.name, func(t *testing.T) {
			// The families programmed per scope, and anywhere.
			wantScopes := ScopeFamilies{}
			var anywhere []v1.IPFamily
			for _, family := range topology.Families {
				for _, scope := range Scopes {
					if family == v1.IPv4Protocol || tc.v6[scope] {
						wantScopes[scope] = append(wantScopes[scope], family)
						if !slices.Contains(anywhere, family) {
							anywhere = append(anywhere, family)
						}
					}
				}
			}
			ll := &loopbackListens{served: map[string]string{}}
			hcs := &HealthChecks{Listen: ll.listen}
			t.Cleanup(hcs.Close)
			dp := newFakeDP()
			dp.ipv6 = tc.ipv6
			m := NewMetrics(prometheus.NewRegistry())
			ev := &fakeEvents{}
			a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), HealthChecks: hcs, Metrics: m, Events: ev}, dp)
			tr := kube.NewTracker()

			self := nodeWithIP("a1", "zone-a", "10.250.0.2")
			self.Status.Addresses = append(self.Status.Addresses, v1.NodeAddress{Type: v1.NodeInternalIP, Address: "fd00:250::2"})
			svc, _ := lbLocal(32100)
			svc.Name = "web"
			svc.Spec.ClusterIP, svc.Spec.ClusterIPs = "fd00:10:96::1", []string{"fd00:10:96::1", "10.96.0.1"}
			svc.Spec.Ports[0].NodePort = 30080
			svc.Spec.Ports[1].NodePort = 30053
			// IPv4 has one local endpoint and hints for both zones; IPv6
			// two local ones and no hints: the modes differ by family.
			v4 := epSlice("web", "web-v4", endpoint{"10.0.1.1", "a1", "zone-a", "zone-a", true}, endpoint{"10.0.2.1", "b1", "zone-b", "zone-b", true})
			v6 := epSlice("web", "web-v6", endpoint{"fd00:1::1", "a1", "zone-a", "", true}, endpoint{"fd00:1::2", "a1", "zone-a", "", true}, endpoint{"fd00:2::1", "b1", "zone-b", "", true})
			v6.AddressType = discovery.AddressTypeIPv6
			tr.NodeChanged(nil, self)
			tr.NodeChanged(nil, node("b1", "zone-b"))
			tr.ServiceChanged(nil, svc)
			tr.SliceChanged(nil, v4)
			tr.SliceChanged(nil, v6)
			tr.Resync()
			if res := a.Apply(tr.Drain()); len(res.Errors) > 0 {
				t.Fatalf("apply: %v", res.Errors)
			}

			// Programmed: exactly the frontends of the programmed families
			// and scopes, as the report decides them.
			st := a.State()
			if !reflect.DeepEqual(st.FamiliesByScope, wantScopes) {
				t.Errorf("debug state families by scope %v, want %v", st.FamiliesByScope, wantScopes)
			}
			if everywhere := wantScopes.Everywhere(); !slices.Equal(st.Families, everywhere) {
				t.Errorf("debug state families %v, want %v (programmed in every scope)", st.Families, everywhere)
			}
			want := map[string]bool{}
			decidedV6 := 0
			for _, f := range st.Frontends {
				if f.Family == v1.IPv6Protocol {
					decidedV6++
				}
				if key, ok := ReportKey(f); ok && (f.Family == v1.IPv4Protocol || tc.v6[f.Scope]) {
					want[key] = true
				}
			}
			if decidedV6 == 0 {
				t.Fatal("no IPv6 frontend decided: the test compares nothing")
			}
			got := map[string]bool{}
			for fe := range dp.fes {
				got[fe.String()] = true
			}
			if len(got) != len(want) {
				t.Errorf("programmed %d frontends, want %d", len(got), len(want))
			}
			for key := range want {
				if !got[key] {
					t.Errorf("%s decided in a programmed family and scope but not programmed", key)
				}
			}
			for key := range got {
				if !want[key] {
					t.Errorf("%s programmed but not decided in a programmed family and scope", key)
				}
			}
			// By name: the IPv6 cluster IP and NodePort from inside the
			// node, and the IPv6 NodePort from outside.
			for key, scope := range map[string]topology.Scope{
				"[fd00:10:96::1]:80/TCP":           topology.ScopeInternal,
				"[fd00:250::2]:30080/TCP":          topology.ScopeInternal,
				"[fd00:250::2]:30080/TCP/external": topology.ScopeExternal,
				"10.250.0.2:30080/TCP/external":    "",
			} {
				if wantIt := scope == "" || tc.v6[scope]; got[key] != wantIt {
					t.Errorf("%s programmed %v, want %v", key, got[key], wantIt)
				}
			}
			for _, family := range topology.Families {
				for _, scope := range Scopes {
					wantV := 0.0
					if wantScopes.Programs(family, scope) {
						wantV = 1
					}
					if v := testutil.ToFloat64(m.Programmed.WithLabelValues(string(family), string(scope))); v != wantV {
						t.Errorf("topolb_programmed{family=%s,scope=%s} = %v, want %v", family, scope, v, wantV)
					}
				}
			}

			// Decided in both families, each on its own.
			modes := map[v1.IPFamily]topology.Mode{}
			for _, p := range st.Services {
				if p.Port == "http" {
					modes[p.Family] = p.Mode
				}
			}
			if modes[v1.IPv4Protocol] != topology.ModePreferSameZone || modes[v1.IPv6Protocol] != topology.ModeNone {
				t.Errorf("modes %v, want PreferSameZone in IPv4 and None in IPv6", modes)
			}
			if n := testutil.ToFloat64(m.Services.WithLabelValues("Hints", "None", "IPv6")); n != 2 {
				t.Errorf("topolb_service_ports{family=IPv6,mode=None} = %v, want 2", n)
			}
			if n := testutil.ToFloat64(m.Backends.WithLabelValues("default/web", "IPv6", "zone-a")); n != 4 {
				t.Errorf("topolb_backends{family=IPv6,zone=zone-a} = %v, want 4 (2 per port)", n)
			}

			// Health-checked in both families, on each family's address with
			// its own count.
			for addr, local := range map[string]int{"10.250.0.2:32100": 1, "[fd00:250::2]:32100": 2} {
				served := ll.addr(addr)
				if served == "" {
					t.Errorf("no health check on %s: %v", addr, ll.served)
					continue
				}
				if code, body, _ := check(t, served); code != http.StatusOK || body.LocalEndpoints != local {
					t.Errorf("health check on %s: %d %+v, want 200 with %d local endpoints", addr, code, body, local)
				}
			}

			// The proxy health server reports the families programmed.
			srv := httptest.NewServer(a.ProxyHealthHandler())
			defer srv.Close()
			_, body := getProxyHealth(t, srv.URL, "/livez")
			status, _ := body["status"].(map[string]any)
			var families []string
			for f := range status {
				families = append(families, f)
			}
			slices.Sort(families)
			var wantFamilies []string
			for _, f := range anywhere {
				wantFamilies = append(wantFamilies, string(f))
			}
			if !slices.Equal(families, wantFamilies) {
				t.Errorf("/livez status families %v, want %v", families, wantFamilies)
			}

			// The IPv6 slice gaining hints changes the IPv6 mode only; the
			// event names the family.
			hinted := v6.DeepCopy()
			for i := range hinted.Endpoints {
				hinted.Endpoints[i].Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: *hinted.Endpoints[i].Zone}}}
			}
			tr.SliceChanged(v6, hinted)
			if res := a.Apply(tr.Drain()); len(res.Errors) > 0 {
				t.Fatalf("apply: %v", res.Errors)
			}
			if want := []string{"default/web:http (IPv6) None->PreferSameZone", "default/web:dns (IPv6) None->PreferSameZone"}; !slices.Equal(ev.modes, want) && !slices.Equal(ev.modes, []string{want[1], want[0]}) {
				t.Errorf("mode events %q, want %q", ev.modes, want)
			}

			// The Service turning IPv4-only stops its IPv6 health check and
			// frontends.
			single := svc.DeepCopy()
			single.Spec.ClusterIP, single.Spec.ClusterIPs = "10.96.0.1", []string{"10.96.0.1"}
			tr.ServiceChanged(svc, single)
			if res := a.Apply(tr.Drain()); len(res.Errors) > 0 {
				t.Fatalf("apply: %v", res.Errors)
			}
			if !refused(ll.addr("[fd00:250::2]:32100")) {
				t.Error("IPv6 health check still served after the Service became IPv4-only")
			}
			if code, _, _ := check(t, ll.addr("10.250.0.2:32100")); code != http.StatusOK {
				t.Errorf("IPv4 health check: %d after the IPv6 one stopped", code)
			}
			for fe := range dp.fes {
				if fe.Addr.Addr().Is6() {
					t.Errorf("%s still programmed after the Service became IPv4-only", fe)
				}
			}
			if n := testutil.ToFloat64(m.Services.WithLabelValues("Hints", "PreferSameZone", "IPv6")); n != 0 {
				t.Errorf("topolb_service_ports{family=IPv6} = %v after the Service became IPv4-only, want 0", n)
			}
		})
	}
}

// TestDebugStateProgrammedFamilies: readers of /debug/state get the
// families programmed per scope from this agent, from an agent that
// programmed per family only (families, in every scope) and from one
// older than dual stack (nothing said: IPv4), and the JSON keeps the
// older field with the families programmed in every scope.
func TestDebugStateProgrammedFamilies(t *testing.T) {
	v4, both := []v1.IPFamily{v1.IPv4Protocol}, []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}
	for _, tc := range []struct {
		name string
		json string
		want ScopeFamilies
	}{
		{"per scope", `{"families":["IPv4"],"familiesByScope":{"internal":["IPv4","IPv6"],"external":["IPv4"]}}`,
			ScopeFamilies{topology.ScopeInternal: both, topology.ScopeExternal: v4}},
		{"per family only", `{"families":["IPv4","IPv6"]}`, ScopeFamilies{topology.ScopeInternal: both, topology.ScopeExternal: both}},
		{"older than dual stack", `{}`, ScopeFamilies{topology.ScopeInternal: v4, topology.ScopeExternal: v4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var st DebugState
			if err := json.Unmarshal([]byte(tc.json), &st); err != nil {
				t.Fatal(err)
			}
			if got := st.ProgrammedFamilies(); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("programmed families %v, want %v", got, tc.want)
			}
		})
	}

	dp := newFakeDP()
	dp.ipv6 = dpmaps.ServesIPv6
	out, err := json.Marshal(New(Config{NodeName: "a1"}, dp).State())
	if err != nil {
		t.Fatal(err)
	}
	var fields struct {
		Families        []v1.IPFamily            `json:"families"`
		FamiliesByScope map[string][]v1.IPFamily `json:"familiesByScope"`
	}
	if err := json.Unmarshal(out, &fields); err != nil {
		t.Fatal(err)
	}
	wantExternal := v4
	if dpmaps.UplinksServeIPv6 {
		wantExternal = both
	}
	if !slices.Equal(fields.Families, wantExternal) || !slices.Equal(fields.FamiliesByScope["internal"], both) || !slices.Equal(fields.FamiliesByScope["external"], wantExternal) {
		t.Errorf("families %v, by scope %v; want %v, internal %v and external %v", fields.Families, fields.FamiliesByScope, wantExternal, both, wantExternal)
	}
}
