// Package kube turns Kubernetes objects, from manifests or from a live
// cluster through client-go informers, into the model the decision engine
// and the agent work on, and tracks their changes.
package kube

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"syscall"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"github.com/topolb/topolb/topology"
)

// Bounds on one manifest file. Above any of them the whole file is refused
// with an error wrapping ErrManifestLimit (naming file and line where one
// applies), so a runaway or hostile file costs a bounded amount of memory
// and time, linear in its size. For scale: a Service with one port and its
// EndpointSlice of three endpoints take about 700 bytes of YAML, so 10,000
// such Services are 7 MiB and 20,000 objects, and decode in about 2 s.
const (
	// MaxManifestBytes is the largest manifest file read: about 45,000
	// Services of the shape above. Decoding YAML runs at about 3 MiB/s and
	// its heap peaks at about 12 times the file's size.
	MaxManifestBytes = 32 << 20
	// MaxManifestDocuments is the most YAML documents ("---"-separated,
	// empty ones included) in one file.
	MaxManifestDocuments = 1 << 18
	// MaxManifestObjects is the most objects in one file, counting every
	// object and List, of any kind, at any depth.
	MaxManifestObjects = 1 << 18
	// MaxListDepth is how deeply `kind: List` documents may nest: 1 is a
	// List of objects (what `kubectl get -o yaml` writes), 2 a List of
	// Lists.
	MaxListDepth = 4
	// MaxManifestWarnings is the most warnings reported for one file; the
	// rest are counted in a last warning.
	MaxManifestWarnings = 100
)

// ErrManifestLimit is wrapped by the errors for manifests above one of the
// bounds above.
var ErrManifestLimit = errors.New("manifest exceeds a limit")

// Objects are the cluster objects topolb reads: Nodes, Services and
// EndpointSlices.
type Objects struct {
	Nodes    []*v1.Node
	Services []*v1.Service
	Slices   []*discovery.EndpointSlice
}

// State indexes the objects for decisions. keepLabel selects the node labels
// to retain (nil keeps all).
func (o *Objects) State(keepLabel func(string) bool) *topology.State {
	return topology.NewState(o.Nodes, o.Services, o.Slices, keepLabel)
}

// Empty reports whether o holds no Node, Service or EndpointSlice.
func (o *Objects) Empty() bool {
	return len(o.Nodes) == 0 && len(o.Services) == 0 && len(o.Slices) == 0
}

// HasNode reports whether o holds a Node named name.
func (o *Objects) HasNode(name string) bool {
	for _, n := range o.Nodes {
		if n.Name == name {
			return true
		}
	}
	return false
}

// LoadManifests reads a file of YAML documents (JSON is YAML too), each an
// object or a `kind: List`, within the bounds above; only regular files are
// read. See DecodeManifests for what is kept, warned about and refused.
func LoadManifests(path string) (*Objects, []string, error) {
	data, _, err := readManifest(path)
	if err != nil {
		return nil, nil, err
	}
	return DecodeManifests(path, data)
}

// readManifest reads a regular file of at most MaxManifestBytes and returns
// it with the stamp of what was read. A FIFO, a device (/dev/zero) or a
// directory is refused before it is read: opening is non-blocking, and the
// type is checked on the open file, so a FIFO swapped in after a check can
// neither block nor be read.
func readManifest(path string) ([]byte, fileStamp, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fileStamp{}, fmt.Errorf("read manifests: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fileStamp{}, fmt.Errorf("read manifests: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fileStamp{}, fmt.Errorf("read manifests: %s is %s, not a regular file", path, fileKind(st.Mode()))
	}
	if st.Size() > MaxManifestBytes {
		return nil, fileStamp{}, fmt.Errorf("read manifests: %s: %d bytes is more than %d MiB: %w", path, st.Size(), MaxManifestBytes>>20, ErrManifestLimit)
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxManifestBytes+1))
	if err != nil {
		return nil, fileStamp{}, fmt.Errorf("read manifests: %w", err)
	}
	if len(data) > MaxManifestBytes {
		return nil, fileStamp{}, fmt.Errorf("read manifests: %s grew to more than %d MiB while it was read: %w", path, MaxManifestBytes>>20, ErrManifestLimit)
	}
	return data, stampOf(st), nil
}

