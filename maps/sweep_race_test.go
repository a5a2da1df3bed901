package maps

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
)

// TestSweepSparesReopenedFlows sweeps a table (tlb_ct_new, where closing
// flows live) of expired closing flows
// while clients reuse their tuples, as wrk's new connection per request
// does within seconds: each SYN reopens its expired flow (two fresh
// entries, 60 s to live), and the sweep, which found the old entries
// expired, must not delete the new ones. A flow that lost an entry this
// way is re-balanced by its next packet (a midflow miss), or, when only
// its reverse entry went, its replies reach the client untranslated and
// the client resets the backend's connection.
func TestSweepSparesReopenedFlows(t *testing.T) {
	const flows = 30000
	d := newDatapath(t, Options{MaxConntrack: 4 * flows, MaxConntrackNew: 4 * flows})
	if !d.compat.lookupAndDelete {
		t.Skipf("kernel %s: %s, the sweep's residual race (deleteCandidates) this test provokes", d.kernel.Release, lookupAndDeleteWithout)
	}
	mustSet(t, d, fe(vipTCP, TCP), be(beTCP))

	client := func(i int) string {
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 7, byte(i >> 8), byte(i)}), 33000).String()
	}
	syns := make([][]byte, flows)
	for i := range flows {
		syns[i] = tcpFrame(client(i), vipTCP, tcpSYN, "").bytes()
		fin := tcpFrame(client(i), vipTCP, tcpFIN|tcpACK, "").bytes()
		for _, in := range [][]byte{syns[i], fin} {
			if ret, _ := run(t, d.tcProg, in); ret != tcOK {
				t.Fatalf("flow %d: verdict %d", i, ret)
			}
		}
	}
	// Expire every entry, as 10 s after the close.
	past := nowNS(t) - uint64(1e9)
	var (
		k tcCtKey
		v tcCtValue
	)
	var keys []tcCtKey
	it := d.ctNew.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, k)
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	if len(keys) != 2*flows {
		t.Fatalf("%d conntrack entries, want %d", len(keys), 2*flows)
	}
	for _, k := range keys {
		if err := d.ctNew.Lookup(&k, &v); err != nil {
			t.Fatal(err)
		}
		v.Expires = past
		if err := d.ctNew.Update(&k, &v, ebpf.UpdateExist); err != nil {
			t.Fatal(err)
		}
	}

	done := make(chan error, 1)
	go func() {
		_, err := d.SweepConntrack(context.Background())
		done <- err
	}()
	// Reopen flows in random order until the sweep is over.
	reopened := map[int]bool{}
	out := make([]byte, 512)
	for swept := false; !swept; {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			swept = true
			continue
		default:
		}
		i := rand.IntN(flows)
		if _, err := d.tcProg.Run(&ebpf.RunOptions{Data: syns[i], DataOut: out}); err != nil {
			t.Fatal(err)
		}
		reopened[i] = true
	}
	lost := 0
	var first string
	for i := range reopened {
		f := flowOf(client(i), vipTCP, beTCP, protoTCP)
		for _, k := range []tcCtKey{f.fwd, f.rev} {
			if err := d.ctNew.Lookup(&k, &v); err != nil {
				lost++
				if first == "" {
					first = fmt.Sprintf("%s -> %s: %v", addrPortFromWire(k.Saddr, k.Sport), addrPortFromWire(k.Daddr, k.Dport), err)
				}
			}
		}
	}
	t.Logf("%d flows reopened during the sweep", len(reopened))
	if len(reopened) == 0 {
		t.Fatal("no flow was reopened while the sweep ran: the test shows nothing")
	}
	if lost > 0 {
		t.Errorf("the sweep deleted %d entries of flows reopened while it ran (first: %s)", lost, first)
	}
}
