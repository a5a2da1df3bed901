package agent

import (
	"context"
	"errors"
	"maps"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// fakeUpkeep is an Upkeep whose answers the test sets, and which counts
// the calls it gets.
type fakeUpkeep struct {
	mu sync.Mutex
	// drift is what Verify reports (and Repair finds); verifyErr fails
	// Verify.
	drift     []dpmaps.Drift
	verifyErr error
	// remaining is what Repair could not fix.
	remaining []dpmaps.Drift
	// sweep is what SweepConntrack reports; sweepErr fails it.
	sweep    dpmaps.SweepStats
	sweepErr error

	verifies, repairs, sweeps int
}

func (f *fakeUpkeep) SweepConntrack(context.Context) (dpmaps.SweepStats, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sweeps++
	return f.sweep, f.sweepErr
}

func (f *fakeUpkeep) Verify() ([]dpmaps.Drift, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.verifies++
	return f.drift, f.verifyErr
}

func (f *fakeUpkeep) Repair() (dpmaps.RepairReport, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.repairs++
	return dpmaps.RepairReport{Found: f.drift, Remaining: f.remaining}, nil
}

// calls returns how many verifications, repairs and sweeps f got.
func (f *fakeUpkeep) calls() (verifies, repairs, sweeps int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.verifies, f.repairs, f.sweeps
}

// runUpkeep runs the agent's upkeep on dp until the test ends.
func runUpkeep(t *testing.T, dp Upkeep, sweep, verify time.Duration) *Agent {
	t.Helper()
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions()}, newFakeDP())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.RunUpkeep(ctx, dp, sweep, verify)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return a
}

// waitUntil polls cond for up to 5 s and fails the test with what when it
// never holds.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

var (
	missing = dpmaps.Drift{Kind: dpmaps.DriftFrontendMissing, Frontend: tcpFE("10.96.0.1:80")}
	wrong   = dpmaps.Drift{Kind: dpmaps.DriftSlotWrong, Frontend: tcpFE("10.96.0.1:80"), ID: 7}
)

// TestUpkeepRepairsDriftAtStart: the first verification runs as soon as
// the upkeep starts (the interval here is an hour), and the drift it finds
// is repaired at once and reported by kind: found, left after the repair,
// and repaired since the start.
func TestUpkeepRepairsDriftAtStart(t *testing.T) {
	dp := &fakeUpkeep{drift: []dpmaps.Drift{missing, wrong, wrong}, remaining: []dpmaps.Drift{wrong}}
	a := runUpkeep(t, dp, 0, time.Hour)
	waitUntil(t, "the first verification's status", func() bool { return a.UpkeepStatus().Drift != nil })
	if v, r, s := dp.calls(); v != 1 || r != 1 || s != 0 {
		t.Errorf("verifies %d, repairs %d, sweeps %d; want 1, 1, 0 (no sweep with a zero interval)", v, r, s)
	}
	st := a.UpkeepStatus()
	wantDrift := map[dpmaps.DriftKind]int{dpmaps.DriftFrontendMissing: 1, dpmaps.DriftSlotWrong: 2}
	if !maps.Equal(st.Drift, wantDrift) {
		t.Errorf("drift %v, want %v", st.Drift, wantDrift)
	}
	if want := map[dpmaps.DriftKind]int{dpmaps.DriftSlotWrong: 1}; !maps.Equal(st.Remaining, want) {
		t.Errorf("remaining %v, want %v", st.Remaining, want)
	}
	if want := map[dpmaps.DriftKind]uint64{dpmaps.DriftFrontendMissing: 1, dpmaps.DriftSlotWrong: 2}; !maps.Equal(st.Repairs, want) {
		t.Errorf("repairs %v, want %v", st.Repairs, want)
	}
	if st.Errors != 0 {
		t.Errorf("errors %d, want 0", st.Errors)
	}
}

// TestUpkeepRepairsAccumulate: every verification that finds drift adds
// it to the repairs, and one that finds none clears the drift and what
// was left.
func TestUpkeepRepairsAccumulate(t *testing.T) {
	dp := &fakeUpkeep{drift: []dpmaps.Drift{missing}, remaining: []dpmaps.Drift{missing}}
	a := runUpkeep(t, dp, 0, 5*time.Millisecond)
	waitUntil(t, "three verifications", func() bool { return a.UpkeepStatus().Repairs[dpmaps.DriftFrontendMissing] >= 3 })
	dp.mu.Lock()
	dp.drift, dp.remaining = nil, nil
	dp.mu.Unlock()
	waitUntil(t, "a clean verification", func() bool { st := a.UpkeepStatus(); return st.Drift == nil && st.Remaining == nil })
	v, r, _ := dp.calls()
	if st := a.UpkeepStatus(); st.Repairs[dpmaps.DriftFrontendMissing] < 3 || st.Errors != 0 {
		t.Errorf("after a clean verification: repairs %v, errors %d (verifies %d, repairs %d)", st.Repairs, st.Errors, v, r)
	}
	if r >= v {
		t.Errorf("%d repairs for %d verifications: a clean verification must not repair", r, v)
	}
}

