package testbed

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// dualStackSpec has tinySpec's two nodes, an outside client, a
// dual-stack Service (IPv6 primary), an IPv6-only one and an IPv4-only
// one.
const dualStackSpec = `
name: ds
dualStack: true` + twoZones + `outside:
  clients: [{name: ext1}]
services:
- name: both
  ipFamilies: [IPv6, IPv4]
  type: LoadBalancer
  loadBalancerIPs: [198.51.100.8, "fd00:198:51:100::8"]
  ports: [{name: http, port: 80}, {name: dns, protocol: UDP, port: 53}]
  endpoints: [{pod: b1}, {pod: b2}]
- name: six
  ipFamilies: [IPv6]
  ports: [{port: 80}]
  endpoints: [{pod: b2}]
- name: four
  ports: [{port: 80}]
  endpoints: [{pod: b1}]
`

// TestDualStackLayout checks the IPv6 addressing plan beside the IPv4 one,
// and the Service and EndpointSlices a dual-stack Service becomes.
func TestDualStackLayout(t *testing.T) {
	spec, err := ParseSpec([]byte(dualStackSpec))
	l := mustLayout(t, spec, err)
	for _, tc := range []struct {
		pod, addr, addr6, gw6, wire6 string
	}{
		{"c", "10.244.1.2", "fd00:10:244:1::2", "fd00:10:244:1::1", "fd00:10:250::2/64"},
		{"b1", "10.244.1.3", "fd00:10:244:1::3", "fd00:10:244:1::1", "fd00:10:250::2/64"},
		{"b2", "10.244.2.2", "fd00:10:244:2::2", "fd00:10:244:2::1", "fd00:10:250::3/64"},
	} {
		p := l.Pod(tc.pod)
		if p.Addr.String() != tc.addr || p.Addr6.String() != tc.addr6 || p.Node.Gateway6.String() != tc.gw6 || p.Node.WireAddr6.String() != tc.wire6 {
			t.Errorf("pod %s: addr %s addr6 %s gateway6 %s wire6 %s", tc.pod, p.Addr, p.Addr6, p.Node.Gateway6, p.Node.WireAddr6)
		}
		if l.PodByAddr(p.Addr6) != p {
			t.Errorf("pod %s is not found by its IPv6 address", tc.pod)
		}
	}
	if l.FabricAddr6.String() != "fd00:10:250::1/64" || l.Router.WireAddr6.String() != "fd00:10:250::fe/64" || l.External("ext1").Addr6.String() != "fd00:203:113::a" {
		t.Errorf("fabric %s, router %s, ext1 %s", l.FabricAddr6, l.Router.WireAddr6, l.External("ext1").Addr6)
	}

	objs, err := l.Objects(spec.Services)
	if err != nil {
		t.Fatal(err)
	}
	n1 := objs.Nodes[0]
	if !slices.Equal(n1.Spec.PodCIDRs, []string{"10.244.1.0/24", "fd00:10:244:1::/64"}) || len(n1.Status.Addresses) != 2 || n1.Status.Addresses[1].Address != "fd00:10:250::2" {
		t.Errorf("node n1: podCIDRs %v, addresses %v", n1.Spec.PodCIDRs, n1.Status.Addresses)
	}
	for _, tc := range []struct {
		svc        string
		clusterIPs []string
		policy     v1.IPFamilyPolicy
		slices     map[string]string // name → first endpoint address
	}{
		{"both", []string{"fd00:10:96::a", "10.96.0.10"}, v1.IPFamilyPolicyRequireDualStack,
			map[string]string{"both-testbed-v6": "fd00:10:244:1::3", "both-testbed": "10.244.1.3"}},
		{"six", []string{"fd00:10:96::b"}, v1.IPFamilyPolicySingleStack, map[string]string{"six-testbed-v6": "fd00:10:244:2::2"}},
		{"four", []string{"10.96.0.11"}, v1.IPFamilyPolicySingleStack, map[string]string{"four-testbed": "10.244.1.3"}},
	} {
		i := slices.IndexFunc(objs.Services, func(s *v1.Service) bool { return s.Name == tc.svc })
		s := objs.Services[i]
		if !slices.Equal(s.Spec.ClusterIPs, tc.clusterIPs) || s.Spec.ClusterIP != tc.clusterIPs[0] || *s.Spec.IPFamilyPolicy != tc.policy || len(s.Spec.IPFamilies) != len(tc.clusterIPs) {
			t.Errorf("service %s: clusterIPs %v (%s), families %v, policy %s", tc.svc, s.Spec.ClusterIPs, s.Spec.ClusterIP, s.Spec.IPFamilies, *s.Spec.IPFamilyPolicy)
		}
		got := map[string]string{}
		for _, es := range objs.Slices {
			if es.Labels[discovery.LabelServiceName] != tc.svc {
				continue
			}
			want := discovery.AddressTypeIPv4
			if strings.HasSuffix(es.Name, "-v6") {
				want = discovery.AddressTypeIPv6
			}
			if es.AddressType != want {
				t.Errorf("slice %s: address type %s", es.Name, es.AddressType)
			}
			got[es.Name] = es.Endpoints[0].Addresses[0]
		}
		if len(got) != len(tc.slices) {
			t.Errorf("service %s: slices %v, want %v", tc.svc, got, tc.slices)
		}
		for name, addr := range tc.slices {
			if got[name] != addr {
				t.Errorf("service %s: slice %s: first endpoint %q, want %s", tc.svc, name, got[name], addr)
			}
		}
	}

	// The decisions are per family, each with its own frontend.
	ds, _ := l.Decide(objs, "n1")
	var fronts []string
	for _, d := range ds {
		if d.Service == "default/both" {
			fronts = append(fronts, string(d.Family)+" "+d.Frontend.String()+" "+d.NodePort.String())
		}
	}
	slices.Sort(fronts)
	want := []string{"IPv4 10.96.0.10:53 10.250.0.2:30001", "IPv4 10.96.0.10:80 10.250.0.2:30000",
		"IPv6 [fd00:10:96::a]:53 [fd00:10:250::2]:30001", "IPv6 [fd00:10:96::a]:80 [fd00:10:250::2]:30000"}
	if !slices.Equal(fronts, want) {
		t.Errorf("decisions of both on n1:\n got %v\nwant %v", fronts, want)
	}
}

