package kube

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// manifestSummary lists the decoded objects as "Node name", "Service ns/name" and
// "EndpointSlice ns/name", in decoding order.
func manifestSummary(o *Objects) []string {
	out := []string{}
	for _, n := range o.Nodes {
		out = append(out, "Node "+n.Name)
	}
	for _, s := range o.Services {
		out = append(out, "Service "+s.Namespace+"/"+s.Name)
	}
	for _, s := range o.Slices {
		out = append(out, "EndpointSlice "+s.Namespace+"/"+s.Name)
	}
	return out
}

// checkDecode decodes in as f.yaml and checks the result: the error exactly
// when wantErr is set (and then no objects or warnings), else
// manifestSummary() of the objects and the warnings exactly.
func checkDecode(t *testing.T, in string, want, wantWarnings []string, wantErr string) {
	t.Helper()
	objs, warnings, err := DecodeManifests("f.yaml", []byte(in))
	if wantErr != "" {
		if err == nil || err.Error() != wantErr {
			t.Fatalf("error %v, want %q", err, wantErr)
		}
		if objs != nil || warnings != nil {
			t.Errorf("got objects %v and warnings %q with the error, want neither", objs, warnings)
		}
		return
	}
	if err != nil {
		t.Fatalf("unexpected error: %v", err)
	}
	if got := manifestSummary(objs); !slices.Equal(got, want) {
		t.Errorf("objects %q, want %q", got, want)
	}
	if !slices.Equal(warnings, wantWarnings) {
		t.Errorf("warnings %q, want %q", warnings, wantWarnings)
	}
}

// decodeCase is a manifest and what DecodeManifests must make of it.
type decodeCase struct {
	name string
	in   string
	// want is manifestSummary() of the result; nil when an error is expected.
	want []string
	// wantWarnings are the warnings exactly; nil means none.
	wantWarnings []string
	// wantErr is the error message exactly ("" for no error); it must
	// name the file and the line.
	wantErr string
}

