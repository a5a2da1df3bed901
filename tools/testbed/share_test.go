package testbed

import (
	"net/netip"
	"testing"

	dpmaps "github.com/topolb/topolb/maps"
)

// TestShareMismatch: a wait for the agent must see a change of weights
// alone (the same backends), and must not see the slot table's rounding.
func TestShareMismatch(t *testing.T) {
	be := func(addr string, w uint32, draining bool) dpmaps.Backend {
		return dpmaps.Backend{Addr: netip.MustParseAddrPort(addr), Weight: w, Draining: draining}
	}
	weighted := []dpmaps.Backend{be("10.0.0.1:80", 6, false), be("10.0.0.2:80", 1, false), be("10.0.0.3:80", 1, false),
		be("10.0.0.4:80", 1, false), be("10.0.0.5:80", 1, false), be("10.0.0.6:80", 0, true)}
	equalSlots := map[string]uint32{"10.0.0.1:80": 1, "10.0.0.2:80": 1, "10.0.0.3:80": 1, "10.0.0.4:80": 1, "10.0.0.5:80": 1}
	rounded := map[string]uint32{"10.0.0.1:80": 307, "10.0.0.2:80": 51, "10.0.0.3:80": 51, "10.0.0.4:80": 51, "10.0.0.5:80": 52}
	equal := []dpmaps.Backend{be("10.0.0.1:80", 0, false), be("10.0.0.2:80", 0, false), be("10.0.0.3:80", 0, false),
		be("10.0.0.4:80", 0, false), be("10.0.0.5:80", 0, false)}
	for _, c := range []struct {
		name     string
		backends []dpmaps.Backend
		slots    map[string]uint32
		mismatch bool
	}{
		{"weights written, rounded", weighted, rounded, false},
		{"weights not written yet", weighted, equalSlots, true},
		{"equal, one slot each", equal, equalSlots, false},
		{"back to equal not written yet", equal, rounded, true},
	} {
		if got := shareMismatch(c.backends, c.slots); (got != "") != c.mismatch {
			t.Errorf("%s: shareMismatch = %q, want a mismatch: %v", c.name, got, c.mismatch)
		}
	}
}
