package topology

import (
	"strconv"
	"unicode/utf8"
)

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
