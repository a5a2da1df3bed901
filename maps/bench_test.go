package maps

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

var (
	benchDatapath = flag.Bool("bench-datapath", false, "run BenchmarkDatapath and record its results in BENCHMARKS.md")
	benchRuns     = flag.Int("bench-runs", 400_000, "program runs per case, size and program (the case's and the baseline's)")
	benchRounds   = flag.Int("bench-rounds", 7, "interleaved rounds (baseline, floor, case) per row; medians are reported")
	benchHotRep   = flag.Int("bench-hot-repeat", 1000, "runs per test-run syscall in keys=hot rows")
	benchSizes    = flag.String("bench-sizes", "1,100000", "numbers of services")
	benchKeys     = flag.String("bench-keys", "hot,cold", "key patterns to measure (hot, cold)")
	benchRowsOnly = flag.String("bench-rows", "", "cases to measure, comma-separated (empty: every case); the others' flows are still set up")
	benchOut      = flag.String("bench-out", "../BENCHMARKS.md", "file whose generated datapath block receives the results (empty: print only)")
	// benchFlowsFlag established flows, spread over random services, are
	// what the keys=cold rows cycle through in random order.
	benchFlowsFlag = flag.Int("bench-flows", 65536, "established flows (and non-service frames) the keys=cold rows cycle through")
)

// Goals of issue 23, checked on every run: every *_hit row within
// goalFloorRatio of the floor measured beside it (the cost of one flow
// table lookup and the rewrite, floor.c), and the keys=cold ratio to the
// floor growing by at most goalGrowth from the smallest to the largest
// number of services.
const (
	goalFloorRatio = 1.25 // *_hit rows: ns_per_pkt / floor_ns
	goalGrowth     = 0.10 // keys=cold floor ratio growth from the smallest to the largest size
	// goalIPv6 (issue 19): an IPv6 row's ns per packet over its IPv4
	// twin's (ipv6Twins), measured in the same run.
	goalIPv6 = 1.15
)

// ipv6Twins are the IPv6 rows and the IPv4 row each is compared with.
var ipv6Twins = [][2]string{{"tc6_hit", "tc_hit"}, {"tc6_new_flow", "tc_new_flow"}, {"xdp6_hit", "xdp_hit"}}

// benchRow is one measured case at one size.
type benchRow struct {
	name, keys      string
	services        int
	ns, base, floor float64   // medians over rounds
	ratio           float64   // median of the rounds' ns / base
	floorRatio      float64   // median of the rounds' ns / floor
	noise           float64   // (max - min) / median of the rounds' floor ratios
	rounds          []float64 // each round's ns, in round order
	// twin, for an IPv6 row measured in the same rounds as its IPv4
	// twin (ipv6Twins): the twin's name and ns, the median of the
	// rounds' ns / twin's ns and that ratio's spread over its median.
	// Empty when the twin was not measured beside it.
	twin                         string
	twinNS, twinRatio, twinNoise float64
}

// BenchmarkDatapath measures each program under BPF_PROG_TEST_RUN against
// a parse-and-pass baseline and the floor (floor.c: one flow-table lookup
// and the rewrite) for the same hook, in interleaved rounds. Not a test:
// it runs only with -bench-datapath (make bench-datapath).
func BenchmarkDatapath(b *testing.B) {
	if !*benchDatapath {
		b.Skip("datapath benchmark runs with -args -bench-datapath (make bench-datapath)")
	}
	requirePrivileges(b)
	var sizes []int
	for _, s := range strings.Split(*benchSizes, ",") {
		var n int
		if _, err := fmt.Sscan(s, &n); err != nil || n < 1 {
			b.Fatalf("bad -bench-sizes %q", *benchSizes)
		}
		sizes = append(sizes, n)
	}
	var base baselineObjects
	if err := loadBaselineObjects(&base, nil); err != nil {
		b.Fatal(err)
	}
	defer base.Close()

	var (
		rows  []benchRow
		steps []stepRow
	)
	for _, n := range sizes {
		r, s := benchSize(b, n, base.TcBaseline, base.XdpBaseline, base.TcBaseline6, base.XdpBaseline6)
		rows, steps = append(rows, r...), append(steps, s...)
	}
	verdicts := append(benchVerdicts(rows), stepVerdicts(steps)...)
	for _, v := range verdicts {
		fmt.Println("BENCH datapath verdict", v)
	}
	if *benchOut != "" {
		if err := writeBenchmarks(*benchOut, rows, steps, verdicts); err != nil {
			b.Fatal(err)
		}
	}
}

