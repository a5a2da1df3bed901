package e2e

import (
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/tools/testbed"
)

// TestOutsideClientThroughKubeProxy runs kube-proxy (nftables) on node-b1
// of the demo testbed with an outside client, and checks the testbed's
// north-south path end to end with today's NodePort implementation: the
// outside client reaches node-b1's NodePort and lands in zone-b
// (topology applies to externalTrafficPolicy Cluster), keeps its address
// under externalTrafficPolicy Local, is dropped when node-b1 has no local
// endpoint, and reaches a load-balancer IP the router sends to node-b1.
// It holds every landing to DecideNode's external backends for node-b1
// (testbed.MeasureNodePort), so the same test can run against topolb once
// it balances NodePorts.
func TestOutsideClientThroughKubeProxy(t *testing.T) {
	requireRoot(t)
	kp := kubeProxyBinary(t)
	cluster := kubetest.Start(t)
	spec := demoSpec(t) // its outside client's external and LB IPs go to node-b1
	ports := []testbed.PortSpec{{Name: "http", Port: 80}, {Name: "echo", Protocol: v1.ProtocolUDP, Port: 53}}
	all := []testbed.EndpointSpec{{Pod: "web-a1"}, {Pod: "web-a2"}, {Pod: "web-b1"}, {Pod: "web-b2"}, {Pod: "web-c1"}, {Pod: "web-c2"}}
	svcs := []testbed.ServiceSpec{
		{Name: "np", Type: v1.ServiceTypeNodePort, Hints: testbed.HintsZone, Ports: ports, Endpoints: all},
		{Name: "np-local", Type: v1.ServiceTypeNodePort, ExternalTrafficPolicy: "Local", Ports: ports, Endpoints: all},
		{Name: "np-nolocal", Type: v1.ServiceTypeNodePort, ExternalTrafficPolicy: "Local", Ports: ports, Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}}},
		{Name: "lb", Type: v1.ServiceTypeLoadBalancer, LoadBalancerIPs: []string{"198.51.100.8"}, Hints: testbed.HintsZone, Ports: ports, Endpoints: all},
	}
	tb, ctx := apiserverTestbed(t, spec, cluster, svcs)
	k, err := tb.StartKubeProxy(ctx, "node-b1", testbed.KubeProxyOptions{Binary: kp, Mode: testbed.KubeProxyNFTables})
	if err != nil {
		t.Fatal(err)
	}
	if needed, err := k.EnsureTopology(ctx); err != nil {
		t.Fatal(err)
	} else if needed {
		t.Log("kube-proxy missed its zone at start (its startup race); relabelled the node")
	}
	ext := tb.External("ext1")
	for _, c := range nodePortCases {
		landings, err := tb.MeasureNodePort(ctx, ext, "node-b1", c.service, c.options(120, nil))
		if err != nil {
			t.Fatal(err)
		}
		checkLandings(t, landings, c.want)
	}
	// The load-balancer IP is routed to node-b1, whose decision applies.
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, "node-b1")
	d := testbed.FindDecision(ds, "lb", v1.ProtocolTCP)
	if d == nil {
		t.Fatal("no decision for lb")
	}
	lbIP := netip.MustParseAddrPort("198.51.100.8:80")
	tally := testbed.Summarize(ext, ext.Send(ctx, testbed.Load{Proto: v1.ProtocolTCP, Target: lbIP, Count: 120}))
	if got := tally.Backends(); tally.Failed > 0 || !slices.Equal(got, d.ExternalBackends) {
		t.Errorf("outside client to %s: landed on %v, %d failed (%v); node-b1 permits %v", lbIP, got, tally.Failed, tally.Errors, d.ExternalBackends)
	}
	noChecksumErrors(t, tb)
}
