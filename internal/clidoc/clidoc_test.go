package clidoc

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// recorder is a testing.TB that records failures instead of failing.
type recorder struct {
	testing.TB
	failures []string
}

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}
func (r *recorder) Fatalf(format string, args ...any) { r.Errorf(format, args...) }

// TestCheck: a README whose table is the command's passes; one that lacks
// a flag, has a stale default or has no section fails, naming the lines.
func TestCheck(t *testing.T) {
	fs := pflag.NewFlagSet("x", pflag.ContinueOnError)
	fs.String("node-name", "somewhere", "name of this node (default $NODE_NAME)")
	fs.IntP("v", "v", 0, "verbosity | level")
	fs.Bool("events", true, "emit events")
	fs.Bool("dry", false, "change nothing")
	table := FlagTable(fs)
	want := "| flag | default | meaning |\n|---|---|---|\n" +
		"| `--dry` |  | change nothing |\n" +
		"| `--events` | `true` | emit events |\n" +
		"| `--node-name string` | `$NODE_NAME` | name of this node |\n" +
		"| `-v`, `--v int` | `0` | verbosity \\| level |\n"
	if table != want {
		t.Fatalf("FlagTable:\n%s\nwant:\n%s", table, want)
	}
	begin, end := markers("x")
	for _, tt := range []struct {
		name, section string
		fail          string // "" passes
	}{
		{name: "agrees", section: begin + table + end},
		{name: "missing_flag", section: begin + strings.Replace(table, "| `--dry` |  | change nothing |\n", "", 1) + end, fail: "+ command: | `--dry`"},
		{name: "stale_default", section: begin + strings.Replace(table, "`true`", "`false`", 1) + end, fail: "- README:  | `--events` | `false`"},
		{name: "no_section", section: table, fail: "no section"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			readme := filepath.Join(t.TempDir(), "README.md")
			if err := os.WriteFile(readme, []byte("# x\n\n"+tt.section+"\n\nmore\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			r := &recorder{TB: t}
			Check(r, readme, "x", table)
			got := strings.Join(r.failures, "\n")
			if tt.fail == "" && got != "" || tt.fail != "" && !strings.Contains(got, tt.fail) {
				t.Errorf("Check failures %q, want one containing %q", got, tt.fail)
			}
		})
	}
}
