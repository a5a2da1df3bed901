package maps

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/nettest"
)

// hostDatapath loads a datapath for ns with its own pin path in a private
// bpffs and attaches the socket hooks to the cgroup v2 root.
func hostDatapath(t *testing.T, ns *nettest.NS) *Datapath {
	t.Helper()
	return hostDatapathOpts(t, Options{NetNS: ns.Path})
}

// hostDatapathOpts is hostDatapath with more options (NetNS set).
func hostDatapathOpts(t *testing.T, opts Options) *Datapath {
	t.Helper()
	root, err := CgroupRoot("auto")
	if err != nil {
		t.Skipf("no cgroup v2 root for the socket hooks: %v", err)
	}
	d := newDatapath(t, opts)
	if !d.compat.netnsCookie {
		t.Skipf("kernel %s lacks %s (Linux 5.14), or it is forced off: the socket hooks act on no socket", d.kernel.Release, featureNetnsCookie)
	}
	must(t, d.AttachHost(root))
	return d
}

// peerName is getpeername(2) of c.
func peerName(t *testing.T, c syscall.Conn) netip.AddrPort {
	t.Helper()
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var sa unix.Sockaddr
	var serr error
	if err := raw.Control(func(fd uintptr) { sa, serr = unix.Getpeername(int(fd)) }); err != nil {
		t.Fatal(err)
	}
	if serr != nil {
		t.Fatalf("getpeername: %v", serr)
	}
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port))
	}
	t.Fatalf("getpeername: %T, want an IP address", sa)
	return netip.AddrPort{}
}

// family is "4" or "6", the suffix of ap's networks ("tcp4", "udp6").
func family(ap netip.AddrPort) string {
	if ap.Addr().Is4() {
		return "4"
	}
	return "6"
}

// hostTCP makes n HTTP requests to vip from ns's own network namespace,
// each on a new connection whose peer must be vip, and counts answers.
func hostTCP(t *testing.T, ns *nettest.NS, vip string, n int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for i := 0; i < n; i++ {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		c, err := ns.DialContext(ctx, "tcp"+family(netip.MustParseAddrPort(vip)), vip)
		cancel()
		if err != nil {
			t.Fatalf("connection %d to %s: %v", i, vip, err)
		}
		if p := peerName(t, c.(*net.TCPConn)); p.String() != vip {
			t.Errorf("connection %d: getpeername says %s, want the service address %s", i, p, vip)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "GET / HTTP/1.0\r\nHost: x\r\n\r\n")
		body, err := io.ReadAll(c)
		c.Close()
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		_, name, _ := strings.Cut(string(body), "\r\n\r\n")
		got[name]++
	}
	return got
}

// hostUDP sends to vip from n new sockets of ns's own network namespace:
// unconnected (two datagrams each with sendto, both answered from vip, by
// one backend) or connected (one datagram; getpeername must say vip).
func hostUDP(t *testing.T, ns *nettest.NS, vip string, n int, connected bool) map[string]int {
	t.Helper()
	to := netip.MustParseAddrPort(vip)
	got := map[string]int{}
	buf := make([]byte, 512)
	for i := 0; i < n; i++ {
		var name string
		if connected {
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			c, err := ns.DialContext(ctx, "udp"+family(to), vip)
			cancel()
			if err != nil {
				t.Fatal(err)
			}
			if p := peerName(t, c.(*net.UDPConn)); p != to {
				t.Errorf("datagram %d: getpeername says %s, want the service address %s", i, p, vip)
			}
			for attempt := 0; attempt < 3 && name == ""; attempt++ {
				if _, err := c.Write([]byte("q")); err != nil {
					t.Fatal(err)
				}
				c.SetReadDeadline(time.Now().Add(time.Second))
				if m, err := c.Read(buf); err == nil {
					name = string(buf[:m])
				}
			}
			c.Close()
		} else {
			c, err := ns.ListenPacket("udp"+family(to), ":0")
			if err != nil {
				t.Fatal(err)
			}
			// Two datagrams from one socket: one flow, one backend.
			var names []string
			for attempt := 0; attempt < 6 && len(names) < 2; attempt++ {
				if _, err := c.WriteTo([]byte("q"), net.UDPAddrFromAddrPort(to)); err != nil {
					t.Fatal(err)
				}
				c.SetReadDeadline(time.Now().Add(time.Second))
				m, from, err := c.ReadFrom(buf)
				if err != nil {
					continue
				}
				if src := from.(*net.UDPAddr).AddrPort(); src != to {
					t.Errorf("datagram %d answered from %s, not the service address %s", i, src, vip)
				}
				names = append(names, string(buf[:m]))
			}
			c.Close()
			if len(names) == 2 {
				name = names[0]
				if names[1] != names[0] {
					t.Errorf("socket %d: its datagrams landed on %s and %s, want one backend", i, names[0], names[1])
				}
			}
		}
		if name == "" {
			t.Fatalf("datagram %d to %s: no answer", i, vip)
		}
		got[name]++
	}
	return got
}

