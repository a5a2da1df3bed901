package maps

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"strconv"
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

// statTable documents the counters: its Counters table has a row
// "| N | `STAT_X` | `name` | what it counts |" per member of enum
// stat_reason, and says "`STAT_MAX` (N) is the count".
const statTable = "../docs/datapath.md"

// TestStatNames checks the stable counter names (derived from enum
// stat_reason's BTF) against the rows of statTable, which record them as
// the external interface they are: every member has a row with its number
// and its name, every row a member, no name is used twice. A new counter
// fails here until its row is added; a change of the naming rule that
// would rename an exported counter fails here too.
func TestStatNames(t *testing.T) {
	names, err := statNames()
	if err != nil {
		t.Fatal(err)
	}
	spec, err := loadTc()
	if err != nil {
		t.Fatal(err)
	}
	var reasons *btf.Enum
	if err := spec.Types.TypeByName("stat_reason", &reasons); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(statTable)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		num  uint64
		name string
	}
	rows := map[string]row{}
	rowRE := regexp.MustCompile("(?m)^\\| ([0-9]+) \\| `(STAT_[A-Z0-9_]+)` \\| `([a-z0-9_]+)` \\|")
	for _, m := range rowRE.FindAllStringSubmatch(string(doc), -1) {
		n, err := strconv.ParseUint(m[1], 10, 32)
		if err != nil {
			t.Fatalf("%s: row %q: %v", statTable, m[0], err)
		}
		if _, dup := rows[m[2]]; dup {
			t.Errorf("%s: two rows for %s", statTable, m[2])
		}
		rows[m[2]] = row{n, m[3]}
	}
	used := map[string]string{}
	for _, v := range reasons.Values {
		if v.Name == "STAT_MAX" {
			if want := fmt.Sprintf("`STAT_MAX` (%d) is the count", v.Value); !strings.Contains(string(doc), want) {
				t.Errorf("%s does not say %q", statTable, want)
			}
			continue
		}
		s := Stat(v.Value)
		if int(s) >= numStats {
			t.Errorf("%s = %d is not below STAT_MAX %d", v.Name, s, numStats)
		}
		name := names[s]
		if other, ok := used[name]; ok {
			t.Errorf("%s and %s are both named %q", other, v.Name, name)
		}
		used[name] = v.Name
		r, ok := rows[v.Name]
		switch {
		case !ok:
			t.Errorf("%s has no row in %s's Counters table: add \"| %d | `%s` | `%s` | what it counts |\"", v.Name, statTable, v.Value, v.Name, name)
		case r.num != v.Value:
			t.Errorf("%s: %s is %d, the enum says %d", statTable, v.Name, r.num, v.Value)
		case r.name != name:
			t.Errorf("%s is named %q, %s says %q: exported names must not change (statNameExceptions)", v.Name, name, statTable, r.name)
		}
		delete(rows, v.Name)
	}
	for cname := range rows {
		t.Errorf("%s has a row for %s, which enum stat_reason lacks", statTable, cname)
	}
	for cname, name := range statNameExceptions {
		if _, ok := used[name]; !ok || used[name] != cname {
			t.Errorf("statNameExceptions: %s is not a member of enum stat_reason", cname)
		}
		if statRuleName(cname) == name {
			t.Errorf("statNameExceptions: %s is named %q by the rule already", cname, name)
		}
	}
	if len(names) != len(used) {
		t.Errorf("%d names for %d stats", len(names), len(used))
	}
	if numStats > int(tcMapSizeSTAT_SLOTS) {
		t.Errorf("%d stats do not fit tlb_stats' %d slots", numStats, tcMapSizeSTAT_SLOTS)
	}
}