// benchFrames builds test frames as patched copies of one template, so
// every frame of a case has the same shape as the baseline's.
type benchFrames struct {
	tmpl []byte
	rng  *rand.Rand
}

func (f *benchFrames) mk(src, dst netip.AddrPort) []byte {
	if src.Addr().Is6() {
		// The IPv4 template's shape, in IPv6.
		return tcpFrame(src.String(), dst.String(), tcpACK, "0123456789").bytes()
	}
	out := slices.Clone(f.tmpl)
	s, t := src.Addr().As4(), dst.Addr().As4()
	copy(out[26:30], s[:])
	copy(out[30:34], t[:])
	binary.BigEndian.PutUint16(out[34:], src.Port())
	binary.BigEndian.PutUint16(out[36:], dst.Port())
	// Checksums do not change the programs' cost, but keep them right
	// so a rewrite helper never sees a frame the kernel would refuse.
	fixChecksums(out)
	return out
}

func (f *benchFrames) client() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(f.rng.IntN(256)), byte(f.rng.IntN(256))}), uint16(1024+f.rng.IntN(60000)))
}

// client6 is client in IPv6: a random address of fd00::/112.
func (f *benchFrames) client6() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16([16]byte{0: 0xfd, 14: byte(f.rng.IntN(256)), 15: byte(f.rng.IntN(256))}), uint16(1024+f.rng.IntN(60000)))
}

// fixChecksums recomputes the IPv4 and TCP checksums of a frame built by
// tcpFrame after its addresses were patched.
func fixChecksums(b []byte) {
	ip := b[14:34]
	ip[10], ip[11] = 0, 0
	binary.BigEndian.PutUint16(ip[10:], csum(0, ip))
	tot := int(binary.BigEndian.Uint16(ip[2:]))
	l4 := b[34 : 14+tot]
	l4[16], l4[17] = 0, 0
	binary.BigEndian.PutUint16(l4[16:], csum(pseudo([4]byte(ip[12:16]), [4]byte(ip[16:20]), protoTCP, len(l4)), l4))
}

// destination returns where a rewritten frame (of either family, no IPv4
// options or IPv6 extension headers) goes.
func destination(b []byte) netip.AddrPort {
	if binary.BigEndian.Uint16(b[12:]) == 0x86dd {
		return netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[38:54])), binary.BigEndian.Uint16(b[56:]))
	}
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[30:34])), binary.BigEndian.Uint16(b[36:]))
}

func source(b []byte) netip.AddrPort {
	if binary.BigEndian.Uint16(b[12:]) == 0x86dd {
		return netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[22:38])), binary.BigEndian.Uint16(b[54:]))
	}
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[26:30])), binary.BigEndian.Uint16(b[34:]))
}