// mapped is the IPv4-mapped IPv6 socket address of ap.
func mapped(ap netip.AddrPort) *unix.SockaddrInet6 {
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: netip.AddrFrom16(ap.Addr().As16()).As16()}
}

// dualStack makes n requests from ns's own network namespace through
// dual-stack IPv6 sockets (IPV6_V6ONLY off) to vip's IPv4-mapped address,
// as Java and other dual-stack clients do: TCP (HTTP, getpeername must
// name vip), connected UDP (getpeername) or unconnected UDP (the answer
// must come from vip). It counts answers by backend.
func dualStack(t *testing.T, ns *nettest.NS, proto Protocol, connected bool, vip string, n int) map[string]int {
	t.Helper()
	to := netip.MustParseAddrPort(vip)
	want := mapped(to)
	peerIs := func(sa unix.Sockaddr, what string) {
		in6, ok := sa.(*unix.SockaddrInet6)
		if !ok || in6.Addr != want.Addr || in6.Port != want.Port {
			t.Errorf("%s: %+v, want the service address %s as ::ffff:%s", what, sa, vip, vip)
		}
	}
	got := map[string]int{}
	for i := 0; i < n; i++ {
		must(t, ns.Do(func() error {
			typ := unix.SOCK_STREAM
			if proto == UDP {
				typ = unix.SOCK_DGRAM
			}
			fd, err := unix.Socket(unix.AF_INET6, typ|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			tv := unix.Timeval{Sec: 2}
			for _, opt := range []error{
				unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0),
				unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv),
				unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv),
			} {
				if opt != nil {
					return opt
				}
			}
			buf := make([]byte, 512)
			var m int
			switch {
			case proto == TCP || connected:
				if err := unix.Connect(fd, want); err != nil {
					return fmt.Errorf("connect to ::ffff:%s: %w", vip, err)
				}
				sa, err := unix.Getpeername(fd)
				if err != nil {
					return err
				}
				peerIs(sa, "getpeername")
				req := []byte("q")
				if proto == TCP {
					req = []byte("GET / HTTP/1.0\r\nHost: x\r\n\r\n")
				}
				if _, err := unix.Write(fd, req); err != nil {
					return err
				}
				for {
					k, err := unix.Read(fd, buf[m:])
					if err != nil {
						return fmt.Errorf("read from ::ffff:%s: %w", vip, err)
					}
					m += k
					if k == 0 || proto == UDP || m == len(buf) {
						break
					}
				}
			default:
				if err := unix.Sendto(fd, []byte("q"), 0, want); err != nil {
					return fmt.Errorf("sendto ::ffff:%s: %w", vip, err)
				}
				k, from, err := unix.Recvfrom(fd, buf, 0)
				if err != nil {
					return fmt.Errorf("recvfrom: %w", err)
				}
				peerIs(from, "recvfrom")
				m = k
			}
			name := string(buf[:m])
			if proto == TCP {
				_, name, _ = strings.Cut(name, "\r\n\r\n")
			}
			got[name]++
			return nil
		}))
	}
	return got
}

