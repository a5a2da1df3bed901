package maps

import (
	"encoding/binary"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// TestScrapeDoesNotBlockWrites: the reads that walk conntrack (every
// entry of both tables) do it without the Datapath's lock, so a map
// write made while one runs over a large table is not held up until the
// walk ends: Counters (the live flows' counts), Programmed (the same, per
// backend), and the walk a change that releases a backend queues (its
// flows marked stale and their final counts, flushStale). Writes are
// made at spread-out moments of back-to-back walks of 250,000 flows;
// with a walk under the lock, a write waits for the rest of the walk it
// lands in (half of one on average, nearly all of one at worst). The
// release row also checks that the releasing change itself does not
// walk (issue 38: it did, after its write, so its caller waited for
// the walk).
func TestScrapeDoesNotBlockWrites(t *testing.T) {
	requirePrivileges(t)
	const flows = 250_000
	fe := Frontend{Addr: netip.MustParseAddrPort("10.96.0.10:80"), Proto: TCP}
	a, b := be("10.1.0.1:8080"), be("10.1.0.2:8080")
	// flowsOf is what the frontend's counters say its flows were.
	flowsOf := func(t *testing.T, d *Datapath) uint64 {
		c, err := d.Counters()
		if err != nil {
			t.Fatal(err)
		}
		return c.Frontends[fe].Flows
	}
	rows := []struct {
		name string
		// walk is one read or change that walks conntrack.
		walk func(d *Datapath) error
		// counted checks the first walk saw the flows (it did walk).
		counted func(t *testing.T, d *Datapath)
		// force are the fallbacks the row forces (Options.ForceFallbacks).
		force []string
	}{
		{name: "counters", walk: func(d *Datapath) error { _, err := d.Counters(); return err },
			counted: func(t *testing.T, d *Datapath) {
				if got := flowsOf(t, d); got < flows {
					t.Fatalf("the scrape counted %d live flows, want at least %d: it did not walk the table", got, flows)
				}
			}},
		{name: "programmed", walk: func(d *Datapath) error { _, err := d.Programmed(); return err },
			counted: func(t *testing.T, d *Datapath) {
				ps, err := d.Programmed()
				if err != nil {
					t.Fatal(err)
				}
				if got := ps[fe].Backends[0].Traffic.Flows; got < flows {
					t.Fatalf("Programmed counted %d live flows, want at least %d: it did not walk the table", got, flows)
				}
			}},
		// The flows' backend leaves and comes back (a new generation:
		// the flows stay the released one's), and every release queues
		// a walk, run here at once. In user space: the kernel's walk
		// (markReleasedInKernel) runs outside the lock the same way, but
		// takes too little time (about 25 ms here) for a write's wait to
		// tell a lock from the machine's noise.
		{name: "release", force: []string{featureForEachMapElem}, walk: func(d *Datapath) error {
			if _, err := d.SetBackends(fe, []Backend{b}); err != nil {
				return err
			}
			if _, err := d.SetBackends(fe, []Backend{a, b}); err != nil {
				return err
			}
			return d.flushStale()
		}, counted: func(t *testing.T, d *Datapath) {
			if got := flowsOf(t, d); got < flows {
				t.Fatalf("the frontend counts %d flows after its backend's release, want at least %d: the release did not count its live flows", got, flows)
			}
		}},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			d := newDatapath(t, Options{MaxConntrack: flows + 1024, ForceFallbacks: row.force})
			mustSet(t, d, fe, a)
			ps, err := d.Programmed()
			if err != nil {
				t.Fatal(err)
			}
			member := ps[fe].Backends[0]
			keys := make([]tcCtKey, flows)
			vals := make([]tcCtValue, flows)
			for i := range keys {
				keys[i].Saddr = 0x0a000000 | uint32(i) // any distinct sources
				keys[i].Daddr = binary.NativeEndian.Uint32([]byte{10, 96, 0, 10})
				keys[i].Sport, keys[i].Dport, keys[i].Proto = 1000, 80, protoTCP
				vals[i] = tcCtValue{Dir: uint8(tcCtDirCT_FORWARD), BackendId: member.ID, BackendGen: member.Gen,
					Expires: ^uint64(0), Packets: 1, Bytes: 100}
			}
			if n, err := d.conntrack.BatchUpdate(keys, vals, &ebpf.BatchOptions{}); err != nil || n != flows {
				t.Fatalf("fill conntrack: %d of %d entries: %v", n, flows, err)
			}
			start := time.Now()
			if err := row.walk(d); err != nil {
				t.Fatal(err)
			}
			alone := time.Since(start)
			row.counted(t, d)
			if row.name == "release" {
				// The changes alone, the walk they queue left to the
				// timer: each must take a small part of a walk that
				// only reads (Counters'; a first marking walk, alone,
				// writes every entry and is far longer).
				s := time.Now()
				if _, err := d.Counters(); err != nil {
					t.Fatal(err)
				}
				read := time.Since(s)
				for i := range 5 {
					s := time.Now()
					if _, err := d.SetBackends(fe, [][]Backend{{b}, {a, b}}[i%2]); err != nil {
						t.Fatal(err)
					}
					if took := time.Since(s); took > read/4 {
						t.Fatalf("a change releasing a backend took %v, over a quarter of a walk (%v): it walked conntrack before returning", took, read)
					}
				}
			}
			typical, worst := writesDuringWalks(t, d, alone, func() error { return row.walk(d) })
			t.Logf("%s over %d flows: %v alone, median %v during the writes; writes: worst %v", row.name, flows, alone, typical, worst)
			if worst > typical/2 {
				t.Fatalf("a write made during %s walks took %v, over half a walk (%v): the walk held the lock", row.name, worst, typical)
			}
		})
	}
}

// writesDuringWalks makes 20 writes at moments spread over walks that
// run back to back (each about alone long) and returns the walks' median
// and the slowest write.
func writesDuringWalks(t *testing.T, d *Datapath, alone time.Duration, walk func() error) (typical, worst time.Duration) {
	t.Helper()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var walks []time.Duration
	var walkErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			s := time.Now()
			if err := walk(); err != nil {
				walkErr = err
				return
			}
			walks = append(walks, time.Since(s))
		}
	}()
	var writes []time.Duration
	for i := range 20 {
		time.Sleep(alone * time.Duration(1+i%7) / 7)
		// A new frontend each time: a write that releases no backend
		// (a release counts that backend's live flows).
		other := Frontend{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, 1, byte(i)}), 80), Proto: TCP}
		s := time.Now()
		mustSet(t, d, other, be("10.1.1.1:8080"))
		writes = append(writes, time.Since(s))
	}
	close(stop)
	wg.Wait()
	if walkErr != nil {
		t.Fatal(walkErr)
	}
	if len(walks) == 0 {
		t.Fatal("no walk finished while the writes were made")
	}
	slices.Sort(walks)
	return walks[len(walks)/2], slices.Max(writes)
}