func benchSize(b *testing.B, services int, tcBase, xdpBase, tcBase6, xdpBase6 *ebpf.Program) ([]benchRow, []stepRow) {
	// Each service has two backends, in each family. The tc rows run
	// with the services as internal frontends of both families (n IPv4
	// and n IPv6 frontends, each family's flows in its own conntrack
	// table, so an IPv6 row is timed in the same rounds as its IPv4
	// twin); for the XDP rows they are replaced by external frontends
	// on other addresses, so each hook's rows see n frontends and 2n
	// backend ids per family.
	d := newDatapath(b, Options{
		MaxFrontends: uint32(2*services + 8),
		MaxBackends:  uint32(8*services + 8),
		// Holds the 2·benchFlows entries of one phase's cold rows
		// (tc flows, then XDP flows) without evicting; main measured with
		// the same size. One such table per family.
		MaxConntrack: max(DefaultMaxConntrack, uint32(4**benchFlowsFlag)),
	})
	f := &benchFrames{
		tmpl: tcpFrame("10.0.0.1:1", "10.96.0.0:80", tcpACK, "0123456789").bytes(),
		rng:  rand.New(rand.NewPCG(1, uint64(services))),
	}
	vips := make([]netip.AddrPort, services)
	extVIPs := make([]netip.AddrPort, services)
	vips6 := make([]netip.AddrPort, services)
	backends := func(i int) []Backend {
		return []Backend{
			be(fmt.Sprintf("10.%d.%d.%d:8080", 128+i>>16, byte(i>>8), byte(i))),
			be(fmt.Sprintf("10.%d.%d.%d:8081", 128+i>>16, byte(i>>8), byte(i))),
		}
	}
	backends6 := func(i int) []Backend {
		return []Backend{be(fmt.Sprintf("[fd01::%x:%x]:8080", i>>16, i&0xffff)), be(fmt.Sprintf("[fd01::%x:%x]:8081", i>>16, i&0xffff))}
	}
	// The XDP rows' backends are on this node (eTP Local, or a local
	// backend of eTP Cluster): DNAT without source translation, the
	// layout-2 rows' path.
	nodeLocal := func(backends func(i int) []Backend) func(i int) []Backend {
		return func(i int) []Backend {
			bs := backends(i)
			for j := range bs {
				bs[j].NodeLocal = true
			}
			return bs
		}
	}
	for i := range vips {
		port := uint16(80 + i>>16)
		vips[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)}), port)
		extVIPs[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{192, 168, byte(i >> 8), byte(i)}), port)
		vips6[i] = netip.AddrPortFrom(netip.AddrFrom16([16]byte{0: 0xfd, 1: 0x96, 14: byte(i >> 8), 15: byte(i)}), port)
		mustSet(b, d, Frontend{Addr: vips[i], Proto: TCP}, backends(i)...)
		mustSet(b, d, Frontend{Addr: vips6[i], Proto: TCP}, backends6(i)...)
	}
	// A hot flow's frontend translates to itself, so one frame can be run
	// many times per syscall (test runs do not restore a rewritten frame
	// between repeats) and still take the full hit path: conntrack hit,
	// validation, counting, the checksum helpers and the writes. Its port
	// equals the target port, so tc skips one of its three checksum helper
	// calls, as for every Service whose port is its targetPort.
	hotFE, hotFE6 := netip.MustParseAddrPort("10.95.0.1:80"), netip.MustParseAddrPort("[fd95::1]:80")
	hotExt, hotExt6 := netip.MustParseAddrPort("192.0.2.1:80"), netip.MustParseAddrPort("[2001:db8::1]:80")
	for _, fe := range []netip.AddrPort{hotFE, hotFE6} {
		mustSet(b, d, Frontend{Addr: fe, Proto: TCP}, Backend{Addr: fe})
	}
	for _, fe := range []netip.AddrPort{hotExt, hotExt6} {
		mustSet(b, d, Frontend{Addr: fe, Proto: TCP, Scope: ScopeExternal}, Backend{Addr: fe, NodeLocal: true})
	}
	hotClient, hotClient6 := netip.MustParseAddrPort("10.0.0.1:1000"), netip.MustParseAddrPort("[fd00::1]:1000")

	fl := loadFloorPrograms(b, d)
	floorFor := map[*ebpf.Program]*ebpf.Program{tcBase: fl.TcFloor, xdpBase: fl.XdpFloor, tcBase6: fl.TcFloor6, xdpBase6: fl.XdpFloor6}
	var (
		sp    stepPrograms
		steps []stepRow
	)
	if *benchSteps {
		sp = loadStepPrograms(b, d, fl)
	}
	// stepRows measures a step chain (bench_steps_test.go) when -bench-steps
	// and the key pattern ask for it.
	hitSteps := func(name, keys string, real, base *ebpf.Program, frames [][]byte, repeat int) {
		if sp == nil || !slices.Contains(strings.Split(*benchKeys, ","), keys) || !benchRowSelected(name) {
			return
		}
		steps = append(steps, hitStepRows(b, name, keys, services, base, real, sp, base == xdpBase, frames, repeat)...)
	}

	runs := *benchRuns
	flows := *benchFlowsFlag
	var rows []benchRow
	// row measures the cases (a case alone, or an IPv4 row and its IPv6
	// twin) selected by -bench-rows and -bench-keys in the same
	// interleaved rounds, each with its hook's baseline and floor.
	row := func(keys string, repeat int, cases ...benchCase) {
		if !slices.Contains(strings.Split(*benchKeys, ","), keys) {
			return
		}
		var sel []benchCase
		for _, c := range cases {
			if benchRowSelected(c.name) {
				c.floor, c.repeat = floorFor[c.base], repeat
				sel = append(sel, c)
			}
		}
		if len(sel) == 0 {
			return
		}
		measured := measure(b, sel, runs)
		for i := range measured {
			r := &measured[i]
			r.keys, r.services = keys, services
			fmt.Printf("BENCH datapath case=%s keys=%s services=%d ns_per_pkt=%.2f baseline_ns=%.2f ratio=%.2f floor_ns=%.2f floor_ratio=%.2f noise=%.0f%%\n",
				r.name, r.keys, r.services, r.ns, r.base, r.ratio, r.floor, r.floorRatio, 100*r.noise)
		}
		pairTwins(measured)
		for _, r := range measured {
			if r.twin != "" {
				fmt.Printf("BENCH datapath case=%s keys=%s services=%d twin=%s ns_ratio=%.2f noise=%.0f%%\n",
					r.name, r.keys, r.services, r.twin, r.twinRatio, 100*r.twinNoise)
			}
		}
		rows = append(rows, measured...)
	}

	nonService := make([][]byte, flows)
	for i := range nonService {
		dst := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 200, byte(f.rng.IntN(256)), byte(f.rng.IntN(256))}), uint16(1+f.rng.IntN(65535)))
		nonService[i] = f.mk(f.client(), dst)
	}
	row("cold", 1, benchCase{name: "tc_non_service", prog: d.tcProg, base: tcBase, frames: nonService})
	row("cold", 1, benchCase{name: "xdp_non_service", prog: d.xdpProg, base: xdpBase, frames: nonService})

	// Establish the flows (untimed; conntrack holds them all), then time
	// their later packets and their replies. tc flows of both families
	// first, then, in cleared tables of the same size, XDP flows to
	// external frontends.
	// A flow is established (promoted into tlb_conntrack, the table an
	// established packet looks up alone) by the client's packet after
	// the backend's reply; the reply is run through tc, where a pod's
	// reply arrives.
	establish := func(prog *ebpf.Program, ok uint32, frame []byte) []byte {
		ret, out := run(b, prog, frame)
		if ret != ok {
			b.Fatalf("establishing flow %s -> %s: verdict %d", source(frame), destination(frame), ret)
		}
		reply := f.mk(destination(out), source(frame))
		if ret, _ := run(b, d.tcProg, reply); ret == tcShot {
			b.Fatalf("reply of flow %s -> %s dropped", source(frame), destination(frame))
		}
		if ret, _ := run(b, prog, frame); ret != ok {
			b.Fatalf("establishing flow %s -> %s, second packet: verdict %d", source(frame), destination(frame), ret)
		}
		return reply
	}
	// establishAll establishes flows flows from random clients to random
	// frontends of vips through prog and returns their frames and their
	// replies.
	establishAll := func(prog *ebpf.Program, ok uint32, client func() netip.AddrPort, vips []netip.AddrPort) (frames, replies [][]byte) {
		frames, replies = make([][]byte, flows), make([][]byte, flows)
		for i := range frames {
			frames[i] = f.mk(client(), vips[f.rng.IntN(services)])
			replies[i] = establish(prog, ok, frames[i])
		}
		return frames, replies
	}
	hits, replies := establishAll(d.tcProg, tcOK, f.client, vips)
	hits6, _ := establishAll(d.tcProg, tcOK, f.client6, vips6)
	hot, hot6 := f.mk(hotClient, hotFE), f.mk(hotClient6, hotFE6)
	hotReply := establish(d.tcProg, tcOK, hot)
	establish(d.tcProg, tcOK, hot6)
	fillFloors := func() {
		fillFloor(b, d, fl.FloorFlows)
		fillFloor6(b, d, fl.FloorFlows6)
	}
	fillFloors()
	allHits := func(measure func()) {
		before, err := d.Counters()
		if err != nil {
			b.Fatal(err)
		}
		measure()
		// Every timed packet must have been a hit: a miss would
		// re-balance (a new flow) or pass, and measure another path.
		after, err := d.Counters()
		if err != nil {
			b.Fatal(err)
		}
		for _, s := range []Stat{StatConntrackCreated, StatConntrackExpired, StatConntrackStaleBackend, StatDropNoBackend, StatDropMapFull, StatConntrackPromoted} {
			if n := after.Stats[s] - before.Stats[s]; n != 0 {
				b.Fatalf("%s moved by %d while measuring hits and replies: not every packet was a hit", s, n)
			}
		}
	}
	allHits(func() {
		// Each IPv6 row in the same rounds as its IPv4 twin (issue 19).
		row("hot", *benchHotRep, benchCase{name: "tc_hit", prog: d.tcProg, base: tcBase, frames: [][]byte{hot}},
			benchCase{name: "tc6_hit", prog: d.tcProg, base: tcBase6, frames: [][]byte{hot6}})
		row("cold", 1, benchCase{name: "tc_hit", prog: d.tcProg, base: tcBase, frames: hits},
			benchCase{name: "tc6_hit", prog: d.tcProg, base: tcBase6, frames: hits6})
		row("hot", *benchHotRep, benchCase{name: "tc_reply", prog: d.tcProg, base: tcBase, frames: [][]byte{hotReply}})
		row("cold", 1, benchCase{name: "tc_reply", prog: d.tcProg, base: tcBase, frames: replies})
		row("hot", *benchHotRep, benchCase{name: "xdp_reply", prog: d.xdpProg, base: xdpBase, frames: [][]byte{hotReply}})
		row("cold", 1, benchCase{name: "xdp_reply", prog: d.xdpProg, base: xdpBase, frames: replies})
		hitSteps("tc_hit", "hot", d.tcProg, tcBase, [][]byte{hot}, *benchHotRep)
		hitSteps("tc_hit", "cold", d.tcProg, tcBase, hits, 1)
	})

	// newFlowFrames are runs frames of flows from random clients to
	// random frontends of vips, each a 5-tuple never seen before.
	newFlowFrames := func(client func() netip.AddrPort, vips []netip.AddrPort) [][]byte {
		frames := make([][]byte, runs)
		for i := range frames {
			frames[i] = f.mk(client(), vips[f.rng.IntN(services)])
		}
		return frames
	}
	// After the tc hit rows, so its evictions cannot turn their hits into
	// misses.
	row("cold", 1, benchCase{name: "tc_new_flow", prog: d.tcProg, base: tcBase, frames: newFlowFrames(f.client, vips)},
		benchCase{name: "tc6_new_flow", prog: d.tcProg, base: tcBase6, frames: newFlowFrames(f.client6, vips6)})
	if sp != nil && slices.Contains(strings.Split(*benchKeys, ","), "cold") {
		steps = append(steps, newFlowStepRows(b, services, tcBase, d.tcProg, sp, f, vips)...)
	}

	// The XDP phase: conntrack emptied, every internal frontend of both
	// families replaced by an external one of its backends, on this node.
	clearConntrack(b, d)
	for i := range services {
		for _, fe := range []struct {
			from, to Frontend
			bs       []Backend
		}{
			{Frontend{Addr: vips[i], Proto: TCP}, Frontend{Addr: extVIPs[i], Proto: TCP, Scope: ScopeExternal}, nodeLocal(backends)(i)},
			{Frontend{Addr: vips6[i], Proto: TCP}, Frontend{Addr: vips6[i], Proto: TCP, Scope: ScopeExternal}, nodeLocal(backends6)(i)},
		} {
			if _, err := d.DeleteFrontend(fe.from); err != nil {
				b.Fatal(err)
			}
			mustSet(b, d, fe.to, fe.bs...)
		}
	}
	xdpHits, _ := establishAll(d.xdpProg, xdpPass, f.client, extVIPs)
	xdpHits6, _ := establishAll(d.xdpProg, xdpPass, f.client6, vips6)
	xdpHot, xdpHot6 := f.mk(hotClient, hotExt), f.mk(hotClient6, hotExt6)
	establish(d.xdpProg, xdpPass, xdpHot)
	establish(d.xdpProg, xdpPass, xdpHot6)
	fillFloors()
	allHits(func() {
		row("hot", *benchHotRep, benchCase{name: "xdp_hit", prog: d.xdpProg, base: xdpBase, frames: [][]byte{xdpHot}},
			benchCase{name: "xdp6_hit", prog: d.xdpProg, base: xdpBase6, frames: [][]byte{xdpHot6}})
		row("cold", 1, benchCase{name: "xdp_hit", prog: d.xdpProg, base: xdpBase, frames: xdpHits},
			benchCase{name: "xdp6_hit", prog: d.xdpProg, base: xdpBase6, frames: xdpHits6})
		hitSteps("xdp_hit", "hot", d.xdpProg, xdpBase, [][]byte{xdpHot}, *benchHotRep)
		hitSteps("xdp_hit", "cold", d.xdpProg, xdpBase, xdpHits, 1)
	})
	clearConntrack(b, d)
	return rows, steps
}

