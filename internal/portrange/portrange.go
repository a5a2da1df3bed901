// Package portrange is the one inclusive range of port numbers the
// project uses: the NodePort range topology decides with, the SNAT ports
// maps hands the datapath, the node's ephemeral range the agent checks
// them against. It is a leaf, so maps need not import topology for it.
package portrange

import (
	"fmt"
	"strconv"
	"strings"
)

// Range is an inclusive range of port numbers. The zero Range is no range
// (callers read it as "the default"); a valid one has 1 <= Min <= Max.
type Range struct{ Min, Max uint16 }

// Parse parses "MIN-MAX" (spaces around either number allowed), the
// syntax of the apiserver's --service-node-port-range, and checks it is
// valid.
func Parse(s string) (Range, error) {
	lo, hi, ok := strings.Cut(s, "-")
	if !ok {
		return Range{}, fmt.Errorf("port range %q: want MIN-MAX", s)
	}
	min, err := strconv.ParseUint(strings.TrimSpace(lo), 10, 16)
	if err != nil {
		return Range{}, fmt.Errorf("port range %q: %w", s, err)
	}
	max, err := strconv.ParseUint(strings.TrimSpace(hi), 10, 16)
	if err != nil {
		return Range{}, fmt.Errorf("port range %q: %w", s, err)
	}
	r := Range{Min: uint16(min), Max: uint16(max)}
	if err := r.Validate(); err != nil {
		return Range{}, fmt.Errorf("port range %q: %w", s, err)
	}
	return r, nil
}

// Validate returns an error unless 1 <= Min <= Max.
func (r Range) Validate() error {
	if r.Min == 0 || r.Min > r.Max {
		return fmt.Errorf("want 1 <= min <= max, got %s", r)
	}
	return nil
}

// String formats the range as "MIN-MAX", as Parse reads it.
func (r Range) String() string { return fmt.Sprintf("%d-%d", r.Min, r.Max) }

// Contains reports whether port is in the range.
func (r Range) Contains(port uint16) bool { return r.Min <= port && port <= r.Max }

// Size is the number of ports in a valid range.
func (r Range) Size() int { return int(r.Max) - int(r.Min) + 1 }

// Overlaps reports whether r and o share a port.
func (r Range) Overlaps(o Range) bool { return r.Min <= o.Max && o.Min <= r.Max }
