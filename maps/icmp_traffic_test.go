package maps

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/topolb/topolb/internal/nettest"
)

// udpRefused sends one datagram on a connected socket from ns to target
// and returns how long the socket took to report ECONNREFUSED (or, at
// connect, refusal: sockRefusal), or an error when it did not within
// timeout.
func udpRefused(t *testing.T, ns *nettest.NS, target string, timeout time.Duration, refusal syscall.Errno) (time.Duration, error) {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	c, err := ns.DialContext(ctx, "udp"+family(netip.MustParseAddrPort(target)), target)
	if err != nil {
		if errors.Is(err, refusal) {
			return time.Since(start), nil // refused at connect (socket hooks)
		}
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(start.Add(timeout))
	if _, err := c.Write([]byte("anyone?")); err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) {
			return time.Since(start), nil
		}
		return 0, err
	}
	buf := make([]byte, 64)
	_, err = c.Read(buf)
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return time.Since(start), nil
	case err == nil:
		return 0, fmt.Errorf("%s answered", target)
	default:
		return 0, fmt.Errorf("not refused: %w", err)
	}
}

// TestICMPRealTraffic sends real errors through the datapath: a client
// pod's UDP datagram to a service whose backend port has no listener is
// refused at once (the backend's port unreachable, translated, reaches the
// client's socket) for a local backend (tc ingress) and a remote one
// (XDP); and a large upload through the service to a backend behind a
// smaller MTU completes, because the node's "fragmentation needed" to the
// client pod is translated (tc egress) and path-MTU discovery works.
func TestICMPRealTraffic(t *testing.T) {
	requirePrivileges(t)
	tb := newTestbed(t)
	d := newDatapath(t, Options{NetNS: tb.node1.Path})
	const (
		vipLocal  = "10.96.0.20:53"
		vipRemote = "10.96.0.21:53"
		vipUpload = "10.96.0.22:80"
		mtu       = 1400
	)
	mustSet(t, d, fe(vipLocal, UDP), be("10.1.1.2:5399"))  // b1, on node1: nothing listens
	mustSet(t, d, fe(vipRemote, UDP), be("10.2.1.2:5399")) // b3, on node2: nothing listens
	mustSet(t, d, fe(vipUpload, TCP), be("10.2.1.2:9000"))
	for _, ifname := range []string{"hc", "hb1", "hb2"} {
		must(t, d.AttachPod(ifname))
	}
	must(t, d.AttachUplink("w1"))

	for _, c := range []struct{ name, vip string }{{"local_backend", vipLocal}, {"remote_backend", vipRemote}} {
		t.Run(c.name+"_port_unreachable", func(t *testing.T) {
			before, err := d.Counters()
			must(t, err)
			took, err := udpRefused(t, tb.client, c.vip, 2*time.Second, syscall.ECONNREFUSED)
			if err != nil {
				t.Fatalf("UDP to %s: %v", c.vip, err)
			}
			after, err := d.Counters()
			must(t, err)
			t.Logf("refused after %s", took)
			if took > 500*time.Millisecond {
				t.Errorf("refused after %s, want at once", took)
			}
			if n := after.Stats[StatICMPTranslated] - before.Stats[StatICMPTranslated]; n != 1 {
				t.Errorf("StatICMPTranslated grew by %d, want 1", n)
			}
		})
	}

	t.Run("upload_through_smaller_mtu", func(t *testing.T) {
		for _, x := range []struct {
			ns     *nettest.NS
			ifname string
		}{{tb.node1, "w1"}, {tb.node2, "w2"}} {
			must(t, x.ns.SetMTU(x.ifname, mtu))
		}
		sink(t, tb.b3, ":9000")
		payload := make([]byte, 4<<20)
		if _, err := rand.Read(payload); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(payload)
		before, err := d.Counters()
		must(t, err)
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		c, err := tb.client.DialContext(ctx, "tcp4", vipUpload)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(15 * time.Second))
		if _, err := c.Write(payload); err != nil {
			t.Fatalf("upload: %v", err)
		}
		c.(*net.TCPConn).CloseWrite()
		answer, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("upload: no answer: %v", err)
		}
		if string(answer) != hex.EncodeToString(sum[:]) {
			t.Fatalf("the backend got %q, want the upload's sha256 %x", answer, sum)
		}
		after, err := d.Counters()
		must(t, err)
		if n := after.Stats[StatICMPTranslated] - before.Stats[StatICMPTranslated]; n == 0 {
			t.Error("no ICMP error translated: the upload never met the smaller MTU")
		}
		t.Logf("%d MiB uploaded through MTU %d; ICMP errors translated: %d", len(payload)>>20, mtu,
			after.Stats[StatICMPTranslated]-before.Stats[StatICMPTranslated])
	})

	for name, ns := range tb.all() {
		if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
		}
	}
}

// sink accepts one connection on addr in ns, reads it to the end and
// answers with the hex sha256 of what it read. The connection is closed
// when the test ends, also when it is stuck.
func sink(t *testing.T, ns *nettest.NS, addr string) {
	t.Helper()
	l, err := ns.Listen("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	conns := make(chan net.Conn, 1)
	go func() {
		defer close(done)
		c, err := l.Accept()
		if err != nil {
			return
		}
		conns <- c
		defer c.Close()
		h := sha256.New()
		if _, err := io.Copy(h, c); err != nil {
			return
		}
		fmt.Fprint(c, hex.EncodeToString(h.Sum(nil)))
	}()
	t.Cleanup(func() {
		l.Close()
		select {
		case c := <-conns:
			c.Close()
		default:
		}
		<-done
	})
}