func keys(m map[string]int) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// TestHostClients balances the node's own processes with the socket hooks:
// TCP, connected and unconnected UDP, through IPv4 sockets and dual-stack
// IPv6 ones (IPv4-mapped addresses), to local and remote backends, peers
// and answers shown as the service address. Two nodes program the same
// service address with different backends, both hooks attached to the one
// cgroup root: each node's processes land only on its own set, so neither
// translates the other's sockets; and the client pod keeps the tc path.
func TestHostClients(t *testing.T) {
	requirePrivileges(t)
	tb := newTestbed(t)
	must(t, tb.node2.AddRoute("10.96.0.0/16", "10.9.0.1")) // some route: translated connects never use it
	d1 := hostDatapath(t, tb.node1)
	d2 := hostDatapath(t, tb.node2)
	for name, ns := range map[string]*nettest.NS{"b1": tb.b1, "b2": tb.b2, "b3": tb.b3} {
		ns.ServeHTTPName(t, ":8080", name)
		ns.ServeUDPName(t, ":5353", name)
	}
	// Addresses no other test uses: the hooks see every socket of the
	// machine, so a mutation that drops the netns check (tools/mutate)
	// must not catch other tests' sockets.
	const vipHTTP, vipDNS = "10.96.213.10:80", "10.96.213.10:53"
	for _, x := range []struct {
		d     *Datapath
		addrs []string
	}{{d1, []string{"10.1.1.2", "10.1.2.2", "10.2.1.2"}}, {d2, []string{"10.2.1.2"}}} {
		var tcp, udp []Backend
		for _, a := range x.addrs {
			tcp = append(tcp, be(a+":8080"))
			udp = append(udp, be(a+":5353"))
		}
		mustSet(t, x.d, fe(vipHTTP, TCP), tcp...)
		mustSet(t, x.d, fe(vipDNS, UDP), udp...)
	}
	for _, ifname := range []string{"hc", "hb1", "hb2"} {
		must(t, d1.AttachPod(ifname))
	}
	must(t, d1.AttachUplink("w1"))
	if n, of, err := d1.HostAttached(); err != nil || n != of || n != len(sockHooks) {
		t.Fatalf("HostAttached = %d of %d, %v", n, of, err)
	}
	before, err := d1.Counters()
	must(t, err)

	const n, dual = 60, 30
	all, remote := []string{"b1", "b2", "b3"}, []string{"b3"}
	for _, c := range []struct {
		name string
		ns   *nettest.NS
		want []string
		run  func(ns *nettest.NS) map[string]int
	}{
		{"node1_tcp", tb.node1, all, func(ns *nettest.NS) map[string]int { return hostTCP(t, ns, vipHTTP, n) }},
		{"node1_udp_unconnected", tb.node1, all, func(ns *nettest.NS) map[string]int { return hostUDP(t, ns, vipDNS, n, false) }},
		{"node1_udp_connected", tb.node1, all, func(ns *nettest.NS) map[string]int { return hostUDP(t, ns, vipDNS, n, true) }},
		{"node1_dual_stack_tcp", tb.node1, all, func(ns *nettest.NS) map[string]int { return dualStack(t, ns, TCP, true, vipHTTP, dual) }},
		{"node1_dual_stack_udp_connected", tb.node1, all, func(ns *nettest.NS) map[string]int { return dualStack(t, ns, UDP, true, vipDNS, dual) }},
		{"node1_dual_stack_udp_unconnected", tb.node1, all, func(ns *nettest.NS) map[string]int { return dualStack(t, ns, UDP, false, vipDNS, dual) }},
		{"node2_tcp", tb.node2, remote, func(ns *nettest.NS) map[string]int { return hostTCP(t, ns, vipHTTP, 20) }},
		{"node2_udp_unconnected", tb.node2, remote, func(ns *nettest.NS) map[string]int { return hostUDP(t, ns, vipDNS, 20, false) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := c.run(c.ns)
			t.Logf("answers: %v", got)
			if !slices.Equal(keys(got), c.want) {
				t.Errorf("answered by %v, want every one of %v and no other", keys(got), c.want)
			}
		})
	}
	after, err := d1.Counters()
	must(t, err)
	// node1's hooks translated node1's calls only: n+dual TCP connects,
	// 2n+dual unconnected sends, n+dual UDP connects (retries add sends,
	// so at least).
	if got, want := after.Stats[StatSockTranslated]-before.Stats[StatSockTranslated], uint64(4*n+3*dual); got < want || got > want+n {
		t.Errorf("node1 StatSockTranslated grew by %d, want about %d", got, want)
	}
	// getpeername of every TCP and connected UDP socket, recvfrom of
	// every unconnected one.
	if got, want := after.Stats[StatSockReverseNAT]-before.Stats[StatSockReverseNAT], uint64(3*n+3*dual); got < want {
		t.Errorf("node1 StatSockReverseNAT grew by %d, want at least %d", got, want)
	}
	if got := after.Frontends[fe(vipHTTP, TCP)].Flows - before.Frontends[fe(vipHTTP, TCP)].Flows; got != n+dual {
		t.Errorf("node1 TCP frontend counted %d new flows, want %d", got, n+dual)
	}
	// A flow per socket, however many datagrams it sends.
	if got := after.Frontends[fe(vipDNS, UDP)].Flows - before.Frontends[fe(vipDNS, UDP)].Flows; got != 2*n+2*dual {
		t.Errorf("node1 UDP frontend counted %d new flows, want %d", got, 2*n+2*dual)
	}
	if got := after.Stats[StatConntrackCreated] - before.Stats[StatConntrackCreated]; got != 0 {
		t.Errorf("host clients created %d conntrack flows: their packets were translated", got)
	}

	// The pod next to them keeps the tc path: conntrack, no socket hook.
	podGot := httpGets(t, tb.client, "http://"+vipHTTP+"/", 20)
	final, err := d1.Counters()
	must(t, err)
	if got := final.Stats[StatSockTranslated] - after.Stats[StatSockTranslated]; got != 0 {
		t.Errorf("the pod's connects went through the socket hooks (%d)", got)
	}
	if got := final.Stats[StatConntrackCreated] - after.Stats[StatConntrackCreated]; got != 20 {
		t.Errorf("the pod's 20 connections created %d conntrack flows, want 20", got)
	}
	t.Logf("pod answers: %v", podGot)

	for name, ns := range tb.all() {
		if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
		}
	}
}

