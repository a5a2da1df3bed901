package maps

import (
	"fmt"
	"math"
	"net/netip"
	"slices"
	"testing"
)

func TestSlotCounts(t *testing.T) {
	cases := []struct {
		name    string
		weights []uint32
		// counts worked out by hand from the rule in slotCounts' comment.
		counts []uint32
		equal  bool
	}{
		{"empty", nil, []uint32{}, true},
		{"one", []uint32{7}, []uint32{1}, true},
		{"equal_weights_one_slot_each", []uint32{5, 5, 5}, []uint32{1, 1, 1}, true},
		{"small_integers_exact", []uint32{1, 2, 3}, []uint32{1, 2, 3}, false},
		{"reduced_by_gcd", []uint32{4000, 1000, 1000}, []uint32{4, 1, 1}, false},
		// Zone-weighted example of issue 13: 2/3 and 1/6 twice, scaled.
		// Quotas 341.333, 85.334, 85.334: the spare slot goes to the
		// larger remainder, the first of the tie.
		{"zone_weighted_shares", []uint32{666666, 166667, 166667}, []uint32{341, 86, 85}, false},
		// 1000+1999+3001 = 6000 > 512: quotas 85.33, 170.58, 256.09;
		// floors 85, 170, 256 leave one slot for the largest remainder.
		{"largest_remainder", []uint32{1000, 1999, 3001}, []uint32{85, 171, 256}, false},
		// 1 of 100001 is below one slot of 512: it still gets one, from
		// the backend the rounding favoured.
		{"tiny_weight_keeps_a_slot", []uint32{1, 100000}, []uint32{1, 511}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			counts, equal := slotCounts(c.weights)
			if !slices.Equal(counts, c.counts) || equal != c.equal {
				t.Errorf("slotCounts(%v) = %v, %t; want %v, %t", c.weights, counts, equal, c.counts, c.equal)
			}
		})
	}
}

// FuzzSlotCounts checks the apportionment's promises on any weights: one
// slot per backend when weights are equal, every backend at least one
// slot, the table no larger than max(512, 4n) unless exact, and each
// share within 1/M of its weight's share when its quota is at least one
// slot.
func FuzzSlotCounts(f *testing.F) {
	f.Add([]byte{1, 2, 3})
	f.Add([]byte{255, 1, 0, 0, 7})
	f.Fuzz(func(t *testing.T, raw []byte) {
		if len(raw) == 0 || len(raw) > 300 {
			return
		}
		w := make([]uint32, 0, len(raw)/2+1)
		for i := 0; i+1 < len(raw) || i == 0; i += 2 {
			x := uint32(raw[i])
			if i+1 < len(raw) {
				x = x<<16 | uint32(raw[i+1])<<3
			}
			w = append(w, max(x, 1))
		}
		counts, equal := slotCounts(w)
		var total, sumW float64
		for i, c := range counts {
			if c == 0 {
				t.Fatalf("backend %d of %v has no slot: %v", i, w, counts)
			}
			total += float64(c)
			sumW += float64(w[i])
		}
		allEqual := !slices.ContainsFunc(w, func(x uint32) bool { return x != w[0] })
		if equal != allEqual || (equal && total != float64(len(w))) {
			t.Fatalf("weights %v: equal %t, counts %v", w, equal, counts)
		}
		m := float64(weightedTableSize(len(w)))
		if total > m {
			t.Fatalf("weights %v: %v slots, more than %v", w, total, m)
		}
		tiny := slices.ContainsFunc(w, func(x uint32) bool { return float64(x)*total/sumW < 1 })
		for i, c := range counts {
			quota := float64(w[i]) * total / sumW
			if !tiny && math.Abs(float64(c)-quota) >= 1-1e-9 {
				t.Fatalf("weights %v: backend %d has %d slots, quota %.3f", w, i, c, quota)
			}
		}
	})
}

// TestWeightedTables counts the slots the kernel holds for weighted
// frontends, and the share of new flows each backend gets through the tc
// program.
func TestWeightedTables(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipUDP, UDP)
	a, b, c := be("10.1.0.1:53"), be("10.1.0.2:53"), be("10.1.0.3:53")
	slotsOf := func() map[string]uint32 {
		t.Helper()
		prog, err := d.Programmed()
		if err != nil {
			t.Fatal(err)
		}
		if len(prog[f].Problems) > 0 {
			t.Fatalf("problems: %v", prog[f].Problems)
		}
		out := map[string]uint32{}
		for _, x := range prog[f].Backends {
			out[x.Addr.String()] = x.Weight
		}
		return out
	}
	steps := []struct {
		name  string
		set   []Backend
		slots map[string]uint32
	}{
		{"one_two_three", []Backend{withWeight(a, 1), withWeight(b, 2), withWeight(c, 3)}, map[string]uint32{"10.1.0.1:53": 1, "10.1.0.2:53": 2, "10.1.0.3:53": 3}},
		{"largest_remainder", []Backend{withWeight(a, 1000), withWeight(b, 1999), withWeight(c, 3001)}, map[string]uint32{"10.1.0.1:53": 85, "10.1.0.2:53": 171, "10.1.0.3:53": 256}},
		{"back_to_equal", []Backend{a, withWeight(b, 4), withWeight(c, 4)}, map[string]uint32{"10.1.0.1:53": 1, "10.1.0.2:53": 4, "10.1.0.3:53": 4}},
		{"equal", []Backend{withWeight(a, 9), withWeight(b, 9), withWeight(c, 9)}, map[string]uint32{"10.1.0.1:53": 1, "10.1.0.2:53": 1, "10.1.0.3:53": 1}},
		{"draining_holds_no_slot", []Backend{withWeight(a, 3), b, drained(c)}, map[string]uint32{"10.1.0.1:53": 3, "10.1.0.2:53": 1, "10.1.0.3:53": 0}},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			mustSet(t, d, f, s.set...)
			if got := slotsOf(); fmt.Sprint(got) != fmt.Sprint(s.slots) {
				t.Errorf("slots = %v, want %v", got, s.slots)
			}
			checkConsistent(t, d)
			if u := d.Usage(); u.Slots != kernelSlots(t, d) {
				t.Errorf("Usage.Slots %d, kernel holds %d", u.Slots, kernelSlots(t, d))
			}
		})
	}

	// 1:3 → 1/4 and 3/4 of new flows.
	mustSet(t, d, f, withWeight(a, 1), withWeight(b, 3))
	const flows = 8000
	got := map[netip.AddrPort]int{}
	for i := 0; i < flows; i++ {
		src := fmt.Sprintf("10.3.%d.%d:%d", i/256, i%256, 1000+i%5000)
		ret, out := run(t, d.tcProg, udpFrame(src, vipUDP, "q").bytes())
		p, err := verifyChecksums(out)
		if ret != tcOK || err != nil {
			t.Fatalf("verdict %d, %v", ret, err)
		}
		got[p.dst]++
	}
	share := float64(got[a.Addr]) / flows
	t.Logf("weights 1:3 over %d flows: %v (share of a %.3f)", flows, got, share)
	// Binomial sd at p=1/4, n=8000 is 0.0048: 4 sd.
	if math.Abs(share-0.25) > 0.02 || got[a.Addr]+got[b.Addr] != flows {
		t.Errorf("weights 1:3 gave %v", got)
	}
}
