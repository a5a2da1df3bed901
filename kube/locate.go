package kube

import (
	yaml3 "go.yaml.in/yaml/v3"
)

// maxLocateBytes bounds the documents parsed a second time to find the
// lines of List items: larger ones report the List's line and the item's
// index instead, so a warning about one item of a huge List does not cost
// a second copy of its tree.
const maxLocateBytes = 8 << 20

// locatedDoc is a document parsed with positions.
type locatedDoc struct {
	root *yaml3.Node
}

// locate returns the line of a List item within its document (1-based),
// parsing the document with positions the first time one of its items is
// asked for. Objects are decoded by sigs.k8s.io/yaml, which keeps no
// positions; this second parse runs only for the few items a warning or an
// error names.
func (d *decoder) locate(loc location) (int, bool) {
	ld := d.parsed(loc.doc)
	if ld == nil {
		return 0, false
	}
	n := ld.root
	for _, i := range loc.path {
		items := mappingValue(n, "items")
		if items == nil || items.Kind != yaml3.SequenceNode || i >= len(items.Content) {
			return 0, false
		}
		n = deref(items.Content[i])
	}
	return n.Line, true
}

// parsed returns document i parsed with positions, parsing it the first
// time, or nil.
func (d *decoder) parsed(i int) *locatedDoc {
	if d.located == nil {
		d.located = map[int]*locatedDoc{}
	}
	ld, ok := d.located[i]
	if !ok {
		ld = parseLocated(d.docs[i].body)
		d.located[i] = ld
	}
	return ld
}

// parseLocated parses body with positions, or returns nil.
func parseLocated(body []byte) *locatedDoc {
	if len(body) > maxLocateBytes {
		return nil
	}
	var doc yaml3.Node
	if err := yaml3.Unmarshal(body, &doc); err != nil || doc.Kind != yaml3.DocumentNode || len(doc.Content) != 1 {
		return nil
	}
	return &locatedDoc{root: deref(doc.Content[0])}
}

// mappingValue returns the value of key in mapping n, or nil.
func mappingValue(n *yaml3.Node, key string) *yaml3.Node {
	if n == nil || n.Kind != yaml3.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Kind == yaml3.ScalarNode && n.Content[i].Value == key {
			return deref(n.Content[i+1])
		}
	}
	return nil
}

// deref follows an alias to its anchor's node.
func deref(n *yaml3.Node) *yaml3.Node {
	if n != nil && n.Kind == yaml3.AliasNode && n.Alias != nil {
		return n.Alias
	}
	return n
}

// duplicate is a key written twice in one mapping, at 1-based lines of its
// document.
type duplicate struct {
	key           string
	first, second int
}

// duplicateKey finds the first key written twice in one mapping of document
// i. ok is false when the document could not be parsed with positions (too
// large, or refused by this parser); dup is nil when no mapping repeats a
// key of its own (keys merged in with "<<" may be overridden; "<<" itself
// is a key like any other).
func (d *decoder) duplicateKey(i int) (dup *duplicate, ok bool) {
	ld := d.parsed(i)
	if ld == nil {
		return nil, false
	}
	seen := map[*yaml3.Node]bool{}
	var walk func(n *yaml3.Node) *duplicate
	walk = func(n *yaml3.Node) *duplicate {
		// Aliases are walked where their anchor is.
		if n == nil || n.Kind == yaml3.AliasNode || seen[n] {
			return nil
		}
		seen[n] = true
		if n.Kind == yaml3.MappingNode {
			keys := map[[2]string]int{}
			for j := 0; j+1 < len(n.Content); j += 2 {
				k := n.Content[j]
				if k.Kind != yaml3.ScalarNode {
					continue
				}
				id := [2]string{k.ShortTag(), k.Value}
				if line, dup := keys[id]; dup {
					return &duplicate{key: k.Value, first: line, second: k.Line}
				}
				keys[id] = k.Line
			}
		}
		for _, c := range n.Content {
			if dup := walk(c); dup != nil {
				return dup
			}
		}
		return nil
	}
	return walk(ld.root), true
}
