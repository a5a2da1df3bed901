package main

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/topolb/topolb/topology"
)

// Bounds on what one table cell or warning line shows, in characters.
const (
	// maxName bounds names and other short fields (a Kubernetes name is
	// at most 253 characters).
	maxName = 253
	// maxText bounds reasons, notes and warnings.
	maxText = topology.MaxReason
)

// cell makes s safe for a terminal and a tab-aligned table: every
// character that is not printable (control characters, tabs, newlines,
// escape sequences, invisible format characters) and every invalid UTF-8
// byte is written as a Go escape (\x1b, \t, \u202e), and the result is cut
// after max characters, ending in "...".
func cell(s string, max int) string {
	var b strings.Builder
	n := 0
	for i, r := range s {
		if n == max {
			b.WriteString("...")
			break
		}
		switch {
		case r == utf8.RuneError && !strings.HasPrefix(s[i:], string(utf8.RuneError)):
			b.WriteString(`\x` + strconv.FormatUint(uint64(s[i]), 16))
		case r == '\\' || !unicode.IsPrint(r):
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteRune(r)
		}
		n++
	}
	return b.String()
}

// cells applies cell to each string.
func cells(ss []string, max int) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = cell(s, max)
	}
	return out
}
