package main

import (
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	good := `# a comment
name: one
file: a.go
package: ./a/
from: x := 1
to: x := 2

name: two
why: because
file: b.c
package: ./b/
after: anchor
from: return 0;
to: return 1;
`
	muts, err := Parse(strings.NewReader(good))
	if err != nil {
		t.Fatal(err)
	}
	if len(muts) != 2 || muts[0].Name != "one" || muts[1].After != "anchor" || muts[1].Line != 8 {
		t.Errorf("parsed %+v", muts)
	}
	for _, c := range []struct{ name, in string }{
		{"missing to", "name: a\nfile: a.go\npackage: ./a/\nfrom: x\n"},
		{"same from and to", "name: a\nfile: a.go\npackage: ./a/\nfrom: x\nto: x\n"},
		{"unknown key", "name: a\nfile: a.go\npackage: ./a/\nfrom: x\nto: y\nwhen: now\n"},
		{"repeated name", "name: a\nfile: a.go\npackage: ./a/\nfrom: x\nto: y\n\nname: a\nfile: a.go\npackage: ./a/\nfrom: x\nto: y\n"},
		{"key twice", "name: a\nname: b\nfile: a.go\npackage: ./a/\nfrom: x\nto: y\n"},
		{"no colon", "name a\n"},
	} {
		if _, err := Parse(strings.NewReader(c.in)); err == nil {
			t.Errorf("%s: parsed without error", c.name)
		}
	}
}

func TestApply(t *testing.T) {
	src := "func f() {\n\tif a {\n\t\treturn 0\n\t}\n\treturn 0\n}\n"
	for _, c := range []struct {
		name string
		m    Mutation
		want string // "" means an error
	}{
		{"indentation kept", Mutation{From: "if a {", To: "if !a {"}, "func f() {\n\tif !a {\n\t\treturn 0\n\t}\n\treturn 0\n}\n"},
		{"ambiguous without anchor", Mutation{From: "return 0", To: "return 1"}, ""},
		{"first match after the anchor", Mutation{After: "if a {", From: "return 0", To: "return 1"}, "func f() {\n\tif a {\n\t\treturn 1\n\t}\n\treturn 0\n}\n"},
		{"missing line", Mutation{From: "return 2", To: "return 1"}, ""},
		{"missing anchor", Mutation{After: "while", From: "return 0", To: "return 1"}, ""},
	} {
		got, err := Apply([]byte(src), c.m)
		switch {
		case c.want == "" && err == nil:
			t.Errorf("%s: applied: %q", c.name, got)
		case c.want != "" && (err != nil || string(got) != c.want):
			t.Errorf("%s: %q, %v; want %q", c.name, got, err, c.want)
		}
	}
}
