package main

import (
	"testing"

	"github.com/topolb/topolb/internal/clidoc"
)

// TestREADMEFlags: the README's table of the demo's flags is the
// command's (make readme-flags regenerates it).
func TestREADMEFlags(t *testing.T) {
	var c config
	clidoc.Check(t, "../../README.md", "topolb-demo", clidoc.FlagTable(newCommand(&c).Flags()))
}
