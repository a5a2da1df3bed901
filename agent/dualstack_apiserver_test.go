package agent

import (
	"context"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// TestDualStackAgainstAPIServer: against a real apiserver that allocates
// cluster IPs of both families, a dual-stack Service (RequireDualStack)
// and an IPv6-only one, with EndpointSlices of both address types (and an
// FQDN one), are decided by the agent in every family the apiserver gave
// them, exactly as explain decides them from a fresh list; IPv6 frontends
// are programmed only when the datapath serves IPv6.
func TestDualStackAgainstAPIServer(t *testing.T) {
	kc := kubetest.Start(t, kubetest.WithDualStackServices())
	ctx := context.Background()
	c := kc.Client

	for _, n := range []struct{ name, zone, v4, v6 string }{
		{"a1", "zone-a", "10.250.0.2", "fd00:250::2"},
		{"b1", "zone-b", "10.250.0.3", "fd00:250::3"},
	} {
		node := node(n.name, n.zone)
		if _, err := c.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create node %s: %v", n.name, err)
		}
		node, err := c.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		node.Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: n.v4}, {Type: v1.NodeInternalIP, Address: n.v6}}
		if _, err := c.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("node %s addresses: %v", n.name, err)
		}
	}
	dual := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "dual"},
		Spec: v1.ServiceSpec{
			Type:           v1.ServiceTypeNodePort,
			IPFamilyPolicy: ptr.To(v1.IPFamilyPolicyRequireDualStack),
			IPFamilies:     []v1.IPFamily{v1.IPv6Protocol, v1.IPv4Protocol},
			Ports:          []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}},
		},
	}
	v6only := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "v6only"},
		Spec: v1.ServiceSpec{
			IPFamilyPolicy: ptr.To(v1.IPFamilyPolicySingleStack),
			IPFamilies:     []v1.IPFamily{v1.IPv6Protocol},
			Ports:          []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}},
		},
	}
	created := map[string]*v1.Service{}
	for _, s := range []*v1.Service{dual, v6only} {
		got, err := c.CoreV1().Services(s.Namespace).Create(ctx, s, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create service %s: %v", s.Name, err)
		}
		created[s.Name] = got
	}
	if ips := created["dual"].Spec.ClusterIPs; len(ips) != 2 {
		t.Fatalf("dual-stack Service got cluster IPs %v: the apiserver does not allocate both families", ips)
	}
	// The IPv4 slice hints every endpoint for its zone; the IPv6 slice
	// carries no hints: the two families of one Service decide
	// differently.
	slice := func(svc, name string, at discovery.AddressType, eps ...endpoint) *discovery.EndpointSlice {
		s := epSlice(svc, name, eps...)
		s.AddressType = at
		s.Ports = s.Ports[:1]
		return s
	}
	for _, s := range []*discovery.EndpointSlice{
		slice("dual", "dual-v4", discovery.AddressTypeIPv4, endpoint{"10.1.1.2", "a1", "zone-a", "zone-a", true}, endpoint{"10.1.2.2", "b1", "zone-b", "zone-b", true}),
		slice("dual", "dual-v6", discovery.AddressTypeIPv6, endpoint{"fd00:1:1::2", "a1", "zone-a", "", true}, endpoint{"fd00:1:2::2", "b1", "zone-b", "", true}),
		slice("dual", "dual-fqdn", discovery.AddressTypeFQDN, endpoint{"web.example", "a1", "zone-a", "", true}),
		slice("v6only", "v6only-v6", discovery.AddressTypeIPv6, endpoint{"fd00:1:1::3", "a1", "zone-a", "zone-a", true}, endpoint{"fd00:1:2::3", "b1", "zone-b", "zone-b", true}),
		// An IPv4 slice of an IPv6-only Service is not its.
		slice("v6only", "v6only-v4", discovery.AddressTypeIPv4, endpoint{"10.1.1.3", "a1", "zone-a", "", true}),
	} {
		if _, err := c.DiscoveryV1().EndpointSlices(s.Namespace).Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create slice %s: %v", s.Name, err)
		}
	}

	// What every run must see, from the apiserver's own allocations.
	type row struct {
		family v1.IPFamily
		mode   topology.Mode
		// backends are the internal backends' addresses.
		backends []string
	}
	want := map[string][]row{
		"default/dual": {
			{v1.IPv4Protocol, topology.ModePreferSameZone, []string{"10.1.1.2:8080"}},
			{v1.IPv6Protocol, topology.ModeNone, []string{"[fd00:1:1::2]:8080", "[fd00:1:2::2]:8080"}},
		},
		"default/v6only": {
			{v1.IPv6Protocol, topology.ModePreferSameZone, []string{"[fd00:1:1::3]:8080"}},
		},
	}

	for _, tc := range ipv6Rows {
		t.Run(tc.name, func(t *testing.T) {
			dp := newFakeDP()
			dp.ipv6 = tc.ipv6
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
			a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), Logger: log}, dp)
			runCtx, cancel := context.WithCancel(ctx)
			tr := kube.NewTracker()
			watched, stopped := make(chan error, 1), make(chan struct{})
			go func() { watched <- kube.Watch(runCtx, c, tr, kube.WatchOptions{Nodes: kube.NodeWatchAll}) }()
			go func() {
				defer close(stopped)
				a.Run(runCtx, tr, 2*time.Millisecond, 200*time.Millisecond)
			}()
			defer func() {
				cancel()
				<-stopped
				if err := <-watched; err != nil && runCtx.Err() == nil {
					t.Errorf("watch: %v", err)
				}
			}()

			deadline := time.Now().Add(20 * time.Second)
			var st DebugState
			ours := func(p topology.PortReport) bool { return want[p.Service] != nil }
			for {
				st = a.State()
				if n := len(slices.DeleteFunc(slices.Clone(st.Services), func(p topology.PortReport) bool { return !ours(p) })); a.Synced() && n == 3 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("agent decided %v (synced %v), want 3 ports of dual and v6only", st.Services, a.Synced())
				}
				time.Sleep(20 * time.Millisecond)
			}

			// The agent's decisions, per service and family.
			got := map[string][]row{}
			for _, p := range st.Services {
				got[p.Service] = append(got[p.Service], row{p.Family, p.Mode, p.Backends})
			}
			for svc, rows := range want {
				if !slices.EqualFunc(got[svc], rows, func(x, y row) bool {
					return x.family == y.family && x.mode == y.mode && slices.Equal(x.backends, y.backends)
				}) {
					t.Errorf("%s: decided %+v, want %+v", svc, got[svc], rows)
				}
			}
			// Each family's port claims that family's cluster IP, as the
			// apiserver allocated it, and its NodePorts on that family's
			// node address.
			dualSvc := created["dual"]
			for _, p := range st.Services {
				if p.Service != "default/dual" {
					continue
				}
				var clusterIP string
				for _, ip := range dualSvc.Spec.ClusterIPs {
					if topology.FamilyOf(netip.MustParseAddr(ip)) == p.Family {
						clusterIP = ip
					}
				}
				nodeIP := map[v1.IPFamily]string{v1.IPv4Protocol: "10.250.0.2", v1.IPv6Protocol: "fd00:250::2"}[p.Family]
				wantFrontends := []string{
					netip.AddrPortFrom(netip.MustParseAddr(clusterIP), 80).String(),
					netip.AddrPortFrom(netip.MustParseAddr(nodeIP), uint16(dualSvc.Spec.Ports[0].NodePort)).String(),
				}
				if !slices.Equal(p.Frontends, wantFrontends) {
					t.Errorf("dual %s: frontends %v, want %v", p.Family, p.Frontends, wantFrontends)
				}
			}

			// The same decisions as explain makes from a fresh list.
			objs, err := kube.ListObjects(ctx, c)
			if err != nil {
				t.Fatal(err)
			}
			state := objs.State(nil)
			ds, warnings := state.DecideNode("a1", topology.DefaultOptions())
			node, _ := state.Node("a1")
			explained := topology.NewReport(node, ds)
			// The test's own Services: the apiserver creates
			// default/kubernetes on its own time, which the fresh list may
			// hold and the agent not yet.
			explainedOurs := slices.DeleteFunc(slices.Clone(explained.Services), func(p topology.PortReport) bool { return !ours(p) })
			agentOurs := slices.DeleteFunc(slices.Clone(st.Services), func(p topology.PortReport) bool { return !ours(p) })
			if len(explainedOurs) != len(agentOurs) {
				t.Fatalf("explain decides %d ports of dual and v6only, the agent %d", len(explainedOurs), len(agentOurs))
			}
			for i, p := range explainedOurs {
				q := agentOurs[i]
				if p.Service != q.Service || p.Family != q.Family || p.Mode != q.Mode || !slices.Equal(p.Backends, q.Backends) || !slices.Equal(p.Frontends, q.Frontends) {
					t.Errorf("explain decides %+v, the agent %+v", p, q)
				}
			}
			if !slices.ContainsFunc(warnings, func(w string) bool {
				return w == `endpointslice default/dual-fqdn: addressType "FQDN" is not served (IPv4 and IPv6 only)`
			}) {
				t.Errorf("warnings %q lack the FQDN slice", warnings)
			}
			plan := state.PlanService(node, types.NamespacedName{Namespace: "default", Name: "v6only"}, topology.DefaultOptions())
			if fams := plan.Families(); !slices.Equal(fams, []v1.IPFamily{v1.IPv6Protocol}) {
				t.Errorf("v6only planned in %v, want IPv6 only", fams)
			}

			// Programmed: every IPv4 frontend, and the IPv6 ones only in
			// the scopes where the datapath serves IPv6.
			for _, f := range explained.Frontends {
				key, ok := ReportKey(f)
				if !ok || want[f.Service] == nil {
					continue
				}
				_, programmed := st.Datapath[key]
				if wantProgrammed := f.Family == v1.IPv4Protocol || tc.v6[f.Scope]; programmed != wantProgrammed {
					t.Errorf("%s (%s %s): programmed %v, want %v", key, f.Family, f.Scope, programmed, wantProgrammed)
				}
			}
		})
	}
}
