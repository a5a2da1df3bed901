package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

// landings sends n new UDP flows to f through tc and counts where they
// went ("drop" for drops).
func landings(t *testing.T, d *Datapath, f Frontend, n int, seed int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for i := 0; i < n; i++ {
		src := fmt.Sprintf("10.7.%d.%d:%d", seed, i%256, 1000+i)
		ret, out := run(t, d.tcProg, udpFrame(src, f.Addr.String(), "q").bytes())
		if ret == tcShot {
			got["drop"]++
			continue
		}
		p, err := verifyChecksums(out)
		if ret != tcOK || err != nil {
			t.Fatalf("verdict %d, %v", ret, err)
		}
		got[p.dst.String()]++
	}
	return got
}

func kinds(drift []Drift) []DriftKind {
	var out []DriftKind
	for _, d := range drift {
		if !slices.Contains(out, d.Kind) {
			out = append(out, d.Kind)
		}
	}
	slices.Sort(out)
	return out
}

// TestVerifyAndRepair corrupts the maps behind the Datapath's back, one
// way at a time: Verify must name the drift, Repair must fix it, and
// traffic through the tc program must land on the programmed backends
// afterwards.
func TestVerifyAndRepair(t *testing.T) {
	d := newDatapath(t, Options{})
	f1, f2, f3 := fe("10.96.1.1:53", UDP), fe("10.96.1.2:53", UDP), fe("10.96.1.3:53", UDP)
	set1 := []Backend{be("10.1.1.1:53"), be("10.1.1.2:53"), be("10.1.1.3:53")}
	set2 := []Backend{be("10.1.2.1:53"), be("10.1.2.2:53")}
	set3 := []Backend{be("10.1.3.1:53"), drained(be("10.1.3.2:53"))}
	mustSet(t, d, f1, set1...)
	mustSet(t, d, f2, set2...)
	mustSet(t, d, f3, be("10.1.3.1:53"), be("10.1.3.2:53"))
	mustSetService(t, d, f3, Service{Backends: set3})
	checkConsistent(t, d)
	allowed := map[Frontend][]string{
		f1: {"10.1.1.1:53", "10.1.1.2:53", "10.1.1.3:53"},
		f2: {"10.1.2.1:53", "10.1.2.2:53"},
		f3: {"10.1.3.1:53"},
	}
	tx := &txn{d: d}
	svcOf := func(f Frontend) *service { return d.fes[f] }
	memberOf := func(f Frontend, addr string) *member { return d.fes[f].members[netip.MustParseAddrPort(addr)] }

	cases := []struct {
		name    string
		corrupt func(t *testing.T)
		want    []DriftKind
		// broken is a frontend whose traffic the corruption visibly
		// breaks before the repair (drops or a wrong backend).
		broken Frontend
	}{
		{"delete_a_slot", func(t *testing.T) {
			s := svcOf(f1)
			if err := d.backends.Delete(backendKey(s.id, 1, s.buffer)); err != nil {
				t.Fatal(err)
			}
		}, []DriftKind{DriftSlotMissing}, f1},
		{"two_frontends_share_an_id", func(t *testing.T) {
			s1, s2 := svcOf(f1), svcOf(f2)
			var v tcBackendValue
			if err := d.backends.Lookup(backendKey(s1.id, 0, s1.buffer), &v); err != nil {
				t.Fatal(err)
			}
			if err := d.backends.Update(backendKey(s2.id, 0, s2.buffer), &v, ebpf.UpdateExist); err != nil {
				t.Fatal(err)
			}
		}, []DriftKind{DriftIDShared}, f2},
		{"zero_a_registry_entry", func(t *testing.T) {
			if err := d.registry.Update(memberOf(f1, "10.1.1.2:53").id, tcRegistryValue{}, ebpf.UpdateAny); err != nil {
				t.Fatal(err)
			}
		}, []DriftKind{DriftRegistry}, Frontend{}},
		{"registry_points_elsewhere", func(t *testing.T) {
			m := memberOf(f3, "10.1.3.2:53")
			if err := d.registry.Update(m.id, registryValue(svcOf(f2).id, m), ebpf.UpdateAny); err != nil {
				t.Fatal(err)
			}
		}, []DriftKind{DriftRegistry}, Frontend{}},
		{"generation_moved", func(t *testing.T) {
			m := memberOf(f2, "10.1.2.2:53")
			if err := tx.putGeneration(m.id, m.gen+3); err != nil {
				t.Fatal(err)
			}
		}, []DriftKind{DriftGeneration}, Frontend{}},
		{"count_without_slot", func(t *testing.T) {
			s := svcOf(f2)
			if err := d.services.Update(s.key, svcValue(s.id, 3, s.gen, s.buffer, s.set), ebpf.UpdateExist); err != nil {
				t.Fatal(err)
			}
		}, []DriftKind{DriftService, DriftSlotMissing}, f2},
		{"frontend_deleted", func(t *testing.T) {
			if err := d.services.Delete(svcOf(f3).key); err != nil {
				t.Fatal(err)
			}
		}, []DriftKind{DriftFrontendMissing}, f3},
		{"stranger_frontend_and_orphan_registry", func(t *testing.T) {
			key, err := svcKey(fe("10.96.9.9:53", UDP))
			if err != nil {
				t.Fatal(err)
			}
			if err := d.services.Update(key, tcSvcValue{Id: 999, Count: 1}, ebpf.UpdateAny); err != nil {
				t.Fatal(err)
			}
			const free = 4000
			rec, err := d.readRecord(free)
			if err != nil {
				t.Fatal(err)
			}
			orphan := &member{be: be("10.9.9.9:53"), id: free, gen: rec.gen}
			if err := d.registry.Update(uint32(free), registryValue(999, orphan), ebpf.UpdateAny); err != nil {
				t.Fatal(err)
			}
		}, []DriftKind{DriftFrontendUnexpected, DriftRegistryOrphan}, Frontend{}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.corrupt(t)
			drift, err := d.Verify()
			if err != nil {
				t.Fatal(err)
			}
			for _, dr := range drift {
				t.Logf("found: %s", dr)
			}
			if got := kinds(drift); !slices.Equal(got, c.want) {
				t.Errorf("Verify found %v, want %v", got, c.want)
			}
			if c.broken != (Frontend{}) {
				got := landings(t, d, c.broken, 60, 2*i)
				bad := 0
				for dst, n := range got {
					if !slices.Contains(allowed[c.broken], dst) {
						bad += n
					}
				}
				t.Logf("before repair %s: %v", c.broken, got)
				if bad == 0 {
					t.Errorf("the corruption did not show in traffic to %s: %v", c.broken, got)
				}
			}
			rep, err := d.Repair()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("repair: reprogrammed %v, deleted %v, registry %d, retired %v, regenerated %v, %d writes",
				rep.Reprogrammed, rep.Deleted, rep.Registry, rep.Retired, rep.Regenerated, rep.Writes)
			if len(rep.Remaining) > 0 || rep.Writes == 0 || !slices.Equal(kinds(rep.Found), c.want) {
				t.Errorf("repair found %v, left %v after %d writes", kinds(rep.Found), rep.Remaining, rep.Writes)
			}
			checkConsistent(t, d)
			for f, want := range allowed {
				got := landings(t, d, f, 60, 2*i+1)
				for dst := range got {
					if !slices.Contains(want, dst) {
						t.Errorf("after repair %s sent flows to %s (%v)", f, dst, got)
					}
				}
				if len(got) != len(want) {
					t.Errorf("after repair %s used %v, want every one of %v", f, got, want)
				}
			}
		})
	}
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Stats[StatConntrackStaleBackend] != 0 {
		t.Logf("stale-backend re-balances during the test: %d", c.Stats[StatConntrackStaleBackend])
	}
}

