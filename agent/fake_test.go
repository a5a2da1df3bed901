package agent

import (
	"sort"

	dpmaps "github.com/topolb/topolb/maps"
)

// fakeDP is a MemoryDatapath that can be told to fail and to serve IPv6
// in some scopes only.
type fakeDP struct {
	*MemoryDatapath
	fail map[dpmaps.Frontend]error
	// ipv6 is what IPv6 answers per scope: whether the fake serves IPv6
	// there (nil: nowhere).
	ipv6 func(dpmaps.Scope) bool
}

func newFakeDP() *fakeDP {
	return &fakeDP{MemoryDatapath: NewMemoryDatapath(), fail: map[dpmaps.Frontend]error{}}
}

func (f *fakeDP) SetService(fe dpmaps.Frontend, s dpmaps.Service) (int, error) {
	if err := f.fail[fe]; err != nil {
		return 0, err
	}
	return f.MemoryDatapath.SetService(fe, s)
}

func (f *fakeDP) IPv6(scope dpmaps.Scope) bool { return f.ipv6 != nil && f.ipv6(scope) }

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
