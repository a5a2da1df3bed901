// Command mutate checks that tests can fail: it applies one-line
// mutations (a rule flipped, a check skipped) to the source one at a time,
// runs the tests of the package each mutation names, restores the file,
// and reports the mutations no test noticed ("survivors"). It is run on
// demand, not by `make test`:
//
//	go run ./tools/mutate                      # every mutation in tools/mutate/mutations.txt
//	go run ./tools/mutate -only reverse-nat    # those whose name contains "reverse-nat"
//	go run ./tools/mutate -list                # list them and report the stale ones, change nothing
//
// Run it as root from the repository root, on a clean tree (it refuses to
// mutate a file with uncommitted changes, so a crash never mixes a
// mutation into real work). Mutations of bpf/ rebuild the BPF objects with
// `make generate` before the tests and restore the generated files after.
// Before the mutations of a package it runs that package's tests once
// unmutated: a package whose tests already fail cannot judge a mutation.
//
// The mutations file is a list of blocks separated by blank lines; lines
// starting with # are comments:
//
//	name: external-frontends-use-external-backends
//	why: external IPs and LB IPs must get the backends externalTrafficPolicy gives
//	file: agent/agent.go
//	package: ./agent/
//	run: TestAgent            (optional: a -run pattern)
//	after: for i, fe := range  (optional: the mutated line is the first match after this one)
//	from: eps = d.Decision.ExternalBackends
//	to: eps = d.Decision.Backends
//
// from and to are compared and written without their indentation; the
// mutated line keeps the original's. from must match exactly one line
// (after the anchor, when there is one), or the mutation is reported stale.
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Mutation is one one-line change and the tests that must notice it.
type Mutation struct {
	Name    string
	Why     string
	File    string
	Package string
	Run     string
	After   string
	From    string
	To      string
	// Line is where the block starts in the mutations file.
	Line int
}

// Outcome of one mutation.
type Outcome string

const (
	// Killed: the tests failed with the mutation in place.
	Killed Outcome = "killed"
	// Survived: the tests passed although the rule was broken.
	Survived Outcome = "SURVIVED"
	// Stale: the line to mutate is not in the file (once) any more.
	Stale Outcome = "stale"
	// Invalid: the mutated code does not build (or, for bpf/, does not
	// compile to an object): it says nothing about the tests.
	Invalid Outcome = "invalid"
	// Unjudged: the package's tests fail without any mutation.
	Unjudged Outcome = "unjudged"
)

func main() {
	file := flag.String("f", "tools/mutate/mutations.txt", "the mutations file")
	only := flag.String("only", "", "run only mutations whose name contains this")
	list := flag.Bool("list", false, "list the mutations and exit")
	timeout := flag.Duration("timeout", 20*time.Minute, "timeout of one package's test run")
	skipBaseline := flag.Bool("skip-baseline", false, "do not run each package's tests unmutated first")
	flag.Parse()

	muts, err := Load(*file)
	if err != nil {
		fmt.Fprintln(os.Stderr, "mutate:", err)
		os.Exit(2)
	}
	var chosen []Mutation
	for _, m := range muts {
		if strings.Contains(m.Name, *only) {
			chosen = append(chosen, m)
		}
	}
	if *list {
		stale := 0
		for _, m := range chosen {
			fmt.Printf("%-45s %s (%s)\n", m.Name, m.File, m.Package)
			if err := Check(m); err != nil {
				stale++
				fmt.Printf("    stale (line %d of %s): %v\n", m.Line, *file, err)
			}
		}
		fmt.Printf("\n%d mutations, %d stale\n", len(chosen), stale)
		if stale > 0 {
			os.Exit(1)
		}
		return
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "mutate: warning: not root; datapath and integration tests will skip, and a skipped test kills nothing")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	r := &runner{timeout: *timeout, baseline: map[string]error{}, skipBaseline: *skipBaseline}
	count := map[Outcome]int{}
	for i, m := range chosen {
		fmt.Printf("[%d/%d] %s: %s in %s ... ", i+1, len(chosen), m.Name, m.Package, m.File)
		start := time.Now()
		out, detail := r.run(ctx, m)
		fmt.Printf("%s (%s)\n", out, time.Since(start).Round(time.Second))
		if detail != "" {
			fmt.Println("    " + strings.ReplaceAll(strings.TrimSpace(detail), "\n", "\n    "))
		}
		count[out]++
		if ctx.Err() != nil {
			fmt.Println("interrupted")
			os.Exit(130)
		}
	}
	fmt.Printf("\n%d mutations: %d killed, %d survived, %d stale, %d invalid, %d unjudged\n", len(chosen),
		count[Killed], count[Survived], count[Stale], count[Invalid], count[Unjudged])
	if count[Survived] > 0 {
		os.Exit(1)
	}
}

