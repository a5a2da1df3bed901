package agent

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/internal/nettest"
	"github.com/topolb/topolb/kube"
	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// lbService is a LoadBalancer Service with cluster IP ip, load-balancer IP
// lbIP, ports TCP 80, 81, ... (n of them) and nRanges /32 source ranges.
func lbService(name, ip, lbIP string, ports, nRanges int) *v1.Service {
	svc := service(name, ip, nil)
	svc.Spec.Type = v1.ServiceTypeLoadBalancer
	svc.Spec.Ports = nil
	for i := range ports {
		svc.Spec.Ports = append(svc.Spec.Ports, v1.ServicePort{Name: fmt.Sprintf("p%d", i), Port: int32(80 + i), Protocol: v1.ProtocolTCP, NodePort: int32(30000 + i)})
	}
	svc.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: lbIP}}
	a := netip.MustParseAddr("100.64.0.0")
	for range nRanges {
		svc.Spec.LoadBalancerSourceRanges = append(svc.Spec.LoadBalancerSourceRanges, a.String()+"/32")
		a = a.Next()
	}
	return svc
}

// servedAt reports which of the frontends programmed are at addr (any
// port, either scope), as "addr:port/PROTO[/external]".
func servedAt(fes []string, addr string) []string {
	return slices.DeleteFunc(slices.Clone(fes), func(f string) bool { return !strings.HasPrefix(f, addr+":") })
}

// TestAgentRefusesServiceOverCaps: a Service over a per-Service cap is
// refused whole (no frontend of it programmed, released when it had
// some), with an Event and the metric; a later Service is served; the
// refused Service is served again once it is within the caps.
func TestAgentRefusesServiceOverCaps(t *testing.T) {
	dp := newFakeDP()
	ev := &fakeEvents{}
	m := NewMetrics(prometheus.NewRegistry())
	opts := topology.DefaultOptions()
	opts.Caps = topology.Caps{SourceRanges: 4, Frontends: 8}
	a := New(Config{NodeName: "a1", Options: opts, Events: ev, Metrics: m}, dp)
	tr := kube.NewTracker()
	tr.NodeChanged(nil, node("a1", "zone-a"))
	tr.Resync()
	a.Apply(tr.Drain())
	programmed := func() []string {
		var out []string
		for fe := range dp.fes {
			out = append(out, fe.String())
		}
		slices.Sort(out)
		return out
	}
	refused := func(c topology.CapName) float64 { return testutil.ToFloat64(m.Refused.WithLabelValues(string(c))) }
	step := func(name string, old, cur *v1.Service) SyncResult {
		t.Helper()
		tr.ServiceChanged(old, cur)
		res := a.Apply(tr.Drain())
		if len(res.Errors) > 0 {
			t.Fatalf("%s: sync errors %v", name, res.Errors)
		}
		return res
	}

	// One port: its cluster IP, and its load-balancer IP in both scopes
	// (no NodePort: the node has no address).
	hostile := lbService("hostile", "10.96.0.1", "198.51.100.1", 1, 5)
	step("hostile", nil, hostile)
	if got := servedAt(programmed(), "198.51.100.1"); len(got) != 0 || len(servedAt(programmed(), "10.96.0.1")) != 0 {
		t.Errorf("the Service over its source-range cap has frontends %v", programmed())
	}
	if want := "hostile: refused: 5 loadBalancerSourceRanges, over the cap of 4 per Service (--max-source-ranges-per-service)"; len(ev.refusals) != 1 || !strings.HasPrefix(ev.refusals[0], want) {
		t.Errorf("refusal events %q, want one starting %q", ev.refusals, want)
	}
	if got := refused(topology.CapSourceRanges); got != 1 {
		t.Errorf("topolb_services_refused{cap=source_ranges} = %v, want 1", got)
	}
	// explain --agent shows why (the agent's /debug/state).
	if w := a.State().Report.Warnings; !slices.ContainsFunc(w, func(s string) bool {
		return strings.HasPrefix(s, "default/hostile: refused: 5 loadBalancerSourceRanges")
	}) {
		t.Errorf("/debug/state warnings %q: none says why default/hostile is refused", w)
	}

	later := lbService("later", "10.96.0.2", "198.51.100.2", 1, 4)
	step("later", nil, later)
	if got, want := programmed(), []string{"10.96.0.2:80/TCP", "198.51.100.2:80/TCP", "198.51.100.2:80/TCP/external"}; !slices.Equal(got, want) {
		t.Errorf("after the later Service: %v, want %v", got, want)
	}

	// Within the cap: served; the metric goes back to 0.
	fixed := lbService("hostile", "10.96.0.1", "198.51.100.1", 1, 4)
	step("fixed", hostile, fixed)
	if got := servedAt(programmed(), "198.51.100.1"); len(got) != 2 {
		t.Errorf("the Service within its caps: %v served at its load-balancer IP, want both scopes", got)
	}
	if got := refused(topology.CapSourceRanges); got != 0 {
		t.Errorf("topolb_services_refused{cap=source_ranges} = %v once within the cap, want 0", got)
	}

	// Over the frontend cap (3 ports × 3 frontends = 9 > 8): its
	// programmed frontends are released, the other Service's kept.
	many := lbService("hostile", "10.96.0.1", "198.51.100.1", 3, 0)
	step("many ports", fixed, many)
	if got, want := programmed(), []string{"10.96.0.2:80/TCP", "198.51.100.2:80/TCP", "198.51.100.2:80/TCP/external"}; !slices.Equal(got, want) {
		t.Errorf("after the Service went over its frontend cap: %v, want only the later Service's %v", got, want)
	}
	if got := refused(topology.CapFrontends); got != 1 || len(ev.refusals) != 2 || !strings.Contains(ev.refusals[1], "9 frontends on this node, over the cap of 8") {
		t.Errorf("frontend cap: metric %v (want 1), events %q", got, ev.refusals)
	}

	// Deleted: no longer counted.
	step("delete", many, nil)
	if got := refused(topology.CapFrontends); got != 0 {
		t.Errorf("topolb_services_refused{cap=frontends} = %v after the Service was deleted, want 0", got)
	}
}

