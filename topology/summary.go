package topology

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
)

// SummaryVersion is the version of the summary's encoding. A reader
// refuses a summary of another version (DecodeSummary) rather than guess
// what its fields mean; a change to the fields or their meaning takes a
// new version, and the key it is stored under (SummaryDataKey) with it.
const SummaryVersion = 1

// SummaryDataKey is the ConfigMap data key the encoded summary is stored
// under; it names the version so a writer and a reader of different
// versions never read each other's encoding.
const SummaryDataKey = "summary.v1.json"

// MaxSummaryBytes bounds the encoded summary: a ConfigMap holds at most
// 1 MiB, and every agent keeps one copy. About 5,000 nodes' zones and CPU
// take 150 KiB, and each label key about 50 bytes a node more.
const MaxSummaryBytes = 768 << 10

// ErrSummaryTooLarge is returned when the summary does not fit in
// MaxSummaryBytes even without any label key.
var ErrSummaryTooLarge = errors.New("topology summary too large")

// Summary is what the decisions of one node read of the other nodes,
// published by one writer so that agents need not watch every Node:
// ZoneWeighted's demand (every counted node's zone and allocatable CPU,
// ZoneDemand) and, for every label key that some Service's topology-keys
// names, each node's value (TopologyKeys). Built by BuildSummary; the
// nodes it stands for are Nodes().
//
// Coupling: it holds what ServicePort.Reads says a decision reads of other
// nodes (Capacity, OtherLabels); a policy that starts reading more of them
// must be added here, or Lacks would not know the summary lacks it.
type Summary struct {
	// Version is SummaryVersion.
	Version int `json:"version"`
	// Written is when the writer wrote it; the writer rewrites an
	// unchanged summary every few minutes, so its age tells a reader
	// whether the writer is alive.
	Written time.Time `json:"written"`
	// Zones maps each zone to its counted nodes (countsForDemand: a zone
	// label and a Ready condition that is not False), each with its
	// allocatable CPU in millicores as NodeFromObject reads it (0 when
	// absent, any invalid value kept as is).
	Zones map[string]map[string]int64 `json:"zones"`
	// NotCounted lists, sorted, the nodes ZoneDemand does not count, so
	// that a reader knows every node by name.
	NotCounted []string `json:"notCounted,omitempty"`
	// Labels maps each label key it covers to every node that carries it
	// and its value. A key present with an empty map is covered and carried
	// by no node; a key absent is not covered (Lacks).
	Labels map[string]map[string]string `json:"labels"`
	// Omitted are the label keys asked for that were left out to keep the
	// summary within MaxSummaryBytes, sorted.
	Omitted []string `json:"omitted,omitempty"`
}

// SummaryLabelKeys returns the label keys the valid topology-keys
// annotations of the State's Services name, sorted, without "*": what a
// summary must cover for them.
func (st *State) SummaryLabelKeys() []string {
	seen := map[string]bool{}
	for _, svc := range st.Services {
		v, ok := svc.Annotations[AnnotationTopologyKeys]
		if !ok {
			continue
		}
		keys, err := ParseTopologyKeys(v)
		if err != nil {
			continue
		}
		for _, k := range keys {
			if k != "*" {
				seen[k] = true
			}
		}
	}
	return slices.Sorted(maps.Keys(seen))
}

// BuildSummary summarizes nodes for readers whose Services' topology keys
// name labelKeys. When the encoding would exceed maxBytes, label keys are
// left out (Omitted), largest encoding first, then by name, until it fits;
// the error wraps ErrSummaryTooLarge when the zones alone do not fit.
// Written is left zero: the writer sets it.
func BuildSummary(nodes map[string]Node, labelKeys []string, maxBytes int) (*Summary, error) {
	s := &Summary{Version: SummaryVersion, Zones: map[string]map[string]int64{}, Labels: map[string]map[string]string{}}
	for name, n := range nodes {
		if countsForDemand(n) {
			z := s.Zones[n.Zone()]
			if z == nil {
				z = map[string]int64{}
				s.Zones[n.Zone()] = z
			}
			z[name] = n.AllocatableMilliCPU
		} else {
			s.NotCounted = append(s.NotCounted, name)
		}
	}
	slices.Sort(s.NotCounted)
	for _, k := range labelKeys {
		vals := map[string]string{}
		for name, n := range nodes {
			if v, ok := n.Labels[k]; ok {
				vals[name] = v
			}
		}
		s.Labels[k] = vals
	}
	size, err := s.encodedSize()
	if err != nil {
		return nil, err
	}
	if size <= maxBytes {
		return s, nil
	}
	// Leave out the largest keys first: the fewest Services lose their
	// data for the most room.
	type keySize struct {
		key  string
		size int
	}
	var sizes []keySize
	for k, vals := range s.Labels {
		b, err := json.Marshal(vals)
		if err != nil {
			return nil, fmt.Errorf("encode label %s: %w", k, err)
		}
		sizes = append(sizes, keySize{k, len(b) + len(k)})
	}
	slices.SortFunc(sizes, func(a, b keySize) int { return cmp.Or(cmp.Compare(b.size, a.size), cmp.Compare(a.key, b.key)) })
	for _, ks := range sizes {
		delete(s.Labels, ks.key)
		s.Omitted = append(s.Omitted, ks.key)
		if size, err = s.encodedSize(); err != nil {
			return nil, err
		}
		if size <= maxBytes {
			slices.Sort(s.Omitted)
			return s, nil
		}
	}
	return nil, fmt.Errorf("%d nodes take %d bytes, over %d: %w", len(nodes), size, maxBytes, ErrSummaryTooLarge)
}

