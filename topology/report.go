package topology

import (
	"math"
	"slices"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Report is the JSON contract of `topolbctl explain -o json`: one entry per
// service port decided for one node, the frontends the node programs, and
// the warnings. Fields are only ever added, never renamed.
type Report struct {
	Node     string       `json:"node"`
	Zone     string       `json:"zone"`
	Services []PortReport `json:"services"`
	// Frontends are every frontend the node programs, after conflicts
	// between Services are resolved (NodeFrontends), sorted by address,
	// protocol and scope. Never null.
	Frontends []FrontendReport `json:"frontends"`
	// Warnings name what was left out: objects, fields and frontends.
	// Never null.
	Warnings []string `json:"warnings"`
	// Skipped are the Services not proxied at all, as kube-proxy skips
	// them (SkipReason), sorted by service; omitted when none.
	Skipped []SkippedService `json:"skipped,omitempty"`
}

// SkippedService is a Service neither topolb nor kube-proxy proxies.
type SkippedService struct {
	// Service is "namespace/name".
	Service string `json:"service"`
	// Reason is SkipReason's.
	Reason string `json:"reason"`
}

// PortReport is one service port's decision in a Report.
type PortReport struct {
	// Service is "namespace/name".
	Service string `json:"service"`
	// Port is the port's name, "" if unnamed.
	Port     string `json:"port"`
	Protocol string `json:"protocol"`
	// Family is the IP family the port is decided in ("IPv4" or "IPv6"):
	// a dual-stack Service reports each port once per family, and each
	// family is decided on its own (its own EndpointSlices, so its own
	// hints and mode).
	Family v1.IPFamily `json:"family"`
	// Frontends are the "ip:port" addresses the port claims on this node:
	// the cluster IP first, then ExternalFrontends (externalIPs,
	// load-balancer IPs, NodePorts on the node's addresses). Which of them
	// it owns is in Report.Frontends.
	Frontends []string `json:"frontends"`
	Policy    Policy   `json:"policy"`
	Mode      Mode     `json:"mode"`
	Reason    string   `json:"reason"`
	// Backends are sorted "ip:port" strings; never null.
	Backends []string `json:"backends"`
	// Weights maps every entry of Backends to the fraction of this node's
	// new internal flows it gets, rounded to 4 decimal places; never null.
	Weights map[string]float64 `json:"weights"`
	// ExternalBackends are sorted "ip:port" strings; null when the port is
	// not externally accessible.
	ExternalBackends []string `json:"externalBackends"`
	// ExternalWeights are the weights of ExternalBackends, as Weights are of
	// Backends; null exactly when ExternalBackends is.
	ExternalWeights map[string]float64 `json:"externalWeights"`
	// DrainingBackends are the serving endpoints (ready, or
	// serving-terminating) that are not in Backends, as sorted "ip:port"
	// strings: new flows never go to them, established flows keep them.
	// Never null.
	DrainingBackends []string `json:"drainingBackends"`
	// ExternalDrainingBackends are the serving endpoints not in
	// ExternalBackends; null exactly when ExternalBackends is.
	ExternalDrainingBackends []string `json:"externalDrainingBackends"`
	// SessionAffinity is "ClientIP" or "None".
	SessionAffinity string `json:"sessionAffinity"`
	// AffinityTimeoutSeconds is the ClientIP affinity timeout; 0 for None.
	AffinityTimeoutSeconds int32 `json:"affinityTimeoutSeconds"`
	// WhenEmpty is what happens to new flows for which a set of the port
	// is empty: "reject" (no usable endpoint anywhere: TCP reset, ICMP
	// port unreachable) or "drop" (the policy leaves this node without
	// backends for the set).
	WhenEmpty EmptyAction `json:"whenEmpty"`
	// ClusterBackends are the cluster set, the policy's choice for this
	// node, as sorted "ip:port" strings; null when the port never uses it.
	ClusterBackends []string `json:"clusterBackends"`
	// ClusterWeights and ClusterDrainingBackends are to ClusterBackends
	// what Weights and DrainingBackends are to Backends; null exactly when
	// ClusterBackends is.
	ClusterWeights          map[string]float64 `json:"clusterWeights"`
	ClusterDrainingBackends []string           `json:"clusterDrainingBackends"`
	// BackendZones counts the internal backends per endpoint zone ("" for
	// endpoints without a zone). Not part of the JSON contract.
	BackendZones map[string]int `json:"-"`
	// ZoneShares sums the internal weights per endpoint zone, when they are
	// not all equal; nil otherwise. Not part of the JSON contract.
	ZoneShares map[string]float64 `json:"-"`
}

// FrontendReport is one frontend the node programs.
type FrontendReport struct {
	// Address is "ip:port".
	Address  string       `json:"address"`
	Protocol string       `json:"protocol"`
	Scope    Scope        `json:"scope"`
	Kind     FrontendKind `json:"kind"`
	// Family is the address's IP family, the owning port's.
	Family v1.IPFamily `json:"family"`
	// Service and Port name the owning service port ("namespace/name", the
	// port's name or "").
	Service string `json:"service"`
	Port    string `json:"port"`
	// Backends, Weights and DrainingBackends are the set the frontend
	// uses, as in PortReport; never null.
	Backends         []string           `json:"backends"`
	Weights          map[string]float64 `json:"weights"`
	DrainingBackends []string           `json:"drainingBackends"`
	// SessionAffinity and AffinityTimeoutSeconds are the owning port's.
	SessionAffinity        string `json:"sessionAffinity"`
	AffinityTimeoutSeconds int32  `json:"affinityTimeoutSeconds"`
	// WhenEmpty is "reject" or "drop", as PortReport's.
	WhenEmpty EmptyAction `json:"whenEmpty"`
	// SourceRanges are the only sources new flows may come from
	// (loadBalancerSourceRanges, load-balancer IPs only), as prefixes;
	// omitted for any source. NodePasses says the node's own processes
	// pass (a range holds its address).
	SourceRanges []string `json:"sourceRanges,omitempty"`
	NodePasses   bool     `json:"nodePasses,omitempty"`
}

// NewReport turns decisions for node into a Report, with the frontends
// NodeFrontends assembles under DefaultOptions; see NewReportOptions.
func NewReport(node Node, ds []PortDecision) Report {
	return NewReportOptions(node, ds, DefaultOptions())
}

// NewReportOptions turns decisions for node into a Report. Frontends are
// NodeFrontends(node, ds, opts) and Warnings its warnings; callers add
// their own warnings (objects skipped, decisions' warnings) to it.
func NewReportOptions(node Node, ds []PortDecision, opts Options) Report {
	r := Report{Node: node.Name, Zone: node.Zone(), Services: make([]PortReport, 0, len(ds)), Frontends: []FrontendReport{}}
	warnings := WalkReport(node, ds, opts,
		func(p PortReport) { r.Services = append(r.Services, p) },
		func(f FrontendReport) { r.Frontends = append(r.Frontends, f) })
	r.Warnings = append([]string{}, warnings...)
	return r
}

// WalkReport hands service the report of every decision in ds, in order,
// then frontend the report of every frontend NodeFrontends(node, ds, opts)
// assembles, and returns NodeFrontends' warnings: NewReportOptions' Report
// one entry at a time, for a writer that need not hold it whole.
func WalkReport(node Node, ds []PortDecision, opts Options, service func(PortReport), frontend func(FrontendReport)) []string {
	for _, d := range ds {
		service(portReport(node, d, opts))
	}
	fes, warnings := NodeFrontends(node, ds, opts)
	for _, f := range fes {
		ranges, nodePasses := f.SourceRanges(node)
		var rangeNames []string
		for _, p := range ranges {
			rangeNames = append(rangeNames, p.String())
		}
		frontend(FrontendReport{
			SourceRanges: rangeNames, NodePasses: nodePasses,
			Address: f.Addr.String(), Protocol: string(f.Protocol), Scope: f.Scope, Kind: f.Kind, Family: f.Port.Family,
			Service: f.Port.Service.String(), Port: f.Port.Name,
			Backends: addrs(f.Backends), Weights: weightMap(f.Backends, f.Weights), DrainingBackends: addrs(f.Draining),
			SessionAffinity: affinityName(f.Port.Affinity), AffinityTimeoutSeconds: f.Port.Affinity.TimeoutSeconds,
			WhenEmpty: f.WhenEmpty,
		})
	}
	return warnings
}

// Only returns the part of the report about one Service: its ports, the
// frontends it owns, and the warnings about it (those that start with its
// "namespace/name: ", as NodeFrontends' do).
func (r Report) Only(nn types.NamespacedName) Report {
	out := r
	name := nn.String()
	out.Services = slices.DeleteFunc(slices.Clone(r.Services), func(p PortReport) bool { return p.Service != name })
	out.Frontends = slices.DeleteFunc(slices.Clone(r.Frontends), func(f FrontendReport) bool { return f.Service != name })
	out.Warnings = slices.DeleteFunc(slices.Clone(r.Warnings), func(w string) bool { return !strings.HasPrefix(w, name+": ") })
	out.Skipped = slices.DeleteFunc(slices.Clone(r.Skipped), func(s SkippedService) bool { return s.Service != name })
	if len(out.Skipped) == 0 {
		out.Skipped = nil
	}
	return out
}

func portReport(node Node, d PortDecision, opts Options) PortReport {
	p, dec := d.Port, d.Decision
	pr := PortReport{
		Service:      p.Service.String(),
		Port:         p.Name,
		Protocol:     string(p.Protocol),
		Family:       p.Family,
		Frontends:    []string{p.ClusterFrontend().Addr.String()},
		Policy:       dec.Policy,
		Mode:         dec.Mode,
		Reason:       dec.Reason,
		Backends:     addrs(dec.Backends),
		Weights:      weightMap(dec.Backends, dec.Weights),
		BackendZones: map[string]int{},

		DrainingBackends:       addrs(dec.Draining),
		SessionAffinity:        affinityName(p.Affinity),
		AffinityTimeoutSeconds: p.Affinity.TimeoutSeconds,
		WhenEmpty:              dec.WhenEmpty,
	}
	ext, _ := p.ExternalFrontends(node, opts)
	for _, fa := range ext {
		pr.Frontends = append(pr.Frontends, fa.Addr.String())
	}
	if dec.ExternalBackends != nil {
		pr.ExternalBackends = addrs(dec.ExternalBackends)
		pr.ExternalWeights = weightMap(dec.ExternalBackends, dec.ExternalWeights)
		pr.ExternalDrainingBackends = addrs(dec.ExternalDraining)
	}
	if dec.ClusterBackends != nil {
		pr.ClusterBackends = addrs(dec.ClusterBackends)
		pr.ClusterWeights = weightMap(dec.ClusterBackends, dec.ClusterWeights)
		pr.ClusterDrainingBackends = addrs(dec.ClusterDraining)
	}
	for _, ep := range dec.Backends {
		pr.BackendZones[ep.Zone]++
	}
	if !EqualWeights(dec.Weights) {
		pr.ZoneShares = map[string]float64{}
		for i, ep := range dec.Backends {
			pr.ZoneShares[ep.Zone] += dec.Weights[i]
		}
	}
	return pr
}

// affinityName renders an affinity as its sessionAffinity value.
func affinityName(a SessionAffinity) string {
	if a.ClientIP {
		return "ClientIP"
	}
	return "None"
}

// weightMap keys weights by their endpoint's "ip:port", rounded to 4
// decimal places; never nil.
func weightMap(eps []Endpoint, ws []float64) map[string]float64 {
	out := make(map[string]float64, len(eps))
	for i, ep := range eps {
		out[ep.Addr.String()] = math.Round(ws[i]*1e4) / 1e4
	}
	return out
}

// addrs returns the endpoints' "ip:port" strings, sorted; never nil.
func addrs(eps []Endpoint) []string {
	out := make([]string, 0, len(eps))
	for _, ep := range eps {
		out = append(out, ep.Addr.String())
	}
	sort.Strings(out)
	return out
}
