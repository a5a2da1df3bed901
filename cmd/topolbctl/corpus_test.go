package main

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

// The malformed-input corpus (tests/corpus, see its README) runs every
// manifest through both paths that read one, and requires the same answer:
//
//   - explain: `topolbctl explain --from-file F --node node-a1 -o json`,
//     in-process through run;
//   - the agent: an agent with an in-memory datapath whose FileWatcher
//     applied tests/corpus/base.yaml first, then finds F in its place.
//
// Each case is one of three outcomes: applied (both decide the same from
// it, with the same loader warnings), refused (the agent keeps the base,
// explain decides with a warning), or failed (an error naming the file and
// line, the same from both; explain exits 2 and the agent keeps the base).

const (
	corpusDir  = "../../tests/corpus"
	corpusNode = "node-a1"
)

type corpusOutcome int

const (
	applied corpusOutcome = iota
	refused
	failed
)

func (o corpusOutcome) String() string {
	return [...]string{"applied", "refused", "failed"}[o]
}

// corpusCase is one manifest and what both paths must make of it. In err
// and warnings, FILE stands for the manifest's path.
type corpusCase struct {
	// file is the manifest's name under tests/corpus/manifests, or for
	// generated cases a name for the test.
	file string
	// gen, if set, creates the manifest in dir and returns its path
	// (inputs too large or too special to commit).
	gen     func(t *testing.T, dir string) string
	outcome corpusOutcome
	// err is the error exactly (failed), or a part of it (refused).
	err string
	// warnings are the loader's warnings exactly; nil means none.
	warnings []string
	// check, if set, looks further at the decisions of an applied case.
	check func(t *testing.T, r topology.Report)
	// unchecked, if set, says what the case covers that no check of its
	// own asserts yet: only the agreement of both paths is checked.
	unchecked string
}

