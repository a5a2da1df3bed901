package agent

import (
	"maps"
	"slices"
	"sort"

	dpmaps "github.com/topolb/topolb/maps"
)

// fakeDP is an in-memory Datapath that counts one write per changed
// backend plus one flip per changed frontend, and can be told to fail.
type fakeDP struct {
	fes    map[dpmaps.Frontend]dpmaps.Service
	fail   map[dpmaps.Frontend]error
	writes int
	// ipv6 is what IPv6 answers per scope: whether the fake serves IPv6
	// there (nil: nowhere).
	ipv6 func(dpmaps.Scope) bool
}

func newFakeDP() *fakeDP {
	return &fakeDP{fes: map[dpmaps.Frontend]dpmaps.Service{}, fail: map[dpmaps.Frontend]error{}}
}

func (f *fakeDP) SetService(fe dpmaps.Frontend, s dpmaps.Service) (int, error) {
	if err := f.fail[fe]; err != nil {
		return 0, err
	}
	old, existed := f.fes[fe]
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
	f.fes[fe] = s
	f.writes += n
	return n, nil
}

func (f *fakeDP) DeleteFrontend(fe dpmaps.Frontend) (int, error) {
	if _, ok := f.fes[fe]; !ok {
		return 0, nil
	}
	n := 1 + len(f.fes[fe].Backends)
	delete(f.fes, fe)
	f.writes += n
	return n, nil
}

func (f *fakeDP) Services() map[dpmaps.Frontend]dpmaps.Service { return maps.Clone(f.fes) }

// Uplinks: the fake has none.
func (f *fakeDP) Uplinks() ([]dpmaps.UplinkStatus, error) { return nil, nil }

// Kernel: the fake has no kernel to probe.
func (f *fakeDP) Kernel() dpmaps.KernelReport { return dpmaps.KernelReport{} }

func (f *fakeDP) IPv6(scope dpmaps.Scope) bool { return f.ipv6 != nil && f.ipv6(scope) }

// Programmed renders the fake's contents as the kernel would hold them:
// active backends with one slot each (or their weight), then draining ones.
func (f *fakeDP) Programmed() (map[dpmaps.Frontend]dpmaps.ProgrammedService, error) {
	out := map[dpmaps.Frontend]dpmaps.ProgrammedService{}
	for fe, s := range f.fes {
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

// programmed renders the active backends as "frontend -> backends".
func (f *fakeDP) programmed() map[string][]string {
	return f.render(false)
}

// draining renders the draining backends as "frontend -> backends".
func (f *fakeDP) draining() map[string][]string {
	return f.render(true)
}

func (f *fakeDP) render(draining bool) map[string][]string {
	out := map[string][]string{}
	for fe, s := range f.fes {
		bes := []string{}
		for _, b := range s.Backends {
			if b.Draining == draining {
				bes = append(bes, b.Addr.String())
			}
		}
		sort.Strings(bes)
		out[fe.String()] = bes
	}
	return out
}
