package e2e

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// floodTable is the conntrack size of TestFloodKeepsConnections: the
// established table's entries, as issue 22's attack used.
const floodTable = 4096

// TestFloodKeepsConnections is issue 22's attack with real traffic: on
// agents with a 4,096-entry conntrack, 8 TCP streams from a pod and 8 from
// an outside client (to a NodePort, source-translated where the backend is
// on another node) in each IP family, the backends of a quarter of the
// pod's streams then turning serving-terminating as in a rollout; then a
// SYN flood of ten times the table from random source ports of the pod
// and of the outside client, sent with raw sockets, split evenly between
// the families (the dual-stack testbed's one load window). Every stream
// must still answer from its own backend, and new connections from both
// in both families must be served afterwards. (With one LRU table, as
// before issue 22, 10 of the 16 IPv4 streams broke here.)
func TestFloodKeepsConnections(t *testing.T) {
	requireRoot(t)
	spec := outsideSpec(t)
	spec.DualStack = true
	tb := newTestbed(t, spec)
	bin := requireAgent(t)
	ctx, cancel := agentsCtx(t)
	if _, err := tb.StartAgents(ctx, testbed.AgentOptions{Binary: bin, Verbosity: 5, MaxConntrack: floodTable}); err != nil {
		cancel()
		t.Fatal(err)
	}
	cancel()
	web := allEndpoints(t, spec)
	web.IPFamilies = bothFamilies
	np := northSouthServicesIn(bothFamilies)[0]
	apply(t, tb, []testbed.ServiceSpec{web, np})
	client := tb.Pod("client")
	ext := tb.External("ext1")

	// floodSource is one client of one family: where its streams and
	// SYNs go.
	type floodSource struct {
		client testbed.Client
		ns     *testbed.NS
		family v1.IPFamily
		to     netip.AddrPort
	}
	var sources []floodSource
	var podFlows, all []*flow
	var draining []string
	for _, family := range servedFamilies(t, tb, topology.ScopeExternal) {
		target := targetsOf(t, tb, client, family)
		fp := openFlows(t, client, target, 8)[:8] // the TCP ones
		npTarget := nodePortOf(t, tb, "node-b1", "np", v1.ProtocolTCP, family)
		var extFlows []*flow
		for i := 0; i < 8; i++ {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			c, err := ext.Open(ctx, v1.ProtocolTCP, npTarget)
			if err != nil {
				cancel()
				t.Fatalf("open outside %s flow: %v", family, err)
			}
			a, err := c.Ask(ctx)
			cancel()
			if err != nil {
				t.Fatalf("outside flow %s: first request: %v", c.LocalAddr(), err)
			}
			t.Cleanup(func() { c.Close() })
			extFlows = append(extFlows, &flow{conn: c, proto: v1.ProtocolTCP, backend: a.Pod})
		}
		// The backends of a quarter of the pod's streams drain, as in a
		// rollout (at most four of the six, over both families).
		for _, b := range backendsOf(fp[:2]) {
			if !slices.Contains(draining, b) {
				draining = append(draining, b)
			}
		}
		podFlows = append(podFlows, fp...)
		all = append(all, fp...)
		all = append(all, extFlows...)
		sources = append(sources, floodSource{client, client.NS, family, target[v1.ProtocolTCP]}, floodSource{ext, ext.NS, family, npTarget})
	}
	for _, b := range draining {
		web.Endpoints[slices.IndexFunc(web.Endpoints, func(e testbed.EndpointSpec) bool { return e.Pod == b })].Condition = testbed.Terminating
	}
	apply(t, tb, []testbed.ServiceSpec{web, np})
	onDraining := 0
	for _, f := range podFlows {
		if slices.Contains(draining, f.backend) {
			onDraining++
		}
	}
	askAll(t, "before the flood", all)

	// The flood: ten times the table, shared by the pod and the outside
	// client in each family, each SYN from a random source port — never
	// one of a stream's own, whose SYN would be that client's new
	// connection.
	var skip []uint16
	for _, f := range all {
		skip = append(skip, f.conn.LocalAddr().Port())
	}
	start := time.Now()
	for _, src := range sources {
		if err := synFlood(src.ns, src.client.ClientAddrOf(src.family), src.to, 10*floodTable/len(sources), skip); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("flooded %d SYNs in %s", 10*floodTable, time.Since(start).Round(time.Millisecond))

	askAll(t, "after the flood", all)
	// New connections from both clients in each family are served.
	for _, src := range sources {
		var err error
		for try := 0; try < 20; try++ {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			_, err = src.client.Request(ctx, v1.ProtocolTCP, src.to)
			cancel()
			if err == nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			t.Errorf("new connection from %s to %s after the flood: %v", src.client.ClientName(), src.to, err)
		}
	}
	if !t.Failed() {
		t.Logf("%d streams (%d of the pod's on draining %v) survived a flood of %d SYNs", len(all), onDraining, draining, 10*floodTable)
	}
	if onDraining == 0 {
		t.Errorf("no stream on a draining backend: the test checks less than it says")
	}
}

// nodePortOf is the NodePort frontend of service's proto port on node in
// family.
func nodePortOf(t *testing.T, tb *testbed.Testbed, node, service string, proto v1.Protocol, family v1.IPFamily) netip.AddrPort {
	t.Helper()
	d := decisionOnOf(t, tb, node, service, proto, family)
	if !d.NodePort.IsValid() {
		t.Fatalf("service %s has no %s %s NodePort on %s", service, family, proto, node)
	}
	return d.NodePort
}

// synFlood sends count TCP SYNs from from to to (either family), inside
// ns, with a raw socket (as hping3 would; the kernel writes the IP
// header, the source its route's), each from a random source port outside skip.
// The sender's own stack answers the SYN-ACKs with resets: the flows never
// get established.
func synFlood(ns *testbed.NS, from netip.Addr, to netip.AddrPort, count int, skip []uint16) error {
	return ns.Do(func() error {
		var domain int
		var sa unix.Sockaddr
		if to.Addr().Is4() {
			domain, sa = unix.AF_INET, &unix.SockaddrInet4{Addr: to.Addr().As4()}
		} else {
			// An IPv6 raw socket of TCP leaves the checksum to us
			// (RFC 3542 3.1: only ICMPv6's is the kernel's).
			domain, sa = unix.AF_INET6, &unix.SockaddrInet6{Addr: to.Addr().As16()}
		}
		fd, err := unix.Socket(domain, unix.SOCK_RAW, unix.IPPROTO_TCP)
		if err != nil {
			return fmt.Errorf("raw socket in %s: %w", ns.Name, err)
		}
		defer unix.Close(fd)
		rng := rand.New(rand.NewPCG(22, uint64(count)))
		seg := make([]byte, 20)
		for sent := 0; sent < count; {
			port := uint16(1024 + rng.IntN(64000))
			if slices.Contains(skip, port) {
				continue
			}
			synSegment(seg, from, to, port, rng.Uint32())
			if err := unix.Sendto(fd, seg, 0, sa); err != nil {
				if err == unix.ENOBUFS || err == unix.EAGAIN {
					time.Sleep(time.Millisecond)
					continue
				}
				return fmt.Errorf("send SYN in %s: %w", ns.Name, err)
			}
			sent++
		}
		return nil
	})
}

// synSegment writes a 20-byte TCP SYN from from:sport to to into seg, with
// its checksum (RFC 9293 3.1, over the pseudo-header; IPv6's, RFC 8200
// 8.1, sums to the same with 16-byte addresses).
func synSegment(seg []byte, from netip.Addr, to netip.AddrPort, sport uint16, seq uint32) {
	clear(seg)
	binary.BigEndian.PutUint16(seg[0:], sport)
	binary.BigEndian.PutUint16(seg[2:], to.Port())
	binary.BigEndian.PutUint32(seg[4:], seq)
	seg[12] = 5 << 4 // data offset: 5 words
	seg[13] = 0x02   // SYN
	binary.BigEndian.PutUint16(seg[14:], 64240)
	var sum uint32
	for _, a := range [][]byte{from.AsSlice(), to.Addr().AsSlice()} {
		for i := 0; i < len(a); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(a[i:]))
		}
	}
	sum += unix.IPPROTO_TCP + uint32(len(seg))
	for i := 0; i < len(seg); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(seg[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(seg[16:], ^uint16(sum))
}