var corpus = []corpusCase{
	{file: "empty.yaml", outcome: refused, err: "FILE: manifest not applied: it holds no Node, Service or EndpointSlice"},
	{file: "comments-only.yaml", outcome: refused, err: "it holds no Node, Service or EndpointSlice"},
	{file: "separators-only.yaml", outcome: refused, err: "it holds no Node, Service or EndpointSlice"},
	{file: "truncated-mid-line.yaml", outcome: failed, err: "FILE:16: did not find expected node content"},
	{file: "truncated-between-documents.yaml", outcome: applied, check: func(t *testing.T, r topology.Report) {
		// A file cut at a document boundary is a valid, smaller manifest:
		// what writing by rename avoids. web has no endpoints yet.
		backendsOf("default/web")(t, r)
		if len(r.Services) != 1 {
			t.Errorf("%d service ports, want web's only", len(r.Services))
		}
	}},
	{file: "invalid-yaml-tab.yaml", outcome: failed, err: "FILE:4: found character that cannot start any token"},
	{file: "invalid-yaml-indent.yaml", outcome: failed, err: "FILE:5: mapping values are not allowed in this context"},
	{file: "nested-lists-too-deep.yaml", outcome: failed, err: "FILE:14: List nested in more than 4 Lists: manifest exceeds a limit"},
	{file: "nested-lists.yaml", outcome: applied, check: backendsOf("default/web", "10.244.1.5:8080", "10.244.2.5:8080")},
	{file: "duplicate-services.yaml", outcome: applied,
		warnings: []string{"FILE:18: Service default/web is defined twice: this definition is used, the one at line 6 is ignored"},
		check: func(t *testing.T, r topology.Report) {
			if len(r.Services) != 1 || !slices.Equal(r.Services[0].Frontends, []string{"10.96.0.11:80"}) {
				t.Errorf("services %+v, want web at the later definition's 10.96.0.11:80 only", r.Services)
			}
		}},
	{file: "duplicate-nodes.yaml", outcome: applied,
		warnings: []string{"FILE:21: Node node-a1 is defined twice: this definition is used, the one at line 1 is ignored"},
		check: func(t *testing.T, r topology.Report) {
			if r.Zone != "zone-b" {
				t.Errorf("zone %q, want the later definition's zone-b", r.Zone)
			}
			backendsOf("default/web", "10.244.2.5:8080")(t, r)
		}},
	{file: "duplicate-slices.yaml", outcome: applied,
		warnings: []string{"FILE:19: EndpointSlice default/web-1 is defined twice: this definition is used, the one at line 12 is ignored"},
		check:    backendsOf("default/web", "10.244.1.6:8080")},
	{file: "duplicate-slices-in-list.yaml", outcome: applied,
		warnings: []string{"FILE:14: EndpointSlice default/web-1 is defined twice: this definition is used, the one at line 8 is ignored"},
		check:    backendsOf("default/web", "10.244.1.6:8080")},
	{file: "duplicate-keys.yaml", outcome: failed,
		err: `FILE:11: key "clusterIP" is given twice in one mapping (also at line 9); which value is meant is unclear, so the manifest is refused`},
	{file: "duplicate-keys-json.yaml", outcome: failed,
		err: `FILE:3: key "labels" is given twice in one mapping (also at line 3); which value is meant is unclear, so the manifest is refused`},
	{file: "unknown-kinds.yaml", outcome: applied, warnings: []string{
		"FILE:5: skipping v1 Pod web-0 (kind not used by topolb)",
		"FILE:6: skipping apps/v1 Deployment web (kind not used by topolb)",
		"FILE:9: skipping discovery.k8s.io/v1beta1 EndpointSlice web-old (kind not used by topolb)",
		"FILE:10: skipping Service stray: it has no apiVersion",
		"FILE:11: skipping v1 Service: it has no metadata.name",
	}, check: backendsOf("default/web")},
	{file: "wrong-type.yaml", outcome: failed,
		err: "FILE:5: service default/web: json: cannot unmarshal string into Go struct field ServicePort.spec.ports.port of type int32"},
	{file: "wrong-type-in-list.yaml", outcome: failed,
		err: "FILE:5: endpointslice default/web-1: json: cannot unmarshal object into Go struct field EndpointSlice.endpoints of type []v1.Endpoint"},
	{file: "missing-node.yaml", outcome: refused, err: "FILE: manifest not applied: it has no Node named as this node (node-a1)"},
	{file: "invalid-names.yaml", outcome: applied, warnings: []string{
		`FILE:7: skipping Service "web\x1b[2J": metadata.name: a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?') (the apiserver refuses such names)`,
		`FILE:8: skipping Service "Web": metadata.name: a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?') (the apiserver refuses such names)`,
		`FILE:9: skipping Service "web" in namespace "Shop": metadata.namespace: a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?') (the apiserver refuses such names)`,
	}, check: func(t *testing.T, r topology.Report) {
		if len(r.Services) != 1 || r.Services[0].Service != "default/ok" {
			t.Errorf("services %+v, want default/ok only", r.Services)
		}
	}},
	{file: "not-an-object.yaml", outcome: failed,
		err: "FILE:1: not a Kubernetes object: json: cannot unmarshal array into Go value of type kube.typeMeta"},
	{file: "scalar-document.yaml", outcome: failed,
		err: "FILE:1: not a Kubernetes object: json: cannot unmarshal string into Go value of type kube.typeMeta"},
	{file: "marker-with-content.yaml", outcome: applied, check: func(t *testing.T, r topology.Report) {
		if len(r.Services) != 2 {
			t.Errorf("services %+v, want api and web from the documents on the marker lines", r.Services)
		}
	}},
	{file: "document-end-markers.yaml", outcome: applied, check: backendsOf("default/web")},
	{file: "crlf.yaml", outcome: applied, check: backendsOf("default/web")},
	{file: "json-list.yaml", outcome: applied, check: backendsOf("default/web", "10.244.1.5:8080")},
	{file: "alias-bomb.yaml", outcome: failed, err: "FILE:1: document contains excessive aliasing"},
	{file: "anchors.yaml", outcome: applied, check: backendsOf("default/web", "10.244.1.5:8080", "10.244.1.6:8080")},
	{file: "utf8-bom.yaml", outcome: applied, check: func(t *testing.T, r topology.Report) {
		if r.Node != corpusNode || len(r.Services) != 0 {
			t.Errorf("report %+v, want node-a1 read despite the byte order mark, and no services", r)
		}
	}},
	{file: "binary-garbage.yaml", outcome: failed, err: "FILE:5: control characters are not allowed"},

	// Generated: too large or too special to commit.
	{file: "a line of 4 MiB", outcome: applied, gen: genHugeLine,
		warnings: []string{"FILE:1: skipping v1 ConfigMap big (kind not used by topolb)"}, check: backendsOf("default/web", "10.244.1.5:8080")},
	{file: "larger than MaxManifestBytes", outcome: failed, gen: genTooLarge,
		err: "read manifests: FILE: 33554433 bytes is more than 32 MiB: manifest exceeds a limit"},
	{file: "more documents than MaxManifestDocuments", outcome: failed, gen: genTooManyDocuments,
		err: "FILE:262144: more than 262144 YAML documents: manifest exceeds a limit"},
	{file: "a FIFO", outcome: failed, gen: genFIFO, err: "read manifests: FILE is a named pipe, not a regular file"},
	{file: "/dev/zero", outcome: failed, gen: func(*testing.T, string) string { return "/dev/zero" },
		err: "read manifests: FILE is a character device, not a regular file"},

	// Cases whose rule belongs to the decision engine: only agreement is
	// checked here until topology/ gives them one.
	{file: "two-services-one-frontend.yaml", outcome: applied, unchecked: "two Services claiming one frontend"},
	{file: "duplicate-service-ports.yaml", outcome: applied, unchecked: "two ports of one Service on the same port and protocol"},
	{file: "special-addresses.yaml", outcome: applied, unchecked: "unspecified, loopback, broadcast and multicast frontends and backends; externalIPs that are not addresses"},
	{file: "topology-keys-invalid.yaml", outcome: applied, unchecked: "topology-keys values that are not label keys"},
}

