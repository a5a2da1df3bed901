package maps

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"
)

// loadBalancerSourceRanges in the datapath (bpf/srcrange.h): a frontend
// with Service.SourceRanges carries SVC_F_SRC_RANGES, and tlb_src_ranges
// holds its prefixes keyed by its svc id. The prefixes of a frontend are
// written before its service entry can name them (create, update) and
// deleted after it no longer does, so no new flow from an allowed source
// is ever refused by a change (between the two, the union is allowed).

// DefaultMaxSourceRanges is the size of tlb_src_ranges: prefixes summed
// over frontends (one Service with 4 ranges and 2 load-balancer IPs on
// one port has 2×2×4 = 16: each LB IP has an internal and an external
// frontend).
const DefaultMaxSourceRanges = int(tcMapSizeDEFAULT_MAX_SRC_RANGES)

// sourceRangeKey is the tlb_src_ranges key of prefix p of service id.
func sourceRangeKey(id uint32, p netip.Prefix) tcSrcRangeKey {
	var wire [4]byte
	binary.BigEndian.PutUint32(wire[:], id)
	return tcSrcRangeKey{Prefixlen: 32 + uint32(prefixBits16(p)), SvcId: binary.NativeEndian.Uint32(wire[:]), Addr: wireAddr(p.Addr())}
}

// sourceRangeFromKey decodes a tlb_src_ranges key; ok is false for a key
// no prefix makes.
func sourceRangeFromKey(k tcSrcRangeKey) (id uint32, p netip.Prefix, ok bool) {
	var wire [4]byte
	binary.NativeEndian.PutUint32(wire[:], k.SvcId)
	id = binary.BigEndian.Uint32(wire[:])
	bits := int(k.Prefixlen) - 32
	if bits < 0 || bits > 128 {
		return id, netip.Prefix{}, false
	}
	a := netip.AddrFrom16(k.Addr.Bytes)
	if a.Is4In6() {
		if bits < v4MappedBits {
			return id, netip.Prefix{}, false
		}
		bits -= v4MappedBits
	}
	p = netip.PrefixFrom(a.Unmap(), bits)
	return id, p, p.Masked() == p
}

// v4MappedBits is the IPv4-mapped prefix (::ffff:0:0/96) in front of an
// IPv4 address in a tlb_addr.
const v4MappedBits = 96

// prefixBits16 is p's length over the 16 bytes of a tlb_addr.
func prefixBits16(p netip.Prefix) int {
	if p.Addr().Is4() {
		return v4MappedBits + p.Bits()
	}
	return p.Bits()
}

// normalizeRanges validates a Service's source ranges: prefixes of
// either family, masked; returned sorted and without duplicates. A
// prefix of the other family than the frontend's matches no source.
func normalizeRanges(rs []netip.Prefix) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(rs))
	for _, p := range rs {
		if !p.IsValid() || p.Addr().Is4In6() || p.Addr().Zone() != "" || p.Masked() != p {
			return nil, fmt.Errorf("source range %s: want a masked IPv4 or IPv6 prefix", p)
		}
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	return slices.Compact(out), nil
}

// putRanges writes the prefixes of id that the kernel does not hold yet.
func (d *writer) putRanges(t *txn, id uint32, want []netip.Prefix) error {
	for _, p := range want {
		if d.ranges[id][p] {
			continue
		}
		if err := t.put(d.srcRanges, "src_ranges", sourceRangeKey(id, p), uint8(1)); err != nil {
			return err
		}
		if d.ranges[id] == nil {
			d.ranges[id] = map[netip.Prefix]bool{}
		}
		d.ranges[id][p] = true
	}
	return nil
}

// pruneRanges deletes the prefixes of id not in keep. A delete that fails
// leaves the prefix allowed and is tried again by the next change of id.
func (d *writer) pruneRanges(t *txn, id uint32, keep []netip.Prefix) error {
	var errs []error
	for p := range d.ranges[id] {
		if slices.Contains(keep, p) {
			continue
		}
		if err := t.del(d.srcRanges, "src_ranges", sourceRangeKey(id, p)); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(d.ranges[id], p)
	}
	if len(d.ranges[id]) == 0 {
		delete(d.ranges, id)
	}
	return errors.Join(errs...)
}

