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
	"time"

	"github.com/cilium/ebpf"
)

// kernelSlots counts the entries of the backends map.
func kernelSlots(t *testing.T, d *Datapath) int {
	t.Helper()
	return countEntries[tcBackendKey, tcBackendValue](t, d.backends)
}

// countEntries counts the entries of m, whose keys are K and values V.
func countEntries[K, V any](t *testing.T, m *ebpf.Map) int {
	t.Helper()
	var (
		k K
		v V
		n int
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// checkConsistent asserts that the kernel holds what the mirror says:
// Verify finds no drift and Dump reads back what Frontends reports.
func checkConsistent(t *testing.T, d *Datapath) {
	t.Helper()
	drift, err := d.Verify()
	if err != nil {
		t.Fatalf("Verify: %v", err)
	}
	for _, dr := range drift {
		t.Errorf("drift: %s", dr)
	}
	dump, err := d.Dump()
	if err != nil {
		t.Fatalf("Dump: %v", err)
	}
	if mirror := d.Frontends(); fmt.Sprint(dump) != fmt.Sprint(mirror) {
		t.Fatalf("kernel and mirror differ\nkernel %v\nmirror %v", dump, mirror)
	}
}

// addrsOf lists the addresses of bs with the given Draining, sorted.
func addrsOf(bs []Backend, draining bool) []string {
	out := []string{}
	for _, b := range bs {
		if b.Draining == draining {
			out = append(out, b.Addr.String())
		}
	}
	slices.Sort(out)
	return out
}

func drained(b Backend) Backend {
	b.Draining = true
	return b
}

func TestSetServiceWrites(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipTCP, TCP)
	a, b, c, dd, e := be("10.1.0.1:80"), be("10.1.0.2:80"), be("10.1.0.3:80"), be("10.1.0.4:80"), be("10.1.0.5:80")
	local := dd
	local.NodeLocal, local.ZoneLocal = true, true
	f2, g := be("10.1.0.6:80"), be("10.1.0.7:80")

	// active and draining list the addresses the step must leave
	// programmed, written out from the step's intent. writes -1 is a full
	// rewrite, checked by the stale count.
	steps := []struct {
		name             string
		svc              Service
		writes           int
		active, draining []string
	}{
		{"create_with_three", Service{Backends: []Backend{a, b, c}}, 3 + 3 + 1, []string{"10.1.0.1:80", "10.1.0.2:80", "10.1.0.3:80"}, nil},
		{"same_set_other_order_and_duplicates", Service{Backends: []Backend{c, a, b, a}}, 0, []string{"10.1.0.1:80", "10.1.0.2:80", "10.1.0.3:80"}, nil},
		{"add_one", Service{Backends: []Backend{a, b, c, dd}}, 3, []string{"10.1.0.1:80", "10.1.0.2:80", "10.1.0.3:80", "10.1.0.4:80"}, nil},
		{"remove_middle", Service{Backends: []Backend{a, c, dd}}, 3, []string{"10.1.0.1:80", "10.1.0.3:80", "10.1.0.4:80"}, nil},
		{"drain_middle", Service{Backends: []Backend{a, drained(dd), c}}, 3, []string{"10.1.0.1:80", "10.1.0.3:80"}, []string{"10.1.0.4:80"}},
		{"draining_again_is_a_no_op", Service{Backends: []Backend{drained(dd), c, a}}, 0, []string{"10.1.0.1:80", "10.1.0.3:80"}, []string{"10.1.0.4:80"}},
		{"draining_unknown_is_ignored", Service{Backends: []Backend{drained(dd), c, a, drained(g)}}, 0, []string{"10.1.0.1:80", "10.1.0.3:80"}, []string{"10.1.0.4:80"}},
		{"undrain", Service{Backends: []Backend{dd, a, c}}, 3, []string{"10.1.0.1:80", "10.1.0.3:80", "10.1.0.4:80"}, nil},
		{"drain_last_slot", Service{Backends: []Backend{drained(dd), a, c}}, 2, []string{"10.1.0.1:80", "10.1.0.3:80"}, []string{"10.1.0.4:80"}},
		{"draining_gone", Service{Backends: []Backend{a, c}}, 1, []string{"10.1.0.1:80", "10.1.0.3:80"}, nil},
		{"remove_last_slot", Service{Backends: []Backend{a}}, 2, []string{"10.1.0.1:80"}, nil},
		{"add_back", Service{Backends: []Backend{a, dd}}, 3, []string{"10.1.0.1:80", "10.1.0.4:80"}, nil},
		{"replace_one_gone", Service{Backends: []Backend{e, dd}}, 3, []string{"10.1.0.4:80", "10.1.0.5:80"}, nil},
		{"rolling_update_replace_one_draining", Service{Backends: []Backend{drained(e), dd, b}}, 3, []string{"10.1.0.2:80", "10.1.0.4:80"}, []string{"10.1.0.5:80"}},
		{"flags_of_one", Service{Backends: []Backend{drained(e), local, b}}, 2, []string{"10.1.0.2:80", "10.1.0.4:80"}, []string{"10.1.0.5:80"}},
		{"affinity_on", Service{Backends: []Backend{drained(e), local, b}, Affinity: DefaultAffinityTimeout}, 1, []string{"10.1.0.2:80", "10.1.0.4:80"}, []string{"10.1.0.5:80"}},
		{"add_with_settings_change", Service{Backends: []Backend{drained(e), local, b, a}}, 3, []string{"10.1.0.1:80", "10.1.0.2:80", "10.1.0.4:80"}, []string{"10.1.0.5:80"}},
		{"two_added_is_a_rewrite", Service{Backends: []Backend{drained(e), local, b, a, f2, g}}, -1, []string{"10.1.0.1:80", "10.1.0.2:80", "10.1.0.4:80", "10.1.0.6:80", "10.1.0.7:80"}, []string{"10.1.0.5:80"}},
		{"weights_are_a_rewrite", Service{Backends: []Backend{local, withWeight(b, 2), a}}, -1, []string{"10.1.0.1:80", "10.1.0.2:80", "10.1.0.4:80"}, nil},
		{"to_empty", Service{}, -1, nil, nil},
		{"from_empty_add_one", Service{Backends: []Backend{a}}, 3, []string{"10.1.0.1:80"}, nil},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			n, err := d.SetService(f, s.svc)
			if err != nil {
				t.Fatal(err)
			}
			if s.writes >= 0 && n != s.writes {
				t.Errorf("writes = %d, want %d", n, s.writes)
			}
			t.Logf("%d writes", n)
			checkConsistent(t, d)
			got := d.Frontends()[f]
			if a := addrsOf(got, false); !slices.Equal(a, append([]string{}, s.active...)) {
				t.Errorf("active = %v, want %v", a, s.active)
			}
			if dr := addrsOf(got, true); !slices.Equal(dr, append([]string{}, s.draining...)) {
				t.Errorf("draining = %v, want %v", dr, s.draining)
			}
			if s.writes < 0 {
				slots := 0
				for _, x := range got {
					slots += int(x.Weight)
				}
				// A rewrite leaves no stale slot behind.
				if k := kernelSlots(t, d); k != slots {
					t.Errorf("backends map holds %d entries after a rewrite, want %d", k, slots)
				}
			}
		})
	}
	if got := d.Frontends()[f]; len(got) != 1 || got[0] != withWeight(a, 1) {
		t.Errorf("backend read back as %+v, want %+v", got, withWeight(a, 1))
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
	if u := d.Usage(); u.Frontends != 0 || u.Slots != 0 || u.BackendIDs != 0 || u.Pending != 0 {
		t.Errorf("Usage after delete = %+v", u)
	}
}

