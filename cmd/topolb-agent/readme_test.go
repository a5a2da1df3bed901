package main

import (
	"testing"

	"github.com/topolb/topolb/internal/clidoc"
)

// TestREADMEFlags: the README's table of the agent's flags is the
// command's (make readme-flags regenerates it).
func TestREADMEFlags(t *testing.T) {
	var f flags
	clidoc.Check(t, "../../README.md", "topolb-agent", clidoc.FlagTable(newCommand(&f).Flags()))
}
