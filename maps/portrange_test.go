package maps

import (
	"strings"
	"testing"
)

func TestParsePortRange(t *testing.T) {
	tests := []struct {
		in   string
		want PortRange
		// wantErr is a part of the error; "" for none.
		wantErr string
	}{
		{in: "61000-65535", want: PortRange{61000, 65535}},
		{in: " 1024 - 2047 ", want: PortRange{1024, 2047}},
		{in: "5000-5000", want: PortRange{5000, 5000}},
		{in: "5000", wantErr: "want MIN-MAX"},
		{in: "6000-5000", wantErr: "min <= max"},
		{in: "0-10", wantErr: "min <= max"},
		{in: "1-65536", wantErr: "out of range"},
		{in: "a-b", wantErr: "invalid syntax"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParsePortRange(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("got %v, %v; want %v", got, err, tt.want)
			}
		})
	}
}

// TestDefaultSNATPorts checks the default against what it must avoid:
// Linux's default ephemeral range and Kubernetes' default NodePort range.
func TestDefaultSNATPorts(t *testing.T) {
	for name, r := range map[string]PortRange{"ephemeral": {32768, 60999}, "nodePort": {30000, 32767}} {
		if DefaultSNATPorts.Overlaps(r) {
			t.Errorf("DefaultSNATPorts %s overlaps the %s range %s", DefaultSNATPorts, name, r)
		}
	}
	if DefaultSNATPorts.Size() < 4096 {
		t.Errorf("DefaultSNATPorts %s has %d ports", DefaultSNATPorts, DefaultSNATPorts.Size())
	}
	if _, err := (Options{SNATPorts: PortRange{Min: 10, Max: 5}}).withDefaults(); err == nil {
		t.Error("Options with an inverted SNAT range accepted")
	}
}
