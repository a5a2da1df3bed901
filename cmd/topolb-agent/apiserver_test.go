package main

import (
	"strings"
	"testing"
)

// TestAPIServerURL checks --apiserver: host:port becomes the client's
// https URL; anything else is refused with the flag named.
func TestAPIServerURL(t *testing.T) {
	for _, c := range []struct {
		in, want string // want "" means refused
	}{
		{"10.0.0.1:6443", "https://10.0.0.1:6443"},
		{"cp.example.com:443", "https://cp.example.com:443"},
		{"[fd00::1]:6443", "https://[fd00::1]:6443"},
		{"10.0.0.1", ""},
		{":6443", ""},
		{"10.0.0.1:", ""},
		{"https://10.0.0.1:6443", ""},
	} {
		got, err := apiServerURL(c.in)
		switch {
		case c.want == "" && err == nil:
			t.Errorf("apiServerURL(%q) = %q, want an error", c.in, got)
		case c.want == "" && !strings.Contains(err.Error(), "--apiserver"):
			t.Errorf("apiServerURL(%q): error %q does not name the flag", c.in, err)
		case c.want != "" && (err != nil || got != c.want):
			t.Errorf("apiServerURL(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
}