// TestAdoptRepairsCorruption restarts over corrupted maps: Load rewrites
// the broken frontends and retires stray registry entries.
func TestAdoptRepairsCorruption(t *testing.T) {
	pin := bpffs(t) + "/topolb"
	opts := Options{PinPath: pin, MaxFrontends: 64, MaxBackends: 256, MaxConntrack: 1024}
	d := newDatapath(t, opts)
	f1, f2 := fe("10.96.1.1:53", UDP), fe("10.96.1.2:53", UDP)
	mustSet(t, d, f1, be("10.1.1.1:53"), be("10.1.1.2:53"), be("10.1.1.3:53"))
	mustSet(t, d, f2, be("10.1.2.1:53"), be("10.1.2.2:53"))
	want := d.Frontends()
	s1, s2 := d.fes[f1], d.fes[f2]
	// f2's first slot takes f1's first id; f1's last slot vanishes; a
	// crashed change left a registry entry in force for a free id.
	var v tcBackendValue
	if err := d.backends.Lookup(backendKey(s1.id, 0, s1.buffer), &v); err != nil {
		t.Fatal(err)
	}
	if err := d.backends.Update(backendKey(s2.id, 0, s2.buffer), &v, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}
	if err := d.backends.Delete(backendKey(s1.id, 2, s1.buffer)); err != nil {
		t.Fatal(err)
	}
	stray := &member{be: be("10.9.9.9:53"), id: 100}
	if err := d.registry.Update(uint32(100), registryValue(s1.id, stray), ebpf.UpdateAny); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	d2, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	drift, err := d2.Verify()
	if err != nil || len(drift) > 0 {
		t.Fatalf("after adopting corrupted maps: %v, %v", drift, err)
	}
	got := d2.Frontends()
	// The kernel is all adoption knows: f1 lost its last slot, f2 serves
	// what its slots say (f1's first backend) but under an id of its own.
	wantNow := map[Frontend][]string{
		f1: {"10.1.1.1:53", "10.1.1.2:53"},
		f2: {"10.1.1.1:53", "10.1.2.2:53"},
	}
	for f, w := range wantNow {
		if a := addrsOf(got[f], false); !slices.Equal(a, w) {
			t.Errorf("adopted %s = %v, want %v (had %v)", f, a, w, want[f])
		}
	}
	ids := map[uint32]Frontend{}
	for _, f := range []Frontend{f1, f2} {
		for _, m := range d2.fes[f].members {
			if other, dup := ids[m.id]; dup {
				t.Errorf("id %d held by %s and %s", m.id, other, f)
			}
			ids[m.id] = f
		}
	}
	if l := landings(t, d2, f2, 40, 9); len(l) != 2 || l["drop"] > 0 {
		t.Errorf("f2 after adoption: %v", l)
	}
}