// TestUpkeepErrorsCounted: a failed verification repairs nothing and is
// counted, and so is a failed sweep; a successful sweep's result is
// reported.
func TestUpkeepErrorsCounted(t *testing.T) {
	t.Run("verify", func(t *testing.T) {
		dp := &fakeUpkeep{drift: []dpmaps.Drift{missing}, verifyErr: errors.New("map read failed")}
		a := runUpkeep(t, dp, 0, time.Hour)
		waitUntil(t, "a counted error", func() bool { return a.UpkeepStatus().Errors > 0 })
		if _, r, _ := dp.calls(); r != 0 {
			t.Errorf("%d repairs after a failed verification, want 0", r)
		}
		if st := a.UpkeepStatus(); st.Errors != 1 || st.Drift != nil || len(st.Repairs) != 0 {
			t.Errorf("status %+v, want 1 error and no drift or repairs", st)
		}
	})
	t.Run("sweep", func(t *testing.T) {
		dp := &fakeUpkeep{sweepErr: errors.New("iterate failed")}
		a := runUpkeep(t, dp, 5*time.Millisecond, 0)
		waitUntil(t, "a counted error", func() bool { return a.UpkeepStatus().Errors > 0 })
		if st := a.UpkeepStatus(); st.Swept {
			t.Errorf("status %+v: a failed sweep reported as swept", st)
		}
		if v, _, _ := dp.calls(); v != 0 {
			t.Errorf("%d verifications with a zero interval, want 0", v)
		}
	})
	t.Run("sweep result", func(t *testing.T) {
		dp := &fakeUpkeep{sweep: dpmaps.SweepStats{Expired: 3, Created: 10, Replaced: 1, Swept: 7}}
		a := runUpkeep(t, dp, 5*time.Millisecond, 0)
		waitUntil(t, "a sweep", func() bool { return a.UpkeepStatus().Swept })
		if st := a.UpkeepStatus(); st.Sweep.Expired != 3 || st.Sweep.Created != 10 || st.Sweep.Replaced != 1 || st.Sweep.Swept != 7 || st.Errors != 0 {
			t.Errorf("status %+v, want the sweep's figures and no error", st)
		}
	})
}

// emptyReader is a DatapathReader with no counters and no usage.
type emptyReader struct{}

func (emptyReader) CachedCounters(time.Duration) (dpmaps.Counters, time.Time, error) {
	return dpmaps.Counters{}, time.Now(), nil
}
func (emptyReader) Usage() dpmaps.Usage                     { return dpmaps.Usage{} }
func (emptyReader) Uplinks() ([]dpmaps.UplinkStatus, error) { return nil, nil }
func (emptyReader) Kernel() dpmaps.KernelReport             { return dpmaps.KernelReport{} }

// TestUpkeepExportsConntrackTables: what a sweep found of the conntrack
// tables of both families and the SNAT ports is exported at the next
// scrape.
func TestUpkeepExportsConntrackTables(t *testing.T) {
	be := netip.MustParseAddrPort("10.244.2.10:8080")
	f := &fakeUpkeep{sweep: dpmaps.SweepStats{
		Established: 30, Unreplied: 700, Established6: 5, Unreplied6: 9, EstablishedCap: 4096, UnrepliedCap: 1024,
		SNATPorts: map[netip.AddrPort]int{be: 12, netip.MustParseAddrPort("10.244.3.10:8080"): 0, netip.MustParseAddrPort("[fd00:244:2::10]:8080"): 3},
	}}
	a := runUpkeep(t, f, 10*time.Millisecond, time.Hour)
	waitUntil(t, "a sweep", func() bool { return a.UpkeepStatus().Swept })
	want := `
# HELP topolb_conntrack_table_capacity Size of each conntrack table (--max-conntrack, --max-conntrack-unreplied, each family's alike).
# TYPE topolb_conntrack_table_capacity gauge
topolb_conntrack_table_capacity{table="established"} 4096
topolb_conntrack_table_capacity{table="established_ipv6"} 4096
topolb_conntrack_table_capacity{table="unreplied"} 1024
topolb_conntrack_table_capacity{table="unreplied_ipv6"} 1024
# HELP topolb_conntrack_table_entries Live entries at the last sweep of each conntrack table: established (assured flows, never evicted) and unreplied (flows not established yet and closing ones, LRU), IPv4's, and established_ipv6 and unreplied_ipv6, IPv6's.
# TYPE topolb_conntrack_table_entries gauge
topolb_conntrack_table_entries{table="established"} 30
topolb_conntrack_table_entries{table="established_ipv6"} 5
topolb_conntrack_table_entries{table="unreplied"} 700
topolb_conntrack_table_entries{table="unreplied_ipv6"} 9
# HELP topolb_snat_ports_in_use SNAT ports held by live flows at the last sweep, by backend (each backend address:port has the whole --snat-ports range).
# TYPE topolb_snat_ports_in_use gauge
topolb_snat_ports_in_use{backend="10.244.2.10:8080"} 12
topolb_snat_ports_in_use{backend="[fd00:244:2::10]:8080"} 3
`
	err := testutil.CollectAndCompare(NewDatapathCollector(emptyReader{}, a), strings.NewReader(want),
		"topolb_conntrack_table_entries", "topolb_conntrack_table_capacity", "topolb_snat_ports_in_use")
	if err != nil {
		t.Error(err)
	}
}