func TestDecodeManifests(t *testing.T) {
	tests := []decodeCase{
		{
			name: "multi-doc with leading and trailing separators",
			in: `---
apiVersion: v1
kind: Node
metadata: {name: a1}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.0.0.1]}]
---
`,
			want: []string{"Node a1", "Service shop/web", "EndpointSlice shop/web-1"},
		},
		{
			name: "kind List and typed lists",
			in: `apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Node, metadata: {name: a1}}
- {apiVersion: v1, kind: Service, metadata: {name: web}}
---
apiVersion: v1
kind: NodeList
items:
- {apiVersion: v1, kind: Node, metadata: {name: b1}}
`,
			want: []string{"Node a1", "Node b1", "Service default/web"},
		},
		{
			name: "empty List",
			in:   "apiVersion: v1\nkind: List\nitems: []\n",
			want: []string{},
		},
		{
			name: "JSON object",
			in: `{
  "apiVersion": "v1",
  "kind": "Service",
  "metadata": {"name": "web", "namespace": "shop"},
  "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}
}
`,
			want: []string{"Service shop/web"},
		},
		{
			name: "JSON List on one line",
			in:   `{"apiVersion": "v1", "kind": "List", "items": [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a1"}}]}`,
			want: []string{"Node a1"},
		},
		{
			name: "comments-only and empty documents are skipped",
			in: `# just a comment
---
---
   # indented comment

---
apiVersion: v1
kind: Node
metadata: {name: a1}
--- # a comment on the separator
# and one more
`,
			want: []string{"Node a1"},
		},
		{
			name: "a null document is skipped",
			in:   "~\n---\napiVersion: v1\nkind: Node\nmetadata: {name: a1}\n",
			want: []string{"Node a1"},
		},
		{
			name: "unknown kinds warn with the document's line",
			in: `apiVersion: v1
kind: ConfigMap
metadata: {name: settings}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: shop}
---
apiVersion: v1
kind: Node
metadata: {name: a1}
---
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Secret, metadata: {name: token}}
`,
			want: []string{"Node a1"},
			wantWarnings: []string{
				"f.yaml:1: skipping v1 ConfigMap settings (kind not used by topolb)",
				"f.yaml:5: skipping apps/v1 Deployment web (kind not used by topolb)",
				"f.yaml:16: skipping v1 Secret token (kind not used by topolb)",
			},
		},
		{
			name: "known kinds of other API versions warn",
			in: `apiVersion: discovery.k8s.io/v1beta1
kind: EndpointSlice
metadata: {name: old}
`,
			want:         []string{},
			wantWarnings: []string{"f.yaml:1: skipping discovery.k8s.io/v1beta1 EndpointSlice old (kind not used by topolb)"},
		},
		{
			name: "namespace defaulting",
			in: `apiVersion: v1
kind: Service
metadata: {name: web}
---
apiVersion: v1
kind: Service
metadata: {name: api, namespace: ""}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1}
addressType: IPv4
endpoints: []
---
apiVersion: v1
kind: Node
metadata: {name: a1}
`,
			want: []string{"Node a1", "Service default/web", "Service default/api", "EndpointSlice default/web-1"},
		},
		{
			name: "malformed YAML names the offending line",
			in: `apiVersion: v1
kind: Node
metadata: {name: a1}
---
apiVersion: v1
kind: Node
metadata:
  name: b1
   labels: {a: b}
`,
			wantErr: "f.yaml:9: mapping values are not allowed in this context",
		},
		{
			name:    "a tab in indentation",
			in:      "# header\n\napiVersion: v1\nkind: Node\nmetadata:\n\tname: a1\n",
			wantErr: "f.yaml:6: found character that cannot start any token",
		},
		{
			name:    "an unclosed flow mapping after comments",
			in:      "# one\n# two\n---\napiVersion: v1\nkind: Node\nmetadata: {name: a1\n",
			wantErr: "f.yaml:6: did not find expected ',' or '}'",
		},
		{
			name:    "malformed JSON",
			in:      "{\n  \"apiVersion\": \"v1\",\n  \"kind\": \"Node\"\n  \"metadata\": {}\n}\n",
			wantErr: "f.yaml:3: did not find expected ',' or '}'",
		},
		{
			name: "wrong field type names the document",
			in: `apiVersion: v1
kind: Node
metadata: {name: a1}
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  ports: [{port: "eighty"}]
`,
			wantErr: "f.yaml:5: service default/web: json: cannot unmarshal string into Go struct field ServicePort.spec.ports.port of type int32",
		},
		{
			name:    "wrong field type in a List item",
			in:      "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Node, metadata: {name: a1, labels: [x]}}\n",
			wantErr: "f.yaml:4: node a1: json: cannot unmarshal array into Go struct field ObjectMeta.metadata.labels of type map[string]string",
		},
		{
			name:    "a document without apiVersion and kind",
			in:      "apiVersion: v1\nkind: Node\nmetadata: {name: a1}\n---\nname: stray\n",
			wantErr: "f.yaml:5: document has no apiVersion and kind",
		},
		{
			name:    "a document that is not an object",
			in:      "- a\n- b\n",
			wantErr: "f.yaml:1: not a Kubernetes object: json: cannot unmarshal array into Go value of type kube.typeMeta",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { checkDecode(t, tt.in, tt.want, tt.wantWarnings, tt.wantErr) })
	}
}

func TestDecodeManifestsKeepsFields(t *testing.T) {
	in := `apiVersion: v1
kind: Service
metadata:
  name: web
  annotations: {topolb.io/zone-threshold: "2"}
spec:
  clusterIP: 10.96.0.1
  trafficDistribution: PreferClose
  internalTrafficPolicy: Local
  ports: [{name: http, port: 80, nodePort: 30080, protocol: UDP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: UDP}]
endpoints:
- addresses: [10.0.0.1]
  nodeName: a1
  zone: zone-a
  conditions: {ready: false, serving: true, terminating: true}
  hints: {forZones: [{name: zone-a}], forNodes: [{name: a1}]}
`
	objs, _, err := DecodeManifests("f.yaml", []byte(in))
	if err != nil {
		t.Fatal(err)
	}
	svc := objs.Services[0]
	if svc.Annotations["topolb.io/zone-threshold"] != "2" || *svc.Spec.TrafficDistribution != "PreferClose" ||
		string(*svc.Spec.InternalTrafficPolicy) != "Local" || svc.Spec.Ports[0].NodePort != 30080 || svc.Spec.Ports[0].Protocol != "UDP" {
		t.Errorf("service fields lost: %+v", svc)
	}
	e := objs.Slices[0].Endpoints[0]
	if *e.NodeName != "a1" || *e.Zone != "zone-a" || *e.Conditions.Ready || !*e.Conditions.Serving || !*e.Conditions.Terminating ||
		e.Hints.ForZones[0].Name != "zone-a" || e.Hints.ForNodes[0].Name != "a1" {
		t.Errorf("endpoint fields lost: %+v", e)
	}
	if *objs.Slices[0].Ports[0].Port != 8080 {
		t.Errorf("slice port lost: %+v", objs.Slices[0].Ports)
	}
}