// TestAttachHostLifecycle pins, re-adopts, detaches and unpins the socket
// hooks, and refuses cgroup paths that are not a hierarchy's root.
func TestAttachHostLifecycle(t *testing.T) {
	requirePrivileges(t)
	root, err := CgroupRoot("auto")
	if err != nil {
		t.Skipf("no cgroup v2 root: %v", err)
	}
	ns := nettest.NewNS(t, "host-life")
	pin := filepath.Join(bpffs(t), "topolb")
	opts := Options{PinPath: pin, NetNS: ns.Path, MaxFrontends: 64, MaxBackends: 64, MaxConntrack: 64}
	d, err := Load(opts)
	must(t, err)
	must(t, d.AttachHost(root))
	must(t, d.AttachHost(root)) // again: updates its own links
	pins := func() []string {
		var out []string
		for _, h := range sockHooks {
			if _, err := os.Stat(filepath.Join(pin, "links", "sock_"+h.name)); err == nil {
				out = append(out, h.name)
			}
		}
		return out
	}
	if got := pins(); len(got) != len(sockHooks) {
		t.Fatalf("pinned socket hooks %v", got)
	}
	// A restarted agent adopts the links (the kernel keeps one
	// attachment per hook, not two).
	must(t, d.Close())
	d, err = Load(opts)
	must(t, err)
	must(t, d.AttachHost(root))
	if n := cgroupAttachments(t, root, d); n != len(sockHooks) {
		t.Errorf("%d of this datapath's programs attached to %s, want %d", n, root, len(sockHooks))
	}
	if got, err := d.Attached(); err != nil || len(got) != 0 {
		t.Errorf("Attached = %v, %v: socket hooks are not interfaces", got, err)
	}
	must(t, d.DetachHost())
	must(t, d.DetachHost())
	if got := pins(); len(got) != 0 {
		t.Errorf("pins left after DetachHost: %v", got)
	}
	if n := cgroupAttachments(t, root, d); n != 0 {
		t.Errorf("%d programs still attached after DetachHost", n)
	}
	must(t, d.AttachHost(root))
	must(t, d.Unpin())
	if got := pins(); len(got) != 0 {
		t.Errorf("pins left after Unpin: %v", got)
	}
	must(t, d.Close())

	for _, bad := range []string{t.TempDir(), filepath.Join(root, "tlbf-no-such-cgroup")} {
		if _, err := CgroupRoot(bad); err == nil {
			t.Errorf("CgroupRoot(%s) accepted a path that is not a cgroup v2 root", bad)
		}
	}
	sub := filepath.Join(root, fmt.Sprintf("tlbf-%d", os.Getpid()))
	if err := os.Mkdir(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(sub)
	if _, err := CgroupRoot(sub); err == nil || !strings.Contains(err.Error(), "not the root") {
		t.Errorf("CgroupRoot(sub-cgroup) = %v, want a refusal naming the root", err)
	}
	if got, err := CgroupRoot(filepath.Dir(root)); filepath.Base(root) == "unified" && (err != nil || got != root) {
		t.Errorf("CgroupRoot(%s) = %s, %v; want the hybrid host's %s", filepath.Dir(root), got, err, root)
	}
}

// cgroupAttachments counts the programs of d's socket object attached to
// cgroup (by program id, as the kernel lists them).
func cgroupAttachments(t *testing.T, cgroup string, d *Datapath) int {
	t.Helper()
	mine := map[uint32]bool{}
	for _, h := range sockHooks {
		info, err := d.sockColl.Programs[h.prog].Info()
		must(t, err)
		id, ok := info.ID()
		if !ok {
			t.Skip("kernel does not report program ids")
		}
		mine[uint32(id)] = true
	}
	f, err := os.Open(cgroup)
	must(t, err)
	defer f.Close()
	n := 0
	for _, h := range sockHooks {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: h.attach})
		must(t, err)
		for _, p := range res.Programs {
			if mine[uint32(p.ID)] {
				n++
			}
		}
	}
	return n
}

