package maps

import (
	"cmp"
	"math/bits"
	"slices"
)

// WeightedSlots is the smallest table of a frontend whose active backends
// have unequal weights (enum map_size in bpf/consts.h).
const WeightedSlots = int(tcMapSizeWEIGHTED_SLOTS)

// weightedTableSize is the number of slots of a weighted table over n
// backends: WeightedSlots, or 4n when that is larger, so every backend
// keeps a few slots whatever n is.
func weightedTableSize(n int) int { return max(WeightedSlots, 4*n) }

// slotCounts returns how many slots each active backend holds in its
// frontend's table, given the backends' weights (each at least 1), and
// whether the weights are all equal.
//
//   - All weights equal: one slot each, equal is true. Single-backend
//     changes then cost at most three writes (update.go).
//   - Weights whose reduced form (divided by their greatest common
//     divisor) sums to at most M = weightedTableSize(len(w)): the reduced
//     weights, exactly. Every backend's share of new flows is exact.
//   - Otherwise a table of M slots apportioned by largest remainder: each
//     backend's slot count differs from its quota w_i·M/Σw by less than
//     one slot, so its share of new flows is within 1/M of its weight's
//     share (M ≥ 512: 0.2 percentage points). A backend whose quota is
//     below one slot still gets one, taken from the backends the
//     rounding favoured most; the bound then holds for every backend
//     whose quota is at least one slot.
//
// The weighted table costs its slot count against Options.MaxBackends.
func slotCounts(w []uint32) (counts []uint32, equal bool) {
	counts = make([]uint32, len(w))
	if len(w) == 0 {
		return counts, true
	}
	equal = true
	g := uint64(w[0])
	for _, x := range w {
		if x != w[0] {
			equal = false
		}
		g = gcd(g, uint64(x))
	}
	if equal {
		for i := range counts {
			counts[i] = 1
		}
		return counts, true
	}
	m := uint64(weightedTableSize(len(w)))
	var reduced uint64
	for _, x := range w {
		reduced += uint64(x) / g
	}
	if reduced <= m {
		for i, x := range w {
			counts[i] = uint32(uint64(x) / g)
		}
		return counts, false
	}
	return largestRemainder(w, m), false
}

// largestRemainder apportions m slots over weights w (each at least 1).
func largestRemainder(w []uint32, m uint64) []uint32 {
	var total uint64
	for _, x := range w {
		total += uint64(x)
	}
	counts := make([]uint32, len(w))
	rem := make([]uint64, len(w))
	var given uint64
	for i, x := range w {
		// x·m/total < m fits, x·m may not: 128-bit product.
		hi, lo := bits.Mul64(uint64(x), m)
		q, r := bits.Div64(hi, lo, total)
		counts[i], rem[i] = uint32(q), r
		given += q
	}
	order := make([]int, len(w))
	for i := range order {
		order[i] = i
	}
	// Largest remainder first; ties to the earlier backend.
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(rem[b], rem[a]) })
	for k := 0; given < m; k++ {
		counts[order[k%len(order)]]++
		given++
	}
	// surplus is count_i - quota_i; only compared, so float64 will do.
	surplus := func(i int) float64 {
		return float64(counts[i]) - float64(w[i])*float64(m)/float64(total)
	}
	for i := range counts {
		if counts[i] > 0 {
			continue
		}
		donor := -1
		for j := range counts {
			if counts[j] > 1 && (donor < 0 || surplus(j) > surplus(donor)) {
				donor = j
			}
		}
		if donor < 0 {
			break // m < len(w) cannot happen: m >= 4·len(w)
		}
		counts[donor]--
		counts[i]++
	}
	return counts
}

func gcd(a, b uint64) uint64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}
