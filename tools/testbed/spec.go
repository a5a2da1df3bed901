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
	// Outside, when set, adds a network outside the cluster: a router on
	// the wire and clients behind it.
	Outside *OutsideSpec `json:"outside,omitempty"`
	// DualStack gives every node, pod, the wire and the outside network
	// an IPv6 address beside its IPv4 one (ULA prefixes: see
	// DefaultPodCIDR6, DefaultWireCIDR6, DefaultOutsideCIDR6), so Services
	// may list IPv6 in their ipFamilies. Without it the testbed is IPv4
	// only.
	DualStack bool `json:"dualStack,omitempty"`
	// KubeProxy says where kube-proxy may run: "" (default: only where a
	// test starts one with StartKubeProxy) or "none" (nowhere:
	// StartKubeProxy fails, and CheckNoKubeProxy proves every node's
	// netfilter is free of kube-proxy's rules).
	KubeProxy KubeProxyPolicy `json:"kubeProxy,omitempty"`

	// mu guards ips: Services built in code get their defaults, cluster
	// IPs and node ports from the same allocator as the spec's.
	mu    sync.Mutex
	ips   *allocator
	roles map[string]Role
}

// KubeProxyPolicy says where kube-proxy may run on a testbed.
type KubeProxyPolicy string

const (
	// KubeProxyOnDemand lets tests start kube-proxy on nodes they choose.
	KubeProxyOnDemand KubeProxyPolicy = ""
	// KubeProxyNone forbids kube-proxy on every node.
	KubeProxyNone KubeProxyPolicy = "none"
)

// OutsideSpec is a network outside the cluster: a router namespace plugged
// into the wire, and client namespaces behind it on their own subnet.
// Nodes route the subnet via the router; the router reaches node
// addresses on the wire, and sends every external IP and load-balancer IP
// of the current Services to IngressNode.
type OutsideSpec struct {
	// CIDR is the outside subnet, an IPv4 /24: the router is its .1 (every
	// client's gateway), client i is .(9+i). Default 203.0.113.0/24
	// (TEST-NET-3, never routed on the Internet).
	CIDR string `json:"cidr,omitempty"`
	// RouterAddr is the router's address on the wire. Default the wire's
	// .254.
	RouterAddr string `json:"routerAddr,omitempty"`
	// IngressNode is the node the router sends external IPs and
	// load-balancer IPs to, as a cloud load balancer would. Default the
	// first node.
	IngressNode string `json:"ingressNode,omitempty"`
	// Clients are the namespaces outside the cluster.
	Clients []ExternalSpec `json:"clients"`
	// RouteServiceRange makes the router send the service range
	// (10.96.0.0/16, the cluster IPs) to the ingress node too, as a
	// router that advertises cluster IPs to the outside does.
	RouteServiceRange bool `json:"routeServiceRange,omitempty"`
}

// ExternalSpec is one client outside the cluster.
type ExternalSpec struct {
	Name string `json:"name"`
}

