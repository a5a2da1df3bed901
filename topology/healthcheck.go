package topology

import (
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// HealthCheck is the service health check a node serves for a
// LoadBalancer Service with externalTrafficPolicy Local, so that the load
// balancer sends traffic only to nodes with a local endpoint: kube-proxy's
// healthCheckNodePort.
type HealthCheck struct {
	// Port is spec.healthCheckNodePort.
	Port uint16
	// Family is the IP family the check is for: it is served on the node's
	// NodePort addresses of that family, as kube-proxy's proxier of each
	// family serves its own.
	Family v1.IPFamily
	// LocalEndpoints is the number of distinct addresses of ready
	// endpoints on the node, over all the Service's slices of the family
	// and all its ports, as kube-proxy's LocalReadyEndpoints counts them: serving-terminating
	// endpoints do not count, so a node whose local pods are all
	// terminating fails the check and the load balancer drains it.
	LocalEndpoints int
}

// ServiceHealthCheck returns the health check svc asks node to serve in
// family, and false when it asks for none: not a LoadBalancer, externalTrafficPolicy not
// Local, or no healthCheckNodePort (a value outside 1..65535 counts as
// none).
func ServiceHealthCheck(svc *v1.Service, epSlices []*discovery.EndpointSlice, node string, family v1.IPFamily) (HealthCheck, bool) {
	p := svc.Spec.HealthCheckNodePort
	if svc.Spec.Type != v1.ServiceTypeLoadBalancer || svc.Spec.ExternalTrafficPolicy != v1.ServiceExternalTrafficPolicyLocal || p < 1 || p > 65535 {
		return HealthCheck{}, false
	}
	ready := map[string]bool{}
	for _, es := range epSlices {
		if string(es.AddressType) != string(family) {
			continue
		}
		for _, e := range es.Endpoints {
			if len(e.Addresses) == 0 || e.NodeName == nil || *e.NodeName != node || node == "" {
				continue
			}
			if e.Conditions.Ready != nil && !*e.Conditions.Ready {
				continue
			}
			if ip, ok := parseAddr(e.Addresses[0], family); ok && AddrProblem(ip) == "" {
				ready[ip.String()] = true
			}
		}
	}
	return HealthCheck{Port: uint16(p), Family: family, LocalEndpoints: len(ready)}, true
}
