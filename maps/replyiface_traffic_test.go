package maps

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestRealTrafficForgedReplies: a pod forging the replies of another
// pod's flow through a Service, from the backend's address and port
// (raw sockets in b2, the backend being b1, both pods of node1), reaches
// neither the client's connected socket nor its path MTU: the forged
// datagram and a forged ICMP "fragmentation needed" arrive on b2's veth,
// where the flow's replies do not come from, and are dropped and counted
// (StatDropReplyIface). The backend's own replies, and the same ICMP
// error sent by the backend, arrive. Before the check, a reply entry
// matched by its 5-tuple on any interface: both forgeries were
// translated and delivered.
func TestRealTrafficForgedReplies(t *testing.T) {
	requirePrivileges(t)
	pin := filepath.Join(bpffs(t), "topolb")
	tb := newTestbed(t)
	d := tb.attachNode1(t, pin)
	const vip, backend = "10.96.0.53:53", "10.1.1.2:5353"
	mustSet(t, d, fe(vip, UDP), Backend{Addr: netip.MustParseAddrPort(backend), NodeLocal: true, ZoneLocal: true})

	srv, err := tb.b1.ListenPacket("udp4", ":5353")
	must(t, err)
	t.Cleanup(func() { srv.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := tb.client.DialContext(ctx, "udp", vip)
	must(t, err)
	defer conn.Close()
	client := conn.LocalAddr().String()

	// recv reads the next datagram on the client's socket within wait:
	// "" when none arrived.
	recv := func(wait time.Duration) string {
		t.Helper()
		must(t, conn.SetReadDeadline(time.Now().Add(wait)))
		buf := make([]byte, 256)
		n, err := conn.Read(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return ""
		}
		must(t, err)
		return string(buf[:n])
	}
	// answer has b1 read the client's datagram and send what back to
	// the address it came from.
	answer := func(what string) {
		t.Helper()
		must(t, srv.SetReadDeadline(time.Now().Add(3*time.Second)))
		buf := make([]byte, 256)
		_, from, err := srv.ReadFrom(buf)
		must(t, err)
		if from.String() != client {
			t.Fatalf("b1 got the datagram from %s, want the client %s (a flow without source NAT)", from, client)
		}
		_, err = srv.WriteTo([]byte(what), from)
		must(t, err)
	}
	_, err = conn.Write([]byte("query"))
	must(t, err)
	answer("answer")
	if got := recv(3 * time.Second); got != "answer" {
		t.Fatalf("the backend's reply: %q, want %q", got, "answer")
	}

	// A datagram from b2 posing as b1.
	before := counterOf(t, d, StatDropReplyIface)
	sendRaw(t, tb.b2.Do, udpFrame(backend, client, "forged"))
	if got := recv(time.Second); got != "" {
		t.Errorf("a forged reply from another pod reached the client's socket: %q", got)
	}
	if got := counterOf(t, d, StatDropReplyIface) - before; got != 1 {
		t.Errorf("%s counted %d for the forged reply, want 1", StatDropReplyIface, got)
	}

	// "Fragmentation needed" about the client's datagrams to b1, from
	// b2 posing as b1, then from b1 itself: only b1's lowers the
	// client's path MTU to the frontend.
	pathMTU := func() int {
		t.Helper()
		raw, err := conn.(*net.UDPConn).SyscallConn()
		must(t, err)
		var mtu int
		var serr error
		must(t, raw.Control(func(fd uintptr) { mtu, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_MTU) }))
		must(t, serr)
		return mtu
	}
	const lowered = 1000
	mtu0 := pathMTU()
	if mtu0 <= lowered {
		t.Fatalf("client's path MTU %d before the test, want above %d", mtu0, lowered)
	}
	quoted := udpFrame(client, backend, "query")
	fragNeeded := icmpErr("10.1.1.2", "10.1.0.2", icmpDestUnreach, icmpFragNeeded, quoted, 0)
	fragNeeded.icmpRest = lowered
	before, xlated := counterOf(t, d, StatDropReplyIface), counterOf(t, d, StatICMPTranslated)
	sendRaw(t, tb.b2.Do, fragNeeded)
	time.Sleep(200 * time.Millisecond)
	if got := pathMTU(); got != mtu0 {
		t.Errorf("a forged fragmentation needed from another pod set the client's path MTU to %d (was %d)", got, mtu0)
	}
	if got := counterOf(t, d, StatDropReplyIface) - before; got != 1 {
		t.Errorf("%s counted %d for the forged ICMP error, want 1", StatDropReplyIface, got)
	}
	sendRaw(t, tb.b1.Do, fragNeeded)
	time.Sleep(200 * time.Millisecond)
	if got := pathMTU(); got != lowered {
		t.Errorf("the backend's fragmentation needed left the client's path MTU at %d, want %d", got, lowered)
	}
	if got := counterOf(t, d, StatICMPTranslated) - xlated; got != 1 {
		t.Errorf("%s counted %d, want 1 (the backend's error)", StatICMPTranslated, got)
	}

	// The flow goes on. The socket reports the lowered MTU once, as the
	// error of its next send (EMSGSIZE): sent again.
	if _, err = conn.Write([]byte("again")); errors.Is(err, unix.EMSGSIZE) {
		_, err = conn.Write([]byte("again"))
	}
	must(t, err)
	answer("answer again")
	if got := recv(3 * time.Second); got != "answer again" {
		t.Errorf("the backend's reply after the forgeries: %q, want %q", got, "answer again")
	}
	tb.noChecksumErrors(t)
}