// failOn makes the nth write (counting from 1) to map what fail, and
// every later one while sticky.
func failOn(d *Datapath, what string, nth int, sticky bool) *int {
	seen := 0
	d.writeFault = func(w string) error {
		if w != what {
			return nil
		}
		seen++
		if seen == nth || (sticky && seen > nth) {
			return errors.New("injected failure")
		}
		return nil
	}
	return &seen
}

// TestRollback fails writes at each step of a change: before the commit
// the previous set keeps serving and every pre-commit write is undone;
// undo failures and finishing failures are queued, reported, and retried
// by the next change.
func TestRollback(t *testing.T) {
	f := fe(vipUDP, UDP)
	a, b, c := be("10.1.0.1:53"), be("10.1.0.2:53"), be("10.1.0.3:53")
	start := func(t *testing.T) *Datapath {
		d := newDatapath(t, Options{})
		mustSet(t, d, f, a, b)
		return d
	}
	unchanged := func(t *testing.T, d *Datapath, err error, n int) {
		t.Helper()
		if err == nil || n == 0 {
			t.Fatalf("SetService = %d writes, %v; want a failure after some writes", n, err)
		}
		t.Logf("%d writes: %v", n, err)
		if got := addrsOf(d.Frontends()[f], false); !slices.Equal(got, []string{"10.1.0.1:53", "10.1.0.2:53"}) {
			t.Errorf("mirror changed: %v", got)
		}
		if l := landings(t, d, f, 40, 1); len(l) != 2 || l["drop"] > 0 {
			t.Errorf("previous set not serving: %v", l)
		}
	}

	t.Run("flip_fails_add_undone", func(t *testing.T) {
		d := start(t)
		failOn(d, "services", 1, false)
		n, err := d.SetBackends(f, []Backend{a, b, c})
		unchanged(t, d, err, n)
		d.writeFault = nil
		checkConsistent(t, d)
		if u := d.Usage(); u.Pending != 0 || u.BackendIDs != 2 {
			t.Errorf("Usage = %+v, want nothing pending and 2 ids", u)
		}
	})
	t.Run("flip_fails_and_undo_fails_id_retired", func(t *testing.T) {
		d := start(t)
		// The add writes the slot, the newcomer's registry entry, then
		// flips; the flip fails, and so does clearing that entry.
		regWrites := 0
		d.writeFault = func(w string) error {
			switch w {
			case "services":
				return errors.New("injected flip failure")
			case "registry":
				if regWrites++; regWrites == 2 {
					return errors.New("injected undo failure")
				}
			}
			return nil
		}
		n, err := d.SetBackends(f, []Backend{a, b, c})
		unchanged(t, d, err, n)
		if msg := err.Error(); !strings.Contains(msg, "injected flip failure") || !strings.Contains(msg, "undo: write registry: injected undo failure") {
			t.Errorf("error does not join the flip and undo failures: %v", err)
		}
		d.writeFault = nil
		if u := d.Usage(); u.Pending != 1 || u.BackendIDs != 3 {
			t.Errorf("Usage = %+v, want one id queued to retire (3 ids held)", u)
		}
		checkConsistent(t, d) // the queued id is not an orphan
		mustSet(t, d, f, a, b)
		if u := d.Usage(); u.Pending != 0 || u.BackendIDs != 2 {
			t.Errorf("after retry Usage = %+v", u)
		}
		checkConsistent(t, d)
	})
	t.Run("hole_fill_fails_drain_undone", func(t *testing.T) {
		d := start(t)
		mustSet(t, d, f, a, b, c) // c last: draining a moves c into slot 0
		failOn(d, "backends", 1, false)
		n, err := d.SetService(f, Service{Backends: []Backend{drained(a), b, c}})
		if err == nil || n == 0 {
			t.Fatalf("drain = %d, %v", n, err)
		}
		d.writeFault = nil
		checkConsistent(t, d) // registry restored to active
		if got := addrsOf(d.Frontends()[f], true); len(got) != 0 {
			t.Errorf("draining after a failed drain: %v", got)
		}
	})
	t.Run("slot_undo_fails_frontend_reprogrammed", func(t *testing.T) {
		d := start(t)
		mustSet(t, d, f, a, b, c)
		// Removing a moves c into its slot, then flips; the flip fails,
		// and so does moving a back.
		slotWrites := 0
		d.writeFault = func(w string) error {
			switch w {
			case "services":
				return errors.New("injected flip failure")
			case "backends":
				if slotWrites++; slotWrites == 2 {
					return errors.New("injected undo failure")
				}
			}
			return nil
		}
		n, err := d.SetBackends(f, []Backend{b, c})
		if err == nil || n == 0 {
			t.Fatalf("remove = %d, %v", n, err)
		}
		t.Log(err)
		d.writeFault = nil
		drift, verr := d.Verify()
		if verr != nil || !slices.Equal(kinds(drift), []DriftKind{DriftSlotWrong}) {
			t.Errorf("a failed undo should leave a wrong slot: %v %v", drift, verr)
		}
		if u := d.Usage(); u.Pending != 1 {
			t.Errorf("Usage = %+v, want the frontend queued", u)
		}
		mustSet(t, d, f, a, b, c) // no change of its own; the retry reprograms
		checkConsistent(t, d)
		if u := d.Usage(); u.Pending != 0 {
			t.Errorf("Usage after retry = %+v", u)
		}
	})
	t.Run("release_fails_after_commit_then_retried", func(t *testing.T) {
		d := start(t)
		// A flow pinned to b, which is then removed but not released.
		src := srcFor(t, "10.0.3.3", f, 1, 2, 100)
		if got := sendTC(t, d, src, f); got != b.Addr {
			t.Fatalf("flow went to %s, want %s", got, b.Addr)
		}
		failOn(d, "backend_stats", 1, false)
		n, err := d.SetBackends(f, []Backend{a})
		if err == nil || n != 2 {
			t.Fatalf("remove = %d writes, %v; want 2 (flip, release) and the release error", n, err)
		}
		d.writeFault = nil
		if got := addrsOf(d.Frontends()[f], false); !slices.Equal(got, []string{"10.1.0.1:53"}) {
			t.Errorf("committed change not in the mirror: %v", got)
		}
		if got := sendTC(t, d, src, f); got != b.Addr {
			t.Errorf("unreleased backend's flow moved to %s before the retry", got)
		}
		checkConsistent(t, d)
		if n := mustSet(t, d, f, a); n != 1 {
			t.Errorf("retry took %d writes, want the one release", n)
		}
		mustFlushStale(t, d)
		if got := sendTC(t, d, src, f); got != a.Addr {
			t.Errorf("after the retried release the flow went to %s", got)
		}
		if u := d.Usage(); u.Pending != 0 || u.BackendIDs != 1 {
			t.Errorf("Usage = %+v", u)
		}
	})
}