// fileKind names a non-regular file's type for errors.
func fileKind(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&os.ModeNamedPipe != 0:
		return "a named pipe"
	case m&os.ModeCharDevice != 0:
		return "a character device"
	case m&os.ModeDevice != 0:
		return "a block device"
	case m&os.ModeSocket != 0:
		return "a socket"
	}
	return "a special file"
}

// DecodeManifests decodes data, a manifest named name (used in errors and
// warnings, with the line).
//
// v1 Nodes and Services and discovery.k8s.io/v1 EndpointSlices are kept,
// with an empty namespace read as "default". The result is all or nothing:
// an error (malformed YAML, a key given twice in one mapping, a document
// that is not an object, a field of the wrong type, a bound above exceeded)
// refuses the whole file and returns no objects. Warnings, with the
// objects:
//   - other kinds and API versions, objects without a name, and objects
//     whose name or namespace the apiserver would refuse are skipped;
//   - an object given twice (same kind, namespace and name) is taken from
//     its last definition in the file; the warning names both lines.
//
// `topolbctl explain --from-file` and the agent's --from-file both load
// through here, so they decide from the same objects.
func DecodeManifests(name string, data []byte) (*Objects, []string, error) {
	if len(data) > MaxManifestBytes {
		return nil, nil, fmt.Errorf("%s: %d bytes is more than %d MiB: %w", name, len(data), MaxManifestBytes>>20, ErrManifestLimit)
	}
	d := &decoder{name: name}
	if err := d.split(data); err != nil {
		return nil, nil, err
	}
	for i := range d.docs {
		if err := d.decodeDocument(i); err != nil {
			return nil, nil, err
		}
	}
	objs := &Objects{}
	for _, e := range d.entries {
		switch {
		case e.dropped:
		case e.node != nil:
			objs.Nodes = append(objs.Nodes, e.node)
		case e.service != nil:
			objs.Services = append(objs.Services, e.service)
		case e.slice != nil:
			objs.Slices = append(objs.Slices, e.slice)
		}
	}
	return objs, d.warnings(), nil
}

// decoder holds one manifest while it is decoded.
type decoder struct {
	name    string
	docs    []document
	objects int
	entries []entry
	// seen indexes entries by object key.
	seen  map[objectKey]int
	notes []note
	// located caches, per document index, the parsed tree used to find the
	// lines of List items; nil when the document could not be parsed.
	located map[int]*locatedDoc
}

// document is one YAML document of the file.
type document struct {
	// line is the 1-based line of the body's first line: 1, or the line of
	// the marker that starts the document.
	line int
	// first is the line reported for the document: the line after its
	// marker, or the marker's line when the document starts on it.
	first int
	body  []byte // a subslice of the file's data
}

// location is where an object is: a document, and the item indices that
// lead to it through nested Lists (none for the document itself).
type location struct {
	doc  int
	path []int
}

func (l location) item(i int) location {
	return location{doc: l.doc, path: append(append([]int(nil), l.path...), i)}
}

type objectKey struct {
	kind, namespace, name string
}

func (k objectKey) String() string {
	if k.namespace == "" {
		return k.kind + " " + k.name
	}
	return k.kind + " " + k.namespace + "/" + k.name
}

// entry is one kept object.
type entry struct {
	loc     location
	dropped bool // defined again later in the file
	node    *v1.Node
	service *v1.Service
	slice   *discovery.EndpointSlice
}

// note is a warning about the object at loc; if other is set, the warning
// names its line too.
type note struct {
	loc   location
	msg   string
	other *location
}

