package maps

import (
	"context"
	"testing"
)

// TestFlushFlows: flushing a pinned datapath from outside (the agent keeps
// its lock) forgets every flow, in each family; the next packet is a new
// flow.
func TestFlushFlows(t *testing.T) {
	for _, fam := range tcFamilies {
		t.Run(fam.name, func(t *testing.T) {
			a := fam.addrs
			d := setupTableFor(t, a)
			for _, src := range []string{a.client, a.client2} {
				if ret, _ := run(t, d.tcProg, udpFrame(src, a.vipUDP, "q").bytes()); ret != tcOK {
					t.Fatalf("verdict %d", ret)
				}
			}
			n, err := FlushFlows(d.opts.PinPath)
			if err != nil {
				t.Fatal(err)
			}
			if n != 4 {
				t.Errorf("flushed %d entries, want 4 (two flows, both directions)", n)
			}
			st, err := d.SweepConntrack(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if len(st.Live) != 0 {
				t.Errorf("entries left after the flush: %v", st.Live)
			}
			if ret, _ := run(t, d.tcProg, udpFrame(a.client, a.vipUDP, "q").bytes()); ret != tcOK {
				t.Fatalf("verdict %d after the flush", ret)
			}
			if c, err := d.Counters(); err != nil {
				t.Fatal(err)
			} else if c.Stats[StatConntrackCreated] != 3 {
				t.Errorf("flows created %d, want 3 (the flushed one is new again)", c.Stats[StatConntrackCreated])
			}
		})
	}
}

// TestPinnedStats reads counters through the pins while the Datapath that
// owns them holds the lock.
func TestPinnedStats(t *testing.T) {
	d := setupTable(t)
	if ret, _ := run(t, d.tcProg, tcpFrame(client, vipTCP, tcpSYN, "").bytes()); ret != tcOK {
		t.Fatalf("verdict %d", ret)
	}
	got, err := PinnedStats(d.opts.PinPath)
	if err != nil {
		t.Fatal(err)
	}
	want, err := d.readStats()
	if err != nil {
		t.Fatal(err)
	}
	if got[StatConntrackCreated] != 1 || len(got) != numStats {
		t.Errorf("pinned stats %v: want %d counters, conntrack_created 1", got, numStats)
	}
	for s, n := range want {
		if got[s] != n {
			t.Errorf("%s: pinned %d, datapath %d", s, got[s], n)
		}
	}
}
