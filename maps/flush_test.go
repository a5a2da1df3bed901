package maps

import (
	"context"
	"testing"
)

// TestFlushFlows: flushing a pinned datapath from outside (the agent keeps
// its lock) forgets every flow; the next packet is a new flow.
func TestFlushFlows(t *testing.T) {
	d := setupTable(t)
	for _, src := range []string{"10.0.9.1:1000", "10.0.9.2:1000"} {
		if ret, _ := run(t, d.tcProg, udpFrame(src, vipUDP, "q").bytes()); ret != tcOK {
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
	if ret, _ := run(t, d.tcProg, udpFrame("10.0.9.1:1000", vipUDP, "q").bytes()); ret != tcOK {
		t.Fatalf("verdict %d after the flush", ret)
	}
	if c, err := d.Counters(); err != nil {
		t.Fatal(err)
	} else if c.Stats[StatConntrackCreated] != 3 {
		t.Errorf("flows created %d, want 3 (the flushed one is new again)", c.Stats[StatConntrackCreated])
	}
}
