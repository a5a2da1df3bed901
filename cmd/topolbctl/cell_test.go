package main

import (
	"strings"
	"testing"
)

func TestCell(t *testing.T) {
	for _, tc := range []struct {
		in   string
		max  int
		want string
	}{
		{"default/web", 253, "default/web"},
		{"zone-é", 253, "zone-é"},
		{"a\tb\nc", 253, `a\tb\nc`},
		{"x\x1b[31mred", 253, `x\x1b[31mred`},
		{"back\\slash", 253, `back\\slash`},
		{"rtl\u202eoverride", 253, `rtl\u202eoverride`},
		{"bad\xffbyte", 253, `bad\xffbyte`},
		{"keep \uFFFD", 253, "keep \uFFFD"},
		{strings.Repeat("é", 10), 4, "éééé..."},
		{"abcd", 4, "abcd"},
	} {
		if got := cell(tc.in, tc.max); got != tc.want {
			t.Errorf("cell(%q, %d) = %q, want %q", tc.in, tc.max, got, tc.want)
		}
	}
}
