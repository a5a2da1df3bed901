package maps

import (
	"context"
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// txn counts the map writes of one API call and wraps their errors.
type txn struct {
	d      *Datapath
	writes int
	// released maps the ids whose generation this transaction set to
	// that generation: their flows are marked stale when it ends
	// (markStale).
	released map[uint32]uint32
}

func (t *txn) put(m *ebpf.Map, what string, key, value any) error {
	t.writes++
	if err := t.fault(what); err != nil {
		return fmt.Errorf("write %s: %w", what, err)
	}
	if err := m.Update(key, value, ebpf.UpdateAny); err != nil {
		if errors.Is(err, unix.E2BIG) || errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.ENOMEM) {
			return fmt.Errorf("write %s: %w: %w", what, ErrMapFull, err)
		}
		return fmt.Errorf("write %s: %w", what, err)
	}
	t.d.log.Log(context.Background(), levelTrace, "map write", "map", what, "key", key, "value", value)
	return nil
}

// del deletes key; a missing key is not an error.
func (t *txn) del(m *ebpf.Map, what string, key any) error {
	t.writes++
	if err := t.fault(what); err != nil {
		return fmt.Errorf("delete %s: %w", what, err)
	}
	if err := m.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete %s: %w", what, err)
	}
	t.d.log.Log(context.Background(), levelTrace, "map delete", "map", what, "key", key)
	return nil
}

// fault returns the failure a test injected for the next write to what.
func (t *txn) fault(what string) error {
	if t.d.writeFault == nil {
		return nil
	}
	return t.d.writeFault(what)
}

func (t *txn) putSlot(s *service, i uint32, buf uint8, m *member) error {
	return t.put(t.d.backends, "backends", backendKey(s.id, i, buf), backendValue(m))
}

func (t *txn) putRegistry(s *service, m *member) error {
	return t.put(t.d.registry, "registry", m.id, registryValue(s.id, m))
}

func (t *txn) clearRegistry(id uint32) error {
	return t.put(t.d.registry, "registry", id, tcRegistryValue{})
}

// putService writes the service entry: count slots of buffer buf with
// settings set, as flip generation s.gen+1.
func (t *txn) putService(s *service, count uint32, buf uint8, set settings) error {
	return t.put(t.d.services, "services", s.key, svcValue(s.id, count, s.gen+1, buf, set))
}

// putGeneration sets id's generation to gen on every CPU and zeroes its
// counters. Flows that carry another generation stop being honoured.
func (t *txn) putGeneration(id, gen uint32) error {
	per := make([]tcBackendStats, t.d.ncpu)
	for i := range per {
		per[i].Gen = gen
	}
	if err := t.put(t.d.backendStats, "backend_stats", id, per); err != nil {
		return err
	}
	if t.released == nil {
		t.released = make(map[uint32]uint32)
	}
	t.released[id] = gen
	return nil
}

// finish schedules the walk that marks the flows of the ids t released
// stale (the datapath no longer checks generations per packet).
func (t *txn) finish() error {
	t.d.queueStale(t.released)
	return nil
}

// step is one map write of a change.
type step struct {
	do func() error
	// undo reverts a step taken before the commit; nil when the step is
	// invisible to the datapath (a slot beyond count, the inactive
	// buffer).
	undo func() error
	// queue records the cleanup left behind when undo fails (steps before
	// the commit) or do fails (steps after it).
	queue func()
}

// change takes a frontend from one state to the next: steps before the
// commit are invisible to the datapath or harmless while it lasts, the
// commit makes the change visible in one map write, and steps after it
// finish the change (their failures are queued and retried).
type change struct {
	pre    []step
	commit func() error // nil: the pre steps are the change
	post   []step
}

// run applies c, calling onCommit once the change is visible. It reports
// committed=false when the change did not take effect: the pre steps were
// undone (what could not be undone is queued and logged, and its error
// joined to the returned one) and the previous state serves.
func (d *writer) run(c *change, onCommit func()) (committed bool, err error) {
	for i, s := range c.pre {
		if err := s.do(); err != nil {
			return false, errors.Join(err, d.undo(c.pre[:i]))
		}
	}
	if c.commit != nil {
		if err := c.commit(); err != nil {
			return false, errors.Join(err, d.undo(c.pre))
		}
	}
	onCommit()
	var errs []error
	for _, s := range c.post {
		if err := s.do(); err != nil {
			if s.queue != nil {
				s.queue()
			}
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		d.log.Warn("change applied, finishing writes failed; queued for retry", "err", err, "pending", d.pending())
		return true, err
	}
	return true, nil
}

// undo reverts steps in reverse order and returns the joined errors of
// the reverts that failed, whose cleanup it queued.
func (d *writer) undo(steps []step) error {
	var errs []error
	for i := len(steps) - 1; i >= 0; i-- {
		s := steps[i]
		if s.undo == nil {
			continue
		}
		if err := s.undo(); err != nil {
			if s.queue != nil {
				s.queue()
			}
			errs = append(errs, fmt.Errorf("undo: %w", err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		d.log.Warn("rollback incomplete; cleanup queued", "err", err, "pending", d.pending())
		return err
	}
	return nil
}

// pending counts queued cleanups.
func (d *writer) pending() int {
	return len(d.retire) + len(d.fixRegistry) + len(d.dirty)
}
