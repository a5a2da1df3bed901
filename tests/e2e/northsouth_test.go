package e2e

import (
	"bufio"
	"bytes"
	"context"
	"net/netip"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// The north-south Services of these tests, on the demo testbed with an
// outside client whose external and load-balancer IPs the router sends to
// node-b1 (zone-b): a NodePort Service with zone hints (eTP Cluster: node-b1
// permits zone-b, web-b1 on itself and web-b2 on node-b2), the same with
// eTP Local (web-b1 only, the client's address kept), one whose only
// endpoint is elsewhere (eTP Local: dropped on node-b1), a LoadBalancer
// and a Service with an external IP.
var (
	nsPorts     = []testbed.PortSpec{{Name: "http", Port: 80}, {Name: "echo", Protocol: v1.ProtocolUDP, Port: 53}}
	nsEndpoints = []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-a2"}, {Pod: "web-b1"}, {Pod: "web-b2"}, {Pod: "web-c1"}, {Pod: "web-c2"}}
	// lbIPs and externalIPs are the load-balancer IP and the external IP
	// of each family.
	lbIPs = map[v1.IPFamily]netip.Addr{
		v1.IPv4Protocol: netip.MustParseAddr("198.51.100.8"), v1.IPv6Protocol: netip.MustParseAddr("fd00:198:51:100::8")}
	externalIPs = map[v1.IPFamily]netip.Addr{
		v1.IPv4Protocol: netip.MustParseAddr("198.51.100.7"), v1.IPv6Protocol: netip.MustParseAddr("fd00:198:51:100::7")}
)

// nodePortCase is a NodePort Service of northSouthServices reached from
// outside through node-b1, and the external backends the spec implies
// for node-b1 (empty: dropped).
type nodePortCase struct {
	service string
	want    []string
}

var nodePortCases = []nodePortCase{
	{"np", []string{"web-b1", "web-b2"}},
	{"np-local", []string{"web-b1"}},
	{"np-nolocal", []string{}},
}

// options measures c with requests per port in families, or, where
// nothing may answer, 20 requests at once that wait half a second each.
func (c nodePortCase) options(requests int, families []v1.IPFamily) testbed.MeasureOptions {
	if len(c.want) == 0 {
		return testbed.MeasureOptions{Requests: 20, Parallel: 20, Timeout: 500 * time.Millisecond, Families: families}
	}
	return testbed.MeasureOptions{Requests: requests, Families: families}
}

// northSouthServices are the north-south Services in IPv4 alone.
func northSouthServices() []testbed.ServiceSpec {
	return northSouthServicesIn([]v1.IPFamily{v1.IPv4Protocol})
}

// northSouthServicesIn are the north-south Services in families (the
// first primary), with a load-balancer IP and an external IP of each
// (bothFamilies needs a dual-stack testbed).
func northSouthServicesIn(families []v1.IPFamily) []testbed.ServiceSpec {
	lb, ext := addrsIn(lbIPs, families), addrsIn(externalIPs, families)
	return []testbed.ServiceSpec{
		{Name: "np", IPFamilies: families, Type: v1.ServiceTypeNodePort, Hints: testbed.HintsZone, Ports: nsPorts, Endpoints: nsEndpoints},
		{Name: "np-local", IPFamilies: families, Type: v1.ServiceTypeNodePort, ExternalTrafficPolicy: "Local", Ports: nsPorts, Endpoints: nsEndpoints},
		{Name: "np-nolocal", IPFamilies: families, Type: v1.ServiceTypeNodePort, ExternalTrafficPolicy: "Local", Ports: nsPorts, Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}}},
		{Name: "lb", IPFamilies: families, Type: v1.ServiceTypeLoadBalancer, LoadBalancerIPs: lb, Hints: testbed.HintsZone, Ports: nsPorts, Endpoints: nsEndpoints},
		{Name: "ext", IPFamilies: families, ExternalIPs: ext, Hints: testbed.HintsZone, Ports: nsPorts, Endpoints: nsEndpoints},
	}
}

// addrsIn lists addrs' addresses of families, in their order.
func addrsIn(addrs map[v1.IPFamily]netip.Addr, families []v1.IPFamily) []string {
	var out []string
	for _, f := range families {
		out = append(out, addrs[f].String())
	}
	return out
}