// pairTwins fills, in rows measured in the same rounds, each IPv6 row's
// comparison with its IPv4 twin (ipv6Twins): the median of the rounds'
// ns ratios and their spread.
func pairTwins(rows []benchRow) {
	for i := range rows {
		for _, twin := range ipv6Twins {
			if rows[i].name != twin[0] {
				continue
			}
			for _, r4 := range rows {
				if r4.name != twin[1] {
					continue
				}
				ratios := make([]float64, len(r4.rounds))
				for k := range ratios {
					ratios[k] = rows[i].rounds[k] / r4.rounds[k]
				}
				rows[i].twin, rows[i].twinNS, rows[i].twinRatio = twin[1], r4.ns, median(ratios)
				rows[i].twinNoise = (slices.Max(ratios) - slices.Min(ratios)) / rows[i].twinRatio
			}
		}
	}
}

// benchRowSelected reports whether -bench-rows asks for the case name.
func benchRowSelected(name string) bool {
	return *benchRowsOnly == "" || slices.Contains(strings.Split(*benchRowsOnly, ","), name)
}

// clearConntrack deletes every entry of both conntrack tables. The
// unreplied table too: tc_new_flow fills it, and the floor's table, filled
// from both, would otherwise evict the next phase's flows (the floor would
// time misses).
func clearConntrack(b *testing.B, d *Datapath) {
	deleteAll[tcCtKey, tcCtValue](b, d.conntrack)
	deleteAll[tcCtKey, tcCtValue](b, d.ctNew)
	deleteAll[tcCt6Key, tcCt6Value](b, d.ct6)
	deleteAll[tcCt6Key, tcCt6Value](b, d.ct6New)
}

