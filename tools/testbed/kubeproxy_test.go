package testbed

import (
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
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

// TestKubeProxyFrontendsIPv6 reads kube-proxy v1.37.2's IPv6 rules
// (nftables, `nft list table ip6 kube-proxy`) written on n1 of the
// dual-stack testbed (dualStackSpec, a dual-stack apiserver) for its
// Services and an IPv6-only one without endpoints (empty6,
// fd00:10:96::c): IPv6 cluster IPs, the IPv6 load-balancer IP, NodePorts
// on n1's IPv6 address, one endpoint (dnat to [addr]:port) and several
// (a numgen map), a rejected frontend.
func TestKubeProxyFrontendsIPv6(t *testing.T) {
	rules, err := os.ReadFile("testdata/kube-proxy-v1.37.2-nftables-ipv6.txt")
	if err != nil {
		t.Fatal(err)
	}
	got, err := nftFrontends(rules, netip.MustParseAddr("fd00:10:244:1::2")) // pod c
	if err != nil {
		t.Fatal(err)
	}
	const b1, b2 = "[fd00:10:244:1::3]", "[fd00:10:244:2::2]"
	both := map[string][]string{"TCP": {b1 + ":8080", b2 + ":8080"}, "UDP": {b1 + ":5353", b2 + ":5353"}}
	want := map[string][]string{
		"[fd00:10:96::b]:80/TCP": {b2 + ":8080"},
		"[fd00:10:96::c]:80/TCP": {},
	}
	for _, fe := range []struct{ addr, port, proto string }{
		{"fd00:10:96::a", "80", "TCP"}, {"fd00:10:96::a", "53", "UDP"},
		{"fd00:198:51:100::8", "80", "TCP"}, {"fd00:198:51:100::8", "53", "UDP"},
		{"fd00:10:250::2", "30000", "TCP"}, {"fd00:10:250::2", "30001", "UDP"},
	} {
		want[net.JoinHostPort(fe.addr, fe.port)+"/"+fe.proto] = both[fe.proto]
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("IPv6 frontends:\n got %q\nwant %q", got, want)
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

// TestKubeProxyExternalFrontends reads the rules kube-proxy v1.37.2 wrote
// on node-a1 (10.250.0.2, zone-a) of examples/every-node.yaml for
// NodePort and LoadBalancer Services, with externalTrafficPolicy Cluster
// and Local, for a packet from a pod and from a client outside the
// cluster. Endpoints: web-a1 10.244.1.3 (on node-a1), web-a2 10.244.2.3,
// web-b1 10.244.3.3.
func TestKubeProxyExternalFrontends(t *testing.T) {
	const a1, a2, b1 = "10.244.1.3", "10.244.2.3", "10.244.3.3"
	pod, outside := netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("203.0.113.10")
	type row struct {
		frontends []string // "ip:port" of the TCP port; the UDP port follows each
		fromPod   []string
		fromOut   []string
	}
	rows := []row{
		// np: zone hints, eTP Cluster: topology applies to both.
		{[]string{"10.96.3.1:80", "10.250.0.2:30000"}, []string{a1, a2}, []string{a1, a2}},
		// np-local: eTP Local: outside traffic to its external frontends
		// stays on the node, pods take the cluster set; the cluster IP is
		// the cluster set for everyone.
		{[]string{"10.250.0.2:30002"}, []string{a1, a2, b1}, []string{a1}},
		{[]string{"10.96.3.2:80"}, []string{a1, a2, b1}, []string{a1, a2, b1}},
		// lb: external IP, LB IP and node port, eTP Cluster.
		{[]string{"10.96.3.3:80", "198.51.100.7:80", "198.51.100.8:80", "10.250.0.2:30004"}, []string{a1, a2, b1}, []string{a1, a2, b1}},
		// lb-local.
		{[]string{"198.51.100.9:80", "10.250.0.2:30006"}, []string{a1, a2, b1}, []string{a1}},
		{[]string{"10.96.3.4:80"}, []string{a1, a2, b1}, []string{a1, a2, b1}},
		// np-empty: rejected.
		{[]string{"10.96.3.5:80", "10.250.0.2:30009"}, []string{}, []string{}},
		// np-nolocal: eTP Local without a local endpoint: dropped from
		// outside, the cluster set for pods.
		{[]string{"10.250.0.2:30011"}, []string{b1}, []string{}},
		{[]string{"10.96.3.6:80"}, []string{b1}, []string{b1}},
	}
	want := func(outsideClient bool) map[string][]string {
		out := map[string][]string{"10.96.0.1:443/TCP": {}}
		for _, r := range rows {
			pods := r.fromPod
			if outsideClient {
				pods = r.fromOut
			}
			for _, fe := range r.frontends {
				ap := netip.MustParseAddrPort(fe)
				udpPort := uint16(53)
				if ap.Port() != 80 {
					udpPort = ap.Port() + 1 // node ports: TCP, then UDP
				}
				tcp, udp := []string{}, []string{}
				for _, p := range pods {
					tcp, udp = append(tcp, p+":8080"), append(udp, p+":5353")
				}
				out[FrontendKey(ap, "tcp")] = tcp
				out[FrontendKey(netip.AddrPortFrom(ap.Addr(), udpPort), "udp")] = udp
			}
		}
		return out
	}
	for mode, path := range map[KubeProxyMode]string{
		KubeProxyNFTables: "testdata/kube-proxy-v1.37.2-nftables-external.txt",
		KubeProxyIPTables: "testdata/kube-proxy-v1.37.2-iptables-external.txt",
	} {
		rules, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, from := range []netip.Addr{pod, outside} {
			t.Run(string(mode)+"/from "+from.String(), func(t *testing.T) {
				var got map[string][]string
				if mode == KubeProxyNFTables {
					got, err = nftFrontends(rules, from)
				} else {
					got, err = iptFrontends(rules, from)
				}
				if err != nil {
					t.Fatal(err)
				}
				w := want(from == outside)
				for _, k := range slices.Sorted(maps.Keys(w)) {
					if g, ok := got[k]; !ok || !reflect.DeepEqual(g, w[k]) {
						t.Errorf("%s: got %q (present %v), want %q", k, g, ok, w[k])
					}
				}
				for k := range got {
					if _, ok := w[k]; !ok {
						t.Errorf("extra frontend %s: %q", k, got[k])
					}
				}
			})
		}
	}
}

// TestKnowsZone checks that only a last logged IPv4 topology line with the
// node's own zone counts: the relabel's temporary zone does not.
func TestKnowsZone(t *testing.T) {
	log := filepath.Join(t.TempDir(), "kube-proxy.log")
	k := &KubeProxy{Process: &Process{Node: &Node{Zone: "zone-a"}, LogPath: log}}
	for _, c := range []struct {
		log  string
		want bool
	}{
		{"", false},
		{`I1 proxier.go:521] "Updated proxier node topology labels" ipFamily="IPv4" labels={"topology.kubernetes.io/zone":"zone-a-relabel"}`, false},
		{`I1 proxier.go:521] "Updated proxier node topology labels" ipFamily="IPv4" labels={"topology.kubernetes.io/zone":"zone-a-relabel"}
I2 proxier.go:521] "Updated proxier node topology labels" ipFamily="IPv4" labels={"topology.kubernetes.io/zone":"zone-a"}`, true},
		{`I2 proxier.go:521] "Updated proxier node topology labels" ipFamily="IPv6" labels={"topology.kubernetes.io/zone":"zone-a"}`, false},
		{`==== start 1
I2 proxier.go:521] "Updated proxier node topology labels" ipFamily="IPv4" labels={"topology.kubernetes.io/zone":"zone-a"}
==== start 2
`, false},
	} {
		if err := os.WriteFile(log, []byte(c.log), 0o644); err != nil {
			t.Fatal(err)
		}
		if got := k.knowsZone(); got != c.want {
			t.Errorf("log %q: knowsZone %v, want %v", c.log, got, c.want)
		}
	}
}