// backendsOf checks that svc has exactly the given internal backends on
// every port.
func backendsOf(svc string, want ...string) func(t *testing.T, r topology.Report) {
	return func(t *testing.T, r topology.Report) {
		t.Helper()
		found := false
		for _, s := range r.Services {
			if s.Service != svc {
				continue
			}
			found = true
			if !slices.Equal(s.Backends, append([]string{}, want...)) {
				t.Errorf("%s %s/%s backends %v, want %v", svc, s.Port, s.Protocol, s.Backends, want)
			}
		}
		if !found {
			t.Errorf("%s not decided", svc)
		}
	}
}

func genHugeLine(t *testing.T, dir string) string {
	data, err := os.ReadFile(filepath.Join(corpusDir, "manifests", "json-list.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	big := "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: big}\ndata: {blob: " + strings.Repeat("x", 4<<20) + "}\n---\n"
	return writeCase(t, dir, append([]byte(big), data...))
}

func genTooLarge(t *testing.T, dir string) string {
	path := filepath.Join(dir, "too-large.yaml")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(kube.MaxManifestBytes + 1); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

func genTooManyDocuments(t *testing.T, dir string) string {
	return writeCase(t, dir, bytes.Repeat([]byte("---\n"), kube.MaxManifestDocuments+1))
}

func genFIFO(t *testing.T, dir string) string {
	path := filepath.Join(dir, "fifo.yaml")
	if err := syscall.Mkfifo(path, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func writeCase(t *testing.T, dir string, data []byte) string {
	path := filepath.Join(dir, "case.yaml")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// explainResult is what `topolbctl explain` made of a manifest.
type explainResult struct {
	code int
	// report is the JSON report (exit 0 only).
	report topology.Report
	// loaderWarnings are the warnings about the file itself (naming it),
	// errorMsg the error (exit 2), both with the path replaced by FILE.
	loaderWarnings []string
	errorMsg       string
	stderr         string
}

func runExplain(t testing.TB, path string) explainResult {
	var stdout, stderr bytes.Buffer
	res := explainResult{code: run([]string{"explain", "--from-file", path, "--node", corpusNode, "-o", "json"}, &stdout, &stderr)}
	res.stderr = stderr.String()
	for _, line := range strings.Split(strings.TrimSpace(res.stderr), "\n") {
		switch {
		case strings.HasPrefix(line, "warning: "+path+":") && !strings.Contains(line, "topolb-agent --from-file would keep"):
			res.loaderWarnings = append(res.loaderWarnings, normalize(strings.TrimPrefix(line, "warning: "), path))
		case strings.HasPrefix(line, "error: "):
			res.errorMsg = normalize(strings.TrimPrefix(line, "error: "), path)
		}
	}
	if res.code == 0 {
		dec := json.NewDecoder(&stdout)
		dec.DisallowUnknownFields()
		if err := dec.Decode(&res.report); err != nil {
			t.Fatalf("explain -o json: %v\n%s", err, stdout.String())
		}
	}
	return res
}

// agentResult is what an agent that had applied base.yaml made of a
// manifest put in its file's place.
type agentResult struct {
	// err is the FileWatcher's error for the manifest, nil if applied.
	err error
	// errorMsg is err's message with the path replaced by FILE.
	errorMsg string
	warnings []string
	// report is the agent's decisions after the manifest; base its
	// decisions after base.yaml.
	report, base topology.Report
	// batchEmpty is whether the manifest changed nothing in the tracker.
	batchEmpty bool
}

// runAgent applies base.yaml, then path, the way topolb-agent --from-file
// does: a FileWatcher for node-a1 on a file that is replaced by a symbolic
// link to path (so FIFOs and devices can stand in too).
func runAgent(t testing.TB, path string) agentResult {
	dir := t.TempDir()
	live := filepath.Join(dir, "cluster.yaml")
	base, err := os.ReadFile(filepath.Join(corpusDir, "base.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(live, base, 0o644); err != nil {
		t.Fatal(err)
	}
	a := agent.New(agent.Config{NodeName: corpusNode, Options: topology.DefaultOptions()}, memDP{})
	tr := kube.NewTracker()
	var res agentResult
	w := &kube.FileWatcher{Path: live, Tracker: tr, NodeName: corpusNode,
		OnLoad: func(_ *kube.Objects, warnings []string) { res.warnings = warnings }}
	if err := w.Load(); err != nil {
		t.Fatalf("base.yaml: %v", err)
	}
	a.Apply(tr.Drain())
	res.base = a.State().Report
	res.warnings = nil

	abs, err := filepath.Abs(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(live); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(abs, live); err != nil {
		t.Fatal(err)
	}
	res.err = w.Load()
	if res.err != nil {
		res.errorMsg = normalize(res.err.Error(), live)
	}
	for i, w := range res.warnings {
		res.warnings[i] = normalize(w, live)
	}
	b := tr.Drain()
	res.batchEmpty = b.Empty()
	a.Apply(b)
	res.report = a.State().Report
	return res
}

// normalize replaces the manifest's path with FILE.
func normalize(s, path string) string { return strings.ReplaceAll(s, path, "FILE") }

// canonical renders the decisions of a report: its service ports in one
// order, so that reports that differ only in the order of ports with the
// same name and protocol compare equal, and without its warnings, if it
// has any (explain adds the decisions' warnings to its report, the agent
// logs them; the loader's are compared on their own).
func canonical(t testing.TB, r topology.Report) string {
	r.Services = slices.Clone(r.Services)
	slices.SortStableFunc(r.Services, func(x, y topology.PortReport) int {
		return cmp.Or(cmp.Compare(x.Service, y.Service), cmp.Compare(x.Port, y.Port), cmp.Compare(x.Protocol, y.Protocol),
			cmp.Compare(strings.Join(x.Frontends, ","), strings.Join(y.Frontends, ",")))
	})
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(b, &fields); err != nil {
		t.Fatal(err)
	}
	delete(fields, "warnings")
	if b, err = json.MarshalIndent(fields, "", "  "); err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestCorpus(t *testing.T) {
	entries, err := os.ReadDir(filepath.Join(corpusDir, "manifests"))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, c := range corpus {
		listed[c.file] = true
	}
	for _, e := range entries {
		if !listed[e.Name()] {
			t.Errorf("tests/corpus/manifests/%s has no case in corpus", e.Name())
		}
	}
	for _, c := range corpus {
		t.Run(c.file, func(t *testing.T) {
			path := filepath.Join(corpusDir, "manifests", c.file)
			if c.gen != nil {
				path = c.gen(t, t.TempDir())
			}
			ex, ag := runExplain(t, path), runAgent(t, path)
			checkAgreement(t, ex, ag)
			if c.unchecked != "" {
				t.Logf("only the agreement of both paths is checked for: %s", c.unchecked)
			}
			switch c.outcome {
			case failed:
				if ex.errorMsg != c.err {
					t.Errorf("error %q, want %q", ex.errorMsg, c.err)
				}
			case refused:
				if !errors.Is(ag.err, kube.ErrNotApplied) || !strings.Contains(ag.errorMsg, c.err) {
					t.Errorf("agent: %v, want a refusal containing %q", ag.err, c.err)
				}
			case applied:
				if ag.err != nil {
					t.Fatalf("agent: %v, want the manifest applied", ag.err)
				}
				if !slices.Equal(ag.warnings, c.warnings) {
					t.Errorf("warnings %q, want %q", ag.warnings, c.warnings)
				}
				if c.check != nil {
					c.check(t, ex.report)
				}
			}
		})
	}
}

// checkAgreement checks that explain and the agent made the same of one
// manifest: the same error, or the agent keeping its state for a refusal
// explain warned about, or the same decisions and loader warnings.
func checkAgreement(t testing.TB, ex explainResult, ag agentResult) {
	t.Helper()
	switch {
	case ex.code == 2:
		if ag.err == nil || errors.Is(ag.err, kube.ErrNotApplied) {
			t.Fatalf("explain failed (%s) but the agent: %v", ex.errorMsg, ag.err)
		}
		if ex.errorMsg != ag.errorMsg {
			t.Errorf("different errors:\nexplain: %s\nagent:   %s", ex.errorMsg, ag.errorMsg)
		}
	case ex.code != 0:
		t.Fatalf("explain exit %d: %s", ex.code, ex.stderr)
	case errors.Is(ag.err, kube.ErrEmptyManifest):
		if !strings.Contains(ex.stderr, "would keep its last good state") {
			t.Errorf("the agent refused an empty manifest; explain did not warn:\n%s", ex.stderr)
		}
	case errors.Is(ag.err, kube.ErrNodeMissing):
		if !strings.Contains(ex.stderr, "node "+corpusNode+" not found") {
			t.Errorf("the agent refused a manifest without its Node; explain did not warn:\n%s", ex.stderr)
		}
	case ag.err != nil:
		t.Fatalf("explain decided, the agent failed: %v", ag.err)
	default:
		if got, want := canonical(t, ag.report), canonical(t, ex.report); got != want {
			t.Errorf("different decisions:\nexplain: %s\nagent:   %s", want, got)
		}
		if !slices.Equal(ex.loaderWarnings, ag.warnings) {
			t.Errorf("different warnings:\nexplain: %q\nagent:   %q", ex.loaderWarnings, ag.warnings)
		}
		if len(ag.warnings) > kube.MaxManifestWarnings+1 {
			t.Errorf("%d warnings, more than MaxManifestWarnings", len(ag.warnings))
		}
		return
	}
	// Not applied: the agent changed nothing.
	if !ag.batchEmpty {
		t.Error("a manifest that was not applied changed the tracker")
	}
	if got, want := canonical(t, ag.report), canonical(t, ag.base); got != want {
		t.Errorf("the agent's decisions changed:\nbefore: %s\nafter:  %s", want, got)
	}
}

// FuzzExplainAgentAgree feeds manifest bytes to both paths and requires the
// same answer (checkAgreement): never a panic, the same error, or the same
// decisions and warnings. Seeds are the corpus.
func FuzzExplainAgentAgree(f *testing.F) {
	entries, err := os.ReadDir(filepath.Join(corpusDir, "manifests"))
	if err != nil {
		f.Fatal(err)
	}
	for _, name := range append([]string{"../base.yaml"}, names(entries)...) {
		data, err := os.ReadFile(filepath.Join(corpusDir, "manifests", name))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		path := writeCase(t, t.TempDir(), data)
		checkAgreement(t, runExplain(t, path), runAgent(t, path))
	})
}

func names(entries []os.DirEntry) []string {
	out := make([]string, 0, len(entries))
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}