// deleteAll deletes every entry of a table of keys K and values V.
func deleteAll[K, V any](b *testing.B, m *ebpf.Map) {
	var (
		keys []K
		k    K
		v    V
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, k)
	}
	if err := it.Err(); err != nil {
		b.Fatal(err)
	}
	for _, k := range keys {
		if err := m.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			b.Fatal(err)
		}
	}
}

// loadFloorPrograms loads floor.c on d's shared maps (it names them
// through nat.h; replacing them keeps the object from creating its own),
// its flow table sized as d's conntrack.
func loadFloorPrograms(b *testing.B, d *Datapath) *floorObjects {
	return loadFloorVariant(b, d, 0, nil)
}

// loadFloorVariant loads floor.c with the steps in mask (bench_steps_test.go)
// on d's shared maps and, when flows is not nil, on that flow table
// instead of its own.
func loadFloorVariant(b *testing.B, d *Datapath, mask floorFloorStep, flows *ebpf.Map) *floorObjects {
	spec, err := loadFloor()
	if err != nil {
		b.Fatal(err)
	}
	sizeMaps(spec, d.opts)
	spec.Maps[floorMapFloorFlows].MaxEntries = d.opts.MaxConntrack
	spec.Maps[floorMapFloorFlows6].MaxEntries = d.opts.MaxConntrack
	if err := configure(spec, d.opts, d.compat, d.ctSrcSeed, d.hashSeed); err != nil {
		b.Fatal(err)
	}
	if err := spec.Variables[floorVarCfgFloorSteps].Set(mask); err != nil {
		b.Fatal(err)
	}
	maps := d.sharedMapSet()
	if flows != nil {
		maps[floorMapFloorFlows] = flows
	}
	var fl floorObjects
	if err := spec.LoadAndAssign(&fl, &ebpf.CollectionOptions{MapReplacements: maps}); err != nil {
		b.Fatalf("load floor programs (steps %#x): %v", uint32(mask), err)
	}
	b.Cleanup(func() { fl.Close() })
	return &fl
}

