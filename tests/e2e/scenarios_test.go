package e2e

import (
	"testing"
	"time"

	"github.com/topolb/topolb/tools/testbed"
)

// TestScenarios runs every scenario of the demo (tools/testbed/examples/
// demo.yaml) and asserts, over HTTP (TCP) and UDP, that the client lands on
// exactly the backend set the spec names, which must also be the set
// DecideNode permits for the client's node (and, with agents, the set the
// agent reports): every permitted backend answers, no other one does, no
// request fails unless the traffic is dropped by design, in which case all
// fail. Backends see the client's own address (pods, and outside clients
// under externalTrafficPolicy Local), and no namespace counts a checksum
// error. Scenarios with via reach the Service through a node's NodePorts. With agents it also runs against a real
// kube-apiserver, the agents watching it instead of a manifest file.
func TestScenarios(t *testing.T) {
	requireRoot(t)
	for _, dp := range append(datapaths, withAgentsAndAPIServer) {
		t.Run(dp.name, func(t *testing.T) {
			spec := demoSpec(t)
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			for _, sc := range spec.Scenarios {
				t.Run(sc.Name, func(t *testing.T) {
					_, stream, err := tb.EnterScenario(t.Context(), sc.Name, func() error { return tb.WaitAgents(t.Context(), 10*time.Second) })
					if err != nil {
						t.Fatal(err)
					}
					if stream != nil {
						err := testbed.StreamStays(t.Context(), stream, sc.Drain.Pod, 10)
						stream.Close()
						if err != nil {
							t.Error(err)
						}
					}
					for _, e := range sc.Expect {
						o := testbed.MeasureOptions{Requests: 200, Parallel: 32}
						if len(e.Backends) == 0 {
							// Every request times out: fewer and shorter.
							o = testbed.MeasureOptions{Requests: 50, Parallel: 50, Timeout: 500 * time.Millisecond}
						}
						landings, _, err := tb.MeasureExpectation(t.Context(), e, o)
						if err != nil {
							t.Fatal(err)
						}
						checkLandings(t, landings, e.Backends)
					}
				})
			}
			noChecksumErrors(t, tb)
		})
	}
}
