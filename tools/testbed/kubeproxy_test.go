package testbed

import (
	"maps"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"testing"
)

// kubeProxyFixtures are the rules kube-proxy v1.37.2 wrote on node-a1 of
// examples/every-node.yaml (zone-a; web-a1 10.244.1.3, web-a2 10.244.2.3,
// web-a3 10.244.2.4, web-b1 10.244.3.3, web-b2 10.244.4.3, web-c1
// 10.244.5.3) for the Services of e2e's hintServices, plus "local": the
// zone-hints Service at 10.96.2.1 with internalTrafficPolicy Local. Both
// modes saw the same cluster.
var kubeProxyFixtures = map[KubeProxyMode]string{
	KubeProxyNFTables: "testdata/kube-proxy-v1.37.2-nftables.txt",
	KubeProxyIPTables: "testdata/kube-proxy-v1.37.2-iptables.txt",
}

// wantNodeA1 is what node-a1 must translate each cluster IP frontend to,
// written from the Services' definitions: hints and conditions as the
// EndpointSlice says, kube-proxy's rules of topology.go.
func wantNodeA1() map[string][]string {
	const (
		a1, a2, a3, b1, b2, c1 = "10.244.1.3", "10.244.2.3", "10.244.2.4", "10.244.3.3", "10.244.4.3", "10.244.5.3"
	)
	out := map[string][]string{"10.96.0.1:443/TCP": {}} // default/kubernetes: no endpoints
	for vip, pods := range map[string][]string{
		"10.96.0.10": {a1, a2},     // zone-hints: zone-a's hinted endpoints
		"10.96.0.11": {a1},         // node-hints: this node's
		"10.96.1.1":  {a1, b1, c1}, // no-hints: all ready
		"10.96.1.2":  {a1, b1, c1}, // partial-hints: one without a hint turns hints off
		"10.96.1.3":  {a3},         // draining: the ready one of zone-a
		"10.96.1.4":  {a1, b2},     // all-terminating: the serving terminating ones
		"10.96.1.5":  {},           // empty: rejected
		"10.96.2.1":  {a1},         // local: this node's
	} {
		tcp, udp := []string{}, []string{}
		for _, p := range pods {
			tcp, udp = append(tcp, p+":8080"), append(udp, p+":5353")
		}
		out[vip+":80/TCP"], out[vip+":53/UDP"] = tcp, udp
	}
	return out
}

func TestKubeProxyFrontends(t *testing.T) {
	client := netip.MustParseAddr("10.244.1.2") // client-a1
	want := wantNodeA1()
	for mode, path := range kubeProxyFixtures {
		t.Run(string(mode), func(t *testing.T) {
			rules, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			var got map[string][]string
			if mode == KubeProxyNFTables {
				got, err = nftFrontends(rules, client)
			} else {
				got, err = iptFrontends(rules, client)
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, k := range slices.Sorted(maps.Keys(want)) {
				if !reflect.DeepEqual(got[k], want[k]) {
					t.Errorf("%s: got %q, want %q", k, got[k], want[k])
				}
			}
			for k := range got {
				if _, ok := want[k]; !ok {
					t.Errorf("extra frontend %s: %q", k, got[k])
				}
			}
		})
	}
}

// TestRuleWalkFollowsSource checks the walk's evaluation of source
// conditions on a hand-made chain: pods take the cluster-wide chain,
// others the local one, as kube-proxy's externalTrafficPolicy Local
// chains do.
func TestRuleWalkFollowsSource(t *testing.T) {
	ruleset := []byte(`table ip kube-proxy {
	map service-ips {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 192.0.2.10 . tcp . 80 : goto external-X-default/web/tcp/http,
			     192.0.2.11 . tcp . 80 : goto negated }
	}

	chain negated {
		ip saddr != 10.244.0.0/16 goto local-X-default/web/tcp/http
		goto service-X-default/web/tcp/http
	}

	chain external-X-default/web/tcp/http {
		ip saddr 10.244.0.0/16 goto service-X-default/web/tcp/http comment "short-circuit pod traffic"
		fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"
		fib saddr type local goto service-X-default/web/tcp/http comment "short-circuit local traffic"
		goto local-X-default/web/tcp/http
	}

	chain mark-for-masquerade {
		meta mark set meta mark | 0x00004000
	}

	chain service-X-default/web/tcp/http {
		meta l4proto tcp dnat ip to numgen random mod 2 map { 0 : 10.244.1.3 . 8080, 1 : 10.244.2.3 . 8080 }
	}

	chain local-X-default/web/tcp/http {
		meta l4proto tcp dnat to 10.244.1.3:8080
	}
}
`)
	for _, c := range []struct {
		from string
		want []string
	}{
		{"10.244.2.2", []string{"10.244.1.3:8080", "10.244.2.3:8080"}},
		{"203.0.113.10", []string{"10.244.1.3:8080"}},
	} {
		got, err := nftFrontends(ruleset, netip.MustParseAddr(c.from))
		if err != nil {
			t.Fatal(err)
		}
		for _, fe := range []string{"192.0.2.10:80/TCP", "192.0.2.11:80/TCP"} {
			if eps := got[fe]; !reflect.DeepEqual(eps, c.want) {
				t.Errorf("%s from %s: %q, want %q", fe, c.from, eps, c.want)
			}
		}
	}
	// A jump to a chain the ruleset does not have is an error, not an
	// empty set.
	broken := []byte("table ip kube-proxy {\n\tmap service-ips {\n\t\telements = { 192.0.2.10 . tcp . 80 : goto nowhere }\n\t}\n}\n")
	if got, err := nftFrontends(broken, netip.MustParseAddr("10.244.2.2")); err == nil {
		t.Errorf("jump to a missing chain: %v, want an error", got)
	}
}
