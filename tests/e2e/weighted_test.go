package e2e

import (
	"math"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// TestZoneWeighted sends traffic from a client on every node to a
// zone-weighted Service with 3, 2 and 1 endpoints in zones a, b and c
// (equal CPU per zone): each client's landings must match its node's
// weights (testbed.ShareTolerance), and with every zone sending the same
// traffic, every endpoint must receive the same load — the policy's promise
// — while zone-a and zone-b keep all their traffic in-zone and zone-c keeps
// half. The Service is dual stack and every check holds in each IP
// family on its own; the requests of the IPv4-only test are split between
// the families (the tolerances follow the counts), so the test takes as
// long as it did.
func TestZoneWeighted(t *testing.T) {
	requireRoot(t)
	spec, err := testbed.EveryNodeSpec()
	if err != nil {
		t.Fatal(err)
	}
	spec.DualStack = true
	tb := newTestbed(t, spec)
	withAgents.start(t, tb)
	svc := spec.Services[0]
	svc.Name, svc.ClusterIP = "weighted", ""
	svc.IPFamilies = bothFamilies
	svc.Hints = testbed.HintsNone
	svc.Annotations = map[string]string{"topolb.io/zone-weighted": "true"}
	var eps []testbed.EndpointSpec
	for _, p := range []string{"web-a1", "web-a2", "web-a3", "web-b1", "web-b2", "web-c1"} {
		eps = append(eps, testbed.EndpointSpec{Pod: p})
	}
	svc.Endpoints = eps
	apply(t, tb, []testbed.ServiceSpec{svc})

	families := servedFamilies(t, tb, topology.ScopeInternal)
	requests := 600 / len(families) // per client, port and family
	type port struct {
		family v1.IPFamily
		proto  v1.Protocol
	}
	// load[port][backend] sums, per zone, the zone's average share: the
	// traffic each endpoint gets when every zone sends the same amount.
	load := map[port]map[string]float64{}
	inZone := map[v1.IPFamily]map[string]float64{} // zone -> share kept in it, TCP
	clients := tb.Clients()
	perZone := map[string]int{}
	for _, c := range clients {
		perZone[c.Zone()]++
	}
	for _, client := range clients {
		landings, err := tb.Measure(t.Context(), client, "weighted", testbed.MeasureOptions{Requests: requests, Parallel: 32, Families: families})
		if err != nil {
			t.Fatal(err)
		}
		checkLandings(t, landings, nil)
		for _, l := range landings {
			family, proto := l.Decision.Family, l.Decision.Protocol
			if l.Decision.Weights == nil && client.Zone() == "zone-c" {
				t.Errorf("%s %s: zone-c's weights are equal: the test exercises no weighting", client.Name, family)
			}
			answered := requests - l.Tally.Failed
			if load[port{family, proto}] == nil {
				load[port{family, proto}] = map[string]float64{}
			}
			if inZone[family] == nil {
				inZone[family] = map[string]float64{}
			}
			for b, n := range l.Tally.Landed {
				share := float64(n) / float64(answered)
				load[port{family, proto}][b] += share / float64(perZone[client.Zone()]) / float64(len(perZone))
				if proto == v1.ProtocolTCP && tb.Pod(b).Zone() == client.Zone() {
					inZone[family][client.Zone()] += share / float64(perZone[client.Zone()])
				}
			}
		}
	}
	for _, family := range families {
		for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
			byBackend := load[port{family, proto}]
			for _, b := range slices.Sorted(mapKeys(byBackend)) {
				// Each endpoint's load is an average over every client's
				// requests: the binomial tolerance of their total.
				if tol := testbed.ShareTolerance(1.0/6, requests*len(clients)); math.Abs(byBackend[b]-1.0/6) > tol {
					t.Errorf("%s %s: %s receives %.1f%% of the load, want 16.7%% ±%.1f%% (every endpoint the same)", family, proto, b, 100*byBackend[b], 100*tol)
				}
			}
			if len(byBackend) != 6 {
				t.Errorf("%s %s: load reached %d endpoints, want 6: %v", family, proto, len(byBackend), byBackend)
			}
		}
		for zone, want := range map[string]float64{"zone-a": 1, "zone-b": 1, "zone-c": 0.5} {
			if got := inZone[family][zone]; math.Abs(got-want) > 0.08 {
				t.Errorf("%s: %s keeps %.1f%% of its traffic in-zone, want %.0f%%", family, zone, 100*got, 100*want)
			}
		}
		t.Logf("%s: load per endpoint: TCP %v, UDP %v; kept in-zone (TCP): %v", family, load[port{family, v1.ProtocolTCP}], load[port{family, v1.ProtocolUDP}], inZone[family])
	}
}

func mapKeys[K comparable, V any](m map[K]V) func(func(K) bool) {
	return func(yield func(K) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}