// fillFloor makes the floor's flow table hold what conntrack holds: the
// same keys, as many, with their values.
func fillFloor(b *testing.B, d *Datapath, table *ebpf.Map) {
	fillFrom[tcCtKey, tcCtValue](b, table, d.conntrack, d.ctNew)
}

// fillFloor6 is fillFloor for IPv6: the floor's IPv6 table from tlb_ct6
// and tlb_ct6_new.
func fillFloor6(b *testing.B, d *Datapath, table *ebpf.Map) {
	fillFrom[tcCt6Key, tcCt6Value](b, table, d.ct6, d.ct6New)
}

// fillFrom makes table hold what the tables from hold.
func fillFrom[K, V any](b *testing.B, table *ebpf.Map, from ...*ebpf.Map) {
	deleteAll[K, V](b, table)
	var (
		k K
		v V
	)
	n := 0
	for _, ct := range from {
		it := ct.Iterate()
		for it.Next(&k, &v) {
			if err := table.Put(&k, &v); err != nil {
				b.Fatalf("fill floor flow table: %v", err)
			}
			n++
		}
		if err := it.Err(); err != nil {
			b.Fatal(err)
		}
	}
	if n == 0 {
		b.Fatal("fill floor flow table: conntrack is empty")
	}
}

// benchCase is one program measured on frames against its hook's
// baseline and floor, repeat runs per syscall.
type benchCase struct {
	name              string
	prog, base, floor *ebpf.Program
	frames            [][]byte
	repeat            int
}

