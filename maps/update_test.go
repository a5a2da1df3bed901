package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cilium/ebpf"
)

// kernelSlots counts the entries of the backends map.
func kernelSlots(t *testing.T, d *Datapath) int {
	t.Helper()
	var (
		k tcBackendKey
		v tcBackendValue
		n int
	)
	it := d.backends.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// checkConsistent asserts that the kernel holds what the mirror says.
func checkConsistent(t *testing.T, d *Datapath) {
	t.Helper()
	dump, err := d.Dump()
	if err != nil {
		t.Fatalf("Dump: %v", err)
	}
	if mirror := d.Frontends(); fmt.Sprint(dump) != fmt.Sprint(mirror) {
		t.Fatalf("kernel and mirror differ\nkernel %v\nmirror %v", dump, mirror)
	}
}

func addrs(bs []Backend) []string {
	var out []string
	for _, b := range bs {
		out = append(out, b.Addr.String())
	}
	slices.Sort(out)
	return out
}

func TestSetBackendsWrites(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipTCP, TCP)
	a, b, c, dd, e := be("10.1.0.1:80"), be("10.1.0.2:80"), be("10.1.0.3:80"), be("10.1.0.4:80"), be("10.1.0.5:80")
	local := dd
	local.NodeLocal, local.ZoneLocal = true, true
	f2, g := be("10.1.0.6:80"), be("10.1.0.7:80")

	steps := []struct {
		name   string
		set    []Backend
		writes int // -1: a full rewrite, checked by the stale count only
	}{
		{"create_with_three", []Backend{a, b, c}, 3 + 3 + 1},
		{"same_set_other_order_and_duplicates", []Backend{c, a, b, a}, 0},
		{"add_one", []Backend{a, b, c, dd}, 3},
		{"remove_middle", []Backend{a, c, dd}, 3},
		{"remove_last_slot", []Backend{a, dd}, 2},
		{"replace_one", []Backend{e, dd}, 2},
		{"flags_of_one", []Backend{e, local}, 1},
		{"add_after_remove_reuses_stale_slot", []Backend{e, local, b}, 3},
		{"two_added_is_a_rewrite", []Backend{e, local, b, f2, g}, -1},
		{"to_empty", nil, -1},
		{"from_empty_add_one", []Backend{a}, 3},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			n, err := d.SetBackends(f, s.set)
			if err != nil {
				t.Fatal(err)
			}
			if s.writes >= 0 && n != s.writes {
				t.Errorf("writes = %d, want %d", n, s.writes)
			}
			t.Logf("%d writes", n)
			checkConsistent(t, d)
			got := d.Frontends()[f]
			want, _ := normalizeSet(s.set)
			if !slices.Equal(addrs(got), addrs(want)) {
				t.Errorf("backends = %v, want %v", got, want)
			}
			if s.writes < 0 {
				// A rewrite leaves no stale slot behind.
				if k := kernelSlots(t, d); k != len(want) {
					t.Errorf("backends map holds %d entries after a rewrite, want %d", k, len(want))
				}
			}
		})
	}
	if got := d.Frontends()[f][0]; got != a {
		t.Errorf("flags lost: %+v", got)
	}

	n, err := d.DeleteFrontend(f)
	if err != nil || n == 0 {
		t.Fatalf("DeleteFrontend = %d, %v", n, err)
	}
	if n, err := d.DeleteFrontend(f); err != nil || n != 0 {
		t.Errorf("second DeleteFrontend = %d, %v; want 0, nil", n, err)
	}
	checkConsistent(t, d)
	if k := kernelSlots(t, d); k != 0 {
		t.Errorf("backends map holds %d entries after delete", k)
	}
	if fr, _, bk, _ := d.Capacity(); fr != 0 || bk != 0 {
		t.Errorf("Capacity = %d frontends, %d backends after delete", fr, bk)
	}
}

func TestSetBackendsFlagsRoundTrip(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipUDP, UDP)
	want := []Backend{
		{Addr: netip.MustParseAddrPort("10.1.0.1:53"), NodeLocal: true},
		{Addr: netip.MustParseAddrPort("10.1.0.2:53"), ZoneLocal: true},
		{Addr: netip.MustParseAddrPort("10.1.0.3:53"), NodeLocal: true, ZoneLocal: true},
		{Addr: netip.AddrPortFrom(netip.MustParseAddr("::ffff:10.1.0.4"), 53)},
	}
	mustSet(t, d, f, want...)
	dump, err := d.Dump()
	if err != nil {
		t.Fatal(err)
	}
	want[3].Addr = netip.MustParseAddrPort("10.1.0.4:53")
	if !slices.Equal(dump[f], want) {
		t.Errorf("Dump = %v, want %v", dump[f], want)
	}
}