// split cuts data into documents at lines that are a document marker: "---"
// or "..." alone or followed by a space, a tab or a comment ("--- {a: 1}"
// starts a document on the marker's line). Documents are subslices of data:
// nothing is copied, and no line is too long.
func (d *decoder) split(data []byte) error {
	cur := document{line: 1, first: 1}
	start := 0
	for pos, line := 0, 1; pos <= len(data); line++ {
		end := bytes.IndexByte(data[pos:], '\n')
		next := len(data) + 1
		if end < 0 {
			end = len(data)
		} else {
			end += pos
			next = end + 1
		}
		if rest, ok := markerRest(data[pos:end]); ok {
			cur.body = data[start:pos]
			d.docs = append(d.docs, cur)
			if len(d.docs) >= MaxManifestDocuments {
				return fmt.Errorf("%s:%d: more than %d YAML documents: %w", d.name, line, MaxManifestDocuments, ErrManifestLimit)
			}
			cur = document{line: line, first: line + 1}
			if t := bytes.TrimSpace(rest); len(t) > 0 && t[0] != '#' {
				cur.first = line
			}
			start = end - len(rest)
		}
		pos = next
	}
	cur.body = data[start:]
	d.docs = append(d.docs, cur)
	return nil
}

// markerRest reports whether line is a document marker, and returns what
// follows the marker on it.
func markerRest(line []byte) ([]byte, bool) {
	if !bytes.HasPrefix(line, []byte("---")) && !bytes.HasPrefix(line, []byte("...")) {
		return nil, false
	}
	rest := line[3:]
	if len(rest) > 0 && rest[0] != ' ' && rest[0] != '\t' && rest[0] != '\r' {
		return nil, false
	}
	if bytes.HasPrefix(line, []byte("...")) {
		// A document end marker may carry only a comment.
		if t := bytes.TrimSpace(rest); len(t) > 0 && t[0] != '#' {
			return nil, false
		}
		return nil, true
	}
	return rest, true
}

// decodeDocument decodes document i into entries and notes.
func (d *decoder) decodeDocument(i int) error {
	doc := d.docs[i]
	if isBlank(doc.body) {
		return nil
	}
	js, err := yaml.YAMLToJSONStrict(doc.body)
	if err != nil && strings.Contains(err.Error(), " already set in map") {
		// Strict decoding also refuses a key that overrides one merged in
		// with "<<", which YAML allows: only a key written twice in one
		// mapping is refused.
		if dup, ok := d.duplicateKey(i); ok && dup != nil {
			return fmt.Errorf("%s:%d: key %q is given twice in one mapping (also at line %d); which value is meant is unclear, so the manifest is refused",
				d.name, doc.line+dup.second-1, dup.key, doc.line+dup.first-1)
		} else if ok {
			js, err = yaml.YAMLToJSON(doc.body)
		}
	}
	if err != nil {
		line, ok := yamlErrorLine(err)
		if !ok {
			return fmt.Errorf("%s:%d: %s", d.name, doc.first, cleanYAMLError(err))
		}
		return fmt.Errorf("%s:%d: %s", d.name, doc.line+line, cleanYAMLError(err))
	}
	if string(js) == "null" {
		return nil
	}
	return d.add(js, location{doc: i}, 0)
}

// isBlank reports whether a document holds only blank lines and comments.
func isBlank(b []byte) bool {
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		if t := bytes.TrimSpace(line); len(t) > 0 && t[0] != '#' {
			return false
		}
	}
	return true
}

type typeMeta struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Items      []json.RawMessage `json:"items"`
	Metadata   struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
}