// measure times cases (cycling each one's frames in a shuffled order) in
// interleaved rounds: each round times, for every case in turn, its
// baseline, its floor, then its program, so all of them see the same
// machine load; the case that goes first rotates from round to round.
// Each program gets runs runs in total. The kernel times each syscall's
// runs. Returns one row per case, in cases' order.
func measure(b *testing.B, cases []benchCase, runs int) []benchRow {
	rounds := max(*benchRounds, 1)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	round := func(c benchCase, p *ebpf.Program, order []int, k int) float64 {
		calls := max(runs/rounds/c.repeat, 1)
		var total time.Duration
		for i := 0; i < calls; i++ {
			_, perRun, err := p.Benchmark(c.frames[order[(k*calls+i)%len(order)]], c.repeat, nil)
			if err != nil {
				b.Fatalf("test run: %v", err)
			}
			total += perRun
		}
		return float64(total.Nanoseconds()) / float64(calls)
	}
	type series struct{ ns, base, floor, ratios, floorRatios []float64 }
	all := make([]series, len(cases))
	orders := make([][]int, len(cases))
	for i, c := range cases {
		orders[i] = rand.New(rand.NewPCG(7, 7)).Perm(len(c.frames))
	}
	for r := 0; r < rounds; r++ {
		for j := range cases {
			i := (r + j) % len(cases)
			c, s := cases[i], &all[i]
			bv := round(c, c.base, orders[i], r)
			fv := round(c, c.floor, orders[i], r)
			pv := round(c, c.prog, orders[i], r)
			s.base, s.floor, s.ns = append(s.base, bv), append(s.floor, fv), append(s.ns, pv)
			s.ratios, s.floorRatios = append(s.ratios, pv/bv), append(s.floorRatios, pv/fv)
		}
	}
	out := make([]benchRow, len(cases))
	for i, s := range all {
		r := benchRow{name: cases[i].name, ns: median(s.ns), base: median(s.base), floor: median(s.floor),
			ratio: median(s.ratios), floorRatio: median(s.floorRatios), rounds: s.ns}
		r.noise = (slices.Max(s.floorRatios) - slices.Min(s.floorRatios)) / r.floorRatio
		out[i] = r
	}
	return out
}

// median is the middle of v (the upper one of an even count).
func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// benchVerdicts checks the goals of issue 23 on rows: every *_hit row's
// ratio to its floor, and the keys=cold floor ratio's growth from the
// smallest size to the largest.
func benchVerdicts(rows []benchRow) []string {
	type key struct{ name, keys string }
	by := map[key]map[int]benchRow{}
	minN, maxN := math.MaxInt, 0
	for _, r := range rows {
		k := key{r.name, r.keys}
		if by[k] == nil {
			by[k] = map[int]benchRow{}
		}
		by[k][r.services] = r
		minN, maxN = min(minN, r.services), max(maxN, r.services)
	}
	met := func(ok bool) string {
		if ok {
			return "met"
		}
		return "NOT MET"
	}
	var out []string
	for _, name := range []string{"tc_hit", "xdp_hit", "tc6_hit", "xdp6_hit"} {
		for _, keys := range []string{"hot", "cold"} {
			rs := by[key{name, keys}]
			if len(rs) == 0 {
				out = append(out, fmt.Sprintf("case=%s keys=%s not measured", name, keys))
				continue
			}
			worst, at := 0.0, 0
			for n, r := range rs {
				if r.floorRatio > worst {
					worst, at = r.floorRatio, n
				}
			}
			out = append(out, fmt.Sprintf("case=%s keys=%s goal=floor_ratio<=%.2f worst=%.2f services=%d %s",
				name, keys, goalFloorRatio, worst, at, met(worst <= goalFloorRatio)))
		}
		cold := by[key{name, "cold"}]
		lo, hi := cold[minN], cold[maxN]
		if minN == maxN || lo.floor == 0 || hi.floor == 0 {
			continue
		}
		growth := hi.floorRatio/lo.floorRatio - 1
		out = append(out, fmt.Sprintf("case=%s goal=cold_growth<=%.0f%% services=%d..%d floor_ratio_growth=%+.0f%% ns_growth=%+.0f%% %s",
			name, 100*goalGrowth, minN, maxN, 100*growth, 100*(hi.ns/lo.ns-1), met(growth <= goalGrowth)))
	}
	// IPv6 against IPv4 (issue 19), from the rounds both were timed in:
	// the median of the rounds' ratios, its spread, and the verdict.
	for _, twin := range ipv6Twins {
		for _, keys := range []string{"hot", "cold"} {
			rs := by[key{twin[0], keys}]
			for _, n := range slices.Sorted(maps.Keys(rs)) {
				r6 := rs[n]
				if r6.twin == "" {
					out = append(out, fmt.Sprintf("case=%s keys=%s services=%d not measured beside %s", twin[0], keys, n, twin[1]))
					continue
				}
				out = append(out, fmt.Sprintf("case=%s keys=%s services=%d goal=ns<=%.2fx_%s ns=%.0f ipv4_ns=%.0f ns_ratio=%.2f noise=%.0f%% %s",
					twin[0], keys, n, goalIPv6, twin[1], r6.ns, r6.twinNS, r6.twinRatio, 100*r6.twinNoise, met(r6.twinRatio <= goalIPv6)))
			}
		}
	}
	return out
}

