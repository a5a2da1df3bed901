package maps

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

var benchSteps = flag.Bool("bench-steps", true, "also measure the per-step breakdown of the hit and new-flow paths (floor.c's cfg_floor_steps)")

// What tc_floor and xdp_floor answer for a missed packet (floor.c's
// FLOOR_MISS_TC, TC_ACT_OK, and FLOOR_MISS_XDP, XDP_TX).
const (
	floorMissTC  = 0
	floorMissXDP = 3
)

// goalNewFlowRatio is issue 23's "new-flow path halved": tc_new_flow
// cold at 100,000 services was 45.3× its baseline before layout 4
// (BENCHMARKS.md, "The floor, before and after layout 4"); half of it.
const goalNewFlowRatio = 45.3 / 2

// floorVariant is one program of a step chain: the floor with the steps
// in mask, or (mask < 0) the real program.
type floorVariant struct {
	name string
	mask floorFloorStep
}

// The chains, each step cumulative on the ones before it, in the real
// path's order. "floor" is the floor itself (floor.c with no steps);
// "rest" is the real program minus the chain's last variant: what the
// real path does that no step names (its dispatch, the reply branch's
// code, register pressure).
var (
	hitChain = []floorVariant{
		{"lookup", floorFloorStepFLOOR_NO_REWRITE},
		{"rewrite", 0},
		{"prologue", floorFloorStepFLOOR_PROLOGUE},
		{"ct_tables", floorFloorStepFLOOR_CT},
		{"expiry", floorFloorStepFLOOR_EXPIRY},
		{"syn", floorFloorStepFLOOR_SYN},
		{"touch", floorFloorStepFLOOR_TOUCH},
		{"counters", floorFloorStepFLOOR_COUNT},
		{"fwd", floorFloorStepFLOOR_FWD},
	}
	newFlowChain = []floorVariant{
		{"lookup_miss", 0},
		{"ct_miss", floorFloorStepFLOOR_NEW_CT_MISS},
		{"service", floorFloorStepFLOOR_NEW_SERVICE},
		{"src_budget", floorFloorStepFLOOR_NEW_SRC},
		{"slot", floorFloorStepFLOOR_NEW_SLOT},
		{"fib", floorFloorStepFLOOR_NEW_FIB},
		{"reply_delete", floorFloorStepFLOOR_NEW_REPLY_DEL},
		{"ct_inserts", floorFloorStepFLOOR_NEW_INSERT},
		{"rewrite", floorFloorStepFLOOR_NEW_REWRITE},
	}
)

// cumulative returns the masks of chain's variants, each with every step
// before it. FLOOR_NO_REWRITE is the one step that takes something away:
// it holds for the first variant only.
func cumulative(chain []floorVariant) []floorFloorStep {
	out := make([]floorFloorStep, len(chain))
	var m floorFloorStep
	for i, v := range chain {
		m |= v.mask
		out[i] = m
		m &^= floorFloorStepFLOOR_NO_REWRITE
	}
	return out
}

// stepPrograms loads floor.c once per distinct mask of the chains, on d's
// shared maps and fl's flow table, and returns the programs by mask.
type stepPrograms map[floorFloorStep]*floorObjects

func loadStepPrograms(b *testing.B, d *Datapath, fl *floorObjects) stepPrograms {
	out := stepPrograms{0: fl}
	for _, chain := range [][]floorVariant{hitChain, newFlowChain} {
		for _, m := range cumulative(chain) {
			if out[m] == nil {
				out[m] = loadFloorVariant(b, d, m, fl.FloorFlows)
			}
		}
	}
	return out
}

// stepRow is one step of a chain, measured in one run: the variant's
// median ns, and the median and range over rounds of its ns minus the
// variant before it (the step's cost).
type stepRow struct {
	chain, keys          string
	services             int
	step                 string
	ns, delta            float64
	deltaMin, deltaMax   float64
	realNS, baseNS, cost float64 // of the chain's real program and baseline, and ns/baseline of the real program
}

