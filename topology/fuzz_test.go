package topology

import (
	"fmt"
	"math"
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// specUsable is the definition of usable endpoints written out from the
// EndpointSlice API, independently of the package's own usable(): the
// endpoints whose ready condition is true, or, when there is none, those
// that are serving and terminating (and so not ready).
func specUsable(eps []Endpoint) []Endpoint {
	var ready, servingTerminating []Endpoint
	for _, e := range eps {
		switch {
		case e.Ready:
			ready = append(ready, e)
		case e.Serving && e.Terminating:
			servingTerminating = append(servingTerminating, e)
		}
	}
	if len(ready) > 0 {
		return ready
	}
	return servingTerminating
}

func containsAddr(eps []Endpoint, a netip.AddrPort) bool {
	return slices.ContainsFunc(eps, func(e Endpoint) bool { return e.Addr == a })
}

// checkSet checks the invariants every backend set has: one positive
// weight per backend, summing to 1, no backend twice.
func checkSet(t *testing.T, what string, eps []Endpoint, ws []float64) {
	t.Helper()
	if len(eps) != len(ws) {
		t.Fatalf("%s: %d backends, %d weights", what, len(eps), len(ws))
	}
	sum := 0.0
	seen := map[netip.AddrPort]bool{}
	for i, w := range ws {
		if !(w > 0) {
			t.Fatalf("%s: backend %s has weight %v", what, eps[i].Addr, w)
		}
		if seen[eps[i].Addr] {
			t.Fatalf("%s: backend %s twice", what, eps[i].Addr)
		}
		seen[eps[i].Addr] = true
		sum += w
	}
	if len(ws) > 0 && math.Abs(sum-1) > 1e-9 {
		t.Fatalf("%s: weights sum to %v", what, sum)
	}
}

// checkPartition checks that active and draining split the serving
// endpoints: every endpoint that is ready, or serving and terminating, is in
// exactly one of them when a set exists (active is not nil).
func checkPartition(t *testing.T, what string, eps, active, draining []Endpoint) {
	t.Helper()
	if active == nil {
		return
	}
	for _, e := range eps {
		serving := e.Ready || (e.Serving && e.Terminating)
		a, d := containsAddr(active, e.Addr), containsAddr(draining, e.Addr)
		switch {
		case serving && a == d:
			t.Fatalf("%s: serving endpoint %s active %v, draining %v", what, e.Addr, a, d)
		case !serving && (a || d):
			t.Fatalf("%s: endpoint %s is not serving but active %v, draining %v", what, e.Addr, a, d)
		}
	}
}

// FuzzDecide checks the decision's invariants on random endpoint sets,
// under every policy:
//   - backends are a subset of the usable endpoints (ready, else
//     serving-terminating), counted on this node alone for a Local policy;
//   - weights are positive and sum to 1;
//   - an empty set rejects exactly when no endpoint is usable;
//   - backends and draining backends split the serving endpoints (ready, or
//     serving and terminating) between them;
//   - when only zone hints exist, every node of a zone gets the same mode;
//   - under Hints and ZoneWeighted with a Cluster internal policy, backends
//     are never empty when any endpoint is usable.
func FuzzDecide(f *testing.F) {
	f.Add([]byte{0x13, 0x25, 0x31}, uint8(0), false)
	f.Add([]byte{0xff, 0x00, 0x7a, 0x44, 0x91}, uint8(3), true)
	f.Add([]byte{0x01}, uint8(1), false)
	f.Add([]byte{0x01, 0x42, 0x83, 0x0c}, uint8(0x40), false)
	zoneNames := []string{"zone-a", "zone-b", "zone-c"}
	nodeNames := []string{"a1", "a2", "b1", "c1"}
	f.Fuzz(func(t *testing.T, data []byte, flags uint8, nodeHintsOn bool) {
		if len(data) > 64 {
			data = data[:64]
		}
		var eps []Endpoint
		anyNodeHints := false
		for i, b := range data {
			node := nodeNames[int(b)%len(nodeNames)]
			e := Endpoint{
				Addr:     netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), 80),
				NodeName: node,
				Zone:     testNodes[node].Zone(),
			}
			switch (b >> 2) & 3 {
			case 0, 1:
				e.Ready, e.Serving = true, true
			case 2:
				e.Serving, e.Terminating = true, true
			case 3:
				e.Terminating = b&0x80 != 0
			}
			if b&0x10 != 0 {
				e.ZoneHints = []string{zoneNames[int(b>>5)%len(zoneNames)]}
			}
			if nodeHintsOn && b&0x20 != 0 {
				e.NodeHints = []string{nodeNames[int(b>>6)%len(nodeNames)]}
				anyNodeHints = true
			}
			eps = append(eps, e)
		}
		port := clusterPort(nil)
		port.InternalPolicyLocal = flags&1 != 0
		port.ExternallyAccessible = flags&2 != 0
		port.ExternalPolicyLocal = port.ExternallyAccessible && flags&4 != 0
		switch (flags >> 3) & 3 {
		case 1:
			port.Annotations = map[string]string{AnnotationZoneThreshold: fmt.Sprint(1 + flags>>5)}
		case 2:
			port.Annotations = map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname,topology.kubernetes.io/zone,*"}
		case 3:
			port.Annotations = map[string]string{AnnotationTopologyAware: "false"}
		}
		if flags&0x40 != 0 {
			port.Annotations = map[string]string{AnnotationZoneWeighted: "true"}
		}
		usableSet := specUsable(eps)
		modeByZone := map[string]Mode{}
		for _, name := range nodeNames {
			node := testNodes[name]
			d := Decide(Input{Node: node, Nodes: testNodes, Port: port, Endpoints: eps}, DefaultOptions())
			var onNode []Endpoint
			for _, e := range eps {
				if e.NodeName == name {
					onNode = append(onNode, e)
				}
			}
			localUsable := specUsable(onNode)
			for _, c := range []struct {
				what     string
				set      []Endpoint
				ws       []float64
				draining []Endpoint
				local    bool
			}{{"internal", d.Backends, d.Weights, d.Draining, port.InternalPolicyLocal}, {"external", d.ExternalBackends, d.ExternalWeights, d.ExternalDraining, port.ExternalPolicyLocal}} {
				if (c.set == nil) != (c.draining == nil) {
					t.Fatalf("node %s: %s backends nil %v, draining nil %v", name, c.what, c.set == nil, c.draining == nil)
				}
				checkPartition(t, name+" "+c.what, eps, c.set, c.draining)
				allowed := usableSet
				if c.local {
					allowed = localUsable
				}
				for _, b := range c.set {
					if !containsAddr(allowed, b.Addr) {
						t.Fatalf("node %s: %s backend %s is not usable (local set: %v)", name, c.what, b.Addr, c.local)
					}
				}
				checkSet(t, name+" "+c.what, c.set, c.ws)
			}
			if want := (len(usableSet) == 0); (d.WhenEmpty == EmptyReject) != want || (d.WhenEmpty != EmptyDrop && !want) {
				t.Fatalf("node %s: WhenEmpty %q with %d usable endpoints", name, d.WhenEmpty, len(usableSet))
			}
			if (d.Policy == PolicyHints || d.Policy == PolicyZoneWeighted) && !port.InternalPolicyLocal && len(usableSet) > 0 && len(d.Backends) == 0 {
				t.Fatalf("node %s: %s with %d usable endpoints programmed none (%s)", name, d.Policy, len(usableSet), d.Reason)
			}
			if d.Policy == PolicyHints && !anyNodeHints && port.UsesClusterEndpoints() {
				if m, seen := modeByZone[node.Zone()]; seen && m != d.Mode {
					t.Fatalf("zone %s: node %s has mode %s, another node %s", node.Zone(), name, d.Mode, m)
				}
				modeByZone[node.Zone()] = d.Mode
			}
		}
	})
}