// NetfilterSpec is netfilter state of a node that changes how forwarded
// traffic is treated.
type NetfilterSpec struct {
	// InvalidDrop installs the rule kube-proxy's iptables mode writes (in
	// its KUBE-FORWARD chain, jumped to first from FORWARD) when
	// nf_conntrack_tcp_be_liberal is 0: `iptables -I FORWARD -m conntrack
	// --ctstate INVALID -j DROP`. kube-proxy's nftables mode installs no
	// such rule.
	InvalidDrop bool `json:"invalidDrop,omitempty"`
	// TCPBeLiberal sets net.netfilter.nf_conntrack_tcp_be_liberal in the
	// node's namespace; unset leaves the kernel's default (0).
	TCPBeLiberal *bool `json:"tcpBeLiberal,omitempty"`
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
	// WireMTU is the MTU of the node's wire interface and of its port on
	// the switch; 0 leaves the default (1500). A smaller MTU than the
	// other nodes' makes the node a path-MTU bottleneck: frames larger
	// than it are dropped by the switch on the way in, and the node's own
	// forwarding answers "fragmentation needed" on the way out.
	WireMTU int `json:"wireMTU,omitempty"`
	// Netfilter is netfilter state set up in the node's namespace.
	Netfilter NetfilterSpec `json:"netfilter,omitempty"`
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
	// IPFamilies are the Service's families, its primary first: IPv4,
	// IPv6, or both in either order (IPv6 needs the spec's dualStack). The
	// testbed writes one EndpointSlice per family. Default [IPv4].
	IPFamilies []v1.IPFamily `json:"ipFamilies,omitempty"`
	// ClusterIP is the IPv4 cluster IP, an address in 10.96.0.0/16
	// (kubetest's service range); "" for a Service without IPv4.
	// Default: 10.96.0.10 and up, by the order of first appearance of the
	// service's name in the spec, so a Service keeps its address across
	// scenarios.
	ClusterIP string `json:"clusterIP,omitempty"`
	// ClusterIPv6 is the IPv6 cluster IP, in fd00:10:96::/108 (kubetest's
	// dual-stack service range); "" for a Service without IPv6. Default
	// fd00:10:96::a and up, as ClusterIP.
	ClusterIPv6 string `json:"clusterIPv6,omitempty"`
	// Type is ClusterIP (the default), NodePort or LoadBalancer.
	Type v1.ServiceType `json:"type,omitempty"`
	// ExternalIPs are written to spec.externalIPs.
	ExternalIPs []string `json:"externalIPs,omitempty"`
	// LoadBalancerIPs are written to status.loadBalancer.ingress, as a
	// cloud controller would (type LoadBalancer only).
	LoadBalancerIPs []string `json:"loadBalancerIPs,omitempty"`
	// LoadBalancerSourceRanges are written to
	// spec.loadBalancerSourceRanges.
	LoadBalancerSourceRanges []string `json:"loadBalancerSourceRanges,omitempty"`
	// ExternalTrafficPolicy is Cluster (the default) or Local; only for
	// externally accessible Services (NodePort, LoadBalancer, or with
	// externalIPs).
	ExternalTrafficPolicy string `json:"externalTrafficPolicy,omitempty"`
	// SessionAffinity is None (the default) or ClientIP, with
	// SessionAffinityTimeout seconds (ClientIP only; default 10800, the
	// API's).
	SessionAffinity        string `json:"sessionAffinity,omitempty"`
	SessionAffinityTimeout int32  `json:"sessionAffinityTimeout,omitempty"`
	// HealthCheckNodePort is the health check port of a LoadBalancer with
	// externalTrafficPolicy Local. Default: assigned, like node ports.
	HealthCheckNodePort int32             `json:"healthCheckNodePort,omitempty"`
	Annotations         map[string]string `json:"annotations,omitempty"`
	// Labels are the Service's labels (for example
	// service.kubernetes.io/service-proxy-name).
	Labels map[string]string `json:"labels,omitempty"`
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
	// NodePort is the port's nodePort (types NodePort and LoadBalancer
	// only), in 30000-32767. Default: assigned from 30000 up, in order of
	// first appearance, the same for the same Service and port in every
	// scenario.
	NodePort int32 `json:"nodePort,omitempty"`
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
	// Families, when set, are the only families whose EndpointSlice lists
	// the endpoint, as a pod with addresses of those families only; each
	// must be one of the Service's. Unset: every family of the Service.
	// A family that lacks the endpoints of a zone decides on its own, as
	// kube-proxy does: it may fall back where the other keeps its hints.
	Families []v1.IPFamily `json:"families,omitempty"`
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
	// Drain, when set, shows a drain: a stream opened on a backend before
	// the scenario is applied keeps answering from it afterwards, while new
	// requests follow Expect.
	Drain *DrainSpec `json:"drain,omitempty"`
}