func withWeight(b Backend, w uint32) Backend {
	b.Weight = w
	return b
}

func TestSetServiceRoundTrip(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipUDP, UDP)
	in := Service{
		Backends: []Backend{
			{Addr: netip.MustParseAddrPort("10.1.0.1:53"), NodeLocal: true},
			{Addr: netip.MustParseAddrPort("10.1.0.2:53"), ZoneLocal: true},
			{Addr: netip.MustParseAddrPort("10.1.0.3:53"), NodeLocal: true, ZoneLocal: true},
			{Addr: netip.AddrPortFrom(netip.MustParseAddr("::ffff:10.1.0.4"), 53)},
		},
		Affinity: 90*time.Second + time.Millisecond, // rounded up to 91 s
		Reject:   true,
	}
	mustSetService(t, d, f, in)
	in.Backends[0].Draining = true
	mustSetService(t, d, f, in)
	// What the datapath stores, written out: weights as slot counts, the
	// 4-in-6 address plain.
	want := []Backend{
		{Addr: netip.MustParseAddrPort("10.1.0.1:53"), NodeLocal: true, Draining: true},
		{Addr: netip.MustParseAddrPort("10.1.0.2:53"), ZoneLocal: true, Weight: 1},
		{Addr: netip.MustParseAddrPort("10.1.0.3:53"), NodeLocal: true, ZoneLocal: true, Weight: 1},
		{Addr: netip.MustParseAddrPort("10.1.0.4:53"), Weight: 1},
	}
	prog, err := d.Programmed()
	if err != nil {
		t.Fatal(err)
	}
	ps := prog[f]
	var got []Backend
	for _, b := range ps.Backends {
		got = append(got, b.Backend)
	}
	byAddr := func(a, b Backend) int { return a.Addr.Compare(b.Addr) }
	slices.SortFunc(got, byAddr)
	slices.SortFunc(want, byAddr)
	if !slices.Equal(got, want) {
		t.Errorf("Programmed backends = %v, want %v", got, want)
	}
	if ps.Affinity != 91*time.Second || !ps.Reject || ps.Slots != 3 || len(ps.Problems) != 0 {
		t.Errorf("Programmed = %+v", ps)
	}
	svc := d.Services()[f]
	slices.SortFunc(svc.Backends, byAddr)
	if svc.Affinity != 91*time.Second || !svc.Reject || !slices.Equal(svc.Backends, want) {
		t.Errorf("Services = %+v", svc)
	}
	checkConsistent(t, d)
}