// FuzzZoneWeightedBalance builds random clusters (nodes with zones, CPU and
// readiness; endpoints with zones and conditions) and checks the promises of
// the ZoneWeighted policy, computing the expectations from its definition
// (issue 13), not from the package's code:
//   - every node's weights are positive, sum to 1, and name only usable
//     endpoints;
//   - all counted nodes of one zone get the same weights;
//   - balance: if each zone z originates its demand share D_z and every node
//     follows its weights, every usable endpoint receives 1/|U|;
//   - least crossing: the traffic that leaves its zone is
//     sum_z max(0, D_z - S_z), the least any balanced assignment needs.
func FuzzZoneWeightedBalance(f *testing.F) {
	f.Add([]byte{0x00, 0x15, 0x2a}, []byte{0x00, 0x01, 0x01})
	f.Add([]byte{0x00, 0x01, 0x02, 0x43}, []byte{0x02, 0x02, 0x03, 0x00, 0x11})
	f.Add([]byte{0x30, 0x31, 0x32}, []byte{0x00, 0x01, 0x02, 0x03, 0x23})
	zoneNames := []string{"zone-a", "zone-b", "zone-c", ""}
	readiness := []v1.ConditionStatus{v1.ConditionTrue, v1.ConditionFalse, v1.ConditionUnknown, ""}
	f.Fuzz(func(t *testing.T, nodeBytes, epBytes []byte) {
		if len(nodeBytes) > 12 {
			nodeBytes = nodeBytes[:12]
		}
		if len(epBytes) > 40 {
			epBytes = epBytes[:40]
		}
		// Node byte: bits 0-1 zone, 2-3 readiness, 4-6 CPU cores (0 =
		// none), bit 7 negative CPU.
		nodes := map[string]Node{}
		for i, b := range nodeBytes {
			name := fmt.Sprintf("n%02d", i)
			labels := map[string]string{}
			if z := zoneNames[b&3]; z != "" {
				labels[LabelZone] = z
			}
			cpu := int64(b>>4&7) * 1000
			if b&0x80 != 0 {
				cpu = -cpu
			}
			nodes[name] = Node{Name: name, Labels: labels, AllocatableMilliCPU: cpu, Ready: readiness[b>>2&3]}
		}
		// Endpoint byte: bits 0-1 zone, 2-3 condition (ready, ready,
		// serving-terminating, not serving).
		var eps []Endpoint
		for i, b := range epBytes {
			e := Endpoint{
				Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 2, 0, byte(i)}), 80),
				Zone: zoneNames[b&3],
			}
			switch b >> 2 & 3 {
			case 0, 1:
				e.Ready, e.Serving = true, true
			case 2:
				e.Serving, e.Terminating = true, true
			case 3:
				e.Terminating = true
			}
			eps = append(eps, e)
		}

		// The demand, from the definition: Nodes with a zone label whose
		// Ready condition is not False; allocatable CPU, or node counts
		// when any of them has none (or a nonsensical amount).
		var counted []Node
		byCount := false
		for _, n := range nodes {
			if n.Labels[LabelZone] != "" && n.Ready != v1.ConditionFalse {
				counted = append(counted, n)
				if n.AllocatableMilliCPU <= 0 {
					byCount = true
				}
			}
		}
		demand := map[string]float64{}
		total := 0.0
		for _, n := range counted {
			u := float64(n.AllocatableMilliCPU)
			if byCount {
				u = 1
			}
			demand[n.Labels[LabelZone]] += u
			total += u
		}
		for z := range demand {
			demand[z] /= total
		}
		U := specUsable(eps)
		supply := map[string]float64{}
		for _, e := range U {
			supply[e.Zone] += 1 / float64(len(U))
		}

		port := zoneWeightedPort()
		load := map[netip.AddrPort]float64{}
		crossing := 0.0
		weightsOfZone := map[string]map[netip.AddrPort]float64{}
		for _, n := range counted {
			zone := n.Labels[LabelZone]
			d := Decide(Input{Node: n, Nodes: nodes, Port: port, Endpoints: eps}, DefaultOptions())
			checkSet(t, "node "+n.Name, d.Backends, d.Weights)
			ws := map[netip.AddrPort]float64{}
			for i, b := range d.Backends {
				if !containsAddr(U, b.Addr) {
					t.Fatalf("node %s: backend %s is not usable", n.Name, b.Addr)
				}
				ws[b.Addr] = d.Weights[i]
			}
			if len(U) > 0 && len(d.Backends) == 0 {
				t.Fatalf("node %s: %d usable endpoints, no backend (%s)", n.Name, len(U), d.Reason)
			}
			if prev, ok := weightsOfZone[zone]; ok {
				for a, w := range ws {
					if math.Abs(prev[a]-w) > 1e-12 {
						t.Fatalf("zone %s: node %s gives %s %v, another node %v", zone, n.Name, a, w, prev[a])
					}
				}
				continue
			}
			weightsOfZone[zone] = ws
			for i, b := range d.Backends {
				load[b.Addr] += demand[zone] * d.Weights[i]
				if b.Zone != zone {
					crossing += demand[zone] * d.Weights[i]
				}
			}
		}
		if len(U) == 0 || total == 0 {
			return
		}
		for _, e := range U {
			if math.Abs(load[e.Addr]-1/float64(len(U))) > 1e-9 {
				t.Fatalf("endpoint %s (zone %q) receives %v, want 1/%d; demand %v, supply %v", e.Addr, e.Zone, load[e.Addr], len(U), demand, supply)
			}
		}
		least := 0.0
		for z, d := range demand {
			least += math.Max(0, d-supply[z])
		}
		if math.Abs(crossing-least) > 1e-9 {
			t.Fatalf("cross-zone traffic %v, least possible %v; demand %v, supply %v", crossing, least, demand, supply)
		}
	})
}

