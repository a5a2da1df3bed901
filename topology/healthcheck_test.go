package topology

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"
)

func TestServiceHealthCheck(t *testing.T) {
	lb := func(etp v1.ServiceExternalTrafficPolicy, port int32) *v1.Service {
		return &v1.Service{Spec: v1.ServiceSpec{Type: v1.ServiceTypeLoadBalancer, ExternalTrafficPolicy: etp, HealthCheckNodePort: port}}
	}
	ep := func(ip, node string, ready *bool) discovery.Endpoint {
		return discovery.Endpoint{Addresses: []string{ip}, NodeName: ptr.To(node), Conditions: discovery.EndpointConditions{Ready: ready}}
	}
	slices := []*discovery.EndpointSlice{
		{AddressType: discovery.AddressTypeIPv4, Endpoints: []discovery.Endpoint{
			ep("10.0.0.1", "n1", nil),           // ready by default
			ep("10.0.0.2", "n1", ptr.To(true)),  //
			ep("10.0.0.3", "n1", ptr.To(false)), // not ready (terminating or not): not counted
			ep("10.0.0.4", "n2", ptr.To(true)),  // another node
			ep("127.0.0.1", "n1", ptr.To(true)), // an address that cannot serve
		}},
		// The same endpoint in a second slice (another port) counts once.
		{AddressType: discovery.AddressTypeIPv4, Endpoints: []discovery.Endpoint{ep("10.0.0.1", "n1", nil)}},
		// IPv6 counts in its own family only: each family's check is
		// served on that family's addresses, as kube-proxy's proxiers do.
		{AddressType: discovery.AddressTypeIPv6, Endpoints: []discovery.Endpoint{
			ep("fd00::1", "n1", nil),
			ep("10.0.0.9", "n1", nil), // not IPv6: not counted
			ep("::1", "n1", nil),      // an address that cannot serve
		}},
		{AddressType: discovery.AddressTypeFQDN, Endpoints: []discovery.Endpoint{ep("web.example", "n1", nil)}},
	}
	v4, v6 := v1.IPv4Protocol, v1.IPv6Protocol
	for _, tc := range []struct {
		name   string
		svc    *v1.Service
		node   string
		family v1.IPFamily
		want   HealthCheck
		ok     bool
	}{
		{"local LoadBalancer", lb(v1.ServiceExternalTrafficPolicyLocal, 32000), "n1", v4, HealthCheck{Port: 32000, Family: v4, LocalEndpoints: 2}, true},
		{"local LoadBalancer, IPv6", lb(v1.ServiceExternalTrafficPolicyLocal, 32000), "n1", v6, HealthCheck{Port: 32000, Family: v6, LocalEndpoints: 1}, true},
		{"node without endpoints", lb(v1.ServiceExternalTrafficPolicyLocal, 32000), "n3", v4, HealthCheck{Port: 32000, Family: v4}, true},
		{"node without endpoints, IPv6", lb(v1.ServiceExternalTrafficPolicyLocal, 32000), "n2", v6, HealthCheck{Port: 32000, Family: v6}, true},
		{"cluster policy", lb(v1.ServiceExternalTrafficPolicyCluster, 32000), "n1", v4, HealthCheck{}, false},
		{"no port", lb(v1.ServiceExternalTrafficPolicyLocal, 0), "n1", v6, HealthCheck{}, false},
		{"NodePort type", &v1.Service{Spec: v1.ServiceSpec{Type: v1.ServiceTypeNodePort, ExternalTrafficPolicy: v1.ServiceExternalTrafficPolicyLocal, HealthCheckNodePort: 32000}}, "n1", v4, HealthCheck{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := ServiceHealthCheck(tc.svc, slices, tc.node, tc.family)
			if got != tc.want || ok != tc.ok {
				t.Errorf("got %+v %v, want %+v %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}
