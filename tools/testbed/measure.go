package testbed

import (
	"context"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/topology"
)

// Landing is where one client's requests to one service port landed, next
// to what the decision for the client's node permits.
type Landing struct {
	Client Client
	// Decision is the decision the landing is held to; its Backends are
	// the permitted set (for traffic from outside, the decision's
	// ExternalBackends).
	Decision Decision
	Tally    Tally
	// SourceKept is set when backends must see the client's own address:
	// always from pods (topolb does not source-translate them), from
	// outside only under externalTrafficPolicy Local.
	SourceKept bool
}

// MeasureOptions tune Measure.
type MeasureOptions struct {
	// Requests per port. Default 300.
	Requests int
	// Parallel requests in flight. Default 32.
	Parallel int
	// Timeout per request. Default 2s.
	Timeout time.Duration
	// Families, when set, are the IP families measured; nil measures
	// every family the Service has.
	Families []v1.IPFamily
}

// measures reports whether o measures decision d.
func (o MeasureOptions) measures(d Decision, service string) bool {
	return d.Service == qualify(service) && (o.Families == nil || slices.Contains(o.Families, d.Family))
}

// Measure sends requests, each on a new flow, from client to every port of
// service (a "name" or "namespace/name"), and returns one Landing per port
// with the decision DecideNode makes for the client's node on the objects
// last applied.
func (tb *traffic) Measure(ctx context.Context, client *Pod, service string, o MeasureOptions) ([]Landing, error) {
	o = o.withDefaults()
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, client.Node.Name)
	var out []Landing
	for _, d := range ds {
		if !o.measures(d, service) {
			continue
		}
		recs := client.Send(ctx, Load{Proto: d.Protocol, Target: d.Frontend, Count: o.Requests, Parallel: o.Parallel, Timeout: o.Timeout})
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		out = append(out, Landing{Client: client, Decision: d, Tally: Summarize(client, recs), SourceKept: true})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("service %s has no ports", service)
	}
	// TCP first, then by port.
	slices.SortStableFunc(out, func(a, b Landing) int {
		return strings.Compare(string(a.Decision.Protocol), string(b.Decision.Protocol))
	})
	return out, nil
}

// MeasureNodePort sends requests, each on a new flow, from client (a pod
// or an outside client) to every port of service at node's NodePort (its
// InternalIP and the port's nodePort), and returns one Landing per port
// held to node's decision: the external backends for an outside client,
// the cluster set for a pod (in-cluster traffic to an external address
// takes the cluster set, in kube-proxy and topolb alike). Backends must
// see an outside client's address only under externalTrafficPolicy Local.
func (tb *traffic) MeasureNodePort(ctx context.Context, client Client, node, service string, o MeasureOptions) ([]Landing, error) {
	o = o.withDefaults()
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, node)
	_, outside := client.(*External)
	var out []Landing
	for _, d := range ds {
		if !o.measures(d, service) {
			continue
		}
		if !d.NodePort.IsValid() {
			return nil, fmt.Errorf("service %s port %q has no nodePort", service, d.Port)
		}
		if outside {
			d.Backends, d.Addrs = d.ExternalBackends, d.ExternalAddrs
		}
		recs := client.Send(ctx, Load{Proto: d.Protocol, Target: d.NodePort, Count: o.Requests, Parallel: o.Parallel, Timeout: o.Timeout})
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		kept := !outside || d.ExternalPolicyLocal
		out = append(out, Landing{Client: client, Decision: d, Tally: Summarize(client, recs), SourceKept: kept})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("service %s has no ports on node %s", service, node)
	}
	slices.SortStableFunc(out, func(a, b Landing) int {
		return strings.Compare(string(a.Decision.Protocol), string(b.Decision.Protocol))
	})
	return out, nil
}

// MeasureExpectation measures an expectation of a spec's scenario: the
// client pod, or the named node's own processes (MeasureHost), through
// the cluster IP (Measure), or a client (pod or outside) through the
// NodePorts of the node it names (MeasureNodePort), in the expectation's
// family when it names one (else in o.Families). It returns the landings
// and the node whose decision they are held to (HeldTo).
func (tb *traffic) MeasureExpectation(ctx context.Context, e Expectation, o MeasureOptions) ([]Landing, string, error) {
	if e.Family != "" {
		o.Families = []v1.IPFamily{e.Family}
	}
	node := tb.HeldTo(e)
	p := tb.Pod(e.Client)
	if e.Via == "" {
		switch {
		case p != nil:
			l, err := tb.Measure(ctx, p, e.Service, o)
			return l, node, err
		case tb.Host(e.Client) != nil:
			hls, err := tb.MeasureHost(ctx, e.Client, e.Service, o)
			var out []Landing
			for _, hl := range hls {
				if hl.Target.Kind == "ClusterIP" {
					out = append(out, hl.Landing)
				}
			}
			return out, node, err
		}
		return nil, "", fmt.Errorf("expectation: %q is not a client pod or a node", e.Client)
	}
	var c Client = p
	if p == nil {
		ext := tb.External(e.Client)
		if ext == nil {
			return nil, "", fmt.Errorf("expectation: no client %q", e.Client)
		}
		c = ext
	}
	l, err := tb.MeasureNodePort(ctx, c, e.Via, e.Service, o)
	return l, node, err
}

