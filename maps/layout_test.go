package maps

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/cilium/ebpf/btf"
)

// layoutHistory records every (layoutVersion, fingerprint) pair ever
// committed, one per line, append-only. A change to a map key, value,
// map type or stored enum changes the fingerprint; this test then fails
// until layoutVersion is bumped and the new pair appended, so pinned maps
// of the old layout are refused instead of misread.
const layoutHistory = "testdata/layout_history"

func TestLayoutFingerprint(t *testing.T) {
	spec, err := loadTc()
	if err != nil {
		t.Fatal(err)
	}
	fp, err := layoutFingerprint(spec)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(layoutHistory)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	seen := map[uint32]uint64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		var v uint32
		var p uint64
		if _, err := fmt.Sscanf(line, "%d %x", &v, &p); err != nil {
			t.Fatalf("%s: bad line %q: %v", layoutHistory, line, err)
		}
		if old, dup := seen[v]; dup && old != p {
			t.Fatalf("%s: layout version %d has two fingerprints (%x, %x): a layout changed without a version bump", layoutHistory, v, old, p)
		}
		for ov, op := range seen {
			if op == p && ov != v {
				t.Fatalf("%s: fingerprint %x recorded for versions %d and %d", layoutHistory, p, ov, v)
			}
		}
		seen[v] = p
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	want, ok := seen[layoutVersion]
	switch {
	case !ok:
		t.Fatalf("layout version %d is not in %s: append \"%d %016x\"", layoutVersion, layoutHistory, layoutVersion, fp)
	case want != fp:
		desc, _ := layoutDescription(spec)
		t.Fatalf("the map layout changed (fingerprint %016x, version %d recorded %016x): bump layoutVersion and append the new pair to %s\nlayout now:\n%s",
			fp, layoutVersion, want, layoutHistory, desc)
	}
}

// TestLayoutFingerprintSeesChanges checks the fingerprint covers what it
// claims: a field's offset, a map's type, an enum value.
func TestLayoutFingerprintSeesChanges(t *testing.T) {
	base := func() uint64 {
		spec, err := loadTc()
		if err != nil {
			t.Fatal(err)
		}
		fp, err := layoutFingerprint(spec)
		if err != nil {
			t.Fatal(err)
		}
		return fp
	}
	orig := base()
	spec, err := loadTc()
	if err != nil {
		t.Fatal(err)
	}
	spec.Maps[tcMapTlbCtNew].Type = spec.Maps[tcMapTlbServices].Type
	if fp, err := layoutFingerprint(spec); err != nil || fp == orig {
		t.Errorf("map type change not seen: %x, %v", fp, err)
	}
	desc, err := layoutDescription(spec)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"struct ct_value(80)", "expires@128", "BACKEND_DRAINING=2", "map tlb_stats"} {
		if !strings.Contains(desc, want) {
			t.Errorf("layout description lacks %q", want)
		}
	}
}

// TestMetaHoldsFingerprint checks a fresh datapath stamps its maps.
func TestMetaHoldsFingerprint(t *testing.T) {
	d := newDatapath(t, Options{})
	spec, err := loadTc()
	if err != nil {
		t.Fatal(err)
	}
	fp, err := layoutFingerprint(spec)
	if err != nil {
		t.Fatal(err)
	}
	var meta tcMeta
	if err := d.meta.Lookup(uint32(0), &meta); err != nil {
		t.Fatal(err)
	}
	if meta.LayoutVersion != layoutVersion || meta.Fingerprint != fp {
		t.Errorf("tlb_meta = %+v, want version %d fingerprint %x", meta, layoutVersion, fp)
	}
}

// TestStatNames checks every reason of enum stat_reason (read from the
// object's BTF: numbers may be left unused between branches) has one name
// of its own, and no name stands for a number the enum lacks.
func TestStatNames(t *testing.T) {
	spec, err := loadTc()
	if err != nil {
		t.Fatal(err)
	}
	var reasons *btf.Enum
	if err := spec.Types.TypeByName("stat_reason", &reasons); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	members := 0
	for _, v := range reasons.Values {
		if v.Name == "STAT_MAX" {
			continue
		}
		members++
		s := Stat(v.Value)
		if int(s) >= numStats {
			t.Errorf("%s = %d is not below STAT_MAX %d", v.Name, s, numStats)
		}
		n, ok := statNames[s]
		if !ok {
			t.Errorf("%s (%d) has no name", v.Name, s)
		}
		if names[n] {
			t.Errorf("stat name %q used twice", n)
		}
		names[n] = true
	}
	if len(statNames) != members {
		t.Errorf("%d names for %d stats", len(statNames), members)
	}
	if numStats > int(tcMapSizeSTAT_SLOTS) {
		t.Errorf("%d stats do not fit tlb_stats' %d slots", numStats, tcMapSizeSTAT_SLOTS)
	}
}
