package topology

import (
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
	// ExternalBackends are sorted "ip:port" strings; null when the port is
	// not externally accessible.
	ExternalBackends []string `json:"externalBackends"`
	// BackendZones counts the internal backends per endpoint zone ("" for
	// endpoints without a zone). Not part of the JSON contract.
	BackendZones map[string]int `json:"-"`
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
			BackendZones: map[string]int{},
		}
		for _, fe := range p.Frontends() {
			pr.Frontends = append(pr.Frontends, fe.String())
		}
		if d.Decision.ExternalBackends != nil {
			pr.ExternalBackends = addrs(d.Decision.ExternalBackends)
		}
		for _, ep := range d.Decision.Backends {
			pr.BackendZones[ep.Zone]++
		}
		r.Services = append(r.Services, pr)
	}
	return r
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