func TestInvalidInputWritesNothing(t *testing.T) {
	d := newDatapath(t, Options{})
	good := fe(vipTCP, TCP)
	mustSet(t, d, good, be(beTCP))
	cases := []struct {
		name string
		fe   Frontend
		bs   []Backend
	}{
		{"ipv6_frontend", fe("[fd00::1]:80", TCP), nil},
		{"icmp_frontend", fe(vipTCP, 1), nil},
		{"sctp_frontend", fe(vipTCP, 132), nil},
		{"port_zero_frontend", fe("10.96.0.10:0", TCP), nil},
		{"unset_frontend", Frontend{Proto: TCP}, nil},
		{"unspecified_frontend", fe("0.0.0.0:80", TCP), nil},
		{"ipv6_backend", good, []Backend{be("[fd00::2]:80")}},
		{"port_zero_backend", good, []Backend{be("10.1.1.9:0")}},
		{"unset_backend", good, []Backend{{}}},
		{"conflicting_duplicates", good, []Backend{be("10.1.1.9:80"), {Addr: netip.MustParseAddrPort("10.1.1.9:80"), NodeLocal: true}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n, err := d.SetBackends(c.fe, c.bs)
			if err == nil || n != 0 {
				t.Fatalf("SetBackends = %d, %v; want an error and 0 writes", n, err)
			}
			if errors.Is(err, ErrMapFull) {
				t.Errorf("invalid input reported as ErrMapFull: %v", err)
			}
			t.Logf("%v", err)
			checkConsistent(t, d)
			if got := d.Frontends(); len(got) != 1 || len(got[good]) != 1 {
				t.Errorf("state changed: %v", got)
			}
		})
	}
	if _, err := d.DeleteFrontend(fe("[fd00::1]:80", TCP)); err == nil {
		t.Error("DeleteFrontend accepted an IPv6 frontend")
	}
}

func TestMapFullKeepsPreviousSet(t *testing.T) {
	d := newDatapath(t, Options{MaxFrontends: 2, MaxBackends: 4})
	f1, f2, f3 := fe("10.96.0.1:80", TCP), fe("10.96.0.2:80", TCP), fe("10.96.0.3:80", TCP)
	mustSet(t, d, f1, be("10.1.0.1:80"), be("10.1.0.2:80"))
	mustSet(t, d, f2, be("10.1.0.3:80"))
	before := d.Frontends()

	if n, err := d.SetBackends(f3, nil); !errors.Is(err, ErrMapFull) || n != 0 {
		t.Errorf("third frontend: %d, %v; want ErrMapFull, 0 writes", n, err)
	}
	if n, err := d.SetBackends(f2, []Backend{be("10.1.0.3:80"), be("10.1.0.4:80"), be("10.1.0.5:80")}); !errors.Is(err, ErrMapFull) || n != 0 {
		t.Errorf("fifth backend: %d, %v; want ErrMapFull, 0 writes", n, err)
	}
	checkConsistent(t, d)
	if got := d.Frontends(); fmt.Sprint(got) != fmt.Sprint(before) {
		t.Errorf("state changed after ErrMapFull: %v, was %v", got, before)
	}
	if fr, frMax, bk, bkMax := d.Capacity(); fr != 2 || frMax != 2 || bk != 3 || bkMax != 4 {
		t.Errorf("Capacity = %d/%d frontends, %d/%d backends", fr, frMax, bk, bkMax)
	}
	// Swapping within capacity still works, and churn never runs the
	// double-buffered map out of room.
	for i := 0; i < 50; i++ {
		set := []Backend{be(fmt.Sprintf("10.2.%d.1:80", i)), be(fmt.Sprintf("10.2.%d.2:80", i)), be(fmt.Sprintf("10.2.%d.3:80", i))}
		mustSet(t, d, f1, set[:1+i%3]...)
	}
	checkConsistent(t, d)
}

// sendNew runs the first packet of flow src -> f through tc and returns
// where it went (the zero AddrPort when it was not rewritten).
func sendTC(t *testing.T, d *Datapath, src string, f Frontend) netip.AddrPort {
	t.Helper()
	var in frame
	if f.Proto == TCP {
		in = tcpFrame(src, f.Addr.String(), tcpACK, "x")
	} else {
		in = udpFrame(src, f.Addr.String(), "x")
	}
	ret, out := run(t, d.tcProg, in.bytes())
	if ret != tcOK {
		t.Fatalf("flow %s -> %s: verdict %d", src, f, ret)
	}
	p, err := verifyChecksums(out)
	if err != nil {
		t.Fatal(err)
	}
	if p.dst == f.Addr {
		return netip.AddrPort{}
	}
	return p.dst
}

