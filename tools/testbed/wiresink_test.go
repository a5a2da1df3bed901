package testbed

import (
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
)

const wireSinkSpec = `
name: sink
kubeProxy: none
zones:
- name: z1
  nodes:
  - name: n1
    pods: [{name: c, role: client}]
  - name: n2
    pods: [{name: b}]
outside: {ingressNode: n1, clients: [{name: ext1}]}
services:
- {name: sink, clusterIP: 10.96.9.9, ports: [{protocol: UDP, port: 9, targetPort: 9}], endpoints: [{pod: b}]}
- {name: np, type: NodePort, ports: [{protocol: UDP, port: 9, targetPort: 9, nodePort: 30909}], endpoints: [{pod: b}]}
`

// TestWireSink runs the node-local floods of BenchmarkE2E's node_pps and
// node_ns_pps rows on a small testbed: frames from a pod on n1 to a
// ClusterIP, and from outside into n1's uplink to a NodePort, both with
// their backend on n2, must reach n1's switch port translated to the
// backend — and only there: the sink drops them, n2 sees none. Without a
// datapath the same floods leave untranslated (the sink's stray count) or
// stay on n1, so the checks can fail; after the sink is gone the port has
// its pass program back. The redirect floor (BenchmarkE2E's ceiling for
// node_pps) takes the ClusterIP flood to the wire translated too, in
// frames the backend's stack accepts, and nothing once it is off.
func TestWireSink(t *testing.T) {
	requireRoot(t)
	spec, err := ParseSpec([]byte(wireSinkSpec))
	if err != nil {
		t.Fatal(err)
	}
	tb, err := New(t.Context(), spec, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Close()
	if _, err := tb.Apply(t.Context(), spec.Services); err != nil {
		t.Fatal(err)
	}
	n1, c, b, ext := tb.Node("n1"), tb.Pod("c"), tb.Pod("b"), tb.External("ext1")
	vip := netip.MustParseAddrPort("10.96.9.9:9")
	nodePort := netip.AddrPortFrom(n1.WireAddr.Addr(), 30909)
	backend := netip.AddrPortFrom(b.Addr, 9)
	const frames = 5000
	floods := []struct {
		name   string
		target netip.AddrPort
		flood  func(target netip.AddrPort, count int) (FloodResult, error)
	}{
		{"pod to ClusterIP", vip, c.FloodUDP},
		{"outside to NodePort", nodePort, func(to netip.AddrPort, n int) (FloodResult, error) { return tb.FloodWire(ext, n1, to, n) }},
	}
	// sunk floods through a sink on n1's port for backend and the flood's
	// target, after a few frames that let n1 resolve its next hop, and
	// checks that b saw none of it.
	sunk := func(name string, target netip.AddrPort, flood func(netip.AddrPort, int) (FloodResult, error)) FloodResult {
		t.Helper()
		if _, err := flood(target, 10); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		sink, err := tb.AttachWireSink(n1, backend, target)
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := sink.Close(); err != nil {
				t.Error(err)
			}
		}()
		var res FloodResult
		atB, err := CountArrivals(b.NS, func() (FloodResult, error) {
			var err error
			res, err = sink.CountArrivals(func() (FloodResult, error) { return flood(target, frames) })
			return res, err
		})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if res.Sent < frames {
			t.Errorf("%s: the flood injected %d frames, asked for %d", name, res.Sent, frames)
		}
		if atB.Arrived != 0 {
			t.Errorf("%s: %d datagrams got past the sink to %s", name, atB.Arrived, b.Name)
		}
		t.Logf("%s: %d frames in %v (%.0f pps, %.0f ns of CPU each): %d at the sink translated, %d untranslated, %d dropped by the wire",
			name, res.Sent, res.Took, res.PPS, float64(res.CPU.Nanoseconds())/float64(res.Sent), res.Arrived, res.Stray, res.WireDrops)
		return res
	}

	// No datapath: the ClusterIP flood leaves n1 untranslated; the
	// NodePort flood is n1's own (nothing listens), taken through the pass
	// program FloodWire lends the uplink, and never reaches the wire.
	res := sunk(floods[0].name, vip, c.FloodUDP)
	if res.Arrived != 0 || res.Stray < uint64(res.Sent)*9/10 || res.Stray > uint64(res.Sent) {
		t.Errorf("no datapath, pod to ClusterIP: %d translated, %d untranslated of %d; want none translated, at least 90%% untranslated", res.Arrived, res.Stray, res.Sent)
	}
	local, err := CountArrivals(n1.NS, func() (FloodResult, error) { return tb.FloodWire(ext, n1, nodePort, frames) })
	if err != nil {
		t.Fatal(err)
	}
	if local.Arrived < uint64(local.Sent)*9/10 || local.Arrived > uint64(local.Sent) {
		t.Errorf("no datapath, outside to n1:30909: %d of %d datagrams reached n1's stack", local.Arrived, local.Sent)
	}
	if xdp := linkXDP(t, n1.NS, UplinkName); xdp.Attached {
		t.Errorf("n1's uplink keeps an XDP program (id %d) after FloodWire lent it one", xdp.ProgId)
	}

	// The redirect floor (no datapath under it) takes the ClusterIP flood
	// to the wire translated, past n1's stack, in frames b's stack takes
	// (its address, no UDP checksum error).
	floor, err := c.AttachRedirectFloor(vip, b, backend.Port())
	if err != nil {
		t.Fatal(err)
	}
	forwarded := func() uint64 {
		t.Helper()
		s, err := n1.NS.SNMP()
		var n uint64
		if err == nil {
			n, err = s.Counter("Ip", "ForwDatagrams")
		}
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	fwdBefore := forwarded()
	res = sunk("redirect floor, "+floods[0].name, vip, c.FloodUDP)
	if res.Stray != 0 || res.Arrived < uint64(res.Sent)*9/10 || res.Arrived > uint64(res.Sent) {
		t.Errorf("redirect floor: %d of %d datagrams reached the wire translated to %s, %d untranslated; want at least 90%% and none", res.Arrived, res.Sent, backend, res.Stray)
	}
	// Redirected, not forwarded by n1's stack.
	if fwd := forwarded() - fwdBefore; fwd > uint64(res.Sent)/10 {
		t.Errorf("redirect floor: n1's stack forwarded %d of the %d datagrams (Ip ForwDatagrams); want them redirected past it", fwd, res.Sent)
	}
	delivered := func() (ip, csumErrs uint64) {
		t.Helper()
		s, err := b.NS.SNMP()
		if err == nil {
			ip, err = s.Counter("Ip", "InDelivers")
		}
		if err == nil {
			csumErrs, err = s.Counter("Udp", "InCsumErrors")
		}
		if err != nil {
			t.Fatal(err)
		}
		return ip, csumErrs
	}
	ipBefore, csumBefore := delivered()
	if _, err := c.FloodUDP(vip, 100); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	ipAfter, csumAfter := delivered()
	if got := ipAfter - ipBefore; got < 90 || got > 100 || csumAfter != csumBefore {
		t.Errorf("redirect floor: %s's stack took %d of 100 datagrams (Ip InDelivers), with %d UDP checksum errors", b.Name, got, csumAfter-csumBefore)
	}
	if err := floor.Close(); err != nil {
		t.Fatal(err)
	}
	res = sunk("redirect floor taken off, "+floods[0].name, vip, c.FloodUDP)
	if res.Arrived != 0 {
		t.Errorf("after the redirect floor is off: %d datagrams translated, want none", res.Arrived)
	}

	if _, err := tb.AttachDirect(); err != nil {
		t.Fatal(err)
	}
	for _, f := range floods {
		res := sunk(f.name, f.target, f.flood)
		if res.Stray != 0 || res.Arrived < uint64(res.Sent)*9/10 || res.Arrived > uint64(res.Sent) {
			t.Errorf("%s: %d of %d datagrams reached the wire translated to %s, %d untranslated; want at least 90%% and none", f.name, res.Arrived, res.Sent, backend, res.Stray)
		}
	}

	// The port has its pass program back.
	if x := linkXDP(t, tb.Fabric, n1.SwitchPort()); x.AttachMode != nl.XDP_ATTACHED_DRV {
		t.Errorf("n1's switch port after the sink: XDP attach mode %d, want a driver-mode program (%d)", x.AttachMode, nl.XDP_ATTACHED_DRV)
	}
}

// linkXDP returns the XDP attachment of ifname in ns (zero when none).
func linkXDP(t *testing.T, ns *NS, ifname string) netlink.LinkXdp {
	t.Helper()
	l, err := ns.Netlink().LinkByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	if x := l.Attrs().Xdp; x != nil {
		return *x
	}
	return netlink.LinkXdp{}
}
