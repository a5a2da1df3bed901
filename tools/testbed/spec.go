package testbed

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"

	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// Spec is the declarative description of a testbed, as read from YAML. See
// examples/demo.yaml for an annotated example.
type Spec struct {
	// Name is a short label used in namespace names: [a-z0-9-], at most 12
	// characters. Default "tb".
	Name string `json:"name,omitempty"`
	// PodCIDR is split into one /24 per node, in the order nodes appear:
	// the first node gets the second /24. Default 10.244.0.0/16.
	PodCIDR string `json:"podCIDR,omitempty"`
	// WireCIDR is the /24 of the wire every node is plugged into: the
	// fabric (the switch, and the nodes' default gateway) has .1, node i
	// has .(1+i). Default 10.250.0.0/24.
	WireCIDR string `json:"wireCIDR,omitempty"`
	// Zones hold the nodes and their pods.
	Zones []ZoneSpec `json:"zones"`
	// Services are the cluster's Services and their endpoints at start.
	Services []ServiceSpec `json:"services,omitempty"`
	// Scenarios are named states of the Services that a demo or a test
	// switches between, each with the landings it expects.
	Scenarios []Scenario `json:"scenarios,omitempty"`

	// mu guards ips: Services built in code get their defaults and
	// cluster IPs from the same allocator as the spec's.
	mu    sync.Mutex
	ips   *clusterIPs
	roles map[string]Role
}

// ZoneSpec is one zone and its nodes.
type ZoneSpec struct {
	Name  string     `json:"name"`
	Nodes []NodeSpec `json:"nodes"`
}

// NodeSpec is one node: a network namespace acting as its host network.
type NodeSpec struct {
	Name string `json:"name"`
	// CPU is the node's allocatable CPU (a Kubernetes quantity), which the
	// EndpointSlice controller weighs zones by. Default "4".
	CPU string `json:"cpu,omitempty"`
	// Labels are added to the zone and hostname labels the testbed sets.
	Labels map[string]string `json:"labels,omitempty"`
	Pods   []PodSpec         `json:"pods,omitempty"`
}

// Role is what a pod runs.
type Role string

const (
	// RoleBackend pods serve HTTP and UDP echo on every target port any
	// Service of the spec uses, answering with their pod, node and zone.
	RoleBackend Role = "backend"
	// RoleClient pods only send requests.
	RoleClient Role = "client"
)

// PodSpec is one pod: a network namespace with a veth to its node.
type PodSpec struct {
	Name string `json:"name"`
	// Role is backend (the default) or client.
	Role Role `json:"role,omitempty"`
}

// Hints names the topology hints the testbed writes for an endpoint, as
// the EndpointSlice controller would.
type Hints string

const (
	// HintsNone writes no hints.
	HintsNone Hints = "none"
	// HintsZone hints every endpoint for its own zone (trafficDistribution
	// PreferSameZone, or the topology-aware hints annotation).
	HintsZone Hints = "zone"
	// HintsNode hints every endpoint for its own node and zone
	// (trafficDistribution PreferSameNode).
	HintsNode Hints = "node"
)