func (s *Summary) encodedSize() (int, error) {
	b, err := s.Encode()
	return len(b), err
}

// Encode returns the summary's encoding (JSON, SummaryVersion).
func (s *Summary) Encode() ([]byte, error) {
	b, err := json.Marshal(s)
	if err != nil {
		return nil, fmt.Errorf("encode topology summary: %w", err)
	}
	return b, nil
}

// DecodeSummary decodes an encoded summary; the error says when it is not
// one, or of another version.
func DecodeSummary(b []byte) (*Summary, error) {
	var s Summary
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("decode topology summary: %w", err)
	}
	if s.Version != SummaryVersion {
		return nil, fmt.Errorf("topology summary version %d, this reader knows %d", s.Version, SummaryVersion)
	}
	return &s, nil
}

// SameInputs reports whether a and b hold the same nodes, CPU and labels,
// whenever they were written: what decides whether a new summary is worth
// writing. Nil equals only nil.
func (s *Summary) SameInputs(o *Summary) bool {
	if s == nil || o == nil {
		return s == nil && o == nil
	}
	a, b := *s, *o
	a.Written, b.Written = time.Time{}, time.Time{}
	ae, err1 := a.Encode()
	be, err2 := b.Encode()
	return err1 == nil && err2 == nil && string(ae) == string(be)
}

// LabelKeys returns the label keys the summary was built for, sorted:
// those it covers and those it Omitted.
func (s *Summary) LabelKeys() []string {
	return slices.Sorted(slices.Values(append(slices.Collect(maps.Keys(s.Labels)), s.Omitted...)))
}

// Nodes returns the nodes the summary stands for, as decisions read them:
// a counted node has its zone label, its allocatable CPU and no Ready
// condition; a node not counted has a Ready condition False; both carry
// the covered labels they have. Nothing else (addresses, other labels) is
// known: the summary stands for other nodes, never for the agent's own.
// A nil summary stands for no nodes.
func (s *Summary) Nodes() map[string]Node {
	out := map[string]Node{}
	if s == nil {
		return out
	}
	node := func(name string) Node {
		n, ok := out[name]
		if !ok {
			n = Node{Name: name, Labels: map[string]string{}}
		}
		return n
	}
	for zone, nodes := range s.Zones {
		for name, cpu := range nodes {
			n := node(name)
			n.Labels[LabelZone] = zone
			n.AllocatableMilliCPU = cpu
			out[name] = n
		}
	}
	for _, name := range s.NotCounted {
		n := node(name)
		n.Ready = v1.ConditionFalse
		out[name] = n
	}
	for k, vals := range s.Labels {
		for name, v := range vals {
			n := node(name)
			n.Labels[k] = v
			out[name] = n
		}
	}
	return out
}

// Lacks says what p's decision reads of other nodes (ServicePort.Reads)
// that the summary lacks, "" when it has it all: no summary at all for
// ZoneWeighted or TopologyKeys, or a label key TopologyKeys names that it
// does not cover (not asked for yet, or Omitted for size). A Service whose
// policy needs nothing of other nodes (Hints, ZoneThreshold, Disabled)
// never lacks anything.
func (s *Summary) Lacks(p ServicePort) string { return s.LacksFor(p.Reads()) }

// LacksFor is Lacks for a port that reads r: for a reader that keeps what
// its decisions read, not the ports.
func (s *Summary) LacksFor(r NodeReads) string {
	if !r.Capacity && len(r.OtherLabels) == 0 {
		return ""
	}
	if s == nil {
		return "no topology summary has been read"
	}
	var missing []string
	for _, k := range r.OtherLabels {
		if _, ok := s.Labels[k]; !ok {
			if slices.Contains(s.Omitted, k) {
				missing = append(missing, k+" (omitted: the summary would exceed its size bound)")
			} else {
				missing = append(missing, k)
			}
		}
	}
	if len(missing) == 0 {
		return ""
	}
	return "the topology summary lacks other nodes' label " + strings.Join(missing, ", ")
}
