package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/topolb/topolb/hintsim"
	"github.com/topolb/topolb/topology"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/golden")

// goldenCase runs topolbctl in-process with args, through run, the same
// path main takes. The golden file holds the command line, the exit code,
// stdout and stderr.
type goldenCase struct {
	name string
	args []string
	// code is the expected exit code.
	code int
	// report, when non-nil, is a value stdout must decode into strictly
	// (unknown fields rejected): the JSON contract of the command.
	report any
}

func TestGolden(t *testing.T) {
	explain := func(file string, args ...string) []string {
		return append([]string{"explain", "--from-file", "testdata/" + file}, args...)
	}
	hints := func(file string, args ...string) []string {
		return append([]string{"hints", "simulate", "--from-file", "testdata/" + file}, args...)
	}
	tests := []goldenCase{
		// explain on the original fixture.
		{name: "explain-cluster-node-a1", args: explain("cluster.yaml", "--node", "node-a1")},
		// explain on one Service per rule, from several nodes.
		{name: "explain-node-a1-table", args: explain("explain.yaml", "--node", "node-a1")},
		{name: "explain-node-a1-json", args: explain("explain.yaml", "--node", "node-a1", "-o", "json"), report: &topology.Report{}},
		{name: "explain-node-a1-yaml", args: explain("explain.yaml", "--node", "node-a1", "-o", "yaml")},
		{name: "explain-node-a2-table", args: explain("explain.yaml", "--node", "node-a2")},
		{name: "explain-node-b1-json", args: explain("explain.yaml", "--node", "node-b1", "-o", "json"), report: &topology.Report{}},
		{name: "explain-node-bare-table", args: explain("explain.yaml", "--node", "node-bare")},
		{name: "explain-missing-node-table", args: explain("explain.yaml", "--node", "node-x")},
		{name: "explain-service-json", args: explain("explain.yaml", "--node", "node-a1", "--service", "default/etp-local", "-o", "json"), report: &topology.Report{}},
		{name: "explain-service-not-found", args: explain("explain.yaml", "--node", "node-a1", "--service", "default/nope")},
		// explain: frontends, scopes and conflicts.
		{name: "explain-frontends-node-a1-table", args: explain("frontends.yaml", "--node", "node-a1")},
		{name: "explain-frontends-node-a1-json", args: explain("frontends.yaml", "--node", "node-a1", "-o", "json"), report: &topology.Report{}},
		{name: "explain-frontends-node-b1-table", args: explain("frontends.yaml", "--node", "node-b1")},
		{name: "explain-frontends-thief-json", args: explain("frontends.yaml", "--node", "node-a1", "--service", "default/thief", "-o", "json"), report: &topology.Report{}},
		// explain: a Service over a per-Service cap is refused whole, and says why.
		{name: "explain-frontends-caps", args: explain("frontends.yaml", "--node", "node-a1", "--max-frontends-per-service", "5")},
		{name: "explain-frontends-nodeport-addresses", args: explain("frontends.yaml", "--node", "node-a1", "--nodeport-addresses", "203.0.113.0/24", "--service-node-port-range", "8000-32767")},
		// explain: a dual-stack Service and an IPv6-only one, decided per family.
		{name: "explain-dual-stack-table", args: explain("dual-stack-cluster.yaml", "--node", "node-a1")},
		{name: "explain-dual-stack-json", args: explain("dual-stack-cluster.yaml", "--node", "node-a1", "-o", "json"), report: &topology.Report{}},
		{name: "explain-dual-stack-nodeport-addresses", args: explain("dual-stack-cluster.yaml", "--node", "node-a1", "--nodeport-addresses", "fd99::/16")},
		// explain: input refused or corrected, with warnings.
		{name: "explain-validation-table", args: explain("validation.yaml", "--node", "node-a1")},
		{name: "explain-validation-json", args: explain("validation.yaml", "--node", "node-a1", "-o", "json"), report: &topology.Report{}},
		{name: "explain-bad-nodeport-addresses", args: explain("frontends.yaml", "--node", "node-a1", "--nodeport-addresses", "203.0.113.0"), code: 2},
		{name: "explain-bad-nodeport-range", args: explain("frontends.yaml", "--node", "node-a1", "--service-node-port-range", "32767-30000"), code: 2},
		// explain: bad input.
		{name: "explain-malformed", args: explain("malformed.yaml", "--node", "node-a1"), code: 2},
		{name: "explain-missing-file", args: explain("no-such-file.yaml", "--node", "node-a1"), code: 2},
		{name: "explain-no-node", args: explain("explain.yaml"), code: 2},
		{name: "explain-bad-output", args: explain("explain.yaml", "--node", "node-a1", "-o", "xml"), code: 2},
		{name: "explain-bad-service", args: explain("explain.yaml", "--node", "node-a1", "--service", "zonal"), code: 2},
		{name: "explain-unknown-flag", args: explain("explain.yaml", "--node", "node-a1", "--zone", "zone-a"), code: 2},

		// hints simulate.
		{name: "hints-feasible-table", args: hints("hints-feasible.yaml")},
		{name: "hints-dual-stack-table", args: hints("dual-stack-cluster.yaml")},
		{name: "hints-feasible-json", args: hints("hints-feasible.yaml", "-o", "json"), report: &hintsim.Report{}},
		{name: "hints-feasible-yaml", args: hints("hints-feasible.yaml", "-o", "yaml")},
		{name: "hints-no-zone-label-table", args: hints("hints-no-zone-label.yaml")},
		{name: "hints-few-endpoints-table", args: hints("hints-few-endpoints.yaml")},
		{name: "hints-few-endpoints-web-json", args: hints("hints-few-endpoints.yaml", "--service", "default/web", "-o", "json"), report: &hintsim.Report{}},
		{name: "hints-differ-table", args: hints("hints-differ.yaml")},
		{name: "hints-differ-api-json", args: hints("hints-differ.yaml", "--service", "default/api", "-o", "json"), report: &hintsim.Report{}},
		{name: "hints-cluster-table", args: hints("cluster.yaml")},
		{name: "hints-service-not-found", args: hints("hints-feasible.yaml", "--service", "default/nope")},
		// hints simulate: bad input.
		{name: "hints-malformed", args: hints("malformed.yaml"), code: 2},
		{name: "hints-bad-output", args: hints("hints-feasible.yaml", "-o", "wide"), code: 2},
		{name: "hints-bad-cpu", args: hints("hints-bad-cpu.yaml"), code: 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run(tc.args, &stdout, &stderr)
			if code != tc.code {
				t.Errorf("exit code %d, want %d; stderr:\n%s", code, tc.code, stderr.String())
			}
			if tc.report != nil {
				dec := json.NewDecoder(bytes.NewReader(stdout.Bytes()))
				dec.DisallowUnknownFields()
				if err := dec.Decode(tc.report); err != nil {
					t.Errorf("stdout does not decode as %T: %v", tc.report, err)
				}
			}
			for _, line := range strings.Split(strings.TrimSpace(stderr.String()), "\n") {
				if line != "" && !strings.HasPrefix(line, "warning: ") && !strings.HasPrefix(line, "error: ") {
					t.Errorf("stderr line is neither a warning nor an error: %q", line)
				}
			}
			got := fmt.Sprintf("# topolbctl %s\n# exit code %d\n-- stdout --\n%s-- stderr --\n%s",
				strings.Join(tc.args, " "), code, stdout.String(), stderr.String())
			checkGolden(t, filepath.Join("testdata", "golden", tc.name+".golden"), got)
		})
	}
}