// outsideSpec is the demo testbed, whose outside client ext1 has its
// external and LB IPs sent to node-b1.
func outsideSpec(t *testing.T) *testbed.Spec {
	t.Helper()
	spec := demoSpec(t)
	if spec.Outside == nil || spec.Outside.IngressNode != "node-b1" {
		t.Fatalf("the demo spec's outside network is %+v, want ext1 entering at node-b1", spec.Outside)
	}
	return spec
}

// checkUplinkPaths checks that every agent's uplink takes the path its
// switch port allows, as the agent reads it back from the kernel: tc
// where the port has no XDP program (TOPOLB_E2E_SWITCH_PORTS=plain), XDP
// where it has one. It logs what each agent reports of the kernel and the
// paths it chose (the kernel matrix's e2e.log shows them per kernel).
func checkUplinkPaths(t *testing.T, tb *testbed.Testbed) {
	t.Helper()
	want := string(maps.UplinkXDP)
	if plainSwitchPorts(t) {
		want = string(maps.UplinkTC)
	}
	for _, a := range tb.Agents() {
		st, err := a.State(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if st.Kernel != nil {
			t.Logf("agent on %s: kernel %v", a.Node.Name, st.Kernel.LogArgs())
		}
		t.Logf("agent on %s: uplinks %+v", a.Node.Name, st.Uplinks)
		if len(st.Uplinks) != 1 || st.Uplinks[0].Path != want {
			t.Errorf("agent on %s: uplinks %+v (%s), want one on path %s", a.Node.Name, st.Uplinks, st.UplinksError, want)
		}
		m, err := a.Metrics(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		line := `topolb_uplink_path{interface="` + testbed.UplinkName + `",path="` + want + `"} 1`
		if !strings.Contains(m, line) {
			t.Errorf("agent on %s: /metrics lacks %s", a.Node.Name, line)
		}
	}
}

// ipForwarded is a node's forwarded datagrams of family (Ip
// ForwDatagrams, Ip6 OutForwDatagrams): packets its stack routed between
// interfaces. topolb's translated flows bypass it.
func ipForwarded(t *testing.T, n *testbed.Node, family v1.IPFamily) uint64 {
	t.Helper()
	s, err := n.NS.SNMP()
	if err != nil {
		t.Fatal(err)
	}
	proto, name := "Ip", "ForwDatagrams"
	if family == v1.IPv6Protocol {
		proto, name = "Ip6", "OutForwDatagrams"
	}
	v, err := s.Counter(proto, name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// checkSources holds the source addresses a landing's backends saw to
// source translation: a backend on the node the traffic entered by sees
// the client's own address, a backend on another node sees only that
// node's address of the landing's family (the flow was source-translated
// there, so the backend's replies come back through it).
func checkSources(t *testing.T, tb *testbed.Testbed, l testbed.Landing, ingress string) {
	t.Helper()
	in := tb.Node(ingress)
	family := l.Decision.Family
	for pod, seen := range l.Tally.Sources {
		want := tb.Host(ingress).ClientAddrOf(family)
		if tb.Pod(pod).Node == in {
			want = l.Client.ClientAddrOf(family)
		}
		for addr, n := range seen {
			if addr != want {
				t.Errorf("%s %s %s from %s: %s saw %d requests from %s, want all from %s", family, l.Decision.Protocol, l.Decision.Service, l.Client.ClientName(), pod, n, addr, want)
			}
		}
	}
}

// TestNorthSouth sends TCP and UDP from a client outside the cluster to
// node-b1's NodePorts, a load-balancer IP and an external IP, all balanced
// by XDP on node-b1's uplink: eTP Cluster lands exactly on node-b1's
// zone-b backends (topology applies to external traffic), the one on
// node-b1 seeing the client's address and the one on node-b2 only
// node-b1's (source-translated; the client sees only the frontend
// address, or its sockets would refuse the answers); eTP Local lands on
// node-b1's own endpoint with the client's address kept; no local
// endpoint, dropped. A pod reaches its own node's NodePort (the tc path,
// the cluster set). node-b1's stack forwards none of it, no fallback is
// counted and no namespace counts a checksum error. The testbed and the
// Services are dual stack, and every check runs in each IP family in
// turn (half of the requests each that the test sent in IPv4 alone).
func TestNorthSouth(t *testing.T) {
	requireRoot(t)
	for _, dp := range datapaths {
		t.Run(dp.name, func(t *testing.T) {
			spec := outsideSpec(t)
			spec.DualStack = true
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			checkUplinkPaths(t, tb)
			apply(t, tb, northSouthServicesIn(bothFamilies))
			inEachFamily(t, tb, topology.ScopeExternal, func(t *testing.T, family v1.IPFamily) {
				northSouthIn(t, tb, family)
			})
			noChecksumErrors(t, tb)
		})
	}
}

// northSouthIn is TestNorthSouth's traffic and checks in family.
func northSouthIn(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
	const requests = 60
	ext := tb.External("ext1")
	b1 := tb.Node("node-b1")
	ctx := t.Context()
	fam := []v1.IPFamily{family}
	forwBefore := ipForwarded(t, b1, family)
	statsBefore, err := maps.PinnedStats(tb.BPFFS("node-b1"))
	if err != nil {
		t.Fatal(err)
	}

	for _, c := range nodePortCases {
		landings, err := tb.MeasureNodePort(ctx, ext, "node-b1", c.service, c.options(requests, fam))
		if err != nil {
			t.Fatal(err)
		}
		if len(landings) != len(nsPorts) {
			t.Errorf("%s: measured %d ports in %s, want %d", c.service, len(landings), family, len(nsPorts))
		}
		for _, l := range landings {
			if l.Decision.Family != family || !slices.Equal(l.Decision.Backends, c.want) {
				t.Errorf("%s %s: node-b1 permits %v from outside in %s, the spec implies %v in %s", l.Decision.Protocol, c.service, l.Decision.Backends, l.Decision.Family, c.want, family)
			}
			checkSources(t, tb, l, "node-b1")
		}
		checkLandings(t, landings, nil)
	}

	// The load-balancer IP and the external IP, which the router sends
	// to node-b1.
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, "node-b1")
	for _, c := range []struct {
		service string
		addr    netip.Addr
	}{{"lb", lbIPs[family]}, {"ext", externalIPs[family]}} {
		for _, p := range nsPorts {
			proto := p.Protocol
			if proto == "" {
				proto = v1.ProtocolTCP
			}
			d := testbed.FindDecisionOf(ds, c.service, proto, family)
			if d == nil {
				t.Fatalf("no %s decision for %s %s on node-b1", family, c.service, proto)
			}
			target := netip.AddrPortFrom(c.addr, uint16(p.Port))
			if !slices.Contains(d.External, target) {
				t.Errorf("%s %s: node-b1's external frontends %v lack %s", c.service, proto, d.External, target)
			}
			l := testbed.Landing{Client: ext, Decision: *d,
				Tally: testbed.Summarize(ext, ext.Send(ctx, testbed.Load{Proto: proto, Target: target, Count: requests}))}
			l.Decision.Backends = d.ExternalBackends
			if !slices.Equal(d.ExternalBackends, []string{"web-b1", "web-b2"}) {
				t.Errorf("%s %s: node-b1 permits %v from outside, want zone-b", c.service, proto, d.ExternalBackends)
			}
			checkLandings(t, []testbed.Landing{l}, nil)
			checkSources(t, tb, l, "node-b1")
		}
	}
	if got := ipForwarded(t, b1, family) - forwBefore; got != 0 {
		t.Errorf("node-b1's stack forwarded %d %s datagrams: north-south traffic did not bypass it", got, family)
	}

	// A pod reaching its own node's NodePort: the tc path, the cluster
	// set of node-a1 (zone-a), its own address kept.
	landings, err := tb.MeasureNodePort(ctx, tb.Pod("client"), "node-a1", "np", testbed.MeasureOptions{Requests: requests, Families: fam})
	if err != nil {
		t.Fatal(err)
	}
	checkLandings(t, landings, []string{"web-a1", "web-a2"})

	stats, err := maps.PinnedStats(tb.BPFFS("node-b1"))
	if err != nil {
		t.Fatal(err)
	}
	delta := func(s maps.Stat) uint64 { return stats[s] - statsBefore[s] }
	t.Logf("node-b1 datapath in %s: snat_flows %d, fwd peer %d l2 %d neigh %d stack %d", family,
		delta(maps.StatSNATFlows), delta(maps.StatFwdPeer), delta(maps.StatFwdL2), delta(maps.StatFwdNeigh), delta(maps.StatFwdStack))
	if delta(maps.StatSNATFlows) == 0 {
		t.Errorf("node-b1 source-translated no %s flow", family)
	}
	for _, s := range []maps.Stat{maps.StatFwdFallbackMTU, maps.StatFwdFallbackTTL, maps.StatFwdFallbackMeta,
		maps.StatDropSNATExhausted, maps.StatDropSNATNoRoute, maps.StatDropSNATFallback, maps.StatFwdStack} {
		if n := delta(s); n != 0 {
			t.Errorf("node-b1 datapath in %s: %s = %d, want 0", family, s, n)
		}
	}
}

// TestNetfilterInvalidDrop runs topolb on nodes whose netfilter has the
// rule kube-proxy's iptables mode installs when
// nf_conntrack_tcp_be_liberal is 0 (drop conntrack INVALID in FORWARD), with
// that sysctl at 0: the client's node (node-a1) and the ingress node of
// the outside client (node-b1). Since translated packets bypass the host
// stack, netfilter never sees a half-translated flow: pod TCP to a local
// and a remote backend, and outside TCP to a NodePort with a local and a
// remote backend, all succeed, and the rule drops nothing.
func TestNetfilterInvalidDrop(t *testing.T) {
	requireRoot(t)
	for _, dp := range datapaths {
		t.Run(dp.name, func(t *testing.T) {
			spec := outsideSpec(t)
			for _, n := range []string{"node-a1", "node-b1"} {
				withInvalidDrop(t, spec, n)
			}
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			web := service(t, spec, "missing-hint", "web") // every endpoint: local and remote
			apply(t, tb, append([]testbed.ServiceSpec{web}, northSouthServices()[0]))
			ctx := t.Context()

			landings, err := tb.Measure(ctx, tb.Pod("client"), "web", testbed.MeasureOptions{Requests: 200})
			if err != nil {
				t.Fatal(err)
			}
			checkLandings(t, landings, []string{"web-a1", "web-a2", "web-b1", "web-b2", "web-c1", "web-c2"})
			landings, err = tb.MeasureNodePort(ctx, tb.External("ext1"), "node-b1", "np", testbed.MeasureOptions{Requests: 120})
			if err != nil {
				t.Fatal(err)
			}
			checkLandings(t, landings, []string{"web-b1", "web-b2"})
			for _, n := range []string{"node-a1", "node-b1"} {
				if dropped := invalidDrops(t, tb.Node(n)); dropped != 0 {
					t.Errorf("%s: kube-proxy's INVALID rule dropped %d packets", n, dropped)
				}
			}
			noChecksumErrors(t, tb)
		})
	}
}

// withInvalidDrop gives a node of spec kube-proxy's INVALID drop rule and
// nf_conntrack_tcp_be_liberal 0.
func withInvalidDrop(t *testing.T, spec *testbed.Spec, node string) {
	t.Helper()
	for zi := range spec.Zones {
		for ni := range spec.Zones[zi].Nodes {
			if n := &spec.Zones[zi].Nodes[ni]; n.Name == node {
				off := false
				n.Netfilter = testbed.NetfilterSpec{InvalidDrop: true, TCPBeLiberal: &off}
				return
			}
		}
	}
	t.Fatalf("spec has no node %s", node)
}

// invalidDrops reads the packet counter of the testbed's INVALID drop
// rule in a node's FORWARD chain.
func invalidDrops(t *testing.T, n *testbed.Node) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "nsenter", "--net="+n.NS.Path, "iptables", "-w", "-vxnL", "FORWARD").Output()
	if err != nil {
		t.Fatalf("%s: iptables -L FORWARD: %v", n.Name, err)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, testbed.InvalidDropComment) {
			continue
		}
		f := strings.Fields(line)
		pkts, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			t.Fatalf("%s: INVALID rule line %q: %v", n.Name, line, err)
		}
		return pkts
	}
	t.Fatalf("%s: no INVALID drop rule in FORWARD:\n%s", n.Name, out)
	return 0
}
