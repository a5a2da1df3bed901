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

// icmpTraffic are TestICMPRealTraffic's frontends and backends in one
// family: UDP to a local and a remote backend port where nothing
// listens, and uploads, each to its own frontend.
type icmpTraffic struct {
	name                string
	vipLocal, vipRemote string
	beLocal, beRemote   string
	// uploads are the family's uploads through a smaller MTU.
	uploads func(tb *testbed) []uploadCase
}

// uploadCase is an upload to vip, translated to be (a sink in sinkNS),
// through a path whose MTUs are made smaller first.
type uploadCase struct {
	name, vip, be string
	sinkNS        *nettest.NS
	mtus          []ifMTU
}

var icmpTrafficFamilies = []icmpTraffic{
	{"ipv4", "10.96.0.20:53", "10.96.0.21:53", "10.1.1.2:5399", "10.2.1.2:5399", func(tb *testbed) []uploadCase {
		// To b3: node2 (the router towards it) answers "fragmentation
		// needed" (hb3 only: a smaller MTU on b3's own interface would
		// lower the MSS it announces instead), then node1, whose uplink
		// is smaller still.
		return []uploadCase{
			{"upload_through_router_mtu", "10.96.0.22:80", "10.2.1.2:9000", tb.b3, []ifMTU{{tb.node2, "hb3", 1400}}},
			{"upload_through_node_mtu", "10.96.0.23:80", "10.2.1.2:9001", tb.b3, []ifMTU{{tb.node1, "w1", 1300}, {tb.node2, "w2", 1300}}},
		}
	}},
	{"ipv6", "[fd00:96::20]:53", "[fd00:96::21]:53", "[fd00:10:1::2]:5399", "[fd00:20:1::2]:5399", func(tb *testbed) []uploadCase {
		// To b1: node1 answers "packet too big" towards it (the uplinks
		// do not translate IPv6, so a remote backend's replies are
		// not translated back: no upload reaches one).
		return []uploadCase{
			{"upload_through_node_mtu", "[fd00:96::23]:80", "[fd00:10:1::2]:9001", tb.b1, []ifMTU{{tb.node1, "hb1", 1300}}},
		}
	}},
}

// TestICMPRealTraffic sends real errors through the datapath, in both
// families: a client pod's UDP datagram to a service whose backend port
// has no listener is refused at once (the backend's port unreachable,
// translated, reaches the client's socket) for a local backend (tc
// ingress) and a remote one (XDP for IPv4; for IPv6, which the uplinks
// pass, tc egress on the pod's veth after the node forwarded it); and
// large uploads through the service to a backend behind a smaller MTU
// complete, because "fragmentation needed" or "packet too big" reaches
// the client translated and path-MTU discovery works: a router's (IPv4:
// node2 towards b3, translated by XDP) and the node's own (translated by
// tc egress).
func TestICMPRealTraffic(t *testing.T) {
	requirePrivileges(t)
	for _, fam := range icmpTrafficFamilies {
		t.Run(fam.name, func(t *testing.T) { testICMPRealTraffic(t, fam) })
	}
}

func testICMPRealTraffic(t *testing.T, f icmpTraffic) {
	tb := newTestbed(t)
	tb.dualStack(t)
	d := newDatapath(t, Options{NetNS: tb.node1.Path})
	mustSet(t, d, fe(f.vipLocal, UDP), be(f.beLocal))   // b1, on node1: nothing listens
	mustSet(t, d, fe(f.vipRemote, UDP), be(f.beRemote)) // b3, on node2: nothing listens
	uploads := f.uploads(tb)
	for _, u := range uploads {
		mustSet(t, d, fe(u.vip, TCP), be(u.be))
	}
	for _, ifname := range []string{"hc", "hb1", "hb2"} {
		must(t, d.AttachPod(ifname))
	}
	must(t, d.AttachUplink("w1"))

	for _, c := range []struct{ name, vip string }{{"local_backend", f.vipLocal}, {"remote_backend", f.vipRemote}} {
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

	// Each upload has its own frontend: the client remembers a path MTU
	// per destination.
	for _, u := range uploads {
		t.Run(u.name, func(t *testing.T) {
			for _, m := range u.mtus {
				must(t, m.ns.SetMTU(m.ifname, m.mtu))
			}
			sink(t, u.sinkNS, u.be)
			before, err := d.Counters()
			must(t, err)
			upload(t, tb.client, u.vip)
			after, err := d.Counters()
			must(t, err)
			n := after.Stats[StatICMPTranslated] - before.Stats[StatICMPTranslated]
			if n == 0 {
				t.Error("no ICMP error translated: the upload never met the smaller MTU")
			}
			t.Logf("4 MiB uploaded; ICMP errors translated: %d", n)
		})
	}

	for name, ns := range tb.all() {
		if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
		}
	}
}

// ifMTU is an interface of a namespace and the MTU a test gives it.
type ifMTU struct {
	ns     *nettest.NS
	ifname string
	mtu    int
}

// upload sends 4 MiB from ns to vip, where a sink answers with their
// sha256, and checks the answer.
func upload(t *testing.T, ns *nettest.NS, vip string) {
	t.Helper()
	payload := make([]byte, 4<<20)
	if _, err := rand.Read(payload); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(payload)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	c, err := ns.DialContext(ctx, "tcp"+family(netip.MustParseAddrPort(vip)), vip)
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
}

// sink accepts one connection on addr in ns, reads it to the end and
// answers with the hex sha256 of what it read. The connection is closed
// when the test ends, also when it is stuck.
func sink(t *testing.T, ns *nettest.NS, addr string) {
	t.Helper()
	l, err := ns.Listen("tcp", addr)
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
