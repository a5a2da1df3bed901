package testbed

import (
	"context"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/topolb/topolb/internal/kubetest"
)

// apiserverTestbed starts an apiserver with opts and a testbed of the spec
// in specYAML served from it, both torn down with the test; the context
// ends after two minutes.
func apiserverTestbed(t *testing.T, specYAML string, opts ...kubetest.Option) (*Testbed, *Spec, context.Context) {
	t.Helper()
	requireRoot(t)
	cluster := kubetest.Start(t, opts...)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	t.Cleanup(cancel)
	tb, spec := upTestbed(t, ctx, specYAML)
	if err := tb.ConnectAPIServer(ctx, cluster.Config); err != nil {
		t.Fatal(err)
	}
	return tb, spec, ctx
}

// TestServiceTypesInAPIServer checks that apiserver mode writes what the
// spec says about reaching a Service from outside — type, node ports,
// external IPs, traffic policy, affinity, health check port — and the
// load-balancer ingress through the status subresource, and that a
// Service can change type between two Applies.
func TestServiceTypesInAPIServer(t *testing.T) {
	tb, _, ctx := apiserverTestbed(t, outsideSpec)
	lb := ServiceSpec{
		Name: "lb", Type: v1.ServiceTypeLoadBalancer, ExternalTrafficPolicy: "Local",
		ExternalIPs: []string{"198.51.100.7"}, LoadBalancerIPs: []string{"198.51.100.8"},
		SessionAffinity: "ClientIP", SessionAffinityTimeout: 60,
		Ports:     []PortSpec{{Name: "http", Port: 80, NodePort: 30080}, {Name: "dns", Protocol: v1.ProtocolUDP, Port: 53}},
		Endpoints: []EndpointSpec{{Pod: "b1"}, {Pod: "b2"}},
	}
	get := func() *v1.Service {
		t.Helper()
		svc, err := tb.KubeClient().CoreV1().Services("default").Get(ctx, "lb", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return svc
	}
	if _, err := tb.Apply(ctx, []ServiceSpec{lb}); err != nil {
		t.Fatal(err)
	}
	svc := get()
	if svc.Spec.Type != v1.ServiceTypeLoadBalancer || svc.Spec.ExternalTrafficPolicy != v1.ServiceExternalTrafficPolicyLocal ||
		svc.Spec.Ports[0].NodePort != 30080 || svc.Spec.Ports[1].NodePort == 0 || svc.Spec.HealthCheckNodePort == 0 ||
		svc.Spec.SessionAffinity != v1.ServiceAffinityClientIP || *svc.Spec.SessionAffinityConfig.ClientIP.TimeoutSeconds != 60 ||
		!slices.Equal(svc.Spec.ExternalIPs, []string{"198.51.100.7"}) {
		t.Errorf("spec in the apiserver: %+v", svc.Spec)
	}
	if ing := svc.Status.LoadBalancer.Ingress; len(ing) != 1 || ing[0].IP != "198.51.100.8" {
		t.Errorf("status in the apiserver: %+v", svc.Status)
	}
	// The manifest and the apiserver agree on the node ports the testbed
	// assigned.
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, "n1")
	if d := FindDecision(ds, "lb", v1.ProtocolUDP); d == nil || d.NodePort.Port() != uint16(svc.Spec.Ports[1].NodePort) {
		t.Errorf("UDP decision %+v, apiserver node port %d", d, svc.Spec.Ports[1].NodePort)
	}

	lb.Type, lb.ExternalTrafficPolicy, lb.LoadBalancerIPs, lb.ExternalIPs = v1.ServiceTypeClusterIP, "", nil, nil
	lb.Ports = []PortSpec{{Name: "http", Port: 80}, {Name: "dns", Protocol: v1.ProtocolUDP, Port: 53}}
	if _, err := tb.Apply(ctx, []ServiceSpec{lb}); err != nil {
		t.Fatal(err)
	}
	if svc := get(); svc.Spec.Type != v1.ServiceTypeClusterIP || svc.Spec.Ports[0].NodePort != 0 || len(svc.Status.LoadBalancer.Ingress) != 0 {
		t.Errorf("after the change to ClusterIP: %+v %+v", svc.Spec, svc.Status)
	}
}

// TestDualStackInAPIServer serves a dual-stack testbed from an apiserver
// with both service ranges (kubetest.WithDualStackServices): it takes the
// Services' cluster IPs of both families, in their order, the
// EndpointSlices of each family and the Nodes' two InternalIPs, and the
// decisions read back from it are made per family. A Service that drops
// IPv6 between two Applies loses its IPv6 slice.
func TestDualStackInAPIServer(t *testing.T) {
	tb, spec, ctx := apiserverTestbed(t, dualStackSpec, kubetest.WithDualStackServices())
	c := tb.KubeClient()
	for _, tc := range []struct {
		name       string
		clusterIPs []string
	}{
		{"both", []string{"fd00:10:96::a", "10.96.0.10"}},
		{"six", []string{"fd00:10:96::b"}},
		{"four", []string{"10.96.0.11"}},
	} {
		svc, err := c.CoreV1().Services("default").Get(ctx, tc.name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(svc.Spec.ClusterIPs, tc.clusterIPs) {
			t.Errorf("service %s: clusterIPs %v in the apiserver, want %v", tc.name, svc.Spec.ClusterIPs, tc.clusterIPs)
		}
	}
	n1, err := c.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(n1.Status.Addresses) != 2 || n1.Status.Addresses[1].Address != "fd00:10:250::2" {
		t.Errorf("node n1's addresses in the apiserver: %v", n1.Status.Addresses)
	}
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, "n1")
	for _, family := range []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol} {
		d := FindDecisionOf(ds, "both", v1.ProtocolTCP, family)
		if d == nil || len(d.Backends) != 2 || d.Frontend.Addr().Is4() != (family == v1.IPv4Protocol) || d.NodePort.Addr().Is4() != (family == v1.IPv4Protocol) {
			t.Errorf("%s decision of both on n1, read back from the apiserver: %+v", family, d)
		}
	}

	// IPv4 only from now on: the IPv6 slice goes, the Service keeps IPv4.
	both := spec.Services[0]
	both.IPFamilies, both.ClusterIPv6, both.LoadBalancerIPs = []v1.IPFamily{v1.IPv4Protocol}, "", []string{"198.51.100.8"}
	if _, err := tb.Apply(ctx, []ServiceSpec{both}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DiscoveryV1().EndpointSlices("default").Get(ctx, "both-testbed-v6", metav1.GetOptions{}); err == nil {
		t.Error("the IPv6 EndpointSlice of both is still there after both dropped IPv6")
	}
	svc, err := c.CoreV1().Services("default").Get(ctx, "both", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(svc.Spec.ClusterIPs, []string{"10.96.0.10"}) || !slices.Equal(svc.Spec.IPFamilies, []v1.IPFamily{v1.IPv4Protocol}) {
		t.Errorf("both after dropping IPv6: clusterIPs %v, families %v", svc.Spec.ClusterIPs, svc.Spec.IPFamilies)
	}
}