// TestHostClientsFamilies balances the node's own processes to a Service
// of each address family through the socket hooks of that family: TCP,
// connected and unconnected UDP, each backend of the set reached, peers
// and answers shown as the service address, and an empty reject frontend
// refused at connect. The backends are addresses of the node itself, so
// the test needs no routing of either family.
func TestHostClientsFamilies(t *testing.T) {
	requirePrivileges(t)
	for _, c := range []struct {
		name     string
		vip      string   // frontend address, no port
		backends []string // node addresses serving b1, b2
	}{
		{"ipv4", "10.96.214.10", []string{"10.214.0.1", "10.214.0.2"}},
		{"ipv6", "fd00:96::214:10", []string{"fd00:214::1", "fd00:214::2"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ns := nettest.NewNS(t, "host-"+c.name)
			bits := "/32"
			if netip.MustParseAddr(c.vip).Is6() {
				bits = "/128"
			}
			var tcp, udp []Backend
			var names []string
			for i, a := range c.backends {
				name := fmt.Sprintf("b%d", i+1)
				must(t, ns.AddAddr("lo", a+bits))
				ap := netip.AddrPortFrom(netip.MustParseAddr(a), 8080)
				ns.ServeHTTPName(t, ap.String(), name)
				ap = netip.AddrPortFrom(ap.Addr(), 5353)
				ns.ServeUDPName(t, ap.String(), name)
				tcp = append(tcp, Backend{Addr: netip.AddrPortFrom(ap.Addr(), 8080)})
				udp = append(udp, Backend{Addr: ap})
				names = append(names, name)
			}
			d := hostDatapath(t, ns)
			vip := netip.MustParseAddr(c.vip)
			vipHTTP := netip.AddrPortFrom(vip, 80).String()
			vipDNS := netip.AddrPortFrom(vip, 53).String()
			vipEmpty := netip.AddrPortFrom(vip, 81).String()
			mustSet(t, d, fe(vipHTTP, TCP), tcp...)
			mustSet(t, d, fe(vipDNS, UDP), udp...)
			if _, err := d.SetService(fe(vipEmpty, TCP), Service{Reject: true}); err != nil {
				t.Fatal(err)
			}
			before, err := d.Counters()
			must(t, err)

			const n = 20
			for _, r := range []struct {
				name string
				run  func() map[string]int
			}{
				{"tcp", func() map[string]int { return hostTCP(t, ns, vipHTTP, n) }},
				{"udp_unconnected", func() map[string]int { return hostUDP(t, ns, vipDNS, n, false) }},
				{"udp_connected", func() map[string]int { return hostUDP(t, ns, vipDNS, n, true) }},
			} {
				got := r.run()
				if !slices.Equal(keys(got), names) {
					t.Errorf("%s: answered by %v, want every one of %v and no other", r.name, keys(got), names)
				}
			}
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			if c, err := ns.DialContext(ctx, "tcp", vipEmpty); !errors.Is(err, syscall.ECONNREFUSED) {
				if c != nil {
					c.Close()
				}
				t.Errorf("connect to the empty reject frontend %s: %v, want ECONNREFUSED", vipEmpty, err)
			}
			after, err := d.Counters()
			must(t, err)
			if got := after.Frontends[fe(vipHTTP, TCP)].Flows - before.Frontends[fe(vipHTTP, TCP)].Flows; got != n {
				t.Errorf("TCP frontend counted %d new flows, want %d", got, n)
			}
			if got := after.Stats[StatReject] - before.Stats[StatReject]; got != 1 {
				t.Errorf("StatReject grew by %d, want 1", got)
			}
		})
	}
}
