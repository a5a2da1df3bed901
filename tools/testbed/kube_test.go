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

// TestServiceTypesInAPIServer checks that apiserver mode writes what the
// spec says about reaching a Service from outside — type, node ports,
// external IPs, traffic policy, affinity, health check port — and the
// load-balancer ingress through the status subresource, and that a
// Service can change type between two Applies.
func TestServiceTypesInAPIServer(t *testing.T) {
	requireRoot(t)
	cluster := kubetest.Start(t)
	spec, err := ParseSpec([]byte(outsideSpec))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	tb, err := New(ctx, spec, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Close()
	if err := tb.ConnectAPIServer(ctx, cluster.Config); err != nil {
		t.Fatal(err)
	}
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