// Check reports why m cannot be applied to its file as it is now (the
// file is missing, or the line is not there once): nil when it can.
func Check(m Mutation) error {
	src, err := os.ReadFile(m.File)
	if err != nil {
		return err
	}
	_, err = Apply(src, m)
	return err
}

// Load reads a mutations file.
func Load(path string) ([]Mutation, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	muts, err := Parse(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return muts, nil
}

// Parse reads mutation blocks. Every block needs name, file, package,
// from and to; names must be unique; unknown keys are errors.
func Parse(r io.Reader) ([]Mutation, error) {
	var out []Mutation
	var cur *Mutation
	names := map[string]int{}
	finish := func() error {
		if cur == nil {
			return nil
		}
		m := *cur
		cur = nil
		for k, v := range map[string]string{"name": m.Name, "file": m.File, "package": m.Package, "from": m.From, "to": m.To} {
			if v == "" {
				return fmt.Errorf("line %d: mutation %q has no %s", m.Line, m.Name, k)
			}
		}
		if m.From == m.To {
			return fmt.Errorf("line %d: mutation %s: from and to are the same", m.Line, m.Name)
		}
		if prev, dup := names[m.Name]; dup {
			return fmt.Errorf("line %d: mutation name %s already used on line %d", m.Line, m.Name, prev)
		}
		names[m.Name] = m.Line
		out = append(out, m)
		return nil
	}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") {
			continue
		}
		if trimmed == "" {
			if err := finish(); err != nil {
				return nil, err
			}
			continue
		}
		key, val, ok := strings.Cut(line, ":")
		if !ok {
			return nil, fmt.Errorf("line %d: want \"key: value\", got %q", n, line)
		}
		val = strings.TrimSpace(val)
		if cur == nil {
			cur = &Mutation{Line: n}
		}
		field, known := map[string]*string{
			"name": &cur.Name, "why": &cur.Why, "file": &cur.File, "package": &cur.Package,
			"run": &cur.Run, "after": &cur.After, "from": &cur.From, "to": &cur.To,
		}[strings.TrimSpace(key)]
		if !known {
			return nil, fmt.Errorf("line %d: unknown key %q", n, key)
		}
		if *field != "" {
			return nil, fmt.Errorf("line %d: %s given twice", n, key)
		}
		*field = val
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if err := finish(); err != nil {
		return nil, err
	}
	return out, nil
}

// Apply returns src with m applied: the one line whose trimmed text is
// m.From (the first one after the line containing m.After, when set)
// replaced by m.To with the original indentation. It fails when the line
// is not there, or (without an anchor) is there more than once.
func Apply(src []byte, m Mutation) ([]byte, error) {
	lines := strings.SplitAfter(string(src), "\n")
	start := 0
	if m.After != "" {
		start = -1
		for i, l := range lines {
			if strings.Contains(l, m.After) {
				start = i + 1
				break
			}
		}
		if start < 0 {
			return nil, fmt.Errorf("anchor %q not found", m.After)
		}
	}
	at := -1
	for i := start; i < len(lines); i++ {
		if strings.TrimSpace(lines[i]) != m.From {
			continue
		}
		if at >= 0 {
			return nil, fmt.Errorf("%q found on lines %d and %d: add an anchor (after:)", m.From, at+1, i+1)
		}
		at = i
		if m.After != "" {
			break
		}
	}
	if at < 0 {
		return nil, fmt.Errorf("line %q not found", m.From)
	}
	l := lines[at]
	indent := l[:len(l)-len(strings.TrimLeft(l, " \t"))]
	eol := ""
	if strings.HasSuffix(l, "\n") {
		eol = "\n"
	}
	lines[at] = indent + m.To + eol
	return []byte(strings.Join(lines, "")), nil
}

