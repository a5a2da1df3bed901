package maps

import (
	"context"
	"math/rand/v2"
	"net/netip"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/nettest"
)

// TestRealTrafficSpoofedBudget: a client outside the node (node2, through
// XDP on the uplink) that completed a handshake keeps being answered
// while a flood of SYNs spoofing its address (IPv4), or addresses of its
// /64 (IPv6, whose budget cells group a /64 on scope external), spends
// the budget of new flows of its cell five times over. The client makes
// 20 requests, each on a new connection, during the flood: at least 18
// must be answered within 2 s. Before proven sources had a budget of
// their own, the flood spent the client's cell and most of its SYNs were
// dropped (7/20 and fewer).
func TestRealTrafficSpoofedBudget(t *testing.T) {
	requirePrivileges(t)
	for _, c := range []struct {
		name string
		// lb is the load-balancer frontend, backend b1's address.
		lb, backend string
		// route is the frontend's prefix, via node1's address on w1.
		route, via string
		// spoof is the flood's source address for packet i.
		spoof func(i int) netip.Addr
	}{
		{
			name: "ipv4_victim_address", lb: "192.0.2.40:80", backend: "10.1.1.2:8080",
			route: "192.0.2.0/24", via: "10.9.0.1",
			spoof: func(int) netip.Addr { return netip.MustParseAddr("10.9.0.2") },
		},
		{
			name: "ipv6_victim_slash64", lb: "[fd00:40::40]:80", backend: "[fd00:10:1::2]:8080",
			route: "fd00:40::/64", via: "fd00:9::1",
			// 64 addresses of the victim's /64 (fd00:9::2's), so node1's
			// neighbour table, which resolves each for the replies, stays
			// small.
			spoof: func(i int) netip.Addr {
				b := netip.MustParseAddr("fd00:9::").As16()
				b[14], b[15] = 0x80, byte(i%64)
				return netip.AddrFrom16(b)
			},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			tb := newTestbed(t)
			tb.dualStack(t)
			// 20 new flows a second per cell; a proven source gets
			// eight times as many of its own.
			const perSource = 20
			d := newDatapath(t, Options{PinPath: filepath.Join(bpffs(t), "topolb"), NetNS: tb.node1.Path,
				UplinkPath: UplinkXDP, NewFlowsPerSource: perSource})
			for _, ifname := range []string{"hc", "hb1", "hb2"} {
				must(t, d.AttachPod(ifname))
			}
			must(t, d.AttachUplink("w1"))
			xdpPassOn(t, tb.node2, "w2")
			must(t, tb.node2.AddRoute(c.route, c.via))
			tb.b1.ServeHTTPName(t, netip.MustParseAddrPort(c.backend).String(), "b1")
			lb := netip.MustParseAddrPort(c.lb)
			ext := Frontend{Addr: lb, Proto: TCP, Scope: ScopeExternal}
			mustSet(t, d, ext, Backend{Addr: netip.MustParseAddrPort(c.backend), NodeLocal: true})

			// get connects within timeout (a SYN dropped is retransmitted
			// after 1 s) and asks for the backend's name.
			get := func(timeout time.Duration) (string, error) {
				ctx, cancel := context.WithTimeout(t.Context(), timeout)
				defer cancel()
				conn, err := tb.node2.DialContext(ctx, "tcp", lb.String())
				if err != nil {
					return "", err
				}
				defer conn.Close()
				return request(conn)
			}
			// The client proves its address before the flood.
			if got, err := get(5 * time.Second); err != nil || got != "b1" {
				t.Fatalf("before the flood: %q, %v; want b1's answer", got, err)
			}

			// Five times the cell's budget, and less than a proven
			// source's own.
			const floodRate = 5 * perSource
			fd := rawSocket(t, tb.node2, lb.Addr().Is6())
			fl := floodAt(t, floodRate, func(i int) error {
				src := netip.AddrPortFrom(c.spoof(i), uint16(1024+rand.IntN(60000)))
				return sendRawFD(fd, tcpFrame(src.String(), lb.String(), tcpSYN, "").withSeq(rand.Uint32(), 0))
			})
			// A second of flood spends the cell's burst many times over.
			time.Sleep(time.Second)
			answered := 0
			for i := range 20 {
				got, err := get(2 * time.Second)
				if err == nil && got == "b1" {
					answered++
				} else {
					t.Logf("request %d: %q, %v", i, got, err)
				}
				// The requests spread over the flood.
				time.Sleep(100 * time.Millisecond)
			}
			sent := fl.Stop()
			t.Logf("%d spoofed SYNs at %d/s; client answered %d/20; %s %d, %s %d", sent, floodRate, answered,
				StatDropSourceLimit, counterOf(t, d, StatDropSourceLimit), StatSourceProven, counterOf(t, d, StatSourceProven))
			// Over the cell's burst and rate for 2 s: spent several times.
			if sent < 2*floodRate {
				t.Errorf("%d spoofed SYNs sent, want at least %d: the flood did not spend the cell", sent, 2*floodRate)
			}
			if answered < 18 {
				t.Errorf("client answered %d/20 during the flood, want at least 18", answered)
			}
		})
	}
}

// rawSocket opens a raw socket in ns that sends whole IP packets
// (IPv4's IP_HDRINCL; IPv6's IPPROTO_RAW implies it), with whatever
// source they carry, as a spoofing sender does. Closed in t.Cleanup.
func rawSocket(t *testing.T, ns *nettest.NS, v6 bool) int {
	t.Helper()
	family := unix.AF_INET
	if v6 {
		family = unix.AF_INET6
	}
	var fd int
	err := ns.Do(func() error {
		var err error
		fd, err = unix.Socket(family, unix.SOCK_RAW, unix.IPPROTO_RAW)
		return err
	})
	if err != nil {
		t.Fatalf("raw socket in %s: %v", ns.Name, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// flood sends packets at a rate from a goroutine of its own (floodAt).
type flood struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	sent   atomic.Int64
	once   sync.Once
}

// floodAt calls send(i) for i = 0, 1, ... rate times a second until the
// flood is stopped (Stop, or the test's end). A failed send fails t and
// ends the flood.
func floodAt(t *testing.T, rate int, send func(i int) error) *flood {
	ctx, cancel := context.WithCancel(t.Context())
	f := &flood{cancel: cancel}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		tick := time.NewTicker(time.Second / time.Duration(rate))
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if err := send(i); err != nil {
				t.Errorf("flood packet %d: %v", i, err)
				return
			}
			f.sent.Add(1)
		}
	}()
	t.Cleanup(func() { f.Stop() })
	return f
}

// Sent is the number of packets sent so far.
func (f *flood) Sent() int { return int(f.sent.Load()) }

// Stop ends the flood, waits for its goroutine and returns Sent.
func (f *flood) Stop() int {
	f.once.Do(func() {
		f.cancel()
		f.wg.Wait()
	})
	return f.Sent()
}

// sendRawFD sends f's IP packet (its Ethernet header left off) on fd, a
// rawSocket of f's family.
func sendRawFD(fd int, f frame) error {
	pkt := f.bytes()[14:]
	if f.is6() {
		return unix.Sendto(fd, pkt, 0, &unix.SockaddrInet6{Addr: f.dst.Addr().As16()})
	}
	return unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: f.dst.Addr().As4()})
}
