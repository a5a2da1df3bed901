package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// flow is a long-lived flow from the client and the backend it first
// reached.
type flow struct {
	conn    *testbed.Conn
	proto   v1.Protocol
	family  v1.IPFamily
	backend string
	// gone is set once the flow's backend was removed and the flow was
	// asked once more.
	gone bool
}

// errorKind names an error for counting.
func errorKind(err error) string {
	tally := testbed.Summarize(nil, []testbed.Record{{Err: err}})
	return tally.Errors[0]
}

func openFlows(t *testing.T, client *testbed.Pod, target map[v1.Protocol]netip.AddrPort, perProto int) []*flow {
	t.Helper()
	var flows []*flow
	for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
		for i := 0; i < perProto; i++ {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			c, err := client.Open(ctx, proto, target[proto])
			if err != nil {
				cancel()
				t.Fatalf("open %s flow: %v", proto, err)
			}
			a, err := c.Ask(ctx)
			cancel()
			if err != nil {
				t.Fatalf("%s flow %s: first request: %v", proto, c.LocalAddr(), err)
			}
			t.Cleanup(func() { c.Close() })
			flows = append(flows, &flow{conn: c, proto: proto, family: topology.FamilyOf(target[proto].Addr()), backend: a.Pod})
		}
	}
	return flows
}

// targets returns the frontends of the web Service's ports.
func targets(t *testing.T, tb *testbed.Testbed, client *testbed.Pod) map[v1.Protocol]netip.AddrPort {
	t.Helper()
	return targetsOf(t, tb, client, "")
}

// targetsOf is targets in family ("": the Service's first).
func targetsOf(t *testing.T, tb *testbed.Testbed, client *testbed.Pod, family v1.IPFamily) map[v1.Protocol]netip.AddrPort {
	t.Helper()
	out := map[v1.Protocol]netip.AddrPort{}
	for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
		out[proto] = decisionOnOf(t, tb, client.Node.Name, "web", proto, family).Frontend
	}
	return out
}

