package maps

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/topolb/topolb/internal/nettest"
)

// tcpRefused connects from ns to target and returns how long the
// connection took to be refused, or an error when it was not.
func tcpRefused(t *testing.T, ns *nettest.NS, target string, timeout time.Duration, refusal syscall.Errno) (time.Duration, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	start := time.Now()
	c, err := ns.DialContext(ctx, "tcp"+family(netip.MustParseAddrPort(target)), target)
	took := time.Since(start)
	if err == nil {
		c.Close()
		return 0, errors.New("connected")
	}
	if !errors.Is(err, refusal) {
		return 0, err
	}
	return took, nil
}

// udpSendRefused sends one datagram from an unconnected socket in ns and
// returns the send's error.
func udpSendRefused(t *testing.T, ns *nettest.NS, target string) error {
	t.Helper()
	c, err := ns.ListenPacket("udp"+family(netip.MustParseAddrPort(target)), ":0")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.WriteTo([]byte("q"), net.UDPAddrFromAddrPort(netip.MustParseAddrPort(target)))
	return err
}

// TestRejectRealTraffic refuses connections to an empty reject service
// from each kind of client, within 100 ms: a pod (a reset or port
// unreachable from tc), the node's own processes (the socket call fails
// with ECONNREFUSED), and a client outside the node reaching an external
// frontend (a reset or port unreachable from XDP or from the uplink's tc
// path, both ways; node2 stands in for it). A service empty by policy keeps dropping: the pod's connection
// times out.
func TestRejectRealTraffic(t *testing.T) {
	requirePrivileges(t)
	for _, path := range []UplinkPath{UplinkXDP, UplinkTC} {
		t.Run(string(path), func(t *testing.T) { testRejectRealTraffic(t, path) })
	}
}

func testRejectRealTraffic(t *testing.T, path UplinkPath) {
	tb := newTestbed(t)
	d := hostDatapathOpts(t, Options{NetNS: tb.node1.Path, UplinkPath: path})
	const (
		vipTCP, vipUDP = "10.96.0.30:80", "10.96.0.30:53"
		dropTCP        = "10.96.0.31:80"
		extTCP, extUDP = "192.0.2.30:80", "192.0.2.30:53"
	)
	for _, f := range []Frontend{fe(vipTCP, TCP), fe(vipUDP, UDP),
		{Addr: netip.MustParseAddrPort(extTCP), Proto: TCP, Scope: ScopeExternal},
		{Addr: netip.MustParseAddrPort(extUDP), Proto: UDP, Scope: ScopeExternal}} {
		mustSetService(t, d, f, Service{Reject: true})
	}
	mustSetService(t, d, fe(dropTCP, TCP), Service{})
	for _, ifname := range []string{"hc", "hb1", "hb2"} {
		must(t, d.AttachPod(ifname))
	}
	must(t, d.AttachUplink("w1"))
	must(t, tb.node2.AddRoute("192.0.2.0/24", "10.9.0.1"))
	if path == UplinkXDP {
		// XDP_TX on w1 hands frames to w2, which takes them only in
		// NAPI mode; tc's redirect needs nothing of w2.
		xdpPassOn(t, tb.node2, "w2")
	}

	for _, c := range []struct {
		name   string
		ns     *nettest.NS
		tcp    string
		udp    string
		unconn bool // also an unconnected UDP send, refused by the socket hook
		// hook says the socket hooks refuse (the node's processes):
		// their errno is sockRefusal's.
		hook bool
	}{
		{"pod", tb.client, vipTCP, vipUDP, false, false},
		{"host_process", tb.node1, vipTCP, vipUDP, true, true},
		{"outside_client", tb.node2, extTCP, extUDP, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			refusal := syscall.ECONNREFUSED
			if c.hook {
				refusal = sockRefusal(d, syscall.ECONNREFUSED)
			}
			checkRefused(t, d, c.ns, c.tcp, c.udp, c.unconn, refusal)
		})
	}

	t.Run("drop_frontend_keeps_dropping", func(t *testing.T) { checkDropped(t, tb.client, dropTCP) })

	for name, ns := range tb.all() {
		if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
		}
	}
}