func TestLoadManifests(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "cluster.yaml")
	if err := os.WriteFile(path, []byte("apiVersion: v1\nkind: Node\nmetadata: {name: a1}\n---\nkind: [\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, _, err := LoadManifests(path)
	if err == nil || !strings.HasPrefix(err.Error(), path+":5: ") {
		t.Errorf("error %v, want one starting with %s:5:", err, path)
	}
	_, _, err = LoadManifests(filepath.Join(dir, "missing.yaml"))
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("error %v, want one wrapping fs.ErrNotExist", err)
	}
}

func TestDecodeManifestsDuplicates(t *testing.T) {
	tests := []decodeCase{
		{
			name: "the last definition of an object wins, both lines named",
			in: `apiVersion: v1
kind: Service
metadata: {name: web}
spec: {clusterIP: 10.96.0.1}
---
apiVersion: v1
kind: Node
metadata: {name: a1}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec: {clusterIP: 10.96.0.2}
`,
			want:         []string{"Node a1", "Service default/web"},
			wantWarnings: []string{"f.yaml:10: Service default/web is defined twice: this definition is used, the one at line 1 is ignored"},
		},
		{
			name: "same name in other namespaces and kinds is no duplicate",
			in: `apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Service, metadata: {name: web, namespace: a}}
- {apiVersion: v1, kind: Service, metadata: {name: web, namespace: b}}
- {apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web, namespace: a}, addressType: IPv4}
- {apiVersion: v1, kind: Node, metadata: {name: web}}
`,
			want: []string{"Node web", "Service a/web", "Service b/web", "EndpointSlice a/web"},
		},
		{
			name: "same-named EndpointSlices in a List: the last is kept, not merged",
			in: `apiVersion: v1
kind: List
items:
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}
  addressType: IPv4
  endpoints: [{addresses: [10.0.0.1]}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}
  addressType: IPv4
  endpoints: [{addresses: [10.0.0.2]}]
`,
			want:         []string{"EndpointSlice default/web-1"},
			wantWarnings: []string{"f.yaml:9: EndpointSlice default/web-1 is defined twice: this definition is used, the one at line 4 is ignored"},
		},
		{
			name: "Nodes are cluster-scoped: a namespace does not tell them apart",
			in:   "{apiVersion: v1, kind: Node, metadata: {name: a1, namespace: x}}\n---\n{apiVersion: v1, kind: Node, metadata: {name: a1}}\n",
			want: []string{"Node a1"},
			wantWarnings: []string{
				"f.yaml:3: Node a1 is defined twice: this definition is used, the one at line 1 is ignored",
			},
		},
		{
			name: "a key given twice in one mapping refuses the file",
			in: `apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  clusterIP: 10.96.0.1
  clusterIP: 10.96.0.2
`,
			wantErr: `f.yaml:6: key "clusterIP" is given twice in one mapping (also at line 5); which value is meant is unclear, so the manifest is refused`,
		},
		{
			name: "a key merged in with << may be overridden",
			in: `apiVersion: v1
kind: List
items:
- &node {apiVersion: v1, kind: Node, metadata: {name: a1, labels: {zone: a}}}
- {<<: *node, metadata: {name: b1}}
`,
			want: []string{"Node a1", "Node b1"},
		},
		{
			name: "a key written twice next to a merge is still refused",
			in: `apiVersion: v1
kind: List
items:
- &node {apiVersion: v1, kind: Node, metadata: {name: a1}}
- <<: *node
  metadata: {name: b1}
  metadata: {name: c1}
`,
			wantErr: `f.yaml:7: key "metadata" is given twice in one mapping (also at line 6); which value is meant is unclear, so the manifest is refused`,
		},
		{
			name:    "a key given twice in a JSON object refuses the file",
			in:      "---\n{\"apiVersion\": \"v1\", \"kind\": \"Node\",\n \"metadata\": {\"name\": \"a\", \"name\": \"b\"}}\n",
			wantErr: `f.yaml:3: key "name" is given twice in one mapping (also at line 3); which value is meant is unclear, so the manifest is refused`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { checkDecode(t, tt.in, tt.want, tt.wantWarnings, tt.wantErr) })
	}
	// The kept definition is the later one, field by field.
	objs, _, err := DecodeManifests("f.yaml", []byte(tests[0].in))
	if err != nil {
		t.Fatal(err)
	}
	if ip := objs.Services[0].Spec.ClusterIP; ip != "10.96.0.2" {
		t.Errorf("kept clusterIP %s, want the later definition's 10.96.0.2", ip)
	}
}

