// Package kube turns Kubernetes objects, from manifests or from a live
// cluster through client-go informers, into the model the decision engine
// and the agent work on, and tracks their changes.
package kube

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"sigs.k8s.io/yaml"

	"github.com/topolb/topolb/topology"
)

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

// LoadManifests reads a file of YAML documents (JSON is YAML too), each an
// object or a `kind: List`. v1 Nodes and Services and discovery.k8s.io/v1
// EndpointSlices are kept; other kinds are skipped with a warning. A
// malformed document is an error naming the file and line.
func LoadManifests(path string) (*Objects, []string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("read manifests: %w", err)
	}
	return DecodeManifests(path, data)
}

// DecodeManifests is LoadManifests on data already read; name is used in
// errors and warnings.
func DecodeManifests(name string, data []byte) (*Objects, []string, error) {
	objs := &Objects{}
	var warnings []string
	for _, doc := range splitDocuments(data) {
		if len(bytes.TrimSpace(stripComments(doc.body))) == 0 {
			continue
		}
		js, err := yaml.YAMLToJSON(doc.body)
		if err != nil {
			return nil, nil, fmt.Errorf("%s:%d: %s", name, doc.line+yamlErrorLine(err), cleanYAMLError(err))
		}
		if string(js) == "null" {
			continue
		}
		w, err := objs.add(js)
		if err != nil {
			return nil, nil, fmt.Errorf("%s:%d: %w", name, doc.line, err)
		}
		for _, s := range w {
			warnings = append(warnings, fmt.Sprintf("%s:%d: %s", name, doc.line, s))
		}
	}
	return objs, warnings, nil
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

// add decodes one JSON object (or List) into o.
func (o *Objects) add(js []byte) ([]string, error) {
	var tm typeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return nil, fmt.Errorf("not a Kubernetes object: %w", err)
	}
	switch {
	case tm.Kind == "List" || strings.HasSuffix(tm.Kind, "List") && tm.Items != nil:
		var warnings []string
		for i, item := range tm.Items {
			w, err := o.add(item)
			if err != nil {
				return nil, fmt.Errorf("%s item %d: %w", tm.Kind, i, err)
			}
			warnings = append(warnings, w...)
		}
		return warnings, nil
	case tm.APIVersion == "v1" && tm.Kind == "Node":
		var n v1.Node
		if err := json.Unmarshal(js, &n); err != nil {
			return nil, fmt.Errorf("node %s: %w", tm.Metadata.Name, err)
		}
		o.Nodes = append(o.Nodes, &n)
	case tm.APIVersion == "v1" && tm.Kind == "Service":
		var s v1.Service
		if err := json.Unmarshal(js, &s); err != nil {
			return nil, fmt.Errorf("service %s/%s: %w", nsOrDefault(tm.Metadata.Namespace), tm.Metadata.Name, err)
		}
		s.Namespace = nsOrDefault(s.Namespace)
		o.Services = append(o.Services, &s)
	case tm.APIVersion == "discovery.k8s.io/v1" && tm.Kind == "EndpointSlice":
		var es discovery.EndpointSlice
		if err := json.Unmarshal(js, &es); err != nil {
			return nil, fmt.Errorf("endpointslice %s/%s: %w", nsOrDefault(tm.Metadata.Namespace), tm.Metadata.Name, err)
		}
		es.Namespace = nsOrDefault(es.Namespace)
		o.Slices = append(o.Slices, &es)
	case tm.Kind == "" && tm.APIVersion == "":
		return nil, fmt.Errorf("document has no apiVersion and kind")
	default:
		return []string{fmt.Sprintf("skipping %s %s (kind not used by topolb)", tm.APIVersion, kindName(tm))}, nil
	}
	return nil, nil
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

type document struct {
	line int // 1-based line of the document's first line
	body []byte
}

// splitDocuments splits YAML on "---" separator lines, remembering where
// each document starts.
func splitDocuments(data []byte) []document {
	var docs []document
	cur := document{line: 1}
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64*1024), 64*1024*1024)
	line := 0
	for sc.Scan() {
		line++
		text := sc.Text()
		if strings.HasPrefix(text, "---") && strings.TrimSpace(strings.SplitN(text[3:], "#", 2)[0]) == "" {
			docs = append(docs, cur)
			cur = document{line: line + 1}
			continue
		}
		cur.body = append(cur.body, text...)
		cur.body = append(cur.body, '\n')
	}
	return append(docs, cur)
}

// stripComments drops full-line comments, to recognise documents that hold
// nothing else.
func stripComments(b []byte) []byte {
	var out []byte
	for _, l := range bytes.Split(b, []byte("\n")) {
		if t := bytes.TrimSpace(l); len(t) > 0 && t[0] != '#' {
			out = append(out, l...)
		}
	}
	return out
}

var (
	yamlLineRE       = regexp.MustCompile(`line (\d+)`)
	yamlLinePrefixRE = regexp.MustCompile(`line \d+: `)
)

// yamlErrorLine returns the 0-based line offset a YAML error names inside
// its document, or 0.
func yamlErrorLine(err error) int {
	m := yamlLineRE.FindStringSubmatch(err.Error())
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n - 1
}

func cleanYAMLError(err error) string {
	s := strings.TrimPrefix(err.Error(), "error converting YAML to JSON: ")
	return yamlLinePrefixRE.ReplaceAllString(strings.TrimPrefix(s, "yaml: "), "")
}