func TestConntrackFollowsPermission(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipTCP, TCP)
	a, b, c := be("10.1.0.1:80"), be("10.1.0.2:80"), be("10.1.0.3:80")
	mustSet(t, d, f, a, b)

	// A flow that a fresh hash over [a b c] would send elsewhere, so
	// staying put proves the conntrack pin.
	var src string
	for port := 30000; ; port++ {
		src = fmt.Sprintf("10.0.0.9:%d", port)
		ap := netip.MustParseAddrPort(src)
		if slotOf(ap, f.Addr, protoTCP, 2) == 0 && slotOf(ap, f.Addr, protoTCP, 3) != 0 {
			break
		}
	}
	if got := sendTC(t, d, src, f); got != a.Addr {
		t.Fatalf("new flow went to %s, hash predicts %s", got, a.Addr)
	}

	mustSet(t, d, f, a, b, c)
	if got := sendTC(t, d, src, f); got != a.Addr {
		t.Errorf("after adding %s the flow moved to %s", c.Addr, got)
	}
	mustSet(t, d, f, a, c)
	if got := sendTC(t, d, src, f); got != a.Addr {
		t.Errorf("after removing %s the flow moved to %s", b.Addr, got)
	}
	mustSet(t, d, f, c, b, a, be("10.1.0.4:80")) // a full rewrite keeping a
	if got := sendTC(t, d, src, f); got != a.Addr {
		t.Errorf("after a rewrite keeping %s the flow moved to %s", a.Addr, got)
	}

	mustSet(t, d, f, c, b, be("10.1.0.4:80"))
	moved := sendTC(t, d, src, f)
	if moved == a.Addr || moved == (netip.AddrPort{}) {
		t.Fatalf("after removing its backend the flow went to %q", moved)
	}
	mustSet(t, d, f, c, b, be("10.1.0.4:80"), a)
	if got := sendTC(t, d, src, f); got != moved {
		t.Errorf("re-adding %s pulled the flow from %s to %s", a.Addr, moved, got)
	}

	// Replacing the flow's backend in place moves it too.
	var set []Backend
	for _, x := range d.Frontends()[f] {
		if x.Addr != moved {
			set = append(set, x)
		}
	}
	replacement := be("10.1.0.9:80")
	set = append(set, replacement)
	if n := mustSet(t, d, f, set...); n != 2 {
		t.Errorf("replace took %d writes, want 2", n)
	}
	if got := sendTC(t, d, src, f); got == moved {
		t.Errorf("flow still goes to replaced backend %s", moved)
	}

	// Once the frontend is gone its flows are no longer translated.
	if _, err := d.DeleteFrontend(f); err != nil {
		t.Fatal(err)
	}
	if got := sendTC(t, d, src, f); got.IsValid() {
		t.Errorf("flow of a deleted frontend still translated to %s", got)
	}
}

// TestUpdatesAreAtomic checks, packet by packet while a writer flips
// between sets, that every new flow lands exactly where one complete set
// sends it: a half-written set would show up as another slot.
func TestUpdatesAreAtomic(t *testing.T) {
	d := newDatapath(t, Options{MaxConntrack: 1 << 16})
	f := fe(vipUDP, UDP)
	s1 := []Backend{be("10.1.0.1:53"), be("10.1.0.2:53"), be("10.1.0.3:53")}
	s2 := []Backend{be("10.1.0.4:53"), be("10.1.0.5:53")}
	s3 := append(slices.Clone(s1), be("10.1.0.6:53")) // s1 plus one: the O(1) add
	mustSet(t, d, f, s1...)

	var stop atomic.Bool
	var wg sync.WaitGroup
	var flips int
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load(); i++ {
			next := [][]Backend{s2, s1, s3, s1}[i%4]
			if _, err := d.SetBackends(f, next); err != nil {
				t.Error(err)
				return
			}
			flips++
		}
	}()

	defer func() { stop.Store(true); wg.Wait() }()
	for i := 0; i < 20000; i++ {
		src := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 16), byte(i >> 8)}), uint16(1024+i%50000))
		in := udpFrame(src.String(), vipUDP, "q").bytes()
		ret, out := run(t, d.tcProg, in)
		if ret != tcOK {
			t.Fatalf("packet %d dropped (verdict %d)", i, ret)
		}
		p, err := verifyChecksums(out)
		if err != nil {
			t.Fatal(err)
		}
		ok := false
		for _, set := range [][]Backend{s1, s2, s3} {
			if p.dst == set[slotOf(src, f.Addr, protoUDP, len(set))].Addr {
				ok = true
			}
		}
		if !ok {
			t.Fatalf("packet %d from %s went to %s: not the slot of any complete set", i, src, p.dst)
		}
	}
	stop.Store(true)
	wg.Wait()
	t.Logf("%d set changes during the run", flips)
	c, _ := d.Counters()
	if c.Drops != (Drops{}) {
		t.Errorf("drops during churn: %+v", c.Drops)
	}
	checkConsistent(t, d)
}

