package topology

import (
	"fmt"
	"net/netip"
)

// Caps bound what one Service may take of a node's datapath tables, which
// every Service shares: without them one Service (one tenant's) with
// thousands of loadBalancerSourceRanges or ports could fill a table and
// leave the Services written after it unserved. A Service over a cap is
// refused whole on the node: none of its frontends is programmed and its
// health check NodePort is not served, so a load balancer that checks it
// sends it nothing. Refusing whole, rather than truncating, never serves a
// Service other than as written: dropping source ranges would let in
// sources its author kept out, dropping frontends would serve some of its
// addresses and not others. The zero value caps nothing.
type Caps struct {
	// SourceRanges is the most distinct loadBalancerSourceRanges (both
	// families together) one Service's load-balancer IPs may carry on a
	// node; 0: no cap. The datapath holds each range once per
	// load-balancer frontend.
	SourceRanges int
	// Frontends is the most frontends one Service may claim on a node:
	// each port in each family on each of its addresses (cluster IPs,
	// externalIPs, load-balancer IPs, the NodePort on each of the node's
	// NodePort addresses), once per scope it is served in; 0: no cap.
	Frontends int
}

// DefaultCaps are the caps topolb-agent (and explain) apply by default:
// well above what a Service written by hand carries, far below the
// tables' sizes (65,536 source-range slots, the services map's
// --max-frontends).
var DefaultCaps = Caps{SourceRanges: 256, Frontends: 1024}

// CapName names a cap in refusals and in the agent's metric labels.
type CapName string

// The caps.
const (
	CapSourceRanges CapName = "source_ranges"
	CapFrontends    CapName = "frontends"
)

// capFlags are the topolb-agent flags that set each cap, for messages.
var capFlags = map[CapName]string{
	CapSourceRanges: "--max-source-ranges-per-service",
	CapFrontends:    "--max-frontends-per-service",
}

// Refusal is why a Service is refused on a node: it asks for Count of
// what Cap bounds to Limit.
type Refusal struct {
	Cap   CapName
	Count int
	Limit int
}

// String says what is over which cap, for warnings and Events.
func (r Refusal) String() string {
	what := map[CapName]string{CapSourceRanges: "loadBalancerSourceRanges", CapFrontends: "frontends on this node"}[r.Cap]
	return fmt.Sprintf("refused: %d %s, over the cap of %d per Service (%s); none of its frontends is served on this node",
		r.Count, what, r.Limit, capFlags[r.Cap])
}

// Refusal returns why a Service whose frontends on a node are claims (every
// claim of every port and family, Claims) is refused under c, and false
// when it is not. Source ranges are checked first: they are what a
// Service can multiply without bound by editing one field.
func (c Caps) Refusal(claims []Frontend) (Refusal, bool) {
	ranges := map[netip.Prefix]bool{}
	keys := map[Key]bool{}
	for _, f := range claims {
		keys[f.Key()] = true
		if f.Kind != KindLoadBalancerIP {
			continue
		}
		for _, p := range f.Port.LoadBalancerSourceRanges {
			ranges[p] = true
		}
	}
	if c.SourceRanges > 0 && len(ranges) > c.SourceRanges {
		return Refusal{Cap: CapSourceRanges, Count: len(ranges), Limit: c.SourceRanges}, true
	}
	if c.Frontends > 0 && len(keys) > c.Frontends {
		return Refusal{Cap: CapFrontends, Count: len(keys), Limit: c.Frontends}, true
	}
	return Refusal{}, false
}