// add decodes one JSON object, or a List of them, found at loc; depth is
// the number of Lists around it. Every level decodes only its own bytes
// once, and depth is bounded, so the work is linear in the file's size.
func (d *decoder) add(js []byte, loc location, depth int) error {
	d.objects++
	if d.objects > MaxManifestObjects {
		return d.errorf(loc, "more than %d objects: %w", MaxManifestObjects, ErrManifestLimit)
	}
	var tm typeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return d.errorf(loc, "not a Kubernetes object: %w", err)
	}
	ns := nsOrDefault(tm.Metadata.Namespace)
	switch {
	case tm.Kind == "List" || strings.HasSuffix(tm.Kind, "List") && tm.Items != nil:
		if depth >= MaxListDepth {
			return d.errorf(loc, "%s nested in more than %d Lists: %w", tm.Kind, MaxListDepth, ErrManifestLimit)
		}
		for i, item := range tm.Items {
			if err := d.add(item, loc.item(i), depth+1); err != nil {
				return err
			}
		}
		return nil
	case tm.Kind == "" && tm.APIVersion == "":
		return d.errorf(loc, "document has no apiVersion and kind")
	case !isKept(tm):
		if tm.APIVersion == "" {
			d.warn(loc, "skipping %s: it has no apiVersion", kindName(tm))
		} else {
			d.warn(loc, "skipping %s %s (kind not used by topolb)", tm.APIVersion, kindName(tm))
		}
		return nil
	case tm.Metadata.Name == "":
		d.warn(loc, "skipping %s %s: it has no metadata.name", tm.APIVersion, tm.Kind)
		return nil
	}
	key := objectKey{kind: tm.Kind, namespace: ns, name: tm.Metadata.Name}
	if tm.Kind == "Node" {
		key.namespace = ""
	}
	if reason := invalidName(key); reason != "" {
		d.warn(loc, "skipping %s (the apiserver refuses such names)", reason)
		return nil
	}
	e := entry{loc: loc}
	switch tm.Kind {
	case "Node":
		e.node = &v1.Node{}
		if err := json.Unmarshal(js, e.node); err != nil {
			return d.errorf(loc, "node %s: %w", tm.Metadata.Name, err)
		}
	case "Service":
		e.service = &v1.Service{}
		if err := json.Unmarshal(js, e.service); err != nil {
			return d.errorf(loc, "service %s/%s: %w", ns, tm.Metadata.Name, err)
		}
		e.service.Namespace = ns
	case "EndpointSlice":
		e.slice = &discovery.EndpointSlice{}
		if err := json.Unmarshal(js, e.slice); err != nil {
			return d.errorf(loc, "endpointslice %s/%s: %w", ns, tm.Metadata.Name, err)
		}
		e.slice.Namespace = ns
	}
	if d.seen == nil {
		d.seen = map[objectKey]int{}
	}
	if prev, dup := d.seen[key]; dup {
		d.entries[prev].dropped = true
		first := d.entries[prev].loc
		d.notes = append(d.notes, note{loc: loc, other: &first,
			msg: fmt.Sprintf("%s is defined twice: this definition is used, the one at line %%d is ignored", key)})
	}
	d.seen[key] = len(d.entries)
	d.entries = append(d.entries, e)
	return nil
}

// maxQuotedName bounds how much of an invalid name a warning quotes.
const maxQuotedName = 64

// invalidName returns, for an object whose name or namespace the apiserver
// would refuse, what is wrong with which (quoted and cut to maxQuotedName
// bytes, so warnings stay bounded and printable); "" when both are valid.
// Names are what `explain` and the logs print, so only names the cluster
// itself could hold get that far.
func invalidName(k objectKey) string {
	var msgs []string
	if k.namespace != "" {
		if msgs = validation.IsDNS1123Label(k.namespace); len(msgs) > 0 {
			return fmt.Sprintf("%s %s in namespace %s: metadata.namespace: %s", k.kind, quoteName(k.name), quoteName(k.namespace), msgs[0])
		}
	}
	switch k.kind {
	case "Service":
		msgs = validation.IsDNS1035Label(k.name)
	default:
		msgs = validation.IsDNS1123Subdomain(k.name)
	}
	if len(msgs) > 0 {
		return fmt.Sprintf("%s %s: metadata.name: %s", k.kind, quoteName(k.name), msgs[0])
	}
	return ""
}

// quoteName quotes s as a Go string, escaping control and non-UTF-8
// bytes, cut to maxQuotedName bytes.
func quoteName(s string) string {
	if len(s) > maxQuotedName {
		return strconv.Quote(s[:maxQuotedName]) + "..."
	}
	return strconv.Quote(s)
}

