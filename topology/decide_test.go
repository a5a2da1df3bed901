package topology

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// ep builds an endpoint "10.0.0.<n>:80" on node with zone. Options mutate it.
func ep(n int, node, zone string, opts ...func(*Endpoint)) Endpoint {
	e := Endpoint{
		Addr:     netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, byte(n)}), 80),
		NodeName: node, Zone: zone, Ready: true, Serving: true,
	}
	for _, o := range opts {
		o(&e)
	}
	return e
}

func zones(z ...string) func(*Endpoint) { return func(e *Endpoint) { e.ZoneHints = z } }
func nodes(n ...string) func(*Endpoint) { return func(e *Endpoint) { e.NodeHints = n } }
func terminating(serving bool) func(*Endpoint) {
	return func(e *Endpoint) { e.Ready, e.Serving, e.Terminating = false, serving, true }
}
func unready(e *Endpoint) { e.Ready, e.Serving = false, false }

// testNodes are the nodes every case may refer to.
var testNodes = map[string]Node{
	"a1":   {Name: "a1", Labels: map[string]string{LabelZone: "zone-a", LabelHostname: "a1", LabelRegion: "r1"}},
	"a2":   {Name: "a2", Labels: map[string]string{LabelZone: "zone-a", LabelHostname: "a2", LabelRegion: "r1"}},
	"b1":   {Name: "b1", Labels: map[string]string{LabelZone: "zone-b", LabelHostname: "b1", LabelRegion: "r1"}},
	"c1":   {Name: "c1", Labels: map[string]string{LabelZone: "zone-c", LabelHostname: "c1", LabelRegion: "r2"}},
	"nz":   {Name: "nz", Labels: map[string]string{LabelHostname: "nz"}},
	"bare": {Name: "bare"},
}

func clusterPort(ann map[string]string) ServicePort {
	return ServicePort{
		Service: types.NamespacedName{Namespace: "ns", Name: "svc"}, Family: v1.IPv4Protocol, Protocol: v1.ProtocolTCP, Port: 80,
		ClusterIP: netip.MustParseAddr("10.96.0.1"), Annotations: ann,
	}
}