// TestCountersNeverGoBackwards removes backends that carried traffic: the
// frontend's totals keep their packets.
func TestCountersNeverGoBackwards(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipUDP, UDP)
	mustSet(t, d, f, be("10.1.0.1:53"), be("10.1.0.2:53"), be("10.1.0.3:53"))
	landings(t, d, f, 90, 1)
	before, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if before.Frontends[f].Packets != 90 || before.Frontends[f].Flows != 90 {
		t.Fatalf("counted %+v, want 90 flows and packets", before.Frontends[f])
	}
	for _, set := range [][]Backend{
		{be("10.1.0.1:53"), be("10.1.0.2:53")},
		{be("10.1.0.1:53"), drained(be("10.1.0.2:53"))},
		{be("10.1.0.4:53")},
	} {
		mustSetService(t, d, f, Service{Backends: set})
		c, err := d.Counters()
		if err != nil {
			t.Fatal(err)
		}
		if c.Frontends[f] != before.Frontends[f] {
			t.Errorf("after %v: %+v, was %+v", set, c.Frontends[f], before.Frontends[f])
		}
		if len(c.Backends[f]) != len(set) {
			t.Errorf("per-backend counts for %v: %v", set, c.Backends[f])
		}
	}
	landings(t, d, f, 10, 2)
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Frontends[f].Packets != 100 || c.Backends[f][netip.MustParseAddrPort("10.1.0.4:53")] != 10 {
		t.Errorf("after 10 more: %+v, %v", c.Frontends[f], c.Backends[f])
	}
}

// TestDriftKindsComplete: DriftKinds lists every DriftKind constant of
// verify.go once, so the metrics export each kind from the start.
func TestDriftKindsComplete(t *testing.T) {
	src, err := os.ReadFile("verify.go")
	if err != nil {
		t.Fatal(err)
	}
	var consts []DriftKind
	for _, m := range regexp.MustCompile(`(?m)^\s+Drift\w+ DriftKind = "([a-z_]+)"$`).FindAllSubmatch(src, -1) {
		consts = append(consts, DriftKind(m[1]))
	}
	if len(consts) < 10 {
		t.Fatalf("found %d DriftKind constants in verify.go, expected more", len(consts))
	}
	got := slices.Clone(DriftKinds)
	slices.Sort(got)
	slices.Sort(consts)
	if !slices.Equal(got, consts) {
		t.Errorf("DriftKinds %v, the constants are %v", got, consts)
	}
}
