package maps

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkScrape: the CPU a metrics scrape every second costs beside a
// full conntrack table (issue 38), with the traffic figures read at each
// scrape (Counters: a walk of every entry) against read at most every
// scrapeMaxAge (CachedCounters: one walk, then scrapes that read the
// named counters only). Both in interleaved rounds of scrapeMaxAge/1 s
// scrapes each, on one Datapath with 1,000 frontends of 10 backends and
// 250,000 entries. Prints the CPU per scrape of each and their ratio.
func BenchmarkScrape(b *testing.B) {
	requirePrivileges(b)
	const (
		frontends    = 1000
		perFrontend  = 10
		flows        = 125_000
		scrapeMaxAge = 10 * time.Second
		scrapesEach  = 10 // a round: scrapeMaxAge of scrapes every second
		rounds       = 3
	)
	d := newDatapath(b, Options{MaxFrontends: 2 * frontends, MaxBackends: 2 * frontends * perFrontend, MaxConntrack: 2 * flows})
	for i := range frontends {
		f := Frontend{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, byte(i / 250), byte(i%250 + 1)}), 80), Proto: TCP}
		bes := make([]Backend, perFrontend)
		for j := range bes {
			bes[j] = be(fmt.Sprintf("10.1.%d.%d:8080", i/25, (i%25)*10+j+1))
		}
		if _, err := d.SetBackends(f, bes); err != nil {
			b.Fatalf("frontend %d: %v", i, err)
		}
	}
	if n, err := d.FillConntrack(flows, time.Hour); err != nil {
		b.Fatalf("fill conntrack (%d of %d flows): %v", n, flows, err)
	}
	cpu := func() time.Duration {
		var ru unix.Rusage
		if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
			b.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	var walked, cached time.Duration
	for range rounds {
		start := cpu()
		for range scrapesEach {
			if _, err := d.Counters(); err != nil {
				b.Fatal(err)
			}
		}
		walked += cpu() - start
		d.traffic = trafficCache{} // the round's first scrape walks
		start = cpu()
		for range scrapesEach {
			if _, _, err := d.CachedCounters(scrapeMaxAge); err != nil {
				b.Fatal(err)
			}
		}
		cached += cpu() - start
	}
	n := float64(rounds * scrapesEach)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) / n }
	fmt.Printf("BENCH scrape ct_entries=%d frontends=%d walk_each_cpu_ms=%.2f cached_cpu_ms=%.2f ratio=%.1f\n",
		2*flows, frontends, ms(walked), ms(cached), float64(walked)/float64(max(cached, 1)))
}