// ServiceSpec is a Service and the one EndpointSlice the testbed writes for
// it.
type ServiceSpec struct {
	Name string `json:"name"`
	// Namespace defaults to "default".
	Namespace string `json:"namespace,omitempty"`
	// ClusterIP is an address in 10.96.0.0/16 (kubetest's service range).
	// Default: 10.96.0.10 and up, by the order of first appearance of the
	// service's name in the spec, so a Service keeps its address across
	// scenarios.
	ClusterIP   string            `json:"clusterIP,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
	// TrafficDistribution is copied to spec.trafficDistribution
	// (informational: topolb reads the hints, as kube-proxy does).
	TrafficDistribution string `json:"trafficDistribution,omitempty"`
	// InternalTrafficPolicy is Cluster (default) or Local.
	InternalTrafficPolicy string     `json:"internalTrafficPolicy,omitempty"`
	Ports                 []PortSpec `json:"ports"`
	// Hints is the default for every endpoint: none (the default), zone
	// or node.
	Hints     Hints          `json:"hints,omitempty"`
	Endpoints []EndpointSpec `json:"endpoints,omitempty"`
}

// PortSpec is one Service port.
type PortSpec struct {
	// Name is required when the Service has more than one port.
	Name string `json:"name,omitempty"`
	// Protocol is TCP (default) or UDP. Backends answer HTTP on TCP ports
	// and a one-datagram echo on UDP ports.
	Protocol v1.Protocol `json:"protocol,omitempty"`
	Port     int32       `json:"port"`
	// TargetPort defaults to 8080 for TCP and 5353 for UDP.
	TargetPort int32 `json:"targetPort,omitempty"`
}

// Condition is an endpoint's state, spelled as the three EndpointSlice
// conditions it sets.
type Condition string

const (
	// Ready: ready, serving, not terminating (the default).
	Ready Condition = "ready"
	// Terminating: not ready, still serving, terminating; the pod keeps
	// answering, as a pod in its grace period does.
	Terminating Condition = "terminating"
	// NotReady: neither ready nor serving, not terminating.
	NotReady Condition = "not-ready"
)

// EndpointSpec is one endpoint of a Service: a backend pod.
type EndpointSpec struct {
	Pod string `json:"pod"`
	// Hints overrides the Service's hints for this endpoint.
	Hints Hints `json:"hints,omitempty"`
	// ForZones and ForNodes, when set, are written as the hints instead.
	ForZones []string `json:"forZones,omitempty"`
	ForNodes []string `json:"forNodes,omitempty"`
	// Condition defaults to ready.
	Condition Condition `json:"condition,omitempty"`
}

// Scenario is a named state of the Services and what clients should see.
type Scenario struct {
	// Name is a short identifier ([a-z0-9-]).
	Name string `json:"name"`
	// Title is a one-line description for people.
	Title string `json:"title,omitempty"`
	// Services replace the spec's Services while the scenario is applied.
	Services []ServiceSpec `json:"services"`
	// Expect lists the exact backend sets clients land on.
	Expect []Expectation `json:"expect,omitempty"`
}

// Expectation is the exact set of backend pods a client reaches through
// every port of a Service. An empty Backends list means the traffic is
// dropped.
type Expectation struct {
	Client   string   `json:"client"`
	Service  string   `json:"service"`
	Backends []string `json:"backends"`
}

// Defaults.
const (
	DefaultName     = "tb"
	DefaultPodCIDR  = "10.244.0.0/16"
	DefaultWireCIDR = "10.250.0.0/24"
	DefaultCPU      = "4"
	DefaultHTTPPort = 8080
	DefaultUDPPort  = 5353
	// FirstClusterIP is the first address handed to Services without one.
	FirstClusterIP = "10.96.0.10"
)

var nameRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)

// LoadSpec reads and validates a spec from a YAML file.
func LoadSpec(path string) (*Spec, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read testbed spec: %w", err)
	}
	s, err := ParseSpec(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

// ParseSpec decodes YAML (unknown fields are errors; merge keys `<<` may
// be overridden, so scenarios can reuse a Service with an anchor), applies
// the defaults and validates the result.
func ParseSpec(data []byte) (*Spec, error) {
	var s Spec
	strict := func(d *json.Decoder) *json.Decoder { d.DisallowUnknownFields(); return d }
	if err := yaml.Unmarshal(data, &s, strict); err != nil {
		return nil, fmt.Errorf("decode testbed spec: %w", err)
	}
	if err := s.complete(); err != nil {
		return nil, err
	}
	return &s, nil
}

// complete applies defaults and validates.
func (s *Spec) complete() error {
	if s.Name == "" {
		s.Name = DefaultName
	}
	if !nameRE.MatchString(s.Name) || len(s.Name) > 12 {
		return fmt.Errorf("name %q: want [a-z0-9-], at most 12 characters", s.Name)
	}
	if s.PodCIDR == "" {
		s.PodCIDR = DefaultPodCIDR
	}
	if s.WireCIDR == "" {
		s.WireCIDR = DefaultWireCIDR
	}
	if len(s.Zones) == 0 {
		return fmt.Errorf("no zones")
	}
	pods := map[string]Role{}
	nodes := map[string]bool{}
	zones := map[string]bool{}
	for zi := range s.Zones {
		z := &s.Zones[zi]
		if z.Name == "" || zones[z.Name] {
			return fmt.Errorf("zone %d: name %q empty or repeated", zi+1, z.Name)
		}
		zones[z.Name] = true
		if len(z.Nodes) == 0 {
			return fmt.Errorf("zone %s: no nodes", z.Name)
		}
		for ni := range z.Nodes {
			n := &z.Nodes[ni]
			if !nameRE.MatchString(n.Name) || nodes[n.Name] {
				return fmt.Errorf("zone %s: node name %q invalid or repeated", z.Name, n.Name)
			}
			nodes[n.Name] = true
			if n.CPU == "" {
				n.CPU = DefaultCPU
			}
			for pi := range n.Pods {
				p := &n.Pods[pi]
				if !nameRE.MatchString(p.Name) {
					return fmt.Errorf("node %s: pod name %q invalid", n.Name, p.Name)
				}
				if _, dup := pods[p.Name]; dup {
					return fmt.Errorf("pod %s defined twice", p.Name)
				}
				if p.Role == "" {
					p.Role = RoleBackend
				}
				if p.Role != RoleBackend && p.Role != RoleClient {
					return fmt.Errorf("pod %s: role %q: want backend or client", p.Name, p.Role)
				}
				pods[p.Name] = p.Role
			}
		}
	}

	ips := newClusterIPs()
	s.ips, s.roles = ips, pods
	if err := completeServices(s.Services, pods, ips, "services"); err != nil {
		return err
	}
	seen := map[string]bool{}
	for i := range s.Scenarios {
		sc := &s.Scenarios[i]
		if !nameRE.MatchString(sc.Name) || seen[sc.Name] {
			return fmt.Errorf("scenario %d: name %q invalid or repeated", i+1, sc.Name)
		}
		seen[sc.Name] = true
		where := "scenario " + sc.Name
		if err := completeServices(sc.Services, pods, ips, where); err != nil {
			return err
		}
		for _, e := range sc.Expect {
			if role, ok := pods[e.Client]; !ok {
				return fmt.Errorf("%s: expect: unknown client pod %q", where, e.Client)
			} else if role != RoleClient {
				return fmt.Errorf("%s: expect: pod %s is not a client", where, e.Client)
			}
			if !slices.ContainsFunc(sc.Services, func(svc ServiceSpec) bool { return svc.Key() == qualify(e.Service) }) {
				return fmt.Errorf("%s: expect: service %q is not in the scenario", where, e.Service)
			}
			for _, b := range e.Backends {
				if pods[b] != RoleBackend {
					return fmt.Errorf("%s: expect: %q is not a backend pod", where, b)
				}
			}
		}
	}
	return nil
}

// CompleteServices validates Services built in code (for Testbed.Apply)
// and returns copies with the defaults a spec file gets: namespace,
// protocol, target port, condition, and a cluster IP that stays the same
// for the same name.
func (s *Spec) CompleteServices(svcs []ServiceSpec) ([]ServiceSpec, error) {
	out := make([]ServiceSpec, len(svcs))
	for i, svc := range svcs {
		svc.Ports = slices.Clone(svc.Ports)
		svc.Endpoints = slices.Clone(svc.Endpoints)
		svc.Annotations = copyMap(svc.Annotations)
		out[i] = svc
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ips == nil {
		return nil, errors.New("spec not validated: use ParseSpec or LoadSpec")
	}
	if err := completeServices(out, s.roles, s.ips, "services"); err != nil {
		return nil, err
	}
	return out, nil
}

// Key returns "namespace/name".
func (s ServiceSpec) Key() string { return s.Namespace + "/" + s.Name }

// qualify turns "name" into "default/name"; "ns/name" is returned as is.
func qualify(svc string) string {
	if strings.Contains(svc, "/") {
		return svc
	}
	return v1.NamespaceDefault + "/" + svc
}

// clusterIPs hands out stable default cluster IPs by service key.
type clusterIPs struct {
	next  netip.Addr
	byKey map[string]netip.Addr
	used  map[netip.Addr]string
}

func newClusterIPs() *clusterIPs {
	return &clusterIPs{next: netip.MustParseAddr(FirstClusterIP), byKey: map[string]netip.Addr{}, used: map[netip.Addr]string{}}
}

var serviceRange = netip.MustParsePrefix("10.96.0.0/16")

func (c *clusterIPs) assign(svc *ServiceSpec) error {
	key := svc.Key()
	if svc.ClusterIP != "" {
		ip, err := netip.ParseAddr(svc.ClusterIP)
		if err != nil || !serviceRange.Contains(ip) {
			return fmt.Errorf("service %s: clusterIP %q: want an address in %s", key, svc.ClusterIP, serviceRange)
		}
		if owner, ok := c.used[ip]; ok && owner != key {
			return fmt.Errorf("service %s: clusterIP %s is already used by %s", key, ip, owner)
		}
		c.used[ip] = key
		c.byKey[key] = ip
		return nil
	}
	ip, ok := c.byKey[key]
	for !ok {
		ip = c.next
		c.next = c.next.Next()
		if _, taken := c.used[ip]; !taken {
			ok = true
		}
	}
	c.used[ip] = key
	c.byKey[key] = ip
	svc.ClusterIP = ip.String()
	return nil
}

func completeServices(svcs []ServiceSpec, pods map[string]Role, ips *clusterIPs, where string) error {
	seen := map[string]bool{}
	for i := range svcs {
		svc := &svcs[i]
		if svc.Namespace == "" {
			svc.Namespace = v1.NamespaceDefault
		}
		if !nameRE.MatchString(svc.Name) || seen[svc.Key()] {
			return fmt.Errorf("%s: service %q: name invalid or repeated", where, svc.Name)
		}
		seen[svc.Key()] = true
		key := svc.Key()
		if err := ips.assign(svc); err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		if len(svc.Ports) == 0 {
			return fmt.Errorf("%s: service %s: no ports", where, key)
		}
		names := map[string]bool{}
		for pi := range svc.Ports {
			p := &svc.Ports[pi]
			if p.Protocol == "" {
				p.Protocol = v1.ProtocolTCP
			}
			if p.Protocol != v1.ProtocolTCP && p.Protocol != v1.ProtocolUDP {
				return fmt.Errorf("%s: service %s: port %q: protocol %q: want TCP or UDP", where, key, p.Name, p.Protocol)
			}
			if p.TargetPort == 0 {
				p.TargetPort = DefaultHTTPPort
				if p.Protocol == v1.ProtocolUDP {
					p.TargetPort = DefaultUDPPort
				}
			}
			if p.Port < 1 || p.Port > 65535 || p.TargetPort < 1 || p.TargetPort > 65535 {
				return fmt.Errorf("%s: service %s: port %q: number out of range", where, key, p.Name)
			}
			if names[p.Name] || (p.Name == "" && len(svc.Ports) > 1) {
				return fmt.Errorf("%s: service %s: port name %q repeated or missing", where, key, p.Name)
			}
			names[p.Name] = true
		}
		if svc.InternalTrafficPolicy != "" && svc.InternalTrafficPolicy != string(v1.ServiceInternalTrafficPolicyCluster) &&
			svc.InternalTrafficPolicy != string(v1.ServiceInternalTrafficPolicyLocal) {
			return fmt.Errorf("%s: service %s: internalTrafficPolicy %q: want Cluster or Local", where, key, svc.InternalTrafficPolicy)
		}
		if err := checkHints(svc.Hints); err != nil {
			return fmt.Errorf("%s: service %s: %w", where, key, err)
		}
		eps := map[string]bool{}
		for ei := range svc.Endpoints {
			ep := &svc.Endpoints[ei]
			if pods[ep.Pod] != RoleBackend {
				return fmt.Errorf("%s: service %s: endpoint %q is not a backend pod", where, key, ep.Pod)
			}
			if eps[ep.Pod] {
				return fmt.Errorf("%s: service %s: endpoint %s listed twice", where, key, ep.Pod)
			}
			eps[ep.Pod] = true
			if err := checkHints(ep.Hints); err != nil {
				return fmt.Errorf("%s: service %s: endpoint %s: %w", where, key, ep.Pod, err)
			}
			switch ep.Condition {
			case "":
				ep.Condition = Ready
			case Ready, Terminating, NotReady:
			default:
				return fmt.Errorf("%s: service %s: endpoint %s: condition %q: want ready, terminating or not-ready", where, key, ep.Pod, ep.Condition)
			}
		}
	}
	return nil
}

func checkHints(h Hints) error {
	switch h {
	case "", HintsNone, HintsZone, HintsNode:
		return nil
	}
	return fmt.Errorf("hints %q: want none, zone or node", h)
}

// Scenario returns the named scenario.
func (s *Spec) Scenario(name string) (*Scenario, error) {
	for i := range s.Scenarios {
		if s.Scenarios[i].Name == name {
			return &s.Scenarios[i], nil
		}
	}
	return nil, fmt.Errorf("no scenario %q", name)
}

// BackendPorts returns the TCP and UDP target ports of every Service in the
// spec and its scenarios, plus the defaults: the ports backend pods serve.
func (s *Spec) BackendPorts() (tcp, udp []uint16) {
	tcp, udp = []uint16{DefaultHTTPPort}, []uint16{DefaultUDPPort}
	add := func(svcs []ServiceSpec) {
		for _, svc := range svcs {
			for _, p := range svc.Ports {
				if p.Protocol == v1.ProtocolUDP {
					udp = append(udp, uint16(p.TargetPort))
				} else {
					tcp = append(tcp, uint16(p.TargetPort))
				}
			}
		}
	}
	add(s.Services)
	for _, sc := range s.Scenarios {
		add(sc.Services)
	}
	slices.Sort(tcp)
	slices.Sort(udp)
	return slices.Compact(tcp), slices.Compact(udp)
}
