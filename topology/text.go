package topology

import (
	"strconv"
	"unicode/utf8"
)

// MaxReason bounds a decision's reason, in bytes; a longer one is cut (on
// a character boundary) and ends in "...".
const MaxReason = 1024

// boundReason applies MaxReason.
func boundReason(s string) string {
	if len(s) <= MaxReason {
		return s
	}
	cut := MaxReason - len("...")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

// maxQuoted bounds how much of a user-supplied value (an annotation, a
// field) a reason or warning quotes, so that a huge value cannot make a
// reason huge.
const maxQuoted = 64

// quoteBounded quotes s as Go does (control characters escaped), keeping at
// most maxQuoted runes of it and marking the cut with "...".
func quoteBounded(s string) string {
	if utf8.RuneCountInString(s) <= maxQuoted {
		return strconv.Quote(s)
	}
	cut := 0
	for i := range s {
		if cut == maxQuoted {
			return strconv.Quote(s[:i]) + "..."
		}
		cut++
	}
	return strconv.Quote(s)
}
