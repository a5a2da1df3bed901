package maps

import (
	"testing"

	"github.com/topolb/topolb/internal/portrange"
)

// TestDefaultSNATPorts checks the default against what it must avoid:
// Linux's default ephemeral range and Kubernetes' default NodePort range.
func TestDefaultSNATPorts(t *testing.T) {
	for name, r := range map[string]portrange.Range{"ephemeral": {Min: 32768, Max: 60999}, "nodePort": {Min: 30000, Max: 32767}} {
		if DefaultSNATPorts.Overlaps(r) {
			t.Errorf("DefaultSNATPorts %s overlaps the %s range %s", DefaultSNATPorts, name, r)
		}
	}
	if DefaultSNATPorts.Size() < 4096 {
		t.Errorf("DefaultSNATPorts %s has %d ports", DefaultSNATPorts, DefaultSNATPorts.Size())
	}
	if _, err := (Options{SNATPorts: portrange.Range{Min: 10, Max: 5}}).withDefaults(); err == nil {
		t.Error("Options with an inverted SNAT range accepted")
	}
}