// measureChain times progs (the baseline first) in interleaved rounds,
// each program in turn, over the frames frame(j, i) gives program j for
// its i-th run; repeat runs per syscall, runs runs per program. A run
// whose verdict is bad fails the benchmark (a missed hit, a dropped new
// flow: the chain would time a shorter path than it names). Returns the
// medians over rounds of each program's ns and of its ns minus that of
// program against[j] in the same round (none for -1), with that
// difference's range.
func measureChain(b *testing.B, progs []*ebpf.Program, against []int, frame func(j, i int) []byte, n, repeat, runs int, bad func(j int, ret uint32) bool) (ns, delta, lo, hi []float64) {
	rounds := max(*benchRounds, 1)
	calls := max(runs/rounds/repeat, 1)
	order := rand.New(rand.NewPCG(7, 7)).Perm(n)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	per := make([][]float64, len(progs))
	deltas := make([][]float64, len(progs))
	for r := 0; r < rounds; r++ {
		k := r * calls
		for j, p := range progs {
			var total int64 // ns
			for i := 0; i < calls; i++ {
				ret, perRun, err := p.Benchmark(frame(j, order[(k+i)%n]), repeat, nil)
				if err != nil {
					b.Fatalf("test run: %v", err)
				}
				if bad(j, ret) {
					b.Fatalf("step chain program %d answered %d: not the path it names", j, ret)
				}
				total += perRun.Nanoseconds()
			}
			per[j] = append(per[j], float64(total)/float64(calls))
		}
		for j, a := range against {
			if a >= 0 {
				deltas[j] = append(deltas[j], per[j][r]-per[a][r])
			}
		}
	}
	for j := range progs {
		ns = append(ns, median(per[j]))
		if against[j] < 0 {
			delta, lo, hi = append(delta, 0), append(lo, 0), append(hi, 0)
			continue
		}
		delta, lo, hi = append(delta, median(deltas[j])), append(lo, slices.Min(deltas[j])), append(hi, slices.Max(deltas[j]))
	}
	return ns, delta, lo, hi
}

// chainRows measures one chain (baseline, the chain's variants of hook,
// the real program) and prints and returns its rows. Each step's delta
// is against the program before it. With refresh, the real program also
// runs twice right after the baseline, as steps "refresh" and "again":
// a packet whose flow has seen none for a second takes ct_touch_fam's
// refresh (the peer entry's lookup, a second cache miss when cold, and
// both entries' expiry written), which a program timed after it within
// the second skips. The refresh's delta is against "again" (the same
// program on the same flows a pass later): what the refresh costs. A
// keys=cold round outlasts a second on this machine, so the refresh
// recurs in whichever later variant with ct_touch_fam comes first past the
// second (its delta carries it, the next one's gives it back). bad gets
// the step's name.
func chainRows(b *testing.B, chain string, keys string, services int, base, real *ebpf.Program, variants []floorVariant,
	refresh bool, prog func(m floorFloorStep) *ebpf.Program, frame func(j, i int) []byte, n, repeat, runs int,
	bad func(step string, ret uint32) bool) []stepRow {
	names := []string{"baseline"}
	progs := []*ebpf.Program{base}
	against := []int{-1}
	if refresh {
		names, progs, against = append(names, "refresh", "again"), append(progs, real, real), append(against, 2, -1)
	}
	for i, m := range cumulative(variants) {
		against = append(against, len(progs)-1)
		if i == 0 {
			against[len(against)-1] = 0 // the first step is on the baseline
		}
		names = append(names, variants[i].name)
		progs = append(progs, prog(m))
	}
	against = append(against, len(progs)-1)
	names = append(names, "rest")
	progs = append(progs, real)
	ns, delta, lo, hi := measureChain(b, progs, against, frame, n, repeat, runs,
		func(j int, ret uint32) bool { return bad(names[j], ret) })
	var rows []stepRow
	last := len(progs) - 1
	for j := range progs {
		r := stepRow{chain: chain, keys: keys, services: services, step: names[j], ns: ns[j], delta: delta[j],
			deltaMin: lo[j], deltaMax: hi[j], realNS: ns[last], baseNS: ns[0], cost: ns[last] / ns[0]}
		fmt.Printf("BENCH datapath step case=%s keys=%s services=%d step=%s ns=%.2f delta_ns=%.2f delta_range=%.2f..%.2f\n",
			chain, keys, services, r.step, r.ns, r.delta, r.deltaMin, r.deltaMax)
		rows = append(rows, r)
	}
	return rows
}