// Markers of the generated block in BENCHMARKS.md; text outside them is
// written by hand.
const (
	benchBegin = "<!-- bench-datapath: generated by make bench-datapath, do not edit -->\n"
	benchEnd   = "<!-- end bench-datapath -->\n"
)

func writeBenchmarks(path string, rows []benchRow, steps []stepRow, verdicts []string) error {
	var sec strings.Builder
	sec.WriteString(benchBegin)
	fmt.Fprintf(&sec, "Latest `make bench-datapath` on %s, kernel %s, %d CPUs (load average %s at the end), %s; %d runs per row and program, %d interleaved rounds (baseline, floor, case), keys=hot at %d runs per syscall. noise is the spread of the rounds' floor ratios over their median.\n\n",
		cpuModel(), kernelRelease(), runtime.NumCPU(), loadAvg(), time.Now().UTC().Format("2006-01-02"), *benchRuns, *benchRounds, *benchHotRep)
	fmt.Fprintf(&sec, "| case | keys | services | ns/pkt | baseline ns | ratio | floor ns | floor ratio | noise |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rows {
		fmt.Fprintf(&sec, "| %s | %s | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f%% |\n", r.name, r.keys, r.services, r.ns, r.base, r.ratio, r.floor, r.floorRatio, 100*r.noise)
	}
	sec.WriteString("\n")
	writeTwins(&sec, rows)
	if len(steps) > 0 {
		fmt.Fprintf(&sec, "Steps (bench_steps_test.go): each variant adds one step of the real path to the floor, in the path's order; delta is its ns minus the variant's before it, median over the rounds, with the rounds' range; rest is the real program minus the last variant.\n\n")
		fmt.Fprintf(&sec, "| case | keys | services | step | ns | delta ns | delta range |\n|---|---|---:|---|---:|---:|---:|\n")
		for _, r := range steps {
			fmt.Fprintf(&sec, "| %s | %s | %d | %s | %.2f | %+.2f | %+.0f..%+.0f |\n", r.chain, r.keys, r.services, r.step, r.ns, r.delta, r.deltaMin, r.deltaMax)
		}
		sec.WriteString("\n")
	}
	for _, v := range verdicts {
		fmt.Fprintf(&sec, "- %s\n", v)
	}
	sec.WriteString(benchEnd)

	old, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	doc := string(old)
	start, end := strings.Index(doc, benchBegin), strings.Index(doc, benchEnd)
	if start < 0 || end < start {
		return fmt.Errorf("%s has no generated datapath block (%q ... %q)", path, strings.TrimSpace(benchBegin), strings.TrimSpace(benchEnd))
	}
	doc = doc[:start] + sec.String() + doc[end+len(benchEnd):]
	return os.WriteFile(filepath.Clean(path), []byte(doc), 0o644)
}

// writeTwins writes the IPv6 rows against their IPv4 twins (issue 19),
// when any was measured beside its twin.
func writeTwins(sec *strings.Builder, rows []benchRow) {
	header := false
	for _, r := range rows {
		if r.twin == "" {
			continue
		}
		if !header {
			fmt.Fprintf(sec, "IPv6 against IPv4 (issue 19: within %.0f%%): each IPv6 row timed in the same rounds as its IPv4 twin; ratio is the median of the rounds' ns ratios, noise their spread (max − min) over it.\n\n", 100*(goalIPv6-1))
			fmt.Fprintf(sec, "| case | keys | services | ns/pkt | IPv4 twin | IPv4 ns/pkt | ratio | noise |\n|---|---|---:|---:|---|---:|---:|---:|\n")
			header = true
		}
		fmt.Fprintf(sec, "| %s | %s | %d | %.2f | %s | %.2f | %.2f | %.0f%% |\n", r.name, r.keys, r.services, r.ns, r.twin, r.twinNS, r.twinRatio, 100*r.twinNoise)
	}
	if header {
		sec.WriteString("\n")
	}
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}

func kernelRelease() string {
	b, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}