// TestAgentHostileSourceRangesRealDatapath is issue 32's case on a real
// datapath: a Service with 32,766 /32 source ranges on one load-balancer
// IP would take 65,532 of the 65,536 slots of tlb_src_ranges and leave a
// Service created after it unserved (map full). Under the default caps
// it is refused, and the later Service is programmed with its ranges;
// without caps the same two Services show the failure the caps prevent.
func TestAgentHostileSourceRangesRealDatapath(t *testing.T) {
	nettest.RequireRoot(t)
	for _, tc := range []struct {
		name string
		caps topology.Caps
		// served says whether the later Service is programmed.
		served bool
	}{
		{"default caps", topology.DefaultCaps, true},
		{"no caps", topology.Caps{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bpffs := t.TempDir()
			if err := unix.Mount("bpf", bpffs, "bpf", 0, "mode=0700"); err != nil {
				t.Skipf("cannot mount bpffs: %v", err)
			}
			t.Cleanup(func() { _ = unix.Unmount(bpffs, unix.MNT_DETACH) })
			dp, err := dpmaps.Load(dpmaps.Options{PinPath: filepath.Join(bpffs, "topolb"), MaxFrontends: 1024, MaxBackends: 4096, MaxConntrack: 4096})
			if err != nil {
				t.Fatalf("load datapath: %v", err)
			}
			t.Cleanup(func() {
				if err := dp.Unpin(); err != nil {
					t.Errorf("unpin: %v", err)
				}
				dp.Close()
			})
			opts := topology.DefaultOptions()
			opts.Caps = tc.caps
			ev := &fakeEvents{}
			a := New(Config{NodeName: "a1", Options: opts, Events: ev}, dp)
			tr := kube.NewTracker()
			tr.NodeChanged(nil, node("a1", "zone-a"))
			tr.Resync()
			a.Apply(tr.Drain())

			hostile := lbService("hostile", "10.96.0.1", "198.51.100.1", 1, 32766)
			tr.ServiceChanged(nil, hostile)
			if res := a.Apply(tr.Drain()); len(res.Errors) > 0 {
				t.Fatalf("hostile Service: %v", res.Errors)
			}
			later := lbService("later", "10.96.0.2", "198.51.100.2", 1, 4)
			tr.ServiceChanged(nil, later)
			res := a.Apply(tr.Drain())

			prog, err := dp.Programmed()
			if err != nil {
				t.Fatal(err)
			}
			var laterRanges, hostileRanges int
			for fe, s := range prog {
				switch fe.Addr.Addr().String() {
				case "198.51.100.2":
					laterRanges += len(s.SourceRanges)
				case "198.51.100.1":
					hostileRanges += len(s.SourceRanges)
				}
			}
			t.Logf("hostile: %d ranges programmed, later: %d; sync errors %v; refusals %q", hostileRanges, laterRanges, res.Errors, ev.refusals)
			if !tc.served {
				if len(res.Errors) == 0 || !errors.Is(res.Errors[0], dpmaps.ErrMapFull) {
					t.Errorf("without caps the later Service synced with errors %v, want map full (the issue's failure)", res.Errors)
				}
				return
			}
			if len(res.Errors) > 0 {
				t.Errorf("later Service: %v", res.Errors)
			}
			if hostileRanges != 0 || len(ev.refusals) != 1 {
				t.Errorf("hostile Service: %d ranges programmed, refusals %q; want none programmed, one refusal", hostileRanges, ev.refusals)
			}
			if laterRanges != 2*4 {
				t.Errorf("later Service: %d ranges programmed over its load-balancer frontends, want 8 (4 ranges, 2 scopes)", laterRanges)
			}
		})
	}
}