// TestDualStackErrors checks that IPv6 needs a dual-stack testbed and
// that addresses must be of the Service's families.
func TestDualStackErrors(t *testing.T) {
	base := `
zones: [{name: z, nodes: [{name: n, pods: [{name: b}]}]}]
`
	for _, tc := range []struct {
		name, yaml, want string
	}{
		{"IPv6 without dualStack", base + "services: [{name: s, ipFamilies: [IPv6], ports: [{port: 80}]}]", "needs a dual-stack testbed"},
		{"family repeated", "dualStack: true\n" + base + "services: [{name: s, ipFamilies: [IPv4, IPv4], ports: [{port: 80}]}]", "each once"},
		{"unknown family", "dualStack: true\n" + base + "services: [{name: s, ipFamilies: [IPv5], ports: [{port: 80}]}]", "want IPv4 or IPv6"},
		{"clusterIPv6 of an IPv4 Service", "dualStack: true\n" + base + "services: [{name: s, clusterIPv6: \"fd00:10:96::5\", ports: [{port: 80}]}]", "clusterIPv6"},
		{"clusterIPv6 outside the range", "dualStack: true\n" + base + "services: [{name: s, ipFamilies: [IPv6], clusterIPv6: \"fd00::5\", ports: [{port: 80}]}]", "want an address in fd00:10:96::/108"},
		{"IPv6 external IP of an IPv4 Service", "dualStack: true\n" + base + "services: [{name: s, externalIPs: [\"fd00:1::1\"], ports: [{port: 80}]}]", "not a family of the Service"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseSpec([]byte(tc.yaml))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// TestDualStackWiring brings a dual-stack testbed up and checks, without
// any datapath, that IPv6 crosses it as IPv4 does: pod to pod across the
// wire, pod to node, outside client to node, each seeing the sender's own
// address; and that backends answer on both families.
func TestDualStackWiring(t *testing.T) {
	requireRoot(t)
	ctx := t.Context()
	tb, _ := upTestbed(t, ctx, dualStackSpec)
	for _, ns := range []*NS{tb.Node("n1").NS, tb.Router.NS} {
		if v, err := ns.ReadSysctl("net.ipv6.conf.all.forwarding"); err != nil || v != "1" {
			t.Errorf("%s: IPv6 forwarding %q (%v)", ns.Name, v, err)
		}
	}
	c, b1, b2 := tb.Pod("c"), tb.Pod("b1"), tb.Pod("b2")
	for _, tc := range []struct {
		name   string
		client Client
		to     *Pod
		proto  v1.Protocol
		family v1.IPFamily
	}{
		{"pod to remote pod v6 tcp", c, b2, v1.ProtocolTCP, v1.IPv6Protocol},
		{"pod to remote pod v6 udp", c, b2, v1.ProtocolUDP, v1.IPv6Protocol},
		{"pod to local pod v6", c, b1, v1.ProtocolTCP, v1.IPv6Protocol},
		{"pod to remote pod v4", c, b2, v1.ProtocolTCP, v1.IPv4Protocol},
		{"host to remote pod v6", tb.Host("n1"), b2, v1.ProtocolTCP, v1.IPv6Protocol},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := uint16(DefaultHTTPPort)
			if tc.proto == v1.ProtocolUDP {
				port = DefaultUDPPort
			}
			rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			a, err := tc.client.Request(rctx, tc.proto, netip.AddrPortFrom(tc.to.AddrOf(tc.family), port))
			if err != nil {
				t.Fatal(err)
			}
			from, err := netip.ParseAddrPort(a.Client)
			if err != nil || a.Pod != tc.to.Name || from.Addr() != tc.client.ClientAddrOf(tc.family) {
				t.Errorf("answer %+v (%v), want %s seeing %s", a, err, tc.to.Name, tc.client.ClientAddrOf(tc.family))
			}
		})
	}

	// The live-frame floods in IPv6, pod to remote pod and outside client
	// to node: counted by the receiver's Udp6NoPorts (nothing listens on
	// port 9), checksums valid.
	floodArrives(t, b2.NS, 5000, func(n int) (FloodResult, error) {
		return c.FloodUDP(netip.AddrPortFrom(b2.Addr6, 9), n)
	})
	n2 := tb.Node("n2")
	floodArrives(t, n2.NS, 5000, func(n int) (FloodResult, error) {
		return tb.External("ext1").FloodUDP(netip.AddrPortFrom(n2.WireAddr6.Addr(), 9), n)
	})
	if errs, err := tb.ChecksumErrors(); err != nil || len(errs) > 0 {
		t.Errorf("checksum errors %v, %v", errs, err)
	}

	// An outside client reaches a node's IPv6 address.
	reachNode(t, tb.External("ext1"), tb.Node("n2"), v1.IPv6Protocol)

	// The router sends the IPv6 load-balancer IP to the ingress node's
	// IPv6 address.
	rs, err := tb.Router.NS.Netlink().RouteGet(netip.MustParseAddr("fd00:198:51:100::8").AsSlice())
	if err != nil || len(rs) == 0 || rs[0].Gw.String() != tb.Node("n1").WireAddr6.Addr().String() {
		t.Errorf("router's route to fd00:198:51:100::8: %v (%v), want via %s", rs, err, tb.Node("n1").WireAddr6.Addr())
	}
	if errs, err := tb.ChecksumErrors(); err != nil || len(errs) > 0 {
		t.Errorf("checksum errors %v (%v)", errs, err)
	}
}
