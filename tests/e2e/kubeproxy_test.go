package e2e

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// kubeProxyBinary returns kube-proxy from `make kube-bins`, or skips.
func kubeProxyBinary(t testing.TB) string {
	t.Helper()
	dir, err := kubetest.BinDir()
	if err != nil {
		t.Skipf("kube-proxy: %v", err)
	}
	bin := filepath.Join(dir, "kube-proxy")
	if _, err := os.Stat(bin); err != nil {
		if os.Getenv(kubetest.EnvRequired) != "" {
			t.Fatalf("kube-proxy: %v (run make kube-bins)", err)
		}
		t.Skipf("kube-proxy not built (make kube-bins): %v", err)
	}
	return bin
}

// hintServices are Services whose decisions kube-proxy and topolb must
// share: the Hints policy only (the topolb.io annotations are topolb's
// own), with complete, partial, node and no hints, and endpoints that are
// terminating or not ready.
func hintServices(t *testing.T) []testbed.ServiceSpec {
	t.Helper()
	spec, err := testbed.EveryNodeSpec()
	if err != nil {
		t.Fatal(err)
	}
	var out []testbed.ServiceSpec
	for _, s := range spec.Services {
		if s.Name == "zone-hints" || s.Name == "node-hints" {
			out = append(out, s)
		}
	}
	ports := out[0].Ports
	ep := func(pod string, c testbed.Condition, h testbed.Hints) testbed.EndpointSpec {
		return testbed.EndpointSpec{Pod: pod, Condition: c, Hints: h}
	}
	out = append(out,
		testbed.ServiceSpec{Name: "no-hints", ClusterIP: "10.96.1.1", Ports: ports, Endpoints: []testbed.EndpointSpec{
			ep("web-a1", "", ""), ep("web-b1", "", ""), ep("web-c1", "", "")}},
		testbed.ServiceSpec{Name: "partial-hints", ClusterIP: "10.96.1.2", Ports: ports, Hints: testbed.HintsZone, Endpoints: []testbed.EndpointSpec{
			ep("web-a1", "", ""), ep("web-b1", "", ""), ep("web-c1", "", testbed.HintsNone)}},
		testbed.ServiceSpec{Name: "draining", ClusterIP: "10.96.1.3", Ports: ports, Hints: testbed.HintsZone, Endpoints: []testbed.EndpointSpec{
			ep("web-a1", testbed.Terminating, ""), ep("web-a2", testbed.NotReady, ""), ep("web-a3", "", ""),
			ep("web-b1", "", ""), ep("web-c1", "", "")}},
		testbed.ServiceSpec{Name: "all-terminating", ClusterIP: "10.96.1.4", Ports: ports, Endpoints: []testbed.EndpointSpec{
			ep("web-a1", testbed.Terminating, ""), ep("web-b2", testbed.Terminating, ""), ep("web-c1", testbed.NotReady, "")}},
		testbed.ServiceSpec{Name: "empty", ClusterIP: "10.96.1.5", Ports: ports},
	)
	return out
}

// TestKubeProxyAgrees runs kube-proxy, in nftables and then in iptables
// mode, next to topolb-agent on every node of the every-node testbed,
// against one real kube-apiserver, and asserts that for every node and
// every service port the endpoints kube-proxy programs for the cluster IP
// equal the backends topolb's maps hold, which equal what DecideNode
// permits. Any difference is a bug in one of them. One was found in
// kube-proxy and is worked around, and logged, when it strikes: see
// testbed.KubeProxy.EnsureTopology.
func TestKubeProxyAgrees(t *testing.T) {
	requireRoot(t)
	bin := requireAgent(t)
	kp := kubeProxyBinary(t)
	cluster := kubetest.Start(t)
	svcs := hintServices(t)
	for _, mode := range []testbed.KubeProxyMode{testbed.KubeProxyNFTables, testbed.KubeProxyIPTables} {
		t.Run(string(mode), func(t *testing.T) {
			spec, err := testbed.EveryNodeSpec()
			if err != nil {
				t.Fatal(err)
			}
			spec.Services = nil
			tb := newTestbed(t, spec)
			ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
			defer cancel()
			if err := tb.ConnectAPIServer(ctx, cluster.Config); err != nil {
				t.Fatal(err)
			}
			if _, err := tb.Apply(ctx, svcs); err != nil {
				t.Fatal(err)
			}
			if _, err := tb.StartAgents(ctx, testbed.AgentOptions{Binary: bin}); err != nil {
				t.Fatal(err)
			}
			proxies := make([]*testbed.KubeProxy, len(tb.Nodes))
			var wg sync.WaitGroup
			errs := make([]error, len(tb.Nodes))
			for i, n := range tb.Nodes {
				wg.Add(1)
				go func() {
					defer wg.Done()
					proxies[i], errs[i] = tb.StartKubeProxy(ctx, n.Name, testbed.KubeProxyOptions{Binary: kp, Mode: mode})
				}()
			}
			wg.Wait()
			for _, err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}
			for _, k := range proxies {
				needed, err := k.EnsureTopology(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if needed {
					t.Logf("kube-proxy bug: on %s it never learnt its zone (startup race in kube-proxy v1.37.2, see testbed.KubeProxy.EnsureTopology); relabelled the node to recover", k.Node.Name)
				}
			}
			if err := tb.WaitAgents(ctx, 10*time.Second); err != nil {
				t.Fatal(err)
			}
			objs, _ := tb.Current()
			compared := 0
			for i, n := range tb.Nodes {
				ds, _ := tb.Decide(objs, n.Name)
				// kube-proxy may still be writing a later sync: poll
				// briefly before calling a difference a difference.
				var got map[string][]string
				deadline := time.Now().Add(10 * time.Second)
				for {
					if got, err = proxies[i].Endpoints(ctx, ds); err != nil {
						t.Fatal(err)
					}
					if diff := compareKubeProxy(ds, got); diff == "" || time.Now().After(deadline) {
						break
					}
					time.Sleep(200 * time.Millisecond)
				}
				st, err := tb.Agent(n.Name).State(ctx)
				if err != nil {
					t.Fatal(err)
				}
				for _, d := range ds {
					if d.Policy != topology.PolicyHints {
						continue
					}
					key := testbed.PortKey(d.Service, d.Port, d.Protocol)
					fe := d.Frontend.String() + "/" + string(d.Protocol)
					kpSet, topolbSet := nonNil(got[key]), nonNil(st.Programmed[fe])
					if !slices.Equal(kpSet, topolbSet) || !slices.Equal(topolbSet, d.Addrs) {
						t.Errorf("node %s, %s: kube-proxy %s programs %v, topolb programs %v, DecideNode permits %v (mode %s: %s)",
							n.Name, key, mode, kpSet, topolbSet, d.Addrs, d.Mode, d.Reason)
					}
					compared++
				}
			}
			t.Logf("%d service ports compared on %d nodes: kube-proxy %s and topolb agree", compared, len(tb.Nodes), mode)
		})
	}
}

// compareKubeProxy describes the first Hints-policy port whose kube-proxy
// endpoints differ from the decision, "" if none does.
func compareKubeProxy(ds []testbed.Decision, got map[string][]string) string {
	for _, d := range ds {
		key := testbed.PortKey(d.Service, d.Port, d.Protocol)
		if d.Policy == topology.PolicyHints && !slices.Equal(nonNil(got[key]), d.Addrs) {
			return key
		}
	}
	return ""
}

func nonNil(ss []string) []string {
	if ss == nil {
		return []string{}
	}
	return ss
}