func TestDecodeManifestsDocumentMarkers(t *testing.T) {
	tests := []decodeCase{
		{
			name: "a document that starts on its marker's line is not lost",
			in:   "apiVersion: v1\nkind: Node\nmetadata: {name: a1}\n--- {apiVersion: v1, kind: Node, metadata: {name: b1}}\n--- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}}\n",
			want: []string{"Node a1", "Node b1"},
			// The document on the marker's line is reported at that line.
			wantWarnings: []string{"f.yaml:5: skipping v1 ConfigMap c (kind not used by topolb)"},
		},
		{
			name: "a document end marker splits too",
			in:   "apiVersion: v1\nkind: Node\nmetadata: {name: a1}\n...\napiVersion: v1\nkind: Node\nmetadata: {name: b1}\n... # end\n",
			want: []string{"Node a1", "Node b1"},
		},
		{
			name: "lines that only start with dashes are content",
			in:   "apiVersion: v1\nkind: Node\nmetadata:\n  name: a1\n  annotations:\n    note: |\n      ---x\n      text\n",
			want: []string{"Node a1"},
		},
		{
			name: "CRLF line ends",
			in:   "apiVersion: v1\r\nkind: Node\r\nmetadata: {name: a1}\r\n---\r\napiVersion: v1\r\nkind: Node\r\nmetadata: {name: b1}\r\n",
			want: []string{"Node a1", "Node b1"},
		},
		{
			name: "a line of a megabyte is read whole",
			in: "apiVersion: v1\nkind: Node\nmetadata: {name: a1, annotations: {big: " + strings.Repeat("x", 1<<20) + "}}\n" +
				"---\napiVersion: v1\nkind: Node\nmetadata: {name: b1}\n",
			want: []string{"Node a1", "Node b1"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { checkDecode(t, tt.in, tt.want, tt.wantWarnings, tt.wantErr) })
	}
}

// nestedLists returns a JSON document of depth Lists around one Node.
func nestedLists(depth int) string {
	return strings.Repeat(`{"apiVersion": "v1", "kind": "List", "items": [`, depth) +
		`{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a1"}}` + strings.Repeat("]}", depth)
}

func TestDecodeManifestsLimits(t *testing.T) {
	tests := []struct {
		name string
		in   string
		// wantErr is the error exactly ("" when the input is within the
		// limits and must decode).
		wantErr string
	}{
		{name: "Lists nested to the limit", in: nestedLists(MaxListDepth)},
		{
			name:    "Lists nested past the limit",
			in:      nestedLists(MaxListDepth + 1),
			wantErr: "f.yaml:1: List nested in more than 4 Lists: manifest exceeds a limit",
		},
		{
			name:    "Lists nested past the limit over lines name the List's line",
			in:      "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: List\n  items:\n  - apiVersion: v1\n    kind: List\n    items:\n    - apiVersion: v1\n      kind: List\n      items:\n      - apiVersion: v1\n        kind: List\n        items: []\n",
			wantErr: "f.yaml:13: List nested in more than 4 Lists: manifest exceeds a limit",
		},
		{name: "documents to the limit", in: strings.Repeat("---\n", MaxManifestDocuments-1)},
		{
			name:    "documents past the limit",
			in:      strings.Repeat("---\n", MaxManifestDocuments),
			wantErr: "f.yaml:262144: more than 262144 YAML documents: manifest exceeds a limit",
		},
		{
			name: "objects past the limit",
			in:   "apiVersion: v1\nkind: List\nitems:\n" + strings.Repeat("- {apiVersion: v1, kind: ConfigMap}\n", MaxManifestObjects),
			// Too large a List to find the item's line again: its index.
			wantErr: "f.yaml:1 (List item 262143): more than 262144 objects: manifest exceeds a limit",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := DecodeManifests("f.yaml", []byte(tt.in))
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("within the limits: %v", err)
			case tt.wantErr != "" && (err == nil || err.Error() != tt.wantErr):
				t.Fatalf("error %v, want %q", err, tt.wantErr)
			case tt.wantErr != "" && !errors.Is(err, ErrManifestLimit):
				t.Errorf("error %v does not wrap ErrManifestLimit", err)
			}
		})
	}
	big := make([]byte, MaxManifestBytes+1)
	if _, _, err := DecodeManifests("f.yaml", big); !errors.Is(err, ErrManifestLimit) {
		t.Errorf("data over MaxManifestBytes: error %v, want ErrManifestLimit", err)
	}
}