// TestSetServiceRoundTripIPv6 programs an IPv6 frontend with IPv6
// backends, source ranges and affinity, and reads back what it wrote:
// the 16-byte addresses of layout 5 carry either family.
func TestSetServiceRoundTripIPv6(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe("[fd00:96::53]:53", UDP)
	in := Service{
		Backends: []Backend{
			{Addr: netip.MustParseAddrPort("[fd00:1::1]:53"), NodeLocal: true},
			{Addr: netip.MustParseAddrPort("[fd00:1::2]:53")},
		},
		Affinity:     time.Minute,
		SourceRanges: []netip.Prefix{netip.MustParsePrefix("fd00:9::/64")},
	}
	mustSetService(t, d, f, in)
	in.Backends[1].Draining = true
	mustSetService(t, d, f, in)
	prog, err := d.Programmed()
	if err != nil {
		t.Fatal(err)
	}
	ps, ok := prog[f]
	if !ok {
		t.Fatalf("Programmed has no %s: %v", f, prog)
	}
	var got []Backend
	for _, b := range ps.Backends {
		got = append(got, b.Backend)
	}
	want := []Backend{
		{Addr: netip.MustParseAddrPort("[fd00:1::1]:53"), NodeLocal: true, Weight: 1},
		{Addr: netip.MustParseAddrPort("[fd00:1::2]:53"), Draining: true},
	}
	byAddr := func(a, b Backend) int { return a.Addr.Compare(b.Addr) }
	slices.SortFunc(got, byAddr)
	if !slices.Equal(got, want) {
		t.Errorf("Programmed backends = %v, want %v", got, want)
	}
	if ps.Affinity != time.Minute || ps.Slots != 1 || len(ps.Problems) != 0 {
		t.Errorf("Programmed = %+v", ps)
	}
	checkConsistent(t, d)
}

