package agent

import (
	"maps"
	"slices"
	"sync"

	dpmaps "github.com/topolb/topolb/maps"
)

// MemoryDatapath is a Datapath that keeps what the agent programs in
// memory and nowhere else: no BPF object is loaded and no packet is
// balanced. It is the agent's control plane alone (--datapath=none), for
// measuring what watching and deciding cost without privileges, and the
// base of the unit tests' fake. It counts a write per backend added or
// removed plus one per frontend changed, as the kernel maps would take
// at least.
type MemoryDatapath struct {
	mu     sync.Mutex
	fes    map[dpmaps.Frontend]dpmaps.Service
	writes int
}

// NewMemoryDatapath returns an empty MemoryDatapath.
func NewMemoryDatapath() *MemoryDatapath {
	return &MemoryDatapath{fes: map[dpmaps.Frontend]dpmaps.Service{}}
}

// SetService stores s for fe and returns the writes counted for it; 0 when
// nothing changed.
func (m *MemoryDatapath) SetService(fe dpmaps.Frontend, s dpmaps.Service) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	old, existed := m.fes[fe]
	n := 0
	for _, b := range s.Backends {
		if !slices.Contains(old.Backends, b) {
			n++
		}
	}
	for _, b := range old.Backends {
		if !slices.Contains(s.Backends, b) {
			n++
		}
	}
	if n == 0 && existed && old.Affinity == s.Affinity && old.Reject == s.Reject {
		return 0, nil
	}
	n++ // the flip
	s.Backends = slices.Clone(s.Backends)
	m.fes[fe] = s
	m.writes += n
	return n, nil
}

// DeleteFrontend forgets fe; an absent one costs nothing.
func (m *MemoryDatapath) DeleteFrontend(fe dpmaps.Frontend) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.fes[fe]
	if !ok {
		return 0, nil
	}
	n := 1 + len(s.Backends)
	delete(m.fes, fe)
	m.writes += n
	return n, nil
}

// Services returns a copy of what is stored.
func (m *MemoryDatapath) Services() map[dpmaps.Frontend]dpmaps.Service {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.fes)
}

// Programmed renders what is stored as the kernel would hold it: active
// backends with one slot each (or their weight), then draining ones.
func (m *MemoryDatapath) Programmed() (map[dpmaps.Frontend]dpmaps.ProgrammedService, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[dpmaps.Frontend]dpmaps.ProgrammedService{}
	for fe, s := range m.fes {
		ps := dpmaps.ProgrammedService{Affinity: s.Affinity, Reject: s.Reject}
		for _, b := range s.Backends {
			pb := dpmaps.ProgrammedBackend{Backend: b, State: "active", Current: true}
			if b.Draining {
				pb.State = "draining"
			} else if pb.Weight == 0 {
				pb.Weight = 1
			}
			ps.Backends = append(ps.Backends, pb)
		}
		out[fe] = ps
	}
	return out, nil
}

// Uplinks: there are none without a datapath.
func (m *MemoryDatapath) Uplinks() ([]dpmaps.UplinkStatus, error) { return nil, nil }

// Kernel: nothing was probed.
func (m *MemoryDatapath) Kernel() dpmaps.KernelReport { return dpmaps.KernelReport{} }

// IPv6 is true in every scope: memory holds both families.
func (m *MemoryDatapath) IPv6(dpmaps.Scope) bool { return true }
