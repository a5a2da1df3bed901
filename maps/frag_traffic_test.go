package maps

import (
	"bytes"
	"net"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/topolb/topolb/internal/nettest"
)

// bigDatagram is the payload of TestFragmentedTraffic's datagrams: 4,000
// bytes, which a 1,500-byte MTU splits into three fragments.
const bigDatagram = 4000

// bigEcho is the answer of TestFragmentedTraffic's backend name to req:
// name, a colon and req itself (so the answer is fragmented too) when req
// is a whole query (bigDatagram bytes of bigPayload(its first byte)); no
// answer otherwise.
func bigEcho(name string) func(req []byte) []byte {
	return func(req []byte) []byte {
		if len(req) != bigDatagram || !bytes.Equal(req, bigPayload(req[0])) {
			return nil // not whole: the client's check fails
		}
		return append([]byte(name+":"), req...)
	}
}

// bigPayload is the datagram of query seed: bigDatagram bytes that differ
// from every other query's.
func bigPayload(seed byte) []byte {
	b := make([]byte, bigDatagram)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

// TestFragmentedTraffic sends real 4,000-byte UDP datagrams from the
// client pod to a Service over 1,500-byte MTUs: the client's kernel
// fragments each, tc on its veth translates the fragments (the first
// balanced, the later ones following it), the backend (two on node1, one
// on node2 behind the uplink) gets the datagram whole and echoes it, and
// its fragmented answer, translated back (by tc on a local backend's
// veth, by XDP on the uplink for node2's), reaches the client whole from
// the Service address. Each datagram from a new socket: a new flow.
func TestFragmentedTraffic(t *testing.T) {
	fragmentedTraffic(t, "udp4", "0.0.0.0:0", "10.96.0.20:60", "10.1.1.2:6000", "10.1.2.2:6000", "10.2.1.2:6000")
}

// TestFragmentedTrafficIPv6 is TestFragmentedTraffic in IPv6, on the
// testbed's second family: the fragment headers' 32-bit identifications
// remembered in tlb_frags6, the later fragments' IPv6 headers
// translated, in both directions.
func TestFragmentedTrafficIPv6(t *testing.T) {
	fragmentedTraffic(t, "udp6", "[::]:0", "[fd00:96::20]:60", "[fd00:10:1::2]:6000", "[fd00:10:2::2]:6000", "[fd00:20:1::2]:6000")
}

// fragmentedTraffic is TestFragmentedTraffic over network (its client's
// sockets bound to local) to the frontend vip, served by b1 and b2 on
// node1 and b3 on node2.
func fragmentedTraffic(t *testing.T, network, local, vip, b1, b2, b3 string) {
	requirePrivileges(t)
	tb := newTestbed(t)
	serve := ":6000"
	if network == "udp6" {
		tb.dualStack(t)
		serve = "[::]:6000"
	}
	d := tb.attachNode1(t, filepath.Join(bpffs(t), "topolb"))
	for name, ns := range map[string]*nettest.NS{"b1": tb.b1, "b2": tb.b2, "b3": tb.b3} {
		ns.ServeUDP(t, serve, bigEcho(name))
	}
	mustSet(t, d, fe(vip, UDP),
		Backend{Addr: netip.MustParseAddrPort(b1), NodeLocal: true, ZoneLocal: true},
		Backend{Addr: netip.MustParseAddrPort(b2), NodeLocal: true, ZoneLocal: true},
		Backend{Addr: netip.MustParseAddrPort(b3), ZoneLocal: true})
	for _, x := range []struct {
		ns     *nettest.NS
		ifname string
	}{{tb.client, "eth0"}, {tb.node1, "hc"}, {tb.node1, "hb1"}, {tb.node1, "w1"}, {tb.node2, "w2"}, {tb.node2, "hb3"}, {tb.b1, "eth0"}, {tb.b3, "eth0"}} {
		mtu, err := x.ns.MTU(x.ifname)
		if err != nil {
			t.Fatal(err)
		}
		if mtu != 1500 {
			t.Fatalf("%s %s: MTU %d, the test needs 1500", x.ns.Name, x.ifname, mtu)
		}
	}
	before, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}

	const n = 30
	to := net.UDPAddrFromAddrPort(netip.MustParseAddrPort(vip))
	got := map[string]int{}
	// The client's kernel picks each socket's port at random, so two of
	// the n sockets can get the same one: their datagrams are one flow.
	ports := map[uint16]bool{}
	buf := make([]byte, 65536)
	for i := range n {
		payload := bigPayload(byte(i))
		c, err := tb.client.ListenPacket(network, local)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.WriteTo(payload, to); err != nil {
			t.Fatal(err)
		}
		ports[c.LocalAddr().(*net.UDPAddr).AddrPort().Port()] = true
		if err := c.SetReadDeadline(time.Now().Add(2 * time.Second)); err != nil {
			t.Fatal(err)
		}
		m, src, err := c.ReadFrom(buf)
		c.Close()
		if err != nil {
			t.Fatalf("datagram %d: no answer: %v", i, err)
		}
		if s := src.(*net.UDPAddr).AddrPort().String(); s != vip {
			t.Fatalf("datagram %d answered from %s, not the Service address %s", i, s, vip)
		}
		name, echo, ok := bytes.Cut(buf[:m], []byte(":"))
		if !ok || !bytes.Equal(echo, payload) {
			t.Fatalf("datagram %d: answer of %d bytes is not the %d-byte datagram echoed", i, m, bigDatagram)
		}
		got[string(name)]++
	}
	t.Logf("answers per backend: %v", got)
	for _, name := range []string{"b1", "b2", "b3"} {
		if got[name] == 0 {
			t.Errorf("backend %s never answered: %v", name, got)
		}
	}

	after, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	delta := func(s Stat) uint64 { return after.Stats[s] - before.Stats[s] }
	// Three fragments each way per datagram: two first fragments and
	// four later ones, none passed untranslated; one flow per source port.
	flows := uint64(len(ports))
	for s, want := range map[Stat]uint64{StatFragFirst: 2 * n, StatFragFollowed: 4 * n, StatFragment: 0, StatConntrackCreated: flows} {
		if got := delta(s); got != want {
			t.Errorf("%s delta = %d, want %d", s, got, want)
		}
	}
	if after.Drops != (Drops{}) {
		t.Errorf("drops: %+v", after.Drops)
	}
	tb.noChecksumErrors(t)
}