// HeldTo returns the node whose decision an expectation's landings are
// held to: the node it goes through (Via), else the client pod's node,
// else the client node itself ("" for none of them).
func (l *Layout) HeldTo(e Expectation) string {
	switch {
	case e.Via != "":
		return e.Via
	case l.Pod(e.Client) != nil:
		return l.Pod(e.Client).Node.Name
	case l.Node(e.Client) != nil:
		return e.Client
	}
	return ""
}

// Scope returns the scope of the frontends an expectation's traffic
// reaches: external for an outside client (through a node's uplink),
// internal for a pod or a node's processes (the cluster IP, or a NodePort
// from inside the node). The datapath serves each family per scope
// (agent.ScopeFamilies).
func (l *Layout) Scope(e Expectation) topology.Scope {
	if l.Pod(e.Client) == nil && l.External(e.Client) != nil {
		return topology.ScopeExternal
	}
	return topology.ScopeInternal
}

// withDefaults fills in MeasureOptions' defaults.
func (o MeasureOptions) withDefaults() MeasureOptions {
	if o.Requests <= 0 {
		o.Requests = 300
	}
	if o.Parallel <= 0 {
		o.Parallel = 32
	}
	if o.Timeout <= 0 {
		o.Timeout = 2 * time.Second
	}
	return o
}

// Problems lists how the landing departs from its decision: a backend it
// does not permit answered, a permitted backend never answered, requests
// failed although backends are permitted, requests succeeded although
// traffic should be dropped, or (when SourceKept) a backend saw another
// source address than the client's. Empty means the landing is exactly the
// decision.
func (l Landing) Problems() []string {
	var out []string
	got := l.Tally.Backends()
	want := l.Decision.Backends
	for _, b := range got {
		if !slices.Contains(want, b) {
			out = append(out, fmt.Sprintf("%d requests landed on %s, which the decision does not permit", l.Tally.Landed[b], b))
		}
	}
	for _, b := range want {
		if l.Tally.Landed[b] == 0 {
			out = append(out, fmt.Sprintf("permitted backend %s got no request", b))
		}
	}
	if len(want) > 0 && l.Tally.Failed > 0 {
		out = append(out, fmt.Sprintf("%d requests failed (%s)", l.Tally.Failed, strings.Join(l.Tally.Errors, "; ")))
	}
	if len(want) == 0 && len(got) > 0 {
		out = append(out, "traffic should be dropped but was answered")
	}
	out = append(out, l.shareProblems()...)
	if l.SourceKept && l.Tally.WrongSource > 0 {
		out = append(out, fmt.Sprintf("%d answers saw a source other than the client's address", l.Tally.WrongSource))
	}
	return out
}

// shareProblems compares, under unequal weights, each backend's share of
// the answered requests with its weight. A share may miss its weight by
// ShareTolerance(weight, answered): four standard deviations of the
// binomial count (a false alarm about once in 16,000 backends measured)
// plus the datapath's table granularity (docs/datapath.md: a weighted
// table of M slots is within 1/M of each weight; 0.01 bounds it).
func (l Landing) shareProblems() []string {
	answered := 0
	for _, n := range l.Tally.Landed {
		answered += n
	}
	if l.Decision.Weights == nil || answered == 0 {
		return nil
	}
	var out []string
	for _, b := range slices.Sorted(maps.Keys(l.Decision.Weights)) {
		w := l.Decision.Weights[b]
		got := float64(l.Tally.Landed[b]) / float64(answered)
		if tol := ShareTolerance(w, answered); math.Abs(got-w) > tol {
			out = append(out, fmt.Sprintf("%s got %.1f%% of %d requests, weight %.1f%% (tolerance ±%.1f%%)", b, 100*got, answered, 100*w, 100*tol))
		}
	}
	return out
}

// ShareTolerance is how far a backend's measured share of n requests may
// be from its weight w: 4·sqrt(w(1−w)/n) + 0.01.
func ShareTolerance(w float64, n int) float64 {
	return 4*math.Sqrt(w*(1-w)/float64(n)) + 0.01
}
