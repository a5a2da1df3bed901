package maps

import (
	"net"
	"net/netip"
	"testing"
	"time"
)

// TestHostTwoServicesOneBackend pins down what the socket hooks do when one
// unconnected UDP socket of the node sends to two Services that share a
// backend: the answers carry only the backend's address, and the socket's
// one record for that backend names the frontend it sent to last. Asked
// one at a time, each answer shows the frontend asked; asked both at once,
// both answers show the last one (README, Limits). Every rewrite of the
// record to another frontend is counted (StatSockRevNATClobbered).
func TestHostTwoServicesOneBackend(t *testing.T) {
	requirePrivileges(t)
	tb := newTestbed(t)
	d := hostDatapath(t, tb.node1)
	tb.b1.ServeUDPName(t, ":5353", "b1")
	// Addresses no other test uses: the hooks see every socket of the
	// machine.
	vipA, vipB := netip.MustParseAddrPort("10.96.214.10:53"), netip.MustParseAddrPort("10.96.214.11:53")
	for _, vip := range []netip.AddrPort{vipA, vipB} {
		mustSet(t, d, fe(vip.String(), UDP), be("10.1.1.2:5353"))
	}
	c, err := tb.node1.ListenPacket("udp4", "0.0.0.0:0")
	must(t, err)
	defer c.Close()
	send := func(to netip.AddrPort) {
		t.Helper()
		if _, err := c.WriteTo([]byte("q"), net.UDPAddrFromAddrPort(to)); err != nil {
			t.Fatal(err)
		}
	}
	answerFrom := func() netip.AddrPort {
		t.Helper()
		buf := make([]byte, 64)
		must(t, c.SetReadDeadline(time.Now().Add(2*time.Second)))
		n, from, err := c.ReadFrom(buf)
		if err != nil {
			t.Fatalf("no answer: %v", err)
		}
		if string(buf[:n]) != "b1" {
			t.Fatalf("answered by %q, want b1", buf[:n])
		}
		return from.(*net.UDPAddr).AddrPort()
	}
	before, err := d.Counters()
	must(t, err)

	// One at a time: each answer is shown from the frontend asked.
	for _, vip := range []netip.AddrPort{vipA, vipB} {
		send(vip)
		if got := answerFrom(); got != vip {
			t.Errorf("asked %s alone: the answer shows %s", vip, got)
		}
	}
	// Both at once: the answer to A is shown from B too.
	send(vipA)
	send(vipB)
	for i := range 2 {
		if got := answerFrom(); got != vipB {
			t.Errorf("answer %d of two asked at once shows %s, want %s, the frontend sent to last", i+1, got, vipB)
		}
	}

	after, err := d.Counters()
	must(t, err)
	// The record went A, B, A, B: three rewrites to another frontend.
	if got := after.Stats[StatSockRevNATClobbered] - before.Stats[StatSockRevNATClobbered]; got != 3 {
		t.Errorf("StatSockRevNATClobbered grew by %d, want 3", got)
	}
}