// hitStepRows measures the hit chain of one hook (tc or XDP) on frames,
// each an established flow's packet.
func hitStepRows(b *testing.B, chain, keys string, services int, base, real *ebpf.Program, sp stepPrograms, xdp bool,
	frames [][]byte, repeat int) []stepRow {
	miss := uint32(floorMissTC)
	if xdp {
		miss = floorMissXDP
	}
	prog := func(m floorFloorStep) *ebpf.Program {
		if xdp {
			return sp[m].XdpFloor
		}
		return sp[m].TcFloor
	}
	bad := func(step string, ret uint32) bool {
		// The floor variants must hit; the real program's verdict is
		// checked by the counters (allHits).
		return step != "baseline" && step != "refresh" && step != "again" && step != "rest" && ret == miss
	}
	return chainRows(b, chain, keys, services, base, real, hitChain, true, prog,
		func(_, i int) []byte { return frames[i] }, len(frames), repeat, *benchRuns, bad)
}

// newFlowStepRows measures the new-flow chain on tc: each program gets
// frames of its own (a new flow must be new to the program that times
// it), from clients 10.<j+1>.x.x to the frontends in vips.
func newFlowStepRows(b *testing.B, services int, base, real *ebpf.Program, sp stepPrograms, f *benchFrames, vips []netip.AddrPort) []stepRow {
	runs := *benchRuns
	type flow struct{ client, vip netip.AddrPort }
	flows := make([]flow, runs)
	for i := range flows {
		flows[i] = flow{f.client(), vips[f.rng.IntN(len(vips))]}
	}
	frame := func(j, i int) []byte {
		c := flows[i].client.Addr().As4()
		c[1] = byte(j + 1)
		return f.mk(netip.AddrPortFrom(netip.AddrFrom4(c), flows[i].client.Port()), flows[i].vip)
	}
	bad := func(_ string, ret uint32) bool { return ret == tcShot }
	return chainRows(b, "tc_new_flow", "cold", services, base, real, newFlowChain, false,
		func(m floorFloorStep) *ebpf.Program { return sp[m].TcFloorNew }, frame, runs, 1, runs, bad)
}

// stepVerdicts says, per chain at the largest size, what the gap between
// the real program and its floor is made of, and for the new-flow path
// whether halving is met and which steps it would take to get there.
func stepVerdicts(rows []stepRow) []string {
	maxN := 0
	for _, r := range rows {
		maxN = max(maxN, r.services)
	}
	type key struct{ chain, keys string }
	by := map[key][]stepRow{}
	var order []key
	for _, r := range rows {
		if r.services != maxN {
			continue
		}
		k := key{r.chain, r.keys}
		if by[k] == nil {
			order = append(order, k)
		}
		by[k] = append(by[k], r)
	}
	var out []string
	for _, k := range order {
		rs := by[k]
		var floor float64
		var parts []string
		refresh := ""
		for _, r := range rs {
			switch r.step {
			case "refresh":
				refresh = fmt.Sprintf("; a flow's first packet after a second (ct_touch_fam's refresh) %+.0f more", r.delta)
			case "baseline", "again", "lookup", "lookup_miss":
			case "rewrite":
				if k.chain != "tc_new_flow" {
					floor = r.ns
					continue
				}
				fallthrough
			default:
				parts = append(parts, fmt.Sprintf("%s=%+.0f", r.step, r.delta))
			}
		}
		real := rs[len(rs)-1]
		if k.chain != "tc_new_flow" {
			out = append(out, fmt.Sprintf("step case=%s keys=%s services=%d floor_ns=%.0f real_ns=%.0f gap_ns=%.0f of which %s%s",
				k.chain, k.keys, maxN, floor, real.ns, real.ns-floor, strings.Join(parts, " "), refresh))
			continue
		}
		goalNS := goalNewFlowRatio * real.baseNS
		verdict := "met"
		if real.cost > goalNewFlowRatio {
			verdict = fmt.Sprintf("NOT MET: %.0f ns over, the steps: %s", real.ns-goalNS, strings.Join(parts, " "))
		}
		out = append(out, fmt.Sprintf("step case=tc_new_flow keys=cold services=%d goal=ratio<=%.1f ratio=%.1f ns=%.0f goal_ns=%.0f %s",
			maxN, goalNewFlowRatio, real.cost, real.ns, goalNS, verdict))
	}
	return out
}
