package topology

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
)

// FuzzDecide checks the decision's invariants on random endpoint sets:
//   - backends are a subset of the usable endpoints (ready, else
//     serving-terminating), counted on this node alone for a Local policy;
//   - when only zone hints exist, every node of a zone gets the same mode;
//   - under Hints with a Cluster internal policy, backends are never empty
//     when any endpoint is ready or serving-terminating.
func FuzzDecide(f *testing.F) {
	f.Add([]byte{0x13, 0x25, 0x31}, uint8(0), false)
	f.Add([]byte{0xff, 0x00, 0x7a, 0x44, 0x91}, uint8(3), true)
	f.Add([]byte{0x01}, uint8(1), false)
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
		usableSet, _ := usable(eps)
		modeByZone := map[string]Mode{}
		for _, name := range nodeNames {
			node := testNodes[name]
			d := Decide(Input{Node: node, Nodes: testNodes, Port: port, Endpoints: eps}, DefaultOptions())
			localUsable, _ := usable(filter(eps, func(e Endpoint) bool { return e.NodeName == name }))
			for _, c := range []struct {
				set   []Endpoint
				local bool
			}{{d.Backends, port.InternalPolicyLocal}, {d.ExternalBackends, port.ExternalPolicyLocal}} {
				allowed := usableSet
				if c.local {
					allowed = localUsable
				}
				for _, b := range c.set {
					if !slices.ContainsFunc(allowed, func(u Endpoint) bool { return u.Addr == b.Addr }) {
						t.Fatalf("node %s: backend %s is not usable (local set: %v)", name, b.Addr, c.local)
					}
				}
			}
			if d.Policy == PolicyHints && !port.InternalPolicyLocal && len(usableSet) > 0 && len(d.Backends) == 0 {
				t.Fatalf("node %s: Hints with %d usable endpoints programmed none (%s)", name, len(usableSet), d.Reason)
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