// DrainSpec is a long-lived TCP stream from Client to Service's TCP port,
// opened on backend Pod before a scenario that retires Pod (serving-
// terminating, or out of the client's set while it still serves) is
// applied.
type DrainSpec struct {
	Client  string `json:"client"`
	Service string `json:"service"`
	Pod     string `json:"pod"`
}

// Expectation is the exact set of backend pods a client reaches through
// every port of a Service. An empty Backends list means the traffic is
// dropped.
type Expectation struct {
	// Client is a client pod, a node (its own processes, on the host
	// network, through the cluster IP: Testbed.MeasureHost), or (with
	// Via) an outside client.
	Client string `json:"client"`
	// Via, when set, names the node whose NodePorts the client uses
	// (Testbed.MeasureNodePort): an outside client lands on that node's
	// external backends, a pod on its cluster set. Unset, a pod uses the
	// cluster IP (Testbed.Measure).
	Via      string   `json:"via,omitempty"`
	Service  string   `json:"service"`
	Backends []string `json:"backends"`
	// Family, when set, is the one IP family the expectation holds for
	// (each family of a dual-stack Service is decided on its own, so it
	// may land elsewhere); unset, it holds for every family of the
	// Service.
	Family v1.IPFamily `json:"family,omitempty"`
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
	// Node ports are handed out in the apiserver's default range.
	FirstNodePort = 30000
	LastNodePort  = 32767
	// A node's wire MTU is between IPv4's minimum reassembly size and a
	// jumbo frame; in a dual-stack testbed at least IPv6's minimum link
	// MTU (RFC 8200 5: below it Linux disables IPv6 on the interface).
	MinWireMTU  = 576
	MinWireMTU6 = 1280
	MaxWireMTU  = 9000
	// DefaultOutsideCIDR is the outside network's default subnet.
	DefaultOutsideCIDR = "203.0.113.0/24"
	// IPv6 addressing of a dual-stack testbed (Spec.DualStack), in the
	// unique local range: node i's pods get the /64 fd00:10:244:i::/64
	// (gateway ::1, pod k ::(2+k)), the wire is fd00:10:250::/64 (the
	// switch ::1, node i ::(1+i), the router ::fe), the outside network
	// fd00:203:113::/64 (router ::1, client i ::(10+i)).
	DefaultPodCIDR6     = "fd00:10:244::/48"
	DefaultWireCIDR6    = "fd00:10:250::/64"
	DefaultOutsideCIDR6 = "fd00:203:113::/64"
	// FirstClusterIPv6 is the first IPv6 address handed to Services
	// without one.
	FirstClusterIPv6 = "fd00:10:96::a"
	// DefaultSessionAffinityTimeout is the API's default ClientIP
	// affinity timeout, in seconds.
	DefaultSessionAffinityTimeout = 10800
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
			if n.WireMTU != 0 && (n.WireMTU < MinWireMTU || n.WireMTU > MaxWireMTU) {
				return fmt.Errorf("node %s: wireMTU %d: want %d to %d", n.Name, n.WireMTU, MinWireMTU, MaxWireMTU)
			}
			if n.WireMTU != 0 && s.DualStack && n.WireMTU < MinWireMTU6 {
				return fmt.Errorf("node %s: wireMTU %d: a dual-stack testbed needs IPv6's minimum, %d", n.Name, n.WireMTU, MinWireMTU6)
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

	if err := s.completeOutside(pods, nodes); err != nil {
		return err
	}
	switch s.KubeProxy {
	case KubeProxyOnDemand, KubeProxyNone:
	default:
		return fmt.Errorf("kubeProxy %q: want none or nothing", s.KubeProxy)
	}
	ips := newAllocator()
	s.ips, s.roles = ips, pods
	if err := completeServices(s.Services, pods, ips, s.DualStack, "services"); err != nil {
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
		if err := completeServices(sc.Services, pods, ips, s.DualStack, where); err != nil {
			return err
		}
		for _, e := range sc.Expect {
			if err := s.checkClient(e, pods, nodes); err != nil {
				return fmt.Errorf("%s: expect: %w", where, err)
			}
			i := slices.IndexFunc(sc.Services, func(svc ServiceSpec) bool { return svc.Key() == qualify(e.Service) })
			if i < 0 {
				return fmt.Errorf("%s: expect: service %q is not in the scenario", where, e.Service)
			}
			if e.Family != "" && !slices.Contains(sc.Services[i].IPFamilies, e.Family) {
				return fmt.Errorf("%s: expect: family %q is not one of service %s's (%v)", where, e.Family, e.Service, sc.Services[i].IPFamilies)
			}
			for _, b := range e.Backends {
				if pods[b] != RoleBackend {
					return fmt.Errorf("%s: expect: %q is not a backend pod", where, b)
				}
			}
		}
		if d := sc.Drain; d != nil {
			switch {
			case pods[d.Client] != RoleClient:
				return fmt.Errorf("%s: drain: %q is not a client pod", where, d.Client)
			case pods[d.Pod] != RoleBackend:
				return fmt.Errorf("%s: drain: %q is not a backend pod", where, d.Pod)
			case !slices.ContainsFunc(sc.Services, func(svc ServiceSpec) bool { return svc.Key() == qualify(d.Service) }):
				return fmt.Errorf("%s: drain: service %q is not in the scenario", where, d.Service)
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
		svc.ExternalIPs = slices.Clone(svc.ExternalIPs)
		svc.LoadBalancerIPs = slices.Clone(svc.LoadBalancerIPs)
		svc.LoadBalancerSourceRanges = slices.Clone(svc.LoadBalancerSourceRanges)
		svc.IPFamilies = slices.Clone(svc.IPFamilies)
		svc.Annotations = copyMap(svc.Annotations)
		svc.Labels = copyMap(svc.Labels)
		out[i] = svc
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ips == nil {
		return nil, errors.New("spec not validated: use ParseSpec or LoadSpec")
	}
	if err := completeServices(out, s.roles, s.ips, s.DualStack, "services"); err != nil {
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

// allocator hands out stable default cluster IPs by service key, and node
// ports by service key and port.
type allocator struct {
	// next and byKey are per family (ipv4, ipv6 below); used holds
	// both.
	next  [2]netip.Addr
	byKey [2]map[string]netip.Addr
	used  map[netip.Addr]string

	nextPort   int32
	portByKey  map[string]int32
	portsTaken map[int32]string
}

func newAllocator() *allocator {
	return &allocator{
		next:  [2]netip.Addr{netip.MustParseAddr(FirstClusterIP), netip.MustParseAddr(FirstClusterIPv6)},
		byKey: [2]map[string]netip.Addr{{}, {}}, used: map[netip.Addr]string{},
		nextPort: FirstNodePort, portByKey: map[string]int32{}, portsTaken: map[int32]string{},
	}
}

// The service ranges of kubetest's apiserver (ServiceClusterIPRange and
// the IPv6 half of DualStackServiceClusterIPRange), by family.
var serviceRanges = [2]netip.Prefix{netip.MustParsePrefix("10.96.0.0/16"), netip.MustParsePrefix("fd00:10:96::/108")}

// serviceRange is the IPv4 service range.
var serviceRange = serviceRanges[ipv4]

// Indexes of per-family arrays.
const (
	ipv4 = 0
	ipv6 = 1
)

// familyIndex returns ipv4 or ipv6 for family.
func familyIndex(family v1.IPFamily) int {
	if family == v1.IPv6Protocol {
		return ipv6
	}
	return ipv4
}

// nodePort returns *port when set (checking it is in range and not another
// key's), else the port key had before, else the next free one; key names
// what owns it ("ns/name/port/PROTO" or "ns/name/healthcheck").
func (c *allocator) nodePort(key string, port *int32) error {
	if *port != 0 {
		if *port < FirstNodePort || *port > LastNodePort {
			return fmt.Errorf("%s: node port %d outside %d-%d", key, *port, FirstNodePort, LastNodePort)
		}
		if owner, ok := c.portsTaken[*port]; ok && owner != key {
			return fmt.Errorf("%s: node port %d is already used by %s", key, *port, owner)
		}
		c.portsTaken[*port] = key
		c.portByKey[key] = *port
		return nil
	}
	p, ok := c.portByKey[key]
	for !ok {
		if c.nextPort > LastNodePort {
			return fmt.Errorf("%s: node ports exhausted", key)
		}
		p = c.nextPort
		c.nextPort++
		_, taken := c.portsTaken[p]
		ok = !taken
	}
	c.portsTaken[p] = key
	c.portByKey[key] = p
	*port = p
	return nil
}

// assign checks or hands out the Service's cluster IP of every family it
// has, and clears the field of a family it does not have.
func (c *allocator) assign(svc *ServiceSpec) error {
	fields := [2]*string{&svc.ClusterIP, &svc.ClusterIPv6}
	for fi, field := range fields {
		family := v1.IPv4Protocol
		if fi == ipv6 {
			family = v1.IPv6Protocol
		}
		if !slices.Contains(svc.IPFamilies, family) {
			if *field != "" {
				return fmt.Errorf("service %s: %s %s: %s is not in ipFamilies %v", svc.Key(), clusterIPFields[fi], *field, family, svc.IPFamilies)
			}
			continue
		}
		if err := c.assignFamily(svc.Key(), fi, field); err != nil {
			return err
		}
	}
	return nil
}

// clusterIPFields name ServiceSpec's cluster IP fields, by family.
var clusterIPFields = [2]string{"clusterIP", "clusterIPv6"}

// assignFamily is assign for one family (fi): *field when set (checked),
// else the address key had before, else the next free one.
func (c *allocator) assignFamily(key string, fi int, field *string) error {
	if *field != "" {
		ip, err := netip.ParseAddr(*field)
		if err != nil || !serviceRanges[fi].Contains(ip) {
			return fmt.Errorf("service %s: %s %q: want an address in %s", key, clusterIPFields[fi], *field, serviceRanges[fi])
		}
		if owner, ok := c.used[ip]; ok && owner != key {
			return fmt.Errorf("service %s: %s %s is already used by %s", key, clusterIPFields[fi], ip, owner)
		}
		c.used[ip] = key
		c.byKey[fi][key] = ip
		return nil
	}
	ip, ok := c.byKey[fi][key]
	for !ok {
		ip = c.next[fi]
		c.next[fi] = c.next[fi].Next()
		if _, taken := c.used[ip]; !taken {
			ok = true
		}
	}
	c.used[ip] = key
	c.byKey[fi][key] = ip
	*field = ip.String()
	return nil
}

// completeServices applies the defaults of svcs and validates them;
// dualStack is the spec's (Spec.DualStack).
func completeServices(svcs []ServiceSpec, pods map[string]Role, ips *allocator, dualStack bool, where string) error {
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
		if err := completeFamilies(svc, dualStack); err != nil {
			return fmt.Errorf("%s: service %s: %w", where, key, err)
		}
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
		if err := completeExternal(svc, ips); err != nil {
			return fmt.Errorf("%s: service %s: %w", where, key, err)
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
			for _, f := range ep.Families {
				if !slices.Contains(svc.IPFamilies, f) {
					return fmt.Errorf("%s: service %s: endpoint %s: family %q is not in ipFamilies %v", where, key, ep.Pod, f, svc.IPFamilies)
				}
			}
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

// completeFamilies checks a Service's ipFamilies and applies the default
// ([IPv4]).
func completeFamilies(svc *ServiceSpec, dualStack bool) error {
	if len(svc.IPFamilies) == 0 {
		svc.IPFamilies = []v1.IPFamily{v1.IPv4Protocol}
	}
	if len(svc.IPFamilies) > 2 || (len(svc.IPFamilies) == 2 && svc.IPFamilies[0] == svc.IPFamilies[1]) {
		return fmt.Errorf("ipFamilies %v: want IPv4, IPv6 or both, each once", svc.IPFamilies)
	}
	for _, f := range svc.IPFamilies {
		switch {
		case f != v1.IPv4Protocol && f != v1.IPv6Protocol:
			return fmt.Errorf("ipFamilies: %q: want IPv4 or IPv6", f)
		case f == v1.IPv6Protocol && !dualStack:
			return fmt.Errorf("ipFamilies: IPv6 needs a dual-stack testbed (dualStack: true)")
		}
	}
	return nil
}

// completeExternal checks and completes how a Service is reached from
// outside the cluster: its type, node ports, external and load-balancer
// IPs, traffic policy, session affinity and health check port.
func completeExternal(svc *ServiceSpec, ips *allocator) error {
	key := svc.Key()
	switch svc.Type {
	case "":
		svc.Type = v1.ServiceTypeClusterIP
	case v1.ServiceTypeClusterIP, v1.ServiceTypeNodePort, v1.ServiceTypeLoadBalancer:
	default:
		return fmt.Errorf("type %q: want ClusterIP, NodePort or LoadBalancer", svc.Type)
	}
	hasNodePorts := svc.Type != v1.ServiceTypeClusterIP
	for i := range svc.Ports {
		p := &svc.Ports[i]
		if !hasNodePorts {
			if p.NodePort != 0 {
				return fmt.Errorf("port %q: nodePort with type ClusterIP", p.Name)
			}
			continue
		}
		if err := ips.nodePort(key+"/"+p.Name+"/"+string(p.Protocol), &p.NodePort); err != nil {
			return err
		}
	}
	for _, list := range []struct {
		name string
		ips  []string
	}{{"externalIPs", svc.ExternalIPs}, {"loadBalancerIPs", svc.LoadBalancerIPs}} {
		for _, a := range list.ips {
			ip, err := netip.ParseAddr(a)
			if err != nil || ip.Zone() != "" || ip.Is4In6() {
				return fmt.Errorf("%s: %q is not an IP address", list.name, a)
			}
			family := v1.IPv4Protocol
			if ip.Is6() {
				family = v1.IPv6Protocol
			}
			if !slices.Contains(svc.IPFamilies, family) {
				return fmt.Errorf("%s: %s is %s, not a family of the Service (ipFamilies %v)", list.name, ip, family, svc.IPFamilies)
			}
			if r := serviceRanges[familyIndex(family)]; r.Contains(ip) {
				return fmt.Errorf("%s: %s is in the cluster IP range %s", list.name, ip, r)
			}
		}
	}
	if len(svc.LoadBalancerIPs) > 0 && svc.Type != v1.ServiceTypeLoadBalancer {
		return fmt.Errorf("loadBalancerIPs need type LoadBalancer")
	}
	external := hasNodePorts || len(svc.ExternalIPs) > 0
	switch svc.ExternalTrafficPolicy {
	case "":
	case string(v1.ServiceExternalTrafficPolicyCluster), string(v1.ServiceExternalTrafficPolicyLocal):
		if !external {
			return fmt.Errorf("externalTrafficPolicy %s: the Service is not reachable from outside (no node ports, no externalIPs)", svc.ExternalTrafficPolicy)
		}
	default:
		return fmt.Errorf("externalTrafficPolicy %q: want Cluster or Local", svc.ExternalTrafficPolicy)
	}
	switch svc.SessionAffinity {
	case "", string(v1.ServiceAffinityNone):
		if svc.SessionAffinityTimeout != 0 {
			return fmt.Errorf("sessionAffinityTimeout without sessionAffinity ClientIP")
		}
	case string(v1.ServiceAffinityClientIP):
		if svc.SessionAffinityTimeout == 0 {
			svc.SessionAffinityTimeout = DefaultSessionAffinityTimeout
		}
		if svc.SessionAffinityTimeout < 1 || svc.SessionAffinityTimeout > 86400 {
			return fmt.Errorf("sessionAffinityTimeout %d: want 1 to 86400 seconds", svc.SessionAffinityTimeout)
		}
	default:
		return fmt.Errorf("sessionAffinity %q: want None or ClientIP", svc.SessionAffinity)
	}
	healthCheck := svc.Type == v1.ServiceTypeLoadBalancer && svc.ExternalTrafficPolicy == string(v1.ServiceExternalTrafficPolicyLocal)
	if !healthCheck {
		if svc.HealthCheckNodePort != 0 {
			return fmt.Errorf("healthCheckNodePort needs type LoadBalancer and externalTrafficPolicy Local")
		}
		return nil
	}
	return ips.nodePort(key+"/healthcheck", &svc.HealthCheckNodePort)
}

// checkClient checks an expectation's client and node: a client pod, or,
// through a node's NodePorts (Via), an outside client.
func (s *Spec) checkClient(e Expectation, pods map[string]Role, nodes map[string]bool) error {
	if e.Via != "" && !nodes[e.Via] {
		return fmt.Errorf("via %q is not a node", e.Via)
	}
	if role, ok := pods[e.Client]; ok {
		if role != RoleClient {
			return fmt.Errorf("pod %s is not a client", e.Client)
		}
		return nil
	}
	if nodes[e.Client] {
		if e.Via != "" {
			return fmt.Errorf("node %s: its processes reach the cluster IP, not another node's NodePorts: drop via", e.Client)
		}
		return nil
	}
	if s.Outside != nil && slices.ContainsFunc(s.Outside.Clients, func(c ExternalSpec) bool { return c.Name == e.Client }) {
		if e.Via == "" {
			return fmt.Errorf("outside client %s needs via: the node whose NodePorts it uses", e.Client)
		}
		return nil
	}
	return fmt.Errorf("unknown client %q", e.Client)
}

// completeOutside checks the outside network and applies its defaults.
func (s *Spec) completeOutside(pods map[string]Role, nodes map[string]bool) error {
	o := s.Outside
	if o == nil {
		return nil
	}
	if o.CIDR == "" {
		o.CIDR = DefaultOutsideCIDR
	}
	cidr, err := netip.ParsePrefix(o.CIDR)
	if err != nil || !cidr.Addr().Is4() || cidr.Bits() != 24 {
		return fmt.Errorf("outside: cidr %q: want an IPv4 /24", o.CIDR)
	}
	for _, other := range []string{s.PodCIDR, s.WireCIDR, serviceRange.String()} {
		if p, err := netip.ParsePrefix(other); err == nil && p.Overlaps(cidr) {
			return fmt.Errorf("outside: cidr %s overlaps %s", cidr, p)
		}
	}
	if o.IngressNode == "" {
		o.IngressNode = s.Zones[0].Nodes[0].Name
	}
	if !nodes[o.IngressNode] {
		return fmt.Errorf("outside: ingressNode %q is not a node", o.IngressNode)
	}
	if len(o.Clients) == 0 {
		return fmt.Errorf("outside: no clients")
	}
	if len(o.Clients) > 240 {
		return fmt.Errorf("outside: more than 240 clients")
	}
	seen := map[string]bool{}
	for _, c := range o.Clients {
		if !nameRE.MatchString(c.Name) || seen[c.Name] {
			return fmt.Errorf("outside: client name %q invalid or repeated", c.Name)
		}
		if _, isPod := pods[c.Name]; isPod {
			return fmt.Errorf("outside: client %s has the name of a pod", c.Name)
		}
		seen[c.Name] = true
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