// snatReader is a DatapathReader whose SNAT range has 100 ports.
type snatReader struct{ emptyReader }

func (snatReader) Usage() dpmaps.Usage { return dpmaps.Usage{SNATPorts: 100} }

// TestCollectorExportsEveryDriftKind: every drift kind is exported from
// the start (0 until it drifts, so rates and alerts see a series), with
// what verification found and could not repair; and the SNAT range's size
// and the node's name and zone, which dashboards join on.
func TestCollectorExportsEveryDriftKind(t *testing.T) {
	dp := &fakeUpkeep{drift: []dpmaps.Drift{missing, wrong, wrong}, remaining: []dpmaps.Drift{wrong}}
	a := runUpkeep(t, dp, 0, time.Hour)
	waitUntil(t, "the first verification's status", func() bool { return a.UpkeepStatus().Drift != nil })
	var repaired, remaining strings.Builder
	for _, k := range dpmaps.DriftKinds {
		n, left := 0, 0
		switch k {
		case dpmaps.DriftFrontendMissing:
			n = 1
		case dpmaps.DriftSlotWrong:
			n, left = 2, 1
		}
		repaired.WriteString(`topolb_datapath_drift_repaired_total{kind="` + string(k) + `"} ` + strconv.Itoa(n) + "\n")
		remaining.WriteString(`topolb_datapath_drift_remaining{kind="` + string(k) + `"} ` + strconv.Itoa(left) + "\n")
	}
	want := `
# HELP topolb_datapath_drift_remaining Inconsistencies the last repair could not fix, by kind.
# TYPE topolb_datapath_drift_remaining gauge
` + remaining.String() + `# HELP topolb_datapath_drift_repaired_total Inconsistencies between the kernel maps and what the agent programmed, found and repaired by verification, by kind.
# TYPE topolb_datapath_drift_repaired_total counter
` + repaired.String() + `# HELP topolb_node_info This agent's node and its zone (topology.kubernetes.io/zone, empty before the Node is seen); always 1. Join on instance to label per-node metrics with the node's zone.
# TYPE topolb_node_info gauge
topolb_node_info{node="a1",zone=""} 1
# HELP topolb_snat_ports_capacity Size of the SNAT port range (--snat-ports): the ports each backend address:port can be given.
# TYPE topolb_snat_ports_capacity gauge
topolb_snat_ports_capacity 100
`
	err := testutil.CollectAndCompare(NewDatapathCollector(snatReader{}, a), strings.NewReader(want),
		"topolb_datapath_drift_repaired_total", "topolb_datapath_drift_remaining", "topolb_snat_ports_capacity", "topolb_node_info")
	if err != nil {
		t.Error(err)
	}
}

// kernelReader is a DatapathReader on a kernel without tcx links, whose
// tc programs are attached as clsact filters.
type kernelReader struct{ emptyReader }

func (kernelReader) Kernel() dpmaps.KernelReport {
	return dpmaps.KernelReport{Release: "6.1.0-50-amd64", Features: []dpmaps.KernelFeature{
		{Name: "BPF_FIB_LOOKUP_SRC", Since: "6.7", Present: true, Without: "dropped"},
		{Name: "tcx links", Since: "6.6", Without: "clsact filters", Path: "tc"},
	}}
}

// TestCollectorExportsKernel: every probed feature, present or not, and
// the path chosen for each feature that has a choice (and only those).
func TestCollectorExportsKernel(t *testing.T) {
	a := runUpkeep(t, &fakeUpkeep{}, 0, time.Hour)
	want := `
# HELP topolb_datapath_path The path the datapath takes for a kernel feature with a choice (tcx links: tcx, or tc for clsact filters), from the kernel and the agent's flags (--tc-attach); always 1.
# TYPE topolb_datapath_path gauge
topolb_datapath_path{feature="tcx links",path="tc"} 1
# HELP topolb_kernel_feature 1 where the kernel has a feature the datapath uses, 0 where it lacks it (the datapath then takes the fallback README's requirements name), probed at load; since is the first Linux release with it.
# TYPE topolb_kernel_feature gauge
topolb_kernel_feature{feature="BPF_FIB_LOOKUP_SRC",release="6.1.0-50-amd64",since="6.7"} 1
topolb_kernel_feature{feature="tcx links",release="6.1.0-50-amd64",since="6.6"} 0
`
	err := testutil.CollectAndCompare(NewDatapathCollector(kernelReader{}, a), strings.NewReader(want),
		"topolb_datapath_path", "topolb_kernel_feature")
	if err != nil {
		t.Error(err)
	}
}
