package main

import (
	"testing"

	"github.com/spf13/pflag"

	"github.com/topolb/topolb/internal/clidoc"
)

// TestREADMEFlags: the README's table of `topolbctl maps`'s flags (those
// of maps and of its subcommands; stats takes no filter) is the
// command's (make readme-flags regenerates it).
func TestREADMEFlags(t *testing.T) {
	sub, _, err := newRootCommand().Find([]string{"maps", "conntrack"})
	if err != nil {
		t.Fatal(err)
	}
	fs := pflag.NewFlagSet("maps", pflag.ContinueOnError)
	fs.AddFlagSet(sub.Parent().PersistentFlags())
	fs.AddFlagSet(sub.Flags())
	clidoc.Check(t, "../../README.md", "topolbctl maps", clidoc.FlagTable(fs))
}