// FuzzNodeFrontends builds random Services that claim overlapping
// addresses (cluster IPs, externalIPs, LB IPs, nodePorts, some equal to the
// node's addresses) and checks NodeFrontends:
//   - each (address, protocol, scope) is programmed once;
//   - its owner is the first of its claims by CompareClaims;
//   - the result and the warnings do not depend on the order of the
//     decisions, so an agent that learns them in any order agrees;
//   - a cluster IP is only internal, and external frontends use the
//     cluster set from inside and the external set from outside.
func FuzzNodeFrontends(f *testing.F) {
	f.Add([]byte{0x01, 0x12, 0x23, 0x34, 0x45, 0x56}, uint8(3))
	f.Add([]byte{0xff, 0xff, 0x00, 0x00, 0x81, 0x81, 0x7e}, uint8(0))
	pool := ips("10.96.0.1", "10.96.0.2", "198.51.100.1", "198.51.100.2", "192.168.0.1", "203.0.113.1")
	f.Fuzz(func(t *testing.T, data []byte, rot uint8) {
		if len(data) > 24 {
			data = data[:24]
		}
		var ds []PortDecision
		for i, b := range data {
			p := svcPort(fmt.Sprintf("s%d", i%5), int(b>>6), nil)
			p.Index = i / 5
			p.ClusterIP = pool[int(b)%2]
			p.Port = 80 + uint16(b>>7)
			if b&0x04 != 0 {
				p.Protocol = v1.ProtocolUDP
			}
			if b&0x08 != 0 {
				p.ExternalIPs = []netip.Addr{pool[int(b>>4)%len(pool)]}
			}
			if b&0x10 != 0 {
				p.LoadBalancerIPs = []netip.Addr{pool[int(b>>3)%len(pool)]}
			}
			if b&0x20 != 0 {
				p.NodePort = 30000 + uint16(b&3)
			}
			p.ExternallyAccessible = p.NodePort != 0 || len(p.ExternalIPs) > 0 || len(p.LoadBalancerIPs) > 0
			p.ExternalPolicyLocal = p.ExternallyAccessible && b&0x40 != 0
			eps := []Endpoint{ep(1+i%3, "a1", "zone-a", zones("zone-a")), ep(4+i%2, "b1", "zone-b", zones("zone-b"))}
			ds = append(ds, PortDecision{Port: p, Endpoints: eps, Decision: Decide(Input{Node: addrNode, Nodes: testNodes, Port: p, Endpoints: eps}, DefaultOptions())})
		}
		fes, warnings := NodeFrontends(addrNode, ds, DefaultOptions())

		claims := map[Key][]Frontend{}
		for _, d := range ds {
			cs, _ := Claims(addrNode, d, DefaultOptions())
			for _, c := range cs {
				claims[c.Key()] = append(claims[c.Key()], c)
			}
		}
		seen := map[Key]bool{}
		for _, fe := range fes {
			if seen[fe.Key()] {
				t.Fatalf("%v programmed twice", fe.Key())
			}
			seen[fe.Key()] = true
			for _, c := range claims[fe.Key()] {
				if CompareClaims(c.Claim(), fe.Claim()) < 0 {
					t.Fatalf("%v owned by %s %s, but %s %s claims it first", fe.Key(), fe.Kind, fe.Port.Service, c.Kind, c.Port.Service)
				}
			}
			if fe.Kind == KindClusterIP && fe.Scope != ScopeInternal {
				t.Fatalf("cluster IP %v in scope %s", fe.Addr, fe.Scope)
			}
			want := fe.Port // find the owner's decision
			for _, d := range ds {
				if d.Port.Service == want.Service && d.Port.Index == want.Index {
					wantSet := d.Decision.ExternalBackends
					switch {
					case fe.Kind == KindClusterIP:
						wantSet = d.Decision.Backends
					case fe.Scope == ScopeInternal:
						wantSet = d.Decision.ClusterBackends
					}
					if !slices.Equal(octets(fe.Backends), octets(wantSet)) {
						t.Fatalf("%v (%s, %s): backends %v, want %v", fe.Addr, fe.Kind, fe.Scope, octets(fe.Backends), octets(wantSet))
					}
				}
			}
		}
		if len(seen) != len(claims) {
			t.Fatalf("%d keys claimed, %d programmed", len(claims), len(seen))
		}
		// Any other order of the decisions gives the same frontends.
		if len(ds) > 1 {
			shuffled := append(slices.Clone(ds[int(rot)%len(ds):]), ds[:int(rot)%len(ds)]...)
			slices.Reverse(shuffled)
			fes2, warnings2 := NodeFrontends(addrNode, shuffled, DefaultOptions())
			if len(fes2) != len(fes) || !slices.Equal(warnings, warnings2) {
				t.Fatalf("order changed the result: %d vs %d frontends, warnings %q vs %q", len(fes), len(fes2), warnings, warnings2)
			}
			for i := range fes {
				if fes[i].Key() != fes2[i].Key() || fes[i].Port.Service != fes2[i].Port.Service || fes[i].Port.Index != fes2[i].Port.Index || fes[i].Kind != fes2[i].Kind {
					t.Fatalf("order changed the owner of %v: %s %s vs %s %s", fes[i].Key(), fes[i].Kind, fes[i].Port.Service, fes2[i].Kind, fes2[i].Port.Service)
				}
			}
		}
	})
}