// TestFlowsKeepTheirBackend opens TCP connections and connected UDP
// sockets to the web Service, then changes its backend set three times:
// adding a backend to the client's zone, changing backends in other zones,
// removing one of the zone's backends. After each change, every flow whose
// backend is still permitted must still reach that same backend, and new
// flows must land exactly on the new permitted set; a flow whose backend
// was removed is balanced afresh within a second of the change: UDP
// answers from a permitted backend, TCP gets a reset instead of hanging.
// Not at once: the datapath learns that a backend is gone when the agent's
// walk of conntrack marks its flows stale, within maps.staleDelay (50 ms)
// plus the walk, so until then such a flow may still reach it.
// The Service is dual stack: the flows of both IP families are opened
// together and every check holds for each family; the new flows
// measured after each change are split between the families (the kernel
// matrix runs this test under emulation: IPv6 adds little time there).
func TestFlowsKeepTheirBackend(t *testing.T) {
	requireRoot(t)
	for _, dp := range datapaths {
		t.Run(dp.name, func(t *testing.T) {
			spec := dualStackSpec(t)
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			base := service(t, spec, "zone-hints", "web") // zone-a: web-a1, web-a2
			base.IPFamilies = bothFamilies
			apply(t, tb, []testbed.ServiceSpec{base})
			client := tb.Pod("client")
			families := servedFamilies(t, tb, topology.ScopeInternal)
			var flows []*flow
			for _, family := range families {
				flows = append(flows, openFlows(t, client, targetsOf(t, tb, client, family), 12)...)
			}

			afterAdd := with(base, testbed.EndpointSpec{Pod: "web-a3"})
			otherZones := without(afterAdd, "web-b2")
			otherZones.Endpoints[slices.IndexFunc(otherZones.Endpoints, func(e testbed.EndpointSpec) bool { return e.Pod == "web-c1" })].Condition = testbed.Terminating
			afterRemove := without(otherZones, "web-a2")
			for _, step := range []struct {
				name      string
				svc       testbed.ServiceSpec
				permitted []string
				// removes is set when a backend some flows are on stops
				// being permitted.
				removes bool
			}{
				{"add web-a3 to zone-a", afterAdd, []string{"web-a1", "web-a2", "web-a3"}, false},
				{"remove web-b2, web-c1 terminating", otherZones, []string{"web-a1", "web-a2", "web-a3"}, false},
				{"remove web-a2", afterRemove, []string{"web-a1", "web-a3"}, true},
			} {
				apply(t, tb, []testbed.ServiceSpec{step.svc})
				applied := time.Now()
				kept, moved := map[v1.IPFamily]int{}, 0
				// gone[family]: what became of flows on a backend no
				// longer permitted.
				gone := map[v1.IPFamily]map[string]int{}
				for _, family := range families {
					gone[family] = map[string]int{}
				}
				for _, f := range flows {
					if f.gone {
						continue
					}
					removed := !slices.Contains(step.permitted, f.backend)
					a, err := ask(t, f)
					// A flow on a removed backend may reach it until its
					// entry is marked stale: ask again until it no longer
					// does, for at most a second after the change.
					for removed && err == nil && a.Pod == f.backend && time.Since(applied) < time.Second {
						time.Sleep(20 * time.Millisecond)
						a, err = ask(t, f)
					}
					took := time.Since(applied)
					if removed {
						// Its backend is gone (removed from the slice): the
						// flow is balanced afresh on its next packet. UDP
						// moves to a permitted backend; TCP gets that
						// backend's reset at once instead of hanging.
						f.gone = true
						switch {
						case f.proto == v1.ProtocolUDP && err == nil && slices.Contains(step.permitted, a.Pod) && took < time.Second:
							gone[f.family]["UDP moved to "+a.Pod]++
						case f.proto == v1.ProtocolTCP && err != nil && errorKind(err) == "connection reset" && took < time.Second:
							gone[f.family]["TCP reset"]++
						default:
							t.Errorf("%s: %s flow %s on removed %s: answer %q, err %v %v after the change; want UDP moved to %v or TCP reset, within 1 s",
								step.name, f.proto, f.conn.LocalAddr(), f.backend, a.Pod, err, took.Round(time.Millisecond), step.permitted)
						}
						continue
					}
					switch {
					case err != nil:
						t.Errorf("%s: %s flow %s on %s failed: %v", step.name, f.proto, f.conn.LocalAddr(), f.backend, err)
					case a.Pod != f.backend:
						moved++
						t.Errorf("%s: %s flow %s moved from %s to %s although %s is still permitted", step.name, f.proto, f.conn.LocalAddr(), f.backend, a.Pod, f.backend)
					default:
						kept[f.family]++
					}
				}
				t.Logf("%s: flows that kept their backend %v, %d moved; flows on removed backends: %v", step.name, kept, moved, gone)
				for _, family := range families {
					if kept[family] == 0 {
						t.Errorf("%s: no %s flow was on a backend still permitted: the step checks nothing", step.name, family)
					}
					if step.removes && len(gone[family]) == 0 {
						t.Errorf("%s: no %s flow was on the removed backend: the step checks nothing about removal", step.name, family)
					}
				}
				landings, err := tb.Measure(t.Context(), client, "web", testbed.MeasureOptions{Requests: 150 / len(families), Families: families})
				if err != nil {
					t.Fatal(err)
				}
				checkLandingFamilies(t, landings, families)
				checkLandings(t, landings, step.permitted)
			}
			noChecksumErrors(t, tb)
		})
	}
}

