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

// TestScrapeDoesNotBlockWrites: Counters walks conntrack for the live
// flows' counts (every entry of both tables) without the Datapath's lock,
// so a map write made while a scrape of a large table runs is not held up
// until the walk ends. Writes are made at spread-out moments of
// back-to-back scrapes of 250,000 flows; with the walk under the lock,
// a write waits for the rest of the scrape it lands in (half of one on
// average, nearly all of one at worst).
func TestScrapeDoesNotBlockWrites(t *testing.T) {
	requirePrivileges(t)
	const flows = 250_000
	d := newDatapath(t, Options{MaxConntrack: flows + 1024})
	fe := Frontend{Addr: netip.MustParseAddrPort("10.96.0.10:80"), Proto: TCP}
	mustSet(t, d, fe, be("10.1.0.1:8080"))
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
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	scrape := time.Since(start)
	if got := c.BackendTraffic[fe][member.Addr].Flows; got < flows {
		t.Fatalf("the scrape counted %d live flows, want at least %d: it did not walk the table", got, flows)
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var scrapes []time.Duration
	var scrapeErr error
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
			if _, err := d.Counters(); err != nil {
				scrapeErr = err
				return
			}
			scrapes = append(scrapes, time.Since(s))
		}
	}()
	var writes []time.Duration
	for i := range 20 {
		time.Sleep(scrape * time.Duration(1+i%7) / 7)
		// A new frontend each time: a write that releases no backend
		// (a release reads that backend's final counts).
		other := Frontend{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, 1, byte(i)}), 80), Proto: TCP}
		s := time.Now()
		mustSet(t, d, other, be("10.1.1.1:8080"))
		writes = append(writes, time.Since(s))
	}
	close(stop)
	wg.Wait()
	if scrapeErr != nil {
		t.Fatal(scrapeErr)
	}
	if len(scrapes) == 0 {
		t.Fatal("no scrape finished while the writes were made")
	}
	slices.Sort(scrapes)
	typical := scrapes[len(scrapes)/2]
	worst := slices.Max(writes)
	t.Logf("scrape of %d flows: %v alone, median %v during the writes (%d); writes: worst %v", flows, scrape, typical, len(scrapes), worst)
	if worst > typical/2 {
		t.Fatalf("a write made during scrapes took %v, over half a scrape (%v): the scrape held the lock through its walk", worst, typical)
	}
}