type runner struct {
	timeout      time.Duration
	skipBaseline bool
	// baseline holds each package's unmutated result, by package and
	// -run pattern.
	baseline map[string]error
}

// generatedFiles are what `make generate` rewrites.
func generatedFiles() ([]string, error) {
	var out []string
	for _, pat := range []string{"maps/*_bpfel.go", "maps/*_bpfel.o"} {
		m, err := filepath.Glob(pat)
		if err != nil {
			return nil, err
		}
		out = append(out, m...)
	}
	if len(out) == 0 {
		return nil, errors.New("no generated maps/*_bpfel.* files: run from the repository root")
	}
	return out, nil
}

// run applies m, tests, and restores everything it changed.
func (r *runner) run(ctx context.Context, m Mutation) (Outcome, string) {
	if err := clean(m.File); err != nil {
		return Stale, err.Error()
	}
	key := m.Package + " -run " + m.Run
	if !r.skipBaseline {
		if _, done := r.baseline[key]; !done {
			r.baseline[key] = r.test(ctx, m)
		}
		if err := r.baseline[key]; err != nil {
			return Unjudged, "unmutated tests fail: " + err.Error()
		}
	}
	orig, err := os.ReadFile(m.File)
	if err != nil {
		return Stale, err.Error()
	}
	mutated, err := Apply(orig, m)
	if err != nil {
		return Stale, err.Error()
	}
	bpf := strings.HasPrefix(filepath.ToSlash(filepath.Clean(m.File)), "bpf/")
	saved := map[string][]byte{m.File: orig}
	if bpf {
		gen, err := generatedFiles()
		if err != nil {
			return Invalid, err.Error()
		}
		for _, g := range gen {
			if saved[g], err = os.ReadFile(g); err != nil {
				return Invalid, err.Error()
			}
		}
	}
	defer func() {
		for path, data := range saved {
			if err := os.WriteFile(path, data, 0o644); err != nil {
				fmt.Fprintf(os.Stderr, "mutate: RESTORE FAILED for %s: %v (git checkout it)\n", path, err)
			}
		}
	}()
	if err := os.WriteFile(m.File, mutated, 0o644); err != nil {
		return Invalid, err.Error()
	}
	if bpf {
		if out, err := command(ctx, r.timeout, "make", "generate"); err != nil {
			return Invalid, "make generate: " + lastLines(out, 5)
		}
	}
	// Compile the tests alone first: a build error would otherwise count
	// as a kill.
	if out, err := command(ctx, r.timeout, "go", "test", "-c", "-o", os.DevNull, m.Package); err != nil {
		return Invalid, "build: " + lastLines(out, 5)
	}
	if err := r.test(ctx, m); err != nil {
		return Killed, err.Error()
	}
	return Survived, m.Why
}

// test runs the mutation's package tests and returns why they failed.
func (r *runner) test(ctx context.Context, m Mutation) error {
	args := []string{"test", "-count=1", "-timeout", r.timeout.String()}
	if m.Run != "" {
		args = append(args, "-run", m.Run)
	}
	out, err := command(ctx, r.timeout+time.Minute, "go", append(args, m.Package)...)
	if err != nil {
		return errors.New(failures(out))
	}
	return nil
}

// clean refuses a file with uncommitted changes.
func clean(path string) error {
	out, err := exec.Command("git", "status", "--porcelain", "--", path).Output()
	if err != nil {
		return fmt.Errorf("git status %s: %w", path, err)
	}
	if len(bytes.TrimSpace(out)) > 0 {
		return fmt.Errorf("%s has uncommitted changes: commit or stash them first", path)
	}
	return nil
}

func command(ctx context.Context, timeout time.Duration, name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	return cmd.CombinedOutput()
}

// failures picks the names of the failed tests out of go test's output.
func failures(out []byte) string {
	var fails []string
	for _, l := range strings.Split(string(out), "\n") {
		if t := strings.TrimSpace(l); strings.HasPrefix(t, "--- FAIL") || strings.HasPrefix(t, "panic:") {
			fails = append(fails, t)
		}
	}
	if len(fails) == 0 {
		return lastLines(out, 5)
	}
	if len(fails) > 5 {
		fails = append(fails[:5], fmt.Sprintf("(%d more)", len(fails)-5))
	}
	return strings.Join(fails, "\n")
}

func lastLines(out []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
