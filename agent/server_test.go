package agent

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"
)

// TestWriteDebugStateIsMarshal: the streamed /debug/state is the document
// json.Marshal makes of the state, for a real state and for the empty
// one (null lists, no datapath error).
func TestWriteDebugStateIsMarshal(t *testing.T) {
	a, _, _ := syncAll(t, nodeWithIP("a1", "zone-a", "10.250.0.2"), external("web", "10.96.0.1", "Local"),
		epSlice("web", "web-1", endpoint{"10.0.1.1", "a1", "zone-a", "zone-a", true}, endpoint{"10.0.2.1", "b1", "zone-b", "zone-b", true}))
	full := a.State()
	full.DatapathError = "example"
	if len(full.Datapath) == 0 {
		t.Fatal("no programmed frontends: the test compares nothing")
	}
	for name, st := range map[string]DebugState{"full": full, "empty": {}} {
		want, err := json.Marshal(st)
		if err != nil {
			t.Fatal(err)
		}
		// The datapath half comes from fill, as in the handler.
		head := DebugState{Report: st.Report, Synced: st.Synced}
		fill := func(d *DebugState) {
			d.Programmed, d.Datapath, d.DatapathError = st.Programmed, st.Datapath, st.DatapathError
		}
		var streamed bytes.Buffer
		if err := writeDebugState(&streamed, &head, fill); err != nil {
			t.Fatal(err)
		}
		var got, exp any
		if err := json.Unmarshal(streamed.Bytes(), &got); err != nil {
			t.Fatalf("%s: streamed document is not JSON: %v\n%s", name, err, streamed.String())
		}
		if err := json.Unmarshal(want, &exp); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, exp) {
			t.Errorf("%s: streamed\n%s\nmarshalled\n%s", name, streamed.String(), want)
		}
	}
}