// resetRangeDrops zeroes the refusal counter of a newly assigned id.
func (d *writer) resetRangeDrops(t *txn, id uint32) error {
	return t.put(d.srcRangeDrops, "src_range_drops", id, uint64(0))
}

// adoptRanges takes the prefixes of the kernel's tlb_src_ranges (k) into
// the mirror and deletes those of ids no adopted frontend holds.
func (d *writer) adoptRanges(t *txn, k *kernelState) error {
	held := map[uint32]bool{}
	for _, s := range d.fes {
		held[s.id] = true
	}
	for key := range k.ranges {
		id, p, ok := sourceRangeFromKey(key)
		if !ok || !held[id] {
			if err := t.del(d.srcRanges, "src_ranges", key); err != nil {
				return err
			}
			delete(k.ranges, key)
			continue
		}
		if d.ranges[id] == nil {
			d.ranges[id] = map[netip.Prefix]bool{}
		}
		d.ranges[id][p] = true
	}
	return nil
}

// SourceRangeDrops returns, for every frontend with source ranges, the
// new flows it refused for coming from outside them since its id was
// assigned.
func (d *writer) SourceRangeDrops() (map[Frontend]uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed() {
		return nil, ErrClosed
	}
	return d.sourceRangeDrops()
}

// sourceRangeDrops is SourceRangeDrops under d's lock.
func (d *writer) sourceRangeDrops() (map[Frontend]uint64, error) {
	out := map[Frontend]uint64{}
	for fe, s := range d.fes {
		if !s.set.srcRanges {
			continue
		}
		var n uint64
		if err := d.srcRangeDrops.Lookup(s.id, &n); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil, fmt.Errorf("read src_range_drops of %s: %w", fe, err)
		}
		out[fe] = n
	}
	return out, nil
}

// wantedRanges are the tlb_src_ranges keys the mirror holds.
func (d *writer) wantedRanges() map[tcSrcRangeKey]bool {
	out := map[tcSrcRangeKey]bool{}
	for id, ps := range d.ranges {
		for p := range ps {
			out[sourceRangeKey(id, p)] = true
		}
	}
	return out
}

// verifyRanges reports the prefixes the kernel lacks or holds beyond the
// mirror, sorted.
func (d *writer) verifyRanges(k *kernelState) []Drift {
	byID := make(map[uint32]Frontend, len(d.fes))
	for _, s := range d.fes {
		byID[s.id] = s.fe
	}
	var out []Drift
	add := func(key tcSrcRangeKey, what string) {
		id, p, _ := sourceRangeFromKey(key)
		out = append(out, Drift{Kind: DriftSourceRange, Frontend: byID[id], Detail: fmt.Sprintf("service id %d: prefix %s %s", id, p, what)})
	}
	want := d.wantedRanges()
	for key := range want {
		if !k.ranges[key] {
			add(key, "missing: its sources are refused")
		}
	}
	for key := range k.ranges {
		if !want[key] {
			add(key, "not programmed: its sources are let in")
		}
	}
	slices.SortFunc(out, func(a, b Drift) int { return cmp.Compare(a.Detail, b.Detail) })
	return out
}

// fixRanges writes the prefixes the kernel lacks and deletes those it
// holds beyond the mirror.
func (d *writer) fixRanges(t *txn, k *kernelState) error {
	var errs []error
	want := d.wantedRanges()
	for key := range want {
		if !k.ranges[key] {
			errs = append(errs, t.put(d.srcRanges, "src_ranges", key, uint8(1)))
		}
	}
	for key := range k.ranges {
		if !want[key] {
			errs = append(errs, t.del(d.srcRanges, "src_ranges", key))
		}
	}
	return errors.Join(errs...)
}

// rangesOf returns the prefixes k holds for service id, sorted; never nil.
func (k *kernelState) rangesOf(id uint32) []netip.Prefix {
	out := []netip.Prefix{}
	for key := range k.ranges {
		if kid, p, ok := sourceRangeFromKey(key); ok && kid == id {
			out = append(out, p)
		}
	}
	sorted, _ := normalizeRanges(out)
	return sorted
}
