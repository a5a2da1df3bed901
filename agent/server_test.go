package agent

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"

	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// TestWriteDebugStateIsMarshal: the streamed /debug/state is the document
// json.Marshal makes of the state: through the handler's own path for an
// agent with services and for one without, and with a datapath error.
func TestWriteDebugStateIsMarshal(t *testing.T) {
	a, _, _ := syncAll(t, nodeWithIP("a1", "zone-a", "10.250.0.2"), external("web", "10.96.0.1", "Local"),
		epSlice("web", "web-1", endpoint{"10.0.1.1", "a1", "zone-a", "zone-a", true}, endpoint{"10.0.2.1", "b1", "zone-b", "zone-b", true}),
		service("headless", "None", nil))
	empty, _, _ := syncAll(t, nodeWithIP("a1", "zone-a", "10.250.0.2"))
	full := a.State()
	if len(full.Datapath) == 0 || len(full.Services) == 0 || len(full.Frontends) == 0 || len(full.Skipped) == 0 {
		t.Fatal("no decisions or programmed frontends: the test compares nothing")
	}
	withError := full
	withError.DatapathError = "example"
	withError.Uplinks = []dpmaps.UplinkStatus{{Interface: "eth0", Path: "tc", Programs: []string{"tc_uplink_lb", "tc_lb_egress"}, Reason: "example"}}
	withError.Kernel = &dpmaps.KernelReport{Release: "6.1.0-50-amd64", Features: []dpmaps.KernelFeature{{Name: "tcx links", Since: "6.6", Without: "clsact filters", Path: "tc"}}}
	withUplinksError := full
	withUplinksError.UplinksError = "example"
	for _, c := range []struct {
		name  string
		want  DebugState
		write func(*bytes.Buffer) error
	}{
		{"full", full, func(b *bytes.Buffer) error { return a.writeDebug(b) }},
		{"empty", empty.State(), func(b *bytes.Buffer) error { return empty.writeDebug(b) }},
		{"datapath error", withError, func(b *bytes.Buffer) error {
			st := DebugState{Synced: withError.Synced, Families: withError.Families, FamiliesByScope: withError.FamiliesByScope}
			fill := func(d *DebugState) {
				d.Programmed, d.Datapath, d.DatapathError = withError.Programmed, withError.Datapath, withError.DatapathError
				d.Uplinks, d.Kernel = withError.Uplinks, withError.Kernel
			}
			return writeDebugState(b, walkerOf(withError.Report), &st, fill)
		}},
		{"uplinks error", withUplinksError, func(b *bytes.Buffer) error {
			st := DebugState{Synced: withUplinksError.Synced, Families: withUplinksError.Families, FamiliesByScope: withUplinksError.FamiliesByScope}
			fill := func(d *DebugState) {
				d.Programmed, d.Datapath, d.UplinksError = withUplinksError.Programmed, withUplinksError.Datapath, withUplinksError.UplinksError
			}
			return writeDebugState(b, walkerOf(withUplinksError.Report), &st, fill)
		}},
	} {
		want, err := json.Marshal(c.want)
		if err != nil {
			t.Fatal(err)
		}
		var streamed bytes.Buffer
		if err := c.write(&streamed); err != nil {
			t.Fatal(err)
		}
		var got, exp any
		if err := json.Unmarshal(streamed.Bytes(), &got); err != nil {
			t.Fatalf("%s: streamed document is not JSON: %v\n%s", c.name, err, streamed.String())
		}
		if err := json.Unmarshal(want, &exp); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, exp) {
			t.Errorf("%s: streamed\n%s\nmarshalled\n%s", c.name, streamed.String(), want)
		}
	}
}

// walkerOf walks a Report already built.
func walkerOf(r topology.Report) reportWalker {
	return reportWalker{node: r.Node, zone: r.Zone, skipped: r.Skipped, walk: func(service func(topology.PortReport), frontend func(topology.FrontendReport)) []string {
		for _, p := range r.Services {
			service(p)
		}
		for _, f := range r.Frontends {
			frontend(f)
		}
		return r.Warnings
	}}
}