// TestHintsDeterministic runs the simulations several times: the topology
// cache ranges over maps, and a golden file is only useful if the scenario
// leaves it no choice.
func TestHintsDeterministic(t *testing.T) {
	for _, file := range []string{"hints-feasible.yaml", "hints-no-zone-label.yaml", "hints-few-endpoints.yaml", "hints-differ.yaml"} {
		var first string
		for i := 0; i < 20; i++ {
			var stdout, stderr bytes.Buffer
			if code := run([]string{"hints", "simulate", "--from-file", "testdata/" + file, "-o", "json"}, &stdout, &stderr); code != 0 {
				t.Fatalf("%s: exit code %d: %s", file, code, stderr.String())
			}
			if i == 0 {
				first = stdout.String()
			} else if stdout.String() != first {
				t.Fatalf("%s: run %d differs from run 0", file, i)
			}
		}
	}
}

// checkGolden compares got with the golden file at path, or rewrites the
// file under -update.
func checkGolden(t *testing.T, path, got string) {
	t.Helper()
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read golden file (run go test -update to create it): %v", err)
	}
	if got != string(want) {
		t.Errorf("output differs from %s (run go test -update to accept):\n%s", path, lineDiff(string(want), got))
	}
}

// lineDiff shows the lines that differ between want and got, with their
// line numbers.
func lineDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	for i := 0; i < max(len(w), len(g)); i++ {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			fmt.Fprintf(&b, "line %d:\n  want: %q\n  got:  %q\n", i+1, wl, gl)
		}
	}
	return b.String()
}

// TestDocsMatchGoldens keeps the examples in docs/cli.md true: each is the
// stdout of a golden file, pasted verbatim.
func TestDocsMatchGoldens(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "cli.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"explain-cluster-node-a1", "explain-service-json", "explain-frontends-node-a1-table", "hints-few-endpoints-table", "explain-dual-stack-table"} {
		golden, err := os.ReadFile(filepath.Join("testdata", "golden", name+".golden"))
		if err != nil {
			t.Fatal(err)
		}
		_, rest, _ := strings.Cut(string(golden), "-- stdout --\n")
		stdout, _, _ := strings.Cut(rest, "-- stderr --\n")
		if !strings.Contains(string(doc), stdout) {
			t.Errorf("docs/cli.md does not contain the output of %s: paste it again", name)
		}
	}
}
