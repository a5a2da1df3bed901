package portrange

import (
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		in   string
		want Range
		// wantErr is a part of the error; "" for none.
		wantErr string
	}{
		{in: "61000-65535", want: Range{61000, 65535}},
		{in: " 1024 - 2047 ", want: Range{1024, 2047}},
		{in: "5000-5000", want: Range{5000, 5000}},
		{in: "5000", wantErr: "want MIN-MAX"},
		{in: "6000-5000", wantErr: "min <= max"},
		{in: "0-10", wantErr: "min <= max"},
		{in: "1-65536", wantErr: "out of range"},
		{in: "a-b", wantErr: "invalid syntax"},
		{in: "", wantErr: "want MIN-MAX"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := Parse(tt.in)
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

func TestRange(t *testing.T) {
	r := Range{Min: 30000, Max: 32767}
	if !r.Contains(30000) || !r.Contains(32767) || r.Contains(29999) || r.Contains(32768) {
		t.Errorf("%s: Contains is wrong at an edge", r)
	}
	if r.Size() != 2768 {
		t.Errorf("%s: Size %d, want 2768", r, r.Size())
	}
	for _, tt := range []struct {
		o    Range
		want bool
	}{
		{Range{1, 29999}, false},
		{Range{1, 30000}, true},
		{Range{32767, 40000}, true},
		{Range{32768, 40000}, false},
	} {
		if got := r.Overlaps(tt.o); got != tt.want || tt.o.Overlaps(r) != tt.want {
			t.Errorf("%s.Overlaps(%s) = %t, want %t both ways", r, tt.o, got, tt.want)
		}
	}
}
