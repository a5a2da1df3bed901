package agent

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/topolb/topolb/maps"
)

// Upkeep is what the datapath's periodic upkeep needs: maps.Datapath
// implements it.
type Upkeep interface {
	// SweepConntrack deletes expired flows without stalling the datapath.
	SweepConntrack(ctx context.Context) (maps.SweepStats, error)
	// Verify compares the kernel maps with what was programmed.
	Verify() ([]maps.Drift, error)
	// Repair rewrites what drifted and reports what it did.
	Repair() (maps.RepairReport, error)
}

// Defaults for the upkeep intervals.
const (
	// DefaultSweepInterval is how often expired conntrack entries are
	// deleted: a sixth of the shortest timeout (TCP closing, 10 s) would
	// be wasteful at scale; expired entries are already ignored by the
	// datapath, so the sweep only frees room.
	DefaultSweepInterval = 30 * time.Second
	// DefaultVerifyInterval is how often the kernel maps are compared with
	// what the agent programmed (and repaired on drift).
	DefaultVerifyInterval = time.Minute
)

// UpkeepStatus is what the last sweep and verification found, for metrics.
type UpkeepStatus struct {
	// Sweep is the last successful sweep's result; Swept is false before
	// the first.
	Sweep maps.SweepStats
	Swept bool
	// Drift counts what the last verification found, by kind, before
	// repairing it; Remaining what was left after the repair.
	Drift, Remaining map[maps.DriftKind]int
	// Repairs counts, by drift kind, what verifications found and
	// repaired since the agent started.
	Repairs map[maps.DriftKind]uint64
	// Errors counts failed sweeps and verifications.
	Errors uint64
}

// upkeep runs the sweep and the verification.
type upkeep struct {
	dp  Upkeep
	log *slog.Logger

	mu     sync.Mutex
	status UpkeepStatus
}

// RunUpkeep sweeps expired conntrack entries every sweep interval and
// verifies the kernel maps every verify interval — the first time at once,
// so drift left by another writer before this agent started is repaired —
// until ctx is done. A zero interval disables that task. The results feed
// the metrics (Metrics.UpkeepStatus).
func (a *Agent) RunUpkeep(ctx context.Context, dp Upkeep, sweep, verify time.Duration) {
	u := a.upkeep(dp)
	var sweepC, verifyC <-chan time.Time
	if sweep > 0 {
		t := time.NewTicker(sweep)
		defer t.Stop()
		sweepC = t.C
	}
	if verify > 0 {
		t := time.NewTicker(verify)
		defer t.Stop()
		verifyC = t.C
		u.verify()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-sweepC:
			u.sweep(ctx)
		case <-verifyC:
			u.verify()
		}
	}
}

// upkeep returns the agent's upkeep state, created on first use.
func (a *Agent) upkeep(dp Upkeep) *upkeep {
	u := &upkeep{dp: dp, log: a.log.With("task", "upkeep"),
		status: UpkeepStatus{Repairs: map[maps.DriftKind]uint64{}}}
	if !a.up.CompareAndSwap(nil, u) {
		return a.up.Load()
	}
	return u
}

// UpkeepStatus returns what the last sweep and verification found; the
// zero status before RunUpkeep starts.
func (a *Agent) UpkeepStatus() UpkeepStatus {
	u := a.up.Load()
	if u == nil {
		return UpkeepStatus{}
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	st := u.status
	st.Repairs = cloneMap(st.Repairs)
	return st
}

func (u *upkeep) sweep(ctx context.Context) {
	st, err := u.dp.SweepConntrack(ctx)
	u.mu.Lock()
	defer u.mu.Unlock()
	if err != nil {
		u.status.Errors++
		u.log.Error("conntrack sweep", "err", err)
		return
	}
	u.status.Sweep, u.status.Swept = st, true
	u.log.Debug("conntrack swept", "expired", st.Expired, "evicted", st.Evicted, "took", st.Duration)
}

// verify compares the kernel with what was programmed and repairs drift.
func (u *upkeep) verify() {
	drift, err := u.dp.Verify()
	if err == nil && len(drift) > 0 {
		var rep maps.RepairReport
		rep, err = u.dp.Repair()
		drift = rep.Found
		u.log.Warn("datapath maps drifted from what was programmed; repaired",
			"found", len(rep.Found), "reprogrammed", len(rep.Reprogrammed), "deleted", len(rep.Deleted),
			"remaining", len(rep.Remaining), "writes", rep.Writes, "first", firstDrift(rep.Found))
		u.mu.Lock()
		u.status.Remaining = countDrift(rep.Remaining)
		u.mu.Unlock()
	} else if err == nil {
		u.mu.Lock()
		u.status.Remaining = nil
		u.mu.Unlock()
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if err != nil {
		u.status.Errors++
		u.log.Error("verify datapath maps", "err", err)
		return
	}
	u.status.Drift = countDrift(drift)
	for k, n := range u.status.Drift {
		u.status.Repairs[k] += uint64(n)
	}
}

func countDrift(ds []maps.Drift) map[maps.DriftKind]int {
	if len(ds) == 0 {
		return nil
	}
	out := map[maps.DriftKind]int{}
	for _, d := range ds {
		out[d.Kind]++
	}
	return out
}

func firstDrift(ds []maps.Drift) string {
	if len(ds) == 0 {
		return ""
	}
	d := ds[0]
	return string(d.Kind) + " " + d.Frontend.String() + ": " + d.Detail
}

func cloneMap[K comparable, V any](m map[K]V) map[K]V {
	out := make(map[K]V, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}
