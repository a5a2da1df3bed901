package topology

import (
	"fmt"
	"maps"
	"math"
	"math/big"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
)

// Demand is how much new traffic each zone originates, as the ZoneWeighted
// policy estimates it: the allocatable CPU of the Nodes that carry a zone
// label and whose Ready condition is not False (the EndpointSlice
// controller's own measure), or their number when any of them lacks
// allocatable CPU.
//
// Coupling: the policy reads every Node's zone label, allocatable CPU and
// Ready condition through this type; Reads.Capacity (reads.go) is what tells
// the agent to re-decide ZoneWeighted ports when any of them changes.
type Demand struct {
	// Zone maps each zone with a counted Node to its demand, in Units.
	// Never nil.
	Zone map[string]int64
	// Total is the sum of Zone; 0 when no Node is counted.
	Total int64
	// ByNodeCount is true when each counted Node weighs 1 because at least
	// one of them lacks allocatable CPU; false when the unit is millicores.
	ByNodeCount bool
	// Lacking explains, when ByNodeCount, which Node (the first by name)
	// lacks allocatable CPU; "" otherwise.
	Lacking string
	// Nodes maps each counted Node to its demand in Units (its millicores,
	// or 1). Never nil.
	Nodes map[string]int64
}

// ZoneDemand computes the Demand of a set of nodes. It is pure; callers
// that decide many ports on one snapshot compute it once and pass it in
// Input.Demand.
func ZoneDemand(nodes map[string]Node) Demand {
	names := make([]string, 0, len(nodes))
	for name, n := range nodes {
		if countsForDemand(n) {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	d := Demand{Zone: map[string]int64{}, Nodes: make(map[string]int64, len(names))}
	for _, name := range names {
		if n := nodes[name]; !n.hasCPU() {
			d.ByNodeCount = true
			d.Lacking = lackingCPU(n)
			break
		}
	}
	for _, name := range names {
		n := nodes[name]
		units := int64(1)
		if !d.ByNodeCount {
			units = n.AllocatableMilliCPU
		}
		d.Zone[n.Zone()] += units
		d.Nodes[name] = units
		d.Total += units
	}
	return d
}

// countsForDemand reports whether a node originates demand: it carries a
// zone label and its Ready condition is not False.
func countsForDemand(n Node) bool {
	return n.Zone() != "" && n.Ready != v1.ConditionFalse
}

// lackingCPU says why a node's allocatable CPU cannot weigh it.
func lackingCPU(n Node) string {
	if n.AllocatableMilliCPU == 0 {
		return fmt.Sprintf("node %s has no allocatable CPU", n.Name)
	}
	return fmt.Sprintf("node %s has invalid allocatable CPU %dm", n.Name, n.AllocatableMilliCPU)
}

// share returns zone's fraction of the demand; 0 for the zone-less group
// and for zones without a counted node.
func (d Demand) share(zone string) *big.Rat {
	if zone == "" || d.Total == 0 {
		return new(big.Rat)
	}
	return big.NewRat(d.Zone[zone], d.Total)
}

// describe names the demand measure for a reason.
func (d Demand) describe() string {
	if d.ByNodeCount {
		return "by node count (" + d.Lacking + ")"
	}
	return "by allocatable CPU"
}

// weightTolerance is how far two weights may differ and still count as
// equal: the float rounding of fractions computed exactly, far below the
// finest share the datapath programs (a millionth, agent.weightScale).
const weightTolerance = 1e-9

// EqualWeights reports whether all weights are the same, within float
// rounding: the one test of "equal shares" for the report (no zone
// shares), the agent (one slot per backend) and the testbed (no weights to
// measure). True for none.
func EqualWeights(ws []float64) bool {
	for _, w := range ws {
		if math.Abs(w-ws[0]) > weightTolerance {
			return false
		}
	}
	return true
}

// weighted is a backend set with the fraction of new flows each backend
// gets.
type weighted struct {
	eps []Endpoint
	w   []float64
}

// equalShares gives every endpoint the same weight.
func equalShares(eps []Endpoint) weighted {
	ws := make([]float64, len(eps))
	for i := range ws {
		ws[i] = 1 / float64(len(eps))
	}
	return weighted{eps: eps, w: ws}
}

// zoneWeighted applies the ZoneWeighted policy for a node in zone Z:
//   - U are the usable endpoints (ready, else serving-terminating); S_z is
//     the share of U whose zone is z; endpoints without a zone form one more
//     group, which has no demand.
//   - D_z is zone z's share of the Demand.
//   - The node keeps f = min(1, S_Z/D_Z) of its new flows in Z, in equal
//     shares per endpoint there, and spreads 1-f over the other groups in
//     proportion to their surplus max(0, S_y - D_y), in equal shares inside
//     each group.
//   - A node without a zone, or whose zone has no counted Node, gives equal
//     shares to U.
//
// When every node follows this, every endpoint of U receives the same load
// and the traffic that crosses zones is sum_z max(0, D_z - S_z), the least
// any balanced assignment needs (FuzzZoneWeightedBalance checks both).
// Endpoints that get no weight are left out of the set. The arithmetic is
// exact (rationals); only the final weights are rounded to float64.
//
// The mode is None when the result is equal shares over U, PreferSameZone
// when the node keeps all its flows in its zone and other zones have usable
// endpoints, and ZoneWeighted otherwise.
func zoneWeighted(in Input) (Mode, string, weighted) {
	cands, what := usable(in.Endpoints)
	if len(cands) == 0 {
		return ModeNone, what, weighted{}
	}
	zone := in.Node.Zone()
	if zone == "" {
		return ModeNone, fmt.Sprintf("node %s has no %s label: equal shares over %s", in.Node.Name, LabelZone, what), equalShares(cands)
	}
	demand := in.demand()
	dZone := demand.share(zone)
	if dZone.Sign() == 0 {
		return ModeNone, fmt.Sprintf("%s has no Node with a zone label that is not Ready=False, so it has no demand share: equal shares over %s", zone, what), equalShares(cands)
	}

	g := groupByZone(cands)
	sZone := g.share(zone)
	keep := new(big.Rat).Quo(sZone, dZone)
	if keep.Cmp(big.NewRat(1, 1)) > 0 {
		keep.SetInt64(1)
	}
	spill := new(big.Rat).Sub(big.NewRat(1, 1), keep)

	// perEndpoint is the weight of each endpoint of a group.
	perEndpoint, spills := spillWeights(g, zone, spill, demand)
	if g.count[zone] > 0 && keep.Sign() > 0 {
		perEndpoint[zone] = new(big.Rat).Quo(keep, big.NewRat(g.count[zone], 1))
	}
	out, equal := weigh(cands, perEndpoint)

	head := fmt.Sprintf("%s has %d of %s (%s) and %s of the demand %s", zone, g.count[zone], what, percent(sZone), percent(dZone), demand.describe())
	switch {
	case equal && len(out.eps) == len(cands):
		if spill.Sign() == 0 {
			return ModeNone, fmt.Sprintf("%s: keeps all new flows in %s, equal shares", head, zone), out
		}
		return ModeNone, fmt.Sprintf("%s: keeps %s of new flows in %s, spills %s; the result is equal shares", head, percent(keep), zone, strings.Join(spills, ", ")), out
	case spill.Sign() == 0:
		return ModePreferSameZone, fmt.Sprintf("%s: keeps all new flows in %s", head, zone), out
	}
	return ModeZoneWeighted, fmt.Sprintf("%s: keeps %s of new flows in %s, spills %s", head, percent(keep), zone, strings.Join(spills, ", ")), out
}

// zoneGroups are usable endpoints counted by zone; endpoints without a
// zone form the group "".
type zoneGroups struct {
	// n is the number of endpoints.
	n int64
	// count is the number of endpoints in each group.
	count map[string]int64
	// names are count's keys, sorted.
	names []string
}

// groupByZone counts cands by zone.
func groupByZone(cands []Endpoint) zoneGroups {
	g := zoneGroups{n: int64(len(cands)), count: map[string]int64{}}
	for _, ep := range cands {
		g.count[ep.Zone]++
	}
	g.names = slices.Sorted(maps.Keys(g.count))
	return g
}

// share returns S_z, the fraction of the endpoints in group z.
func (g zoneGroups) share(z string) *big.Rat { return big.NewRat(g.count[z], g.n) }

// spillWeights spreads spill, the fraction of new flows a node in zone
// does not keep there, over the other groups in proportion to their
// surplus max(0, S_y - D_y), in equal shares inside each group. It returns
// the weight of one endpoint of each group that gets a part (a new map,
// empty when spill is 0), and each part as "12.5% zone-b", in group order.
func spillWeights(g zoneGroups, zone string, spill *big.Rat, demand Demand) (map[string]*big.Rat, []string) {
	perEndpoint := map[string]*big.Rat{}
	if spill.Sign() <= 0 {
		return perEndpoint, nil
	}
	surplus := map[string]*big.Rat{}
	total := new(big.Rat)
	for _, y := range g.names {
		if y == zone {
			continue
		}
		s := new(big.Rat).Sub(g.share(y), demand.share(y))
		if s.Sign() > 0 {
			surplus[y] = s
			total.Add(total, s)
		}
	}
	// spill > 0 means S_Z < D_Z, and then the other groups' surplus is
	// positive: total > 0.
	var spills []string
	for _, y := range g.names {
		s, ok := surplus[y]
		if !ok {
			continue
		}
		part := new(big.Rat).Mul(spill, new(big.Rat).Quo(s, total))
		perEndpoint[y] = new(big.Rat).Quo(part, big.NewRat(g.count[y], 1))
		spills = append(spills, fmt.Sprintf("%s %s", percent(part), groupName(y)))
	}
	return perEndpoint, spills
}

// weigh returns the endpoints of cands whose zone has a weight in
// perEndpoint, in cands' order, with that weight rounded to float64, and
// whether every endpoint kept has the same (exact) weight.
func weigh(cands []Endpoint, perEndpoint map[string]*big.Rat) (weighted, bool) {
	var out weighted
	var first *big.Rat
	equal := true
	for _, ep := range cands {
		w, ok := perEndpoint[ep.Zone]
		if !ok {
			continue
		}
		if first == nil {
			first = w
		} else if first.Cmp(w) != 0 {
			equal = false
		}
		f, _ := w.Float64()
		out.eps = append(out.eps, ep)
		out.w = append(out.w, f)
	}
	return out, equal
}

// demand returns the input's Demand, computing it when the caller did not.
func (in Input) demand() Demand {
	if in.Demand != nil {
		return *in.Demand
	}
	return ZoneDemand(in.Nodes)
}

// groupName names an endpoint group in reasons.
func groupName(zone string) string {
	if zone == "" {
		return "to endpoints without a zone"
	}
	return "to " + zone
}

// percent renders a fraction as "67%", or with one decimal when that is
// not whole ("4.5%").
func percent(r *big.Rat) string {
	f, _ := new(big.Rat).Mul(r, big.NewRat(100, 1)).Float64()
	s := fmt.Sprintf("%.1f", f)
	return strings.TrimSuffix(s, ".0") + "%"
}