// TestRemovedBackendDrainsWithinASecond sends new flows (TCP and UDP, in
// both IP families of a dual-stack Service at once) continuously from
// the client while web-a2 is removed from the web Service, and asserts,
// for each protocol and family, that no flow started more than 1 s after
// the change reached web-a2, that web-a1 keeps answering, and that
// nothing fails after that second.
func TestRemovedBackendDrainsWithinASecond(t *testing.T) {
	requireRoot(t)
	for _, dp := range datapaths {
		t.Run(dp.name, func(t *testing.T) {
			spec := dualStackSpec(t)
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			base := service(t, spec, "zone-hints", "web")
			base.IPFamilies = bothFamilies
			apply(t, tb, []testbed.ServiceSpec{base})
			client := tb.Pod("client")
			type load struct {
				family v1.IPFamily
				proto  v1.Protocol
			}
			var loads []load
			for _, family := range servedFamilies(t, tb, topology.ScopeInternal) {
				for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
					loads = append(loads, load{family, proto})
				}
			}

			ctx, cancel := context.WithCancel(t.Context())
			var wg sync.WaitGroup
			recs := map[load][]testbed.Record{}
			var mu sync.Mutex
			for _, l := range loads {
				target := targetsOf(t, tb, client, l.family)[l.proto]
				wg.Add(1)
				go func() {
					defer wg.Done()
					// 8 requests in flight in all, as many as the
					// IPv4-only test had: the families share them.
					r := client.Send(ctx, testbed.Load{Proto: l.proto, Target: target, Parallel: 8 / len(loads), Timeout: 2 * time.Second})
					mu.Lock()
					recs[l] = r
					mu.Unlock()
				}()
			}
			time.Sleep(time.Second)
			changed := time.Now()
			if _, err := tb.Apply(t.Context(), []testbed.ServiceSpec{without(base, "web-a2")}); err != nil {
				cancel()
				wg.Wait()
				t.Fatal(err)
			}
			time.Sleep(2500 * time.Millisecond)
			cancel()
			wg.Wait()

			deadline := changed.Add(time.Second)
			for _, l := range loads {
				rs, what := recs[l], string(l.family)+" "+string(l.proto)
				var last time.Time // start of the last request that reached web-a2
				a1Before, a2Before, a1After, failedInGrace := 0, 0, 0, 0
				for _, r := range rs {
					end := r.Start.Add(r.Took)
					switch {
					case r.Err != nil && end.Before(changed):
						t.Errorf("%s: request that ended %v before the change failed: %v", what, changed.Sub(end).Round(time.Millisecond), r.Err)
					case r.Err != nil && r.Start.After(deadline):
						t.Errorf("%s: request started %v after the change failed: %v", what, r.Start.Sub(changed).Round(time.Millisecond), r.Err)
					case r.Err != nil:
						failedInGrace++
					case r.Answer.Pod == "web-a2":
						last = r.Start
						if r.Start.Before(changed) {
							a2Before++
						}
						if r.Start.After(deadline) {
							t.Errorf("%s: request started %v after web-a2 was removed still landed on it", what, r.Start.Sub(changed).Round(time.Millisecond))
						}
					case r.Answer.Pod != "web-a1":
						t.Errorf("%s: request landed on %s, outside zone-a's permitted set", what, r.Answer.Pod)
					case r.Start.Before(changed):
						a1Before++
					default:
						a1After++
					}
				}
				// Before the change both zone-a backends must have been
				// used, or nothing was removed from under the load.
				if a1Before == 0 || a2Before == 0 {
					t.Errorf("%s: before the change %d requests reached web-a1 and %d web-a2, want both used", what, a1Before, a2Before)
				}
				if last.IsZero() || last.After(deadline) {
					t.Errorf("%s: last request to web-a2 started at %v (change at %v): want one, within a second of the change", what, last.Format(time.StampMilli), changed.Format(time.StampMilli))
				}
				if a1After == 0 {
					t.Errorf("%s: no request reached web-a1 after the change", what)
				}
				drain := "before the change"
				if last.After(changed) {
					drain = fmt.Sprintf("%v after the change", last.Sub(changed).Round(time.Millisecond))
				}
				t.Logf("%s: %d requests; last one to web-a2 started %s; %d in flight at the change or started within the second after it failed", what, len(rs), drain, failedInGrace)
			}
			noChecksumErrors(t, tb)
		})
	}
}

// checkLandingFamilies fails the test unless landings hold each of
// families, and no other.
func checkLandingFamilies(t *testing.T, landings []testbed.Landing, families []v1.IPFamily) {
	t.Helper()
	n := map[v1.IPFamily]int{}
	for _, l := range landings {
		n[l.Decision.Family]++
	}
	for _, family := range families {
		if n[family] == 0 {
			t.Errorf("nothing measured in %s: measured %v", family, n)
		}
	}
	if len(n) != len(families) {
		t.Errorf("measured families %v, want %v", n, families)
	}
}

// ask sends one request on f's connection, waiting at most 2 s.
func ask(t *testing.T, f *flow) (testbed.Answer, error) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	return f.conn.Ask(ctx)
}