// TestRejectRealTrafficIPv6 is TestRejectRealTraffic's pod and node
// process in IPv6: a pod's connection to an empty IPv6 reject frontend is
// refused within 100 ms by a reset from tc, its UDP by an ICMPv6 port
// unreachable from tc, the node's processes by the socket hooks; a
// frontend empty by policy keeps dropping.
func TestRejectRealTrafficIPv6(t *testing.T) {
	requirePrivileges(t)
	tb := newTestbed(t)
	tb.dualStack(t)
	d := hostDatapathOpts(t, Options{NetNS: tb.node1.Path})
	const (
		vipTCP, vipUDP = "[fd00:96::30]:80", "[fd00:96::30]:53"
		dropTCP        = "[fd00:96::31]:80"
	)
	mustSetService(t, d, fe(vipTCP, TCP), Service{Reject: true})
	mustSetService(t, d, fe(vipUDP, UDP), Service{Reject: true})
	mustSetService(t, d, fe(dropTCP, TCP), Service{})
	must(t, d.AttachPod("hc"))

	t.Run("pod", func(t *testing.T) { checkRefused(t, d, tb.client, vipTCP, vipUDP, false, syscall.ECONNREFUSED) })
	t.Run("host_process", func(t *testing.T) {
		checkRefused(t, d, tb.node1, vipTCP, vipUDP, true, sockRefusal(d, syscall.ECONNREFUSED))
	})
	t.Run("drop_frontend_keeps_dropping", func(t *testing.T) { checkDropped(t, tb.client, dropTCP) })
	for name, ns := range tb.all() {
		if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
		}
	}
}

// checkRefused checks that from ns a TCP connection to tcp and a UDP
// datagram on a connected socket to udp (and, with unconn, one from an
// unconnected socket) are refused with refusal within 100 ms, each
// counted once as StatReject.
func checkRefused(t *testing.T, d *Datapath, ns *nettest.NS, tcp, udp string, unconn bool, refusal syscall.Errno) {
	t.Helper()
	const refusedWithin = 100 * time.Millisecond
	before, err := d.Counters()
	must(t, err)
	took, err := tcpRefused(t, ns, tcp, 2*time.Second, refusal)
	if err != nil {
		t.Fatalf("TCP to %s: %v", tcp, err)
	}
	t.Logf("TCP refused after %s", took)
	if took > refusedWithin {
		t.Errorf("TCP refused after %s, want within %s", took, refusedWithin)
	}
	took, err = udpRefused(t, ns, udp, 2*time.Second, refusal)
	if err != nil {
		t.Fatalf("UDP to %s: %v", udp, err)
	}
	t.Logf("UDP refused after %s", took)
	if took > refusedWithin {
		t.Errorf("UDP refused after %s, want within %s", took, refusedWithin)
	}
	want := uint64(2)
	if unconn {
		if err := udpSendRefused(t, ns, udp); !errors.Is(err, refusal) {
			t.Errorf("unconnected UDP send to %s: %v, want %v", udp, err, refusal)
		}
		want++
	}
	after, err := d.Counters()
	must(t, err)
	if n := after.Stats[StatReject] - before.Stats[StatReject]; n != want {
		t.Errorf("StatReject grew by %d, want %d", n, want)
	}
}

// checkDropped checks that a TCP connection from ns to target, an empty
// frontend without Reject, times out (dropped) rather than being refused.
func checkDropped(t *testing.T, ns *nettest.NS, target string) {
	t.Helper()
	const dropNoticedAfter = 300 * time.Millisecond
	_, err := tcpRefused(t, ns, target, dropNoticedAfter, syscall.ECONNREFUSED)
	if !errors.Is(err, context.DeadlineExceeded) {
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			t.Errorf("TCP to an empty frontend without Reject: %v, want a timeout (dropped)", err)
		}
	}
}

// xdpPassOn attaches an XDP program that passes everything to ifname in
// ns, until the test ends: a veth takes frames its peer sends with XDP_TX
// only with an XDP program of its own (its receive queues then run in
// NAPI mode), as a real NIC always would.
func xdpPassOn(t *testing.T, ns *nettest.NS, ifname string) {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.XDP,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, xdpPass), asm.Return()},
	})
	must(t, err)
	t.Cleanup(func() { prog.Close() })
	attachInNS(t, ns, ifname, func(ifindex int) (link.Link, error) {
		return link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifindex})
	})
}

// attachInNS attaches a program to ifname of ns with attach, which gets
// the interface's index there, until the test ends.
func attachInNS(t *testing.T, ns *nettest.NS, ifname string, attach func(ifindex int) (link.Link, error)) {
	t.Helper()
	must(t, ns.Do(func() error {
		iface, err := net.InterfaceByName(ifname)
		if err != nil {
			return err
		}
		l, err := attach(iface.Index)
		if err != nil {
			return err
		}
		t.Cleanup(func() { l.Close() })
		return nil
	}))
}