// isKept reports whether tm is a kind and version topolb reads.
func isKept(tm typeMeta) bool {
	switch {
	case tm.APIVersion == "v1":
		return tm.Kind == "Node" || tm.Kind == "Service"
	case tm.APIVersion == "discovery.k8s.io/v1":
		return tm.Kind == "EndpointSlice"
	}
	return false
}

func (d *decoder) warn(loc location, format string, args ...any) {
	d.notes = append(d.notes, note{loc: loc, msg: fmt.Sprintf(format, args...)})
}

// errorf returns an error naming the file and the line of loc.
func (d *decoder) errorf(loc location, format string, args ...any) error {
	return fmt.Errorf("%s: %w", d.where(loc), fmt.Errorf(format, args...))
}

// warnings formats the notes, at most MaxManifestWarnings of them.
func (d *decoder) warnings() []string {
	var out []string
	for i, n := range d.notes {
		if i == MaxManifestWarnings {
			out = append(out, fmt.Sprintf("%s: %d more warnings not shown", d.name, len(d.notes)-i))
			break
		}
		msg := n.msg
		if n.other != nil {
			line, _ := d.line(*n.other)
			msg = fmt.Sprintf(msg, line)
		}
		out = append(out, d.where(n.loc)+": "+msg)
	}
	return out
}

// where renders loc as "file:line", adding the List item indices when the
// item's own line could not be found.
func (d *decoder) where(loc location) string {
	line, exact := d.line(loc)
	s := d.name + ":" + strconv.Itoa(line)
	if !exact {
		parts := make([]string, len(loc.path))
		for i, p := range loc.path {
			parts[i] = strconv.Itoa(p)
		}
		s += " (List item " + strings.Join(parts, ".") + ")"
	}
	return s
}

// line returns the line loc is reported at: a document's first line (after
// its "---"), or a List item's own line. exact is false when a List item's
// line could not be found and the line is its document's.
func (d *decoder) line(loc location) (line int, exact bool) {
	doc := d.docs[loc.doc]
	if len(loc.path) == 0 {
		return doc.first, true
	}
	if n, ok := d.locate(loc); ok {
		return doc.line + n - 1, true
	}
	return doc.first, false
}

func kindName(tm typeMeta) string {
	if tm.Metadata.Name == "" {
		return tm.Kind
	}
	return tm.Kind + " " + tm.Metadata.Name
}

func nsOrDefault(ns string) string {
	if ns == "" {
		return v1.NamespaceDefault
	}
	return ns
}

var (
	yamlLineRE       = regexp.MustCompile(`line (\d+)`)
	yamlLinePrefixRE = regexp.MustCompile(`line \d+: `)
)

// yamlErrorLine returns the 0-based line offset a YAML error names inside
// its document, and whether it names one.
func yamlErrorLine(err error) (int, bool) {
	m := yamlLineRE.FindStringSubmatch(err.Error())
	if m == nil {
		return 0, false
	}
	n, err := strconv.Atoi(m[1])
	if err != nil {
		return 0, false
	}
	return n - 1, true
}

// cleanYAMLError turns a YAML error into a message without the library's
// prefixes and line numbers (the caller puts the line in front). Of several
// errors ("unmarshal errors:" and one line each) it keeps the first, whose
// line the caller names.
func cleanYAMLError(err error) string {
	s := strings.TrimPrefix(err.Error(), "error converting YAML to JSON: ")
	s = strings.TrimPrefix(s, "yaml: ")
	if rest, ok := strings.CutPrefix(s, "unmarshal errors:\n"); ok {
		first, _, _ := strings.Cut(strings.TrimSpace(rest), "\n")
		s = first
	}
	s = yamlLinePrefixRE.ReplaceAllString(s, "")
	if k, ok := strings.CutPrefix(s, "key "); ok && strings.HasSuffix(k, " already set in map") {
		return "key " + strings.TrimSuffix(k, " already set in map") + " is given twice in one mapping; which value is meant is unclear, so the manifest is refused"
	}
	return s
}