// TestDecodeManifestsLinear checks that decoding work grows linearly with a
// List's size, wide or nested to the limit, by bytes allocated (which,
// unlike time, does not depend on the machine's load): four times the items
// may cost at most five times the allocation.
func TestDecodeManifestsLinear(t *testing.T) {
	wide := func(n int) string {
		var b strings.Builder
		b.WriteString("apiVersion: v1\nkind: List\nitems:\n")
		for i := range n {
			fmt.Fprintf(&b, "- {apiVersion: v1, kind: Node, metadata: {name: n%d}}\n", i)
		}
		return b.String()
	}
	nested := func(n int) string {
		// n Nodes in the innermost of MaxListDepth Lists.
		items := make([]string, n)
		for i := range items {
			items[i] = fmt.Sprintf(`{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n%d"}}`, i)
		}
		return strings.Repeat(`{"apiVersion": "v1", "kind": "List", "items": [`, MaxListDepth) +
			strings.Join(items, ",\n") + strings.Repeat("]}", MaxListDepth)
	}
	for name, gen := range map[string]func(int) string{"wide": wide, "nested": nested} {
		t.Run(name, func(t *testing.T) {
			alloc := func(in string) uint64 {
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				if _, _, err := DecodeManifests("f.yaml", []byte(in)); err != nil {
					t.Fatal(err)
				}
				runtime.ReadMemStats(&after)
				return after.TotalAlloc - before.TotalAlloc
			}
			small, large := alloc(gen(2000)), alloc(gen(8000))
			ratio := float64(large) / float64(small)
			t.Logf("%s: 2000 items %d KiB, 8000 items %d KiB: ratio %.2f (linear: 4)", name, small>>10, large>>10, ratio)
			if ratio > 5 {
				t.Errorf("4x the items cost %.1fx the allocation: not linear", ratio)
			}
		})
	}
}

func TestDecodeManifestsInvalidNames(t *testing.T) {
	in := "apiVersion: v1\nkind: List\nitems:\n" +
		"- {apiVersion: v1, kind: Service, metadata: {name: \"web\\x07\\e[31m\"}}\n" +
		"- {apiVersion: v1, kind: Service, metadata: {name: Web}}\n" +
		"- {apiVersion: v1, kind: Service, metadata: {name: web, namespace: \"a b\"}}\n" +
		"- {apiVersion: v1, kind: Node, metadata: {name: " + strings.Repeat("n", 300) + "}}\n" +
		"- {apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web.1}, addressType: IPv4}\n" +
		"- {apiVersion: v1, kind: Node, metadata: {name: node-a1.example}}\n"
	objs, warnings, err := DecodeManifests("f.yaml", []byte(in))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := manifestSummary(objs), []string{"Node node-a1.example", "EndpointSlice default/web.1"}; !slices.Equal(got, want) {
		t.Errorf("objects %q, want %q", got, want)
	}
	wantPrefixes := []string{
		`f.yaml:4: skipping Service "web\a\x1b[31m": metadata.name: a DNS-1035 label must consist of`,
		`f.yaml:5: skipping Service "Web": metadata.name: a DNS-1035 label`,
		`f.yaml:6: skipping Service "web" in namespace "a b": metadata.namespace: a lowercase RFC 1123 label`,
		`f.yaml:7: skipping Node "` + strings.Repeat("n", maxQuotedName) + `"...: metadata.name: must be no more than 253 characters`,
	}
	if len(warnings) != len(wantPrefixes) {
		t.Fatalf("warnings %q, want %d", warnings, len(wantPrefixes))
	}
	for i, w := range warnings {
		if !strings.HasPrefix(w, wantPrefixes[i]) || !strings.HasSuffix(w, "(the apiserver refuses such names)") {
			t.Errorf("warning %q, want it to start with %q", w, wantPrefixes[i])
		}
		for _, r := range w {
			if r < ' ' {
				t.Errorf("warning %q holds a control character", w)
			}
		}
	}
}
