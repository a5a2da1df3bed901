package topology

import (
	"math"
	"sort"
)

// Report is the JSON contract of `topolbctl explain -o json`: one entry per
// service port decided for one node.
type Report struct {
	Node     string       `json:"node"`
	Zone     string       `json:"zone"`
	Services []PortReport `json:"services"`
}

// PortReport is one service port's decision in a Report.
type PortReport struct {
	// Service is "namespace/name".
	Service string `json:"service"`
	// Port is the port's name, "" if unnamed.
	Port     string `json:"port"`
	Protocol string `json:"protocol"`
	// Frontends are "ip:port" addresses the port is reached at.
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
	// BackendZones counts the internal backends per endpoint zone ("" for
	// endpoints without a zone). Not part of the JSON contract.
	BackendZones map[string]int `json:"-"`
	// ZoneShares sums the internal weights per endpoint zone, when they are
	// not all equal; nil otherwise. Not part of the JSON contract.
	ZoneShares map[string]float64 `json:"-"`
}

// NewReport turns decisions for node into a Report.
func NewReport(node Node, ds []PortDecision) Report {
	r := Report{Node: node.Name, Zone: node.Zone(), Services: make([]PortReport, 0, len(ds))}
	for _, d := range ds {
		p := d.Port
		pr := PortReport{
			Service:      p.Service.String(),
			Port:         p.Name,
			Protocol:     string(p.Protocol),
			Policy:       d.Decision.Policy,
			Mode:         d.Decision.Mode,
			Reason:       d.Decision.Reason,
			Backends:     addrs(d.Decision.Backends),
			Weights:      weightMap(d.Decision.Backends, d.Decision.Weights),
			BackendZones: map[string]int{},

			DrainingBackends:       addrs(d.Decision.Draining),
			SessionAffinity:        "None",
			AffinityTimeoutSeconds: p.Affinity.TimeoutSeconds,
		}
		if p.Affinity.ClientIP {
			pr.SessionAffinity = "ClientIP"
		}
		for _, fe := range p.Frontends() {
			pr.Frontends = append(pr.Frontends, fe.String())
		}
		if d.Decision.ExternalBackends != nil {
			pr.ExternalBackends = addrs(d.Decision.ExternalBackends)
			pr.ExternalWeights = weightMap(d.Decision.ExternalBackends, d.Decision.ExternalWeights)
			pr.ExternalDrainingBackends = addrs(d.Decision.ExternalDraining)
		}
		for _, ep := range d.Decision.Backends {
			pr.BackendZones[ep.Zone]++
		}
		if !equalWeights(d.Decision.Weights) {
			pr.ZoneShares = map[string]float64{}
			for i, ep := range d.Decision.Backends {
				pr.ZoneShares[ep.Zone] += d.Decision.Weights[i]
			}
		}
		r.Services = append(r.Services, pr)
	}
	return r
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

// equalWeights reports whether all weights are the same, within float
// rounding.
func equalWeights(ws []float64) bool {
	for _, w := range ws {
		if math.Abs(w-ws[0]) > 1e-12 {
			return false
		}
	}
	return true
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