func mustSetService(t testing.TB, d *Datapath, f Frontend, s Service) int {
	t.Helper()
	n, err := d.SetService(f, s)
	if err != nil {
		t.Fatalf("SetService(%s): %v", f, err)
	}
	return n
}

func TestInvalidInputWritesNothing(t *testing.T) {
	d := newDatapath(t, Options{})
	good := fe(vipTCP, TCP)
	mustSet(t, d, good, be(beTCP))
	cases := []struct {
		name string
		fe   Frontend
		svc  Service
	}{
		{"zoned_frontend", fe("[fe80::1%eth0]:80", TCP), Service{}},
		{"ipv4_backend_of_ipv6_frontend", fe("[fd00::1]:80", TCP), Service{Backends: []Backend{be(beTCP)}}},
		{"icmp_frontend", fe(vipTCP, 1), Service{}},
		{"sctp_frontend", fe(vipTCP, 132), Service{}},
		{"port_zero_frontend", fe("10.96.0.10:0", TCP), Service{}},
		{"unset_frontend", Frontend{Proto: TCP}, Service{}},
		{"unspecified_frontend", fe("0.0.0.0:80", TCP), Service{}},
		{"unknown_scope", Frontend{Addr: netip.MustParseAddrPort(vipTCP), Proto: TCP, Scope: 7}, Service{}},
		{"ipv6_backend", good, Service{Backends: []Backend{be("[fd00::2]:80")}}},
		{"port_zero_backend", good, Service{Backends: []Backend{be("10.1.1.9:0")}}},
		{"unset_backend", good, Service{Backends: []Backend{{}}}},
		{"conflicting_duplicates", good, Service{Backends: []Backend{be("10.1.1.9:80"), {Addr: netip.MustParseAddrPort("10.1.1.9:80"), NodeLocal: true}}}},
		{"duplicate_draining_and_active", good, Service{Backends: []Backend{be("10.1.1.9:80"), drained(be("10.1.1.9:80"))}}},
		{"negative_affinity", good, Service{Backends: []Backend{be(beTCP)}, Affinity: -time.Second}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n, err := d.SetService(c.fe, c.svc)
			if err == nil || n != 0 {
				t.Fatalf("SetService = %d, %v; want an error and 0 writes", n, err)
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
	if _, err := d.DeleteFrontend(fe("[fe80::1%eth0]:80", TCP)); err == nil {
		t.Error("DeleteFrontend accepted a zoned frontend")
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
	// Draining keeps an id: three ids plus two new ones is five.
	if n, err := d.SetService(f2, Service{Backends: []Backend{drained(be("10.1.0.3:80")), be("10.1.0.4:80"), be("10.1.0.5:80")}}); !errors.Is(err, ErrMapFull) || n != 0 {
		t.Errorf("fifth id: %d, %v; want ErrMapFull, 0 writes", n, err)
	}
	// A weighted table over two backends takes more slots than exist.
	if n, err := d.SetBackends(f1, []Backend{withWeight(be("10.1.0.1:80"), 1), withWeight(be("10.1.0.2:80"), 1000)}); !errors.Is(err, ErrMapFull) || n != 0 {
		t.Errorf("weighted table: %d, %v; want ErrMapFull, 0 writes", n, err)
	}
	checkConsistent(t, d)
	if got := d.Frontends(); fmt.Sprint(got) != fmt.Sprint(before) {
		t.Errorf("state changed after ErrMapFull: %v, was %v", got, before)
	}
	if fr, frMax, bk, bkMax := d.Capacity(); fr != 2 || frMax != 2 || bk != 3 || bkMax != 4 {
		t.Errorf("Capacity = %d/%d frontends, %d/%d backends", fr, frMax, bk, bkMax)
	}
	// Swapping within capacity still works, and churn never runs the
	// double-buffered map out of room. A change takes the ids of its new
	// backends before it releases the old ones: with f2 gone, f1 can swap
	// two backends for two others.
	if _, err := d.DeleteFrontend(f2); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		set := []Backend{be(fmt.Sprintf("10.2.%d.1:80", i)), be(fmt.Sprintf("10.2.%d.2:80", i))}
		mustSet(t, d, f1, set[:1+i%2]...)
	}
	checkConsistent(t, d)
	if u := d.Usage(); u.Slots != 2 || u.BackendIDs != 2 {
		t.Errorf("Usage after churn = %+v, want 2 slots and 2 ids", u)
	}
}

// sendTC runs one packet of flow src -> f through tc and returns where it
// went (the zero AddrPort when it was not rewritten).
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

func TestConntrackFollowsBackendState(t *testing.T) {
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
	mustSetService(t, d, f, Service{Backends: []Backend{c, b, be("10.1.0.4:80"), drained(a)}})
	if got := sendTC(t, d, src, f); got != a.Addr {
		t.Errorf("after draining %s the flow moved to %s", a.Addr, got)
	}

	mustSet(t, d, f, c, b, be("10.1.0.4:80"))
	mustFlushStale(t, d)
	moved := sendTC(t, d, src, f)
	if moved == a.Addr || moved == (netip.AddrPort{}) {
		t.Fatalf("after its backend was gone the flow went to %q", moved)
	}
	mustSet(t, d, f, c, b, be("10.1.0.4:80"), a)
	if got := sendTC(t, d, src, f); got != moved {
		t.Errorf("re-adding %s pulled the flow from %s to %s", a.Addr, moved, got)
	}

	// Replacing the flow's backend in place moves it too.
	var set []Backend
	for _, x := range d.Frontends()[f] {
		if x.Addr != moved {
			set = append(set, be(x.Addr.String()))
		}
	}
	set = append(set, be("10.1.0.9:80"))
	if n := mustSet(t, d, f, set...); n != 3 {
		t.Errorf("replace took %d writes, want 3", n)
	}
	mustFlushStale(t, d)
	if got := sendTC(t, d, src, f); got == moved {
		t.Errorf("flow still goes to replaced backend %s", moved)
	}

	// Once the frontend is gone its flows are no longer translated.
	if _, err := d.DeleteFrontend(f); err != nil {
		t.Fatal(err)
	}
	mustFlushStale(t, d)
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
	s3 := append(slices.Clone(s1), be("10.1.0.6:53")) // s1 plus one: the three-write add
	mustSet(t, d, f, s1...)

	var (
		stop  atomic.Bool
		wg    sync.WaitGroup
		flips atomic.Int64
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load(); i++ {
			next := [][]Backend{s2, s1, s3, s1}[i%4]
			if _, err := d.SetBackends(f, next); err != nil {
				t.Error(err)
				return
			}
			flips.Add(1)
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
	n := flips.Load()
	t.Logf("%d set changes during the run", n)
	if n < 8 {
		t.Fatalf("only %d set changes happened during the run: the race was not exercised", n)
	}
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Drops != (Drops{}) {
		t.Errorf("drops during churn: %+v", c.Drops)
	}
	checkConsistent(t, d)
}

func TestLoadAdoptsPinnedMaps(t *testing.T) {
	pin := filepath.Join(bpffs(t), "topolb")
	opts := Options{PinPath: pin, MaxFrontends: 64, MaxBackends: 256, MaxConntrack: 1024}
	d1 := newDatapath(t, opts)
	f1, f2, f3 := fe(vipTCP, TCP), fe(vipUDP, UDP), Frontend{Addr: netip.MustParseAddrPort(vipTCP), Proto: TCP, Scope: ScopeExternal}
	mustSet(t, d1, f1, be("10.1.0.1:80"), be("10.1.0.2:80"), be("10.1.0.3:80"), be("10.1.0.4:80"))
	mustSetService(t, d1, f2, Service{Backends: []Backend{be("10.1.0.9:53"), be("10.1.0.8:53")}, Affinity: time.Minute})
	mustSet(t, d1, f3, withWeight(be("10.1.0.5:80"), 3), be("10.1.0.6:80"))
	mustSetService(t, d1, f2, Service{Backends: []Backend{be("10.1.0.9:53"), drained(be("10.1.0.8:53"))}, Affinity: time.Minute})
	flowDst := sendTC(t, d1, client, f1)
	// Remove one backend other than the flow's: leaves a stale slot.
	var remaining []Backend
	removed := false
	for _, x := range d1.Frontends()[f1] {
		if x.Addr != flowDst && !removed {
			removed = true
			continue
		}
		remaining = append(remaining, be(x.Addr.String()))
	}
	mustSet(t, d1, f1, remaining...)
	want := d1.Frontends()
	live := 0
	for _, bs := range want {
		for _, b := range bs {
			live += int(b.Weight)
		}
	}
	if live != 3+1+4 {
		t.Fatalf("%d live slots, want 8", live)
	}
	if k := kernelSlots(t, d1); k <= live {
		t.Fatalf("expected stale slots before reload, map holds %d entries for %d live slots", k, live)
	}
	wantSvc := d1.Services()

	t.Run("second_load_refused_while_locked", func(t *testing.T) {
		before := kernelSlots(t, d1)
		d, err := Load(opts)
		if !errors.Is(err, ErrLocked) {
			if d != nil {
				d.Close()
			}
			t.Fatalf("second Load on a locked pin path: %v, want ErrLocked", err)
		}
		t.Log(err)
		if after := kernelSlots(t, d1); after != before {
			t.Errorf("refused Load changed the backends map: %d entries, was %d", after, before)
		}
		checkConsistent(t, d1)
	})

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
	if got := d2.Services(); fmt.Sprint(got) != fmt.Sprint(wantSvc) {
		t.Errorf("adopted services = %v, want %v", got, wantSvc)
	}
	checkConsistent(t, d2)
	if k := kernelSlots(t, d2); k != live {
		t.Errorf("stale slots not collected at load: map holds %d entries, want %d", k, live)
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
	if n := mustSetService(t, d2, f2, Service{Backends: []Backend{be("10.1.0.9:53")}, Affinity: time.Minute}); n != 1 {
		t.Errorf("adopted draining backend gone: %d writes, want 1", n)
	}
	checkConsistent(t, d2)
	if err := d2.Close(); err != nil {
		t.Fatal(err)
	}

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
	for _, c := range []struct {
		name string
		meta tcMeta
	}{
		{"other_layout_version_refused", tcMeta{LayoutVersion: layoutVersion + 1}},
		{"same_version_other_fingerprint_refused", tcMeta{LayoutVersion: layoutVersion, Fingerprint: 0x5eed}},
		{"previous_version_other_fingerprint_refused", tcMeta{LayoutVersion: migrateFrom, Fingerprint: 0x5eed}},
		// Maps of this layout stamped as the previous one: the upgrade
		// finds keys of the wrong size and writes nothing.
		{"previous_layout_stamp_on_these_maps_refused", tcMeta{LayoutVersion: migrateFrom, Fingerprint: prevLayoutFingerprint}},
	} {
		t.Run(c.name, func(t *testing.T) {
			meta, err := ebpf.LoadPinnedMap(filepath.Join(pin, tcMapTlbMeta), nil)
			if err != nil {
				t.Fatal(err)
			}
			defer meta.Close()
			var orig tcMeta
			if err := meta.Lookup(uint32(0), &orig); err != nil {
				t.Fatal(err)
			}
			if err := meta.Update(uint32(0), c.meta, ebpf.UpdateAny); err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := meta.Update(uint32(0), orig, ebpf.UpdateAny); err != nil {
					t.Error(err)
				}
			}()
			if d, err := Load(opts); !errors.Is(err, ErrLayoutMismatch) {
				if d != nil {
					d.Close()
				}
				t.Fatalf("Load over %+v: %v, want ErrLayoutMismatch", c.meta, err)
			}
		})
	}
}

func TestLoadRejectsNonBPFFS(t *testing.T) {
	requirePrivileges(t)
	_, err := Load(Options{PinPath: t.TempDir()})
	if err == nil {
		t.Fatal("Load on a non-bpffs directory succeeded")
	}
	t.Log(err)
}