func TestDecide(t *testing.T) {
	type want struct {
		policy Policy
		mode   Mode
		// backends are the last octets of the internal backends; nil and
		// empty both mean "no backends" (Decide never returns nil).
		backends []int
		// external are the last octets of the external backends; nil
		// means ExternalBackends must be nil (not externally accessible),
		// empty means it must be non-nil and empty.
		external []int
		// reason, if set, must be a substring of the reason.
		reason string
	}
	cases := []struct {
		name string
		node string
		port ServicePort
		opts *Options // nil: DefaultOptions
		eps  []Endpoint
		want want
	}{
		// Hints: kube-proxy's classic cases.
		{name: "no hints: all ready endpoints", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			want: want{PolicyHints, ModeNone, []int{1, 2}, nil, "no ready endpoint carries a zone hint"}},
		{name: "complete zone hints: same zone only", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "a2", "zone-a", zones("zone-a")), ep(3, "b1", "zone-b", zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1, 2}, nil, "all 3 ready endpoints carry zone hints; 2 are hinted for zone-a"}},
		{name: "partial zone hints are ignored, not applied per endpoint", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "a2", "zone-a", zones("zone-a")), ep(3, "b1", "zone-b")},
			want: want{PolicyHints, ModeNone, []int{1, 2, 3}, nil, "10.0.0.3:80 (node b1) has no zone hint"}},
		{name: "empty forZones counts as no hint", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones())},
			want: want{PolicyHints, ModeNone, []int{1, 2}, nil, "no zone hint"}},
		{name: "hints on unready endpoints do not count, nor does their absence", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones("zone-b")), ep(3, "a2", "zone-a", unready), ep(4, "a2", "zone-a", unready, zones("zone-a"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1}, nil, "all 2 ready endpoints"}},
		{name: "several zones per endpoint", node: "b1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a", "zone-b")), ep(2, "c1", "zone-c", zones("zone-c"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1}, nil, ""}},
		{name: "complete zone hints, none for this zone: all", node: "c1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones("zone-b"))},
			want: want{PolicyHints, ModeNone, []int{1, 2}, nil, "none is hinted for zone-c"}},
		{name: "node without a zone label ignores zone hints", node: "nz", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones("zone-b"))},
			want: want{PolicyHints, ModeNone, []int{1, 2}, nil, "has no topology.kubernetes.io/zone label"}},
		{name: "complete node hints naming this node: PreferSameNode", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", nodes("a1"), zones("zone-a")), ep(2, "a2", "zone-a", nodes("a2"), zones("zone-a")), ep(3, "b1", "zone-b", nodes("b1"), zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameNode, []int{1}, nil, "1 is hinted for node a1"}},
		{name: "node hints complete but not for this node fall back to zone hints", node: "a2", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", nodes("a1"), zones("zone-a")), ep(3, "b1", "zone-b", nodes("b1"), zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1}, nil, "no endpoint is hinted for node a2"}},
		{name: "partial node hints fall back to zone hints", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", nodes("a1"), zones("zone-a")), ep(2, "a2", "zone-a", zones("zone-a")), ep(3, "b1", "zone-b", nodes("b1"), zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1, 2}, nil, "node hints ignored: endpoint 10.0.0.2:80 (node a2) has none"}},
		{name: "node hints without zone hints: None when not for this node", node: "b1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", nodes("a1")), ep(2, "a2", "zone-a", nodes("a2"))},
			want: want{PolicyHints, ModeNone, []int{1, 2}, nil, ""}},
		{name: "PreferSameTrafficDistribution off ignores node hints", node: "a1", port: clusterPort(nil),
			opts: &Options{},
			eps:  []Endpoint{ep(1, "a1", "zone-a", nodes("a1"), zones("zone-a")), ep(2, "a2", "zone-a", nodes("a2"), zones("zone-a")), ep(3, "b1", "zone-b", nodes("b1"), zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1, 2}, nil, ""}},
		{name: "all endpoints terminating: serving-terminating fallback without topology", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", terminating(true), zones("zone-a")), ep(2, "b1", "zone-b", terminating(true), zones("zone-b")), ep(3, "b1", "zone-b", terminating(false))},
			want: want{PolicyHints, ModeNone, []int{1, 2}, nil, "no ready endpoints; using 2 serving-terminating"}},
		{name: "ready endpoints win over serving-terminating ones", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", terminating(true)), ep(2, "b1", "zone-b")},
			want: want{PolicyHints, ModeNone, []int{2}, nil, ""}},
		{name: "nothing ready or serving: empty, not nil", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "a1", "zone-a", unready), ep(2, "b1", "zone-b", terminating(false))},
			want: want{PolicyHints, ModeNone, []int{}, nil, "no ready or serving-terminating endpoints"}},
		{name: "no endpoints at all", node: "a1", port: clusterPort(nil), eps: nil,
			want: want{PolicyHints, ModeNone, []int{}, nil, ""}},

		// Traffic policies.
		{name: "iTP Local: local ready endpoints, topology ignored", node: "a1",
			port: func() ServicePort { p := clusterPort(nil); p.InternalPolicyLocal = true; return p }(),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-b")), ep(2, "a2", "zone-a", zones("zone-a")), ep(3, "b1", "zone-b", zones("zone-a"))},
			want: want{PolicyHints, ModeNone, []int{1}, nil, "internalTrafficPolicy Local"}},
		{name: "iTP Local without local endpoints drops", node: "c1",
			port: func() ServicePort { p := clusterPort(nil); p.InternalPolicyLocal = true; return p }(),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			want: want{PolicyHints, ModeNone, []int{}, nil, "0 local endpoints"}},
		{name: "iTP Local still reports invalid annotations", node: "a1",
			port: func() ServicePort {
				p := clusterPort(map[string]string{AnnotationZoneThreshold: "0"})
				p.InternalPolicyLocal = true
				return p
			}(),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			want: want{PolicyHints, ModeNone, []int{1}, nil, `ignoring invalid topolb.io/zone-threshold "0"`}},
		{name: "iTP Local falls back to local serving-terminating", node: "a1",
			port: func() ServicePort { p := clusterPort(nil); p.InternalPolicyLocal = true; return p }(),
			eps:  []Endpoint{ep(1, "a1", "zone-a", terminating(true)), ep(2, "a1", "zone-a", terminating(false)), ep(3, "b1", "zone-b")},
			want: want{PolicyHints, ModeNone, []int{1}, nil, ""}},
		{name: "eTP Local with NodePort: external local, internal by hints", node: "a1",
			port: func() ServicePort {
				p := clusterPort(nil)
				p.NodePort, p.ExternallyAccessible, p.ExternalPolicyLocal = 30080, true, true
				return p
			}(),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "a2", "zone-a", zones("zone-a")), ep(3, "b1", "zone-b", zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1, 2}, []int{1}, "externalTrafficPolicy Local"}},
		{name: "eTP Local without local endpoints: external empty, not nil", node: "c1",
			port: func() ServicePort {
				p := clusterPort(nil)
				p.NodePort, p.ExternallyAccessible, p.ExternalPolicyLocal = 30080, true, true
				return p
			}(),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(3, "b1", "zone-b")},
			want: want{PolicyHints, ModeNone, []int{1, 3}, []int{}, ""}},
		{name: "iTP Local and eTP Cluster with NodePort: cluster set still computed for external", node: "b1",
			port: func() ServicePort {
				p := clusterPort(nil)
				p.NodePort, p.ExternallyAccessible, p.InternalPolicyLocal = 30080, true, true
				return p
			}(),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones("zone-b")), ep(3, "b1", "zone-b", zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameZone, []int{2, 3}, []int{2, 3}, ""}},
		{name: "externally accessible, cluster policies: both sets equal", node: "c1",
			port: func() ServicePort { p := clusterPort(nil); p.NodePort, p.ExternallyAccessible = 30080, true; return p }(),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "c1", "zone-c")},
			want: want{PolicyHints, ModeNone, []int{1, 2}, []int{1, 2}, ""}},

		// Disabled.
		{name: "topology-aware false ignores complete hints", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyAware: "false"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones("zone-b"))},
			want: want{PolicyDisabled, ModeNone, []int{1, 2}, nil, "topology disabled"}},
		{name: "topology-aware false falls back to serving-terminating", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyAware: "False"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a", terminating(true)), ep(2, "b1", "zone-b", unready)},
			want: want{PolicyDisabled, ModeNone, []int{1}, nil, "serving-terminating"}},
		{name: "topology-aware invalid is ignored with a note", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyAware: "nope"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1}, nil, `ignoring invalid topolb.io/topology-aware "nope"`}},
		{name: "topology-aware true is the default", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyAware: "true"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1}, nil, ""}},
		{name: "disabled takes precedence over topology-keys", node: "a1",
			port: clusterPort(map[string]string{AnnotationTopologyAware: "false", AnnotationTopologyKeys: LabelHostname}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			want: want{PolicyDisabled, ModeNone, []int{1, 2}, nil, ""}},

		// TopologyKeys.
		{name: "keys: hostname matches", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname,topology.kubernetes.io/zone,*"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "a2", "zone-a"), ep(3, "b1", "zone-b")},
			want: want{PolicyTopologyKeys, Mode(LabelHostname), []int{1}, nil, ""}},
		{name: "keys: hostname misses, zone matches", node: "a2", port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname, topology.kubernetes.io/zone"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(3, "b1", "zone-b")},
			want: want{PolicyTopologyKeys, Mode(LabelZone), []int{1}, nil, "no endpoint with kubernetes.io/hostname=a2"}},
		{name: "keys: region", node: "b1", port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname,topology.kubernetes.io/region"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(4, "c1", "zone-c")},
			want: want{PolicyTopologyKeys, Mode(LabelRegion), []int{1}, nil, ""}},
		{name: "keys: nothing matches and no star: dropped", node: "c1", port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			want: want{PolicyTopologyKeys, ModeNone, []int{}, nil, "traffic is dropped"}},
		{name: "keys: star after misses: all usable", node: "c1", port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname,*"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "b1", "zone-b", unready)},
			want: want{PolicyTopologyKeys, ModeAny, []int{1, 2}, nil, ""}},
		{name: "keys: key this node lacks is skipped", node: "nz", port: clusterPort(map[string]string{AnnotationTopologyKeys: "topology.kubernetes.io/zone,kubernetes.io/hostname"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "nz", "")},
			want: want{PolicyTopologyKeys, Mode(LabelHostname), []int{2}, nil, "node lacks topology.kubernetes.io/zone"}},
		{name: "keys: endpoint on an unknown node never matches", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyKeys: "topology.kubernetes.io/zone"}),
			eps:  []Endpoint{ep(1, "ghost", "zone-a"), ep(2, "b1", "zone-b")},
			want: want{PolicyTopologyKeys, ModeNone, []int{}, nil, ""}},
		{name: "keys: node without labels, star last: all", node: "bare", port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname,*"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			want: want{PolicyTopologyKeys, ModeAny, []int{1, 2}, nil, "no labels"}},
		{name: "keys: node without labels, no star: none", node: "bare", port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a")},
			want: want{PolicyTopologyKeys, ModeNone, []int{}, nil, "no labels"}},
		{name: "keys: candidates are serving-terminating when none ready", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyKeys: "topology.kubernetes.io/zone,*"}),
			eps:  []Endpoint{ep(1, "a2", "zone-a", terminating(true)), ep(2, "b1", "zone-b", terminating(true))},
			want: want{PolicyTopologyKeys, Mode(LabelZone), []int{1}, nil, "serving-terminating"}},
		{name: "keys: star not last is invalid, falls to hints", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyKeys: "*,kubernetes.io/hostname"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones("zone-b"))},
			want: want{PolicyHints, ModePreferSameZone, []int{1}, nil, `"*" must be the last key`}},
		{name: "keys: duplicate is invalid, falls to zone threshold", node: "a1",
			port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname,kubernetes.io/hostname", AnnotationZoneThreshold: "1"}),
			eps:  []Endpoint{ep(1, "a2", "zone-a"), ep(2, "b1", "zone-b")},
			want: want{PolicyZoneThreshold, ModePreferSameZone, []int{1}, nil, "repeated"}},
		{name: "keys: empty key is invalid", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname,,*"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a")},
			want: want{PolicyHints, ModeNone, []int{1}, nil, "key 2 is empty"}},
		{name: "keys: empty annotation is invalid", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyKeys: ""}),
			eps:  []Endpoint{ep(1, "a1", "zone-a")},
			want: want{PolicyHints, ModeNone, []int{1}, nil, "ignoring invalid topolb.io/topology-keys"}},
		{name: "keys: 17 keys are invalid", node: "a1", port: clusterPort(map[string]string{AnnotationTopologyKeys: strings.Repeat("k,", 16) + "*"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a")},
			want: want{PolicyHints, ModeNone, []int{1}, nil, "at most 16"}},
		{name: "keys take precedence over zone threshold", node: "a1",
			port: clusterPort(map[string]string{AnnotationTopologyKeys: "kubernetes.io/hostname", AnnotationZoneThreshold: "1"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "a2", "zone-a")},
			want: want{PolicyTopologyKeys, Mode(LabelHostname), []int{1}, nil, ""}},

		// ZoneThreshold.
		{name: "threshold met", node: "a1", port: clusterPort(map[string]string{AnnotationZoneThreshold: "2"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "a2", "zone-a"), ep(3, "b1", "zone-b"), ep(4, "a2", "zone-a", unready)},
			want: want{PolicyZoneThreshold, ModePreferSameZone, []int{1, 2}, nil, "threshold 2 met"}},
		{name: "threshold not met: all usable", node: "a1", port: clusterPort(map[string]string{AnnotationZoneThreshold: "3"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "a2", "zone-a"), ep(3, "b1", "zone-b"), ep(4, "a2", "zone-a", unready)},
			want: want{PolicyZoneThreshold, ModeNone, []int{1, 2, 3}, nil, "below threshold 3"}},
		{name: "threshold counts the endpoint zone field, not hints", node: "b1", port: clusterPort(map[string]string{AnnotationZoneThreshold: "1"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a", zones("zone-b")), ep(2, "b1", "zone-b", zones("zone-a"))},
			want: want{PolicyZoneThreshold, ModePreferSameZone, []int{2}, nil, ""}},
		{name: "threshold never met without a zone label", node: "nz", port: clusterPort(map[string]string{AnnotationZoneThreshold: "1"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "nz", "")},
			want: want{PolicyZoneThreshold, ModeNone, []int{1, 2}, nil, "never met"}},
		{name: "threshold over serving-terminating when none ready", node: "a1", port: clusterPort(map[string]string{AnnotationZoneThreshold: "1"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a", terminating(true)), ep(2, "b1", "zone-b", terminating(true))},
			want: want{PolicyZoneThreshold, ModePreferSameZone, []int{1}, nil, ""}},
		{name: "threshold 0 is invalid", node: "a1", port: clusterPort(map[string]string{AnnotationZoneThreshold: "0"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			want: want{PolicyHints, ModeNone, []int{1, 2}, nil, "must be at least 1"}},
		{name: "threshold not a number is invalid", node: "a1", port: clusterPort(map[string]string{AnnotationZoneThreshold: "two"}),
			eps:  []Endpoint{ep(1, "a1", "zone-a")},
			want: want{PolicyHints, ModeNone, []int{1}, nil, "not an integer"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			opts := DefaultOptions()
			if tc.opts != nil {
				opts = *tc.opts
			}
			node, ok := testNodes[tc.node]
			if !ok {
				t.Fatalf("unknown test node %q", tc.node)
			}
			d := Decide(Input{Node: node, Nodes: testNodes, Port: tc.port, Endpoints: tc.eps}, opts)
			if d.Policy != tc.want.policy || d.Mode != tc.want.mode {
				t.Errorf("policy/mode = %s/%s, want %s/%s (reason %q)", d.Policy, d.Mode, tc.want.policy, tc.want.mode, d.Reason)
			}
			if d.Backends == nil {
				t.Errorf("Backends is nil, want non-nil")
			}
			if got := octets(d.Backends); !slices.Equal(got, nonNilInts(tc.want.backends)) {
				t.Errorf("backends = %v, want %v (reason %q)", got, tc.want.backends, d.Reason)
			}
			switch {
			case tc.want.external == nil && d.ExternalBackends != nil:
				t.Errorf("external backends = %v, want nil", octets(d.ExternalBackends))
			case tc.want.external != nil && d.ExternalBackends == nil:
				t.Errorf("external backends = nil, want %v", tc.want.external)
			case tc.want.external != nil && !slices.Equal(octets(d.ExternalBackends), tc.want.external):
				t.Errorf("external backends = %v, want %v", octets(d.ExternalBackends), tc.want.external)
			}
			if !strings.Contains(d.Reason, tc.want.reason) {
				t.Errorf("reason %q does not contain %q", d.Reason, tc.want.reason)
			}
		})
	}
}

func octets(eps []Endpoint) []int {
	out := []int{}
	for _, e := range eps {
		out = append(out, int(e.Addr.Addr().As4()[3]))
	}
	slices.Sort(out)
	return out
}

func nonNilInts(v []int) []int {
	if v == nil {
		return []int{}
	}
	return v
}

func TestParseTopologyKeys(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    []string
		wantErr bool
	}{
		{in: "kubernetes.io/hostname", want: []string{"kubernetes.io/hostname"}},
		{in: " a , b ,*", want: []string{"a", "b", "*"}},
		{in: "*", want: []string{"*"}},
		{in: "", wantErr: true},
		{in: "a,", wantErr: true},
		{in: "a,a", wantErr: true},
		{in: "*,a", wantErr: true},
		{in: strings.TrimSuffix(strings.Repeat("k,", 16), ","), want: func() []string {
			var s []string
			for range 16 {
				s = append(s, "k")
			}
			return s
		}(), wantErr: true}, // 16 keys, but repeated
	} {
		got, err := ParseTopologyKeys(tc.in)
		if (err != nil) != tc.wantErr {
			t.Errorf("ParseTopologyKeys(%q) error = %v, wantErr %v", tc.in, err, tc.wantErr)
			continue
		}
		if err == nil && !slices.Equal(got, tc.want) {
			t.Errorf("ParseTopologyKeys(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
	var sixteen []string
	for i := range 16 {
		sixteen = append(sixteen, fmt.Sprintf("k%d", i))
	}
	if _, err := ParseTopologyKeys(strings.Join(sixteen, ",")); err != nil {
		t.Errorf("16 distinct keys: %v", err)
	}
	if _, err := ParseTopologyKeys(strings.Join(append(sixteen, "*"), ",")); err == nil {
		t.Errorf("17 keys accepted")
	}
}

// withNodePort makes p a NodePort port, with externalTrafficPolicy Local
// when local is true.
func withNodePort(p ServicePort, local bool) ServicePort {
	p.NodePort, p.ExternallyAccessible, p.ExternalPolicyLocal = 30080, true, local
	return p
}

// withITPLocal gives p internalTrafficPolicy Local.
func withITPLocal(p ServicePort) ServicePort { p.InternalPolicyLocal = true; return p }

func TestDraining(t *testing.T) {
	cases := []struct {
		name string
		node string
		port ServicePort
		eps  []Endpoint
		// draining are the last octets of Draining; externalDraining of
		// ExternalDraining, nil meaning it must be nil.
		draining, externalDraining []int
	}{
		{name: "serving-terminating while ready ones exist", node: "a1", port: clusterPort(nil),
			eps:      []Endpoint{ep(1, "a1", "zone-a"), ep(2, "a1", "zone-a", terminating(true)), ep(3, "b1", "zone-b", terminating(false)), ep(4, "b1", "zone-b", unready)},
			draining: []int{2}},
		{name: "all terminating: the serving-terminating ones are active, nothing drains", node: "a1", port: clusterPort(nil),
			eps:      []Endpoint{ep(1, "a1", "zone-a", terminating(true)), ep(2, "b1", "zone-b", terminating(true))},
			draining: []int{}},
		{name: "hints: ready endpoints of other zones drain", node: "a1", port: clusterPort(nil),
			eps:      []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "b1", "zone-b", zones("zone-b")), ep(3, "b1", "zone-b", terminating(true))},
			draining: []int{2, 3}},
		{name: "topology-keys without a match: everything serving drains", node: "c1", port: clusterPort(map[string]string{AnnotationTopologyKeys: LabelHostname}),
			eps:      []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			draining: []int{1, 2}},
		{name: "zone threshold met: other zones drain", node: "a1", port: clusterPort(map[string]string{AnnotationZoneThreshold: "1"}),
			eps:      []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			draining: []int{2}},
		{name: "zone-weighted: endpoints without weight drain", node: "a1", port: zoneWeightedPort(),
			// testNodes by count: zone-a 2/4. S_a = 1/2 keeps all.
			eps:      []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b")},
			draining: []int{2}},
		{name: "iTP Local: remote serving endpoints drain", node: "a1", port: withITPLocal(clusterPort(nil)),
			eps:      []Endpoint{ep(1, "a1", "zone-a"), ep(2, "b1", "zone-b"), ep(3, "c1", "zone-c", terminating(true))},
			draining: []int{2, 3}},
		{name: "eTP Local: its own draining set", node: "a1", port: withNodePort(clusterPort(nil), true),
			eps:              []Endpoint{ep(1, "a1", "zone-a", zones("zone-a")), ep(2, "a2", "zone-a", zones("zone-a")), ep(3, "b1", "zone-b", zones("zone-b"))},
			draining:         []int{3},
			externalDraining: []int{2, 3}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := Decide(Input{Node: testNodes[tc.node], Nodes: testNodes, Port: tc.port, Endpoints: tc.eps}, DefaultOptions())
			if d.Draining == nil {
				t.Errorf("Draining is nil")
			}
			if got := octets(d.Draining); !slices.Equal(got, tc.draining) {
				t.Errorf("draining = %v, want %v (backends %v)", got, tc.draining, octets(d.Backends))
			}
			switch {
			case tc.externalDraining == nil && d.ExternalDraining != nil:
				t.Errorf("external draining = %v, want nil", octets(d.ExternalDraining))
			case tc.externalDraining != nil && !slices.Equal(octets(d.ExternalDraining), tc.externalDraining):
				t.Errorf("external draining = %v, want %v", octets(d.ExternalDraining), tc.externalDraining)
			}
		})
	}
}

// TestWhenEmpty pins when an empty set rejects (no usable endpoint
// anywhere, as kube-proxy rejects Services without endpoints) and when it
// drops (the policy leaves this node without backends).
func TestWhenEmpty(t *testing.T) {
	cases := []struct {
		name string
		node string
		port ServicePort
		eps  []Endpoint
		want EmptyAction
		// empty says which sets must be empty: "internal", "external".
		empty []string
	}{
		{name: "no endpoints at all: reject", node: "a1", port: clusterPort(nil), want: EmptyReject, empty: []string{"internal"}},
		{name: "only unready and not-serving terminating endpoints: reject", node: "a1", port: withNodePort(clusterPort(nil), false),
			eps:  []Endpoint{ep(1, "a1", "zone-a", unready), ep(2, "b1", "zone-b", terminating(false))},
			want: EmptyReject, empty: []string{"internal", "external"}},
		{name: "serving-terminating endpoints are usable: not reject", node: "a1", port: clusterPort(nil),
			eps:  []Endpoint{ep(1, "b1", "zone-b", terminating(true))},
			want: EmptyDrop},
		{name: "iTP Local without a local endpoint: drop", node: "c1", port: withITPLocal(clusterPort(nil)),
			eps:  []Endpoint{ep(1, "a1", "zone-a")},
			want: EmptyDrop, empty: []string{"internal"}},
		{name: "eTP Local without a local endpoint: external drops, internal serves", node: "c1", port: withNodePort(clusterPort(nil), true),
			eps:  []Endpoint{ep(1, "a1", "zone-a")},
			want: EmptyDrop, empty: []string{"external"}},
		{name: "topology-keys without a match: drop", node: "c1", port: clusterPort(map[string]string{AnnotationTopologyKeys: LabelHostname}),
			eps:  []Endpoint{ep(1, "a1", "zone-a")},
			want: EmptyDrop, empty: []string{"internal"}},
		{name: "iTP Local on an empty Service: reject", node: "a1", port: withITPLocal(clusterPort(nil)),
			eps:  []Endpoint{ep(1, "a1", "zone-a", unready)},
			want: EmptyReject, empty: []string{"internal"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := Decide(Input{Node: testNodes[tc.node], Nodes: testNodes, Port: tc.port, Endpoints: tc.eps}, DefaultOptions())
			if d.WhenEmpty != tc.want {
				t.Errorf("WhenEmpty = %q, want %q", d.WhenEmpty, tc.want)
			}
			if got := len(d.Backends) == 0; got != slices.Contains(tc.empty, "internal") {
				t.Errorf("internal set empty = %v, want %v", got, !got)
			}
			if tc.port.ExternallyAccessible {
				if got := len(d.ExternalBackends) == 0; got != slices.Contains(tc.empty, "external") {
					t.Errorf("external set empty = %v, want %v", got, !got)
				}
				for _, scope := range []Scope{ScopeInternal, ScopeExternal} {
					if set, _ := d.SetFor(KindNodePort, scope); set.WhenEmpty != tc.want {
						t.Errorf("NodePort from %s: WhenEmpty %q, want %q", scope, set.WhenEmpty, tc.want)
					}
				}
			}
		})
	}
}