func TestLoadAdoptsPinnedMaps(t *testing.T) {
	pin := filepath.Join(bpffs(t), "topolb")
	opts := Options{PinPath: pin, MaxFrontends: 64, MaxBackends: 256, MaxConntrack: 1024}
	d1 := newDatapath(t, opts)
	f1, f2 := fe(vipTCP, TCP), fe(vipUDP, UDP)
	mustSet(t, d1, f1, be("10.1.0.1:80"), be("10.1.0.2:80"), be("10.1.0.3:80"), be("10.1.0.4:80"))
	mustSet(t, d1, f2, be("10.1.0.9:53"))
	flowDst := sendTC(t, d1, client, f1)
	var keep []Backend
	for _, x := range d1.Frontends()[f1] {
		if x.Addr != flowDst && len(keep) < 2 {
			keep = append(keep, x)
		}
	}
	keep = append(keep, Backend{Addr: flowDst})
	mustSet(t, d1, f1, append(keep[:2:2], d1.Frontends()[f1]...)...) // no-op
	// Remove one backend other than the flow's: leaves a stale slot.
	var remaining []Backend
	for _, x := range d1.Frontends()[f1] {
		if x.Addr != keep[0].Addr {
			remaining = append(remaining, x)
		}
	}
	mustSet(t, d1, f1, remaining...)
	if k := kernelSlots(t, d1); k != 4+1 {
		t.Fatalf("expected one stale slot before reload, map holds %d", k)
	}
	want := d1.Frontends()
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}

	d2, err := Load(opts)
	if err != nil {
		t.Fatalf("reload: %v", err)
	}
	t.Cleanup(func() { d2.Close() })
	if got := d2.Frontends(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("adopted mirror = %v, want %v", got, want)
	}
	checkConsistent(t, d2)
	if k := kernelSlots(t, d2); k != 4 {
		t.Errorf("stale slot not collected at load: map holds %d entries, want 4", k)
	}
	if got := sendTC(t, d2, client, f1); got != flowDst {
		t.Errorf("flow moved across reload: %s, was %s", got, flowDst)
	}
	if n := mustSet(t, d2, f1, remaining...); n != 0 {
		t.Errorf("same set after reload took %d writes", n)
	}
	if n := mustSet(t, d2, f1, append(remaining, be("10.1.0.5:80"))...); n != 3 {
		t.Errorf("add after reload took %d writes, want 3", n)
	}
	checkConsistent(t, d2)

	t.Run("other_sizes_refused", func(t *testing.T) {
		other := opts
		other.MaxBackends = 512
		if d, err := Load(other); !errors.Is(err, ErrLayoutMismatch) {
			if d != nil {
				d.Close()
			}
			t.Fatalf("Load with other sizes: %v, want ErrLayoutMismatch", err)
		}
	})
	t.Run("other_layout_version_refused", func(t *testing.T) {
		if err := d2.meta.Update(uint32(0), tcMeta{LayoutVersion: layoutVersion + 1}, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
		defer d2.meta.Update(uint32(0), tcMeta{LayoutVersion: layoutVersion}, ebpf.UpdateAny)
		if d, err := Load(opts); !errors.Is(err, ErrLayoutMismatch) {
			if d != nil {
				d.Close()
			}
			t.Fatalf("Load over another layout version: %v, want ErrLayoutMismatch", err)
		}
	})
}

func TestLoadRejectsNonBPFFS(t *testing.T) {
	requirePrivileges(t)
	_, err := Load(Options{PinPath: t.TempDir()})
	if err == nil {
		t.Fatal("Load on a non-bpffs directory succeeded")
	}
	t.Log(err)
}
