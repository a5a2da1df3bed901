package netns_test

import (
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/topolb/topolb/internal/netns"
	"github.com/topolb/topolb/internal/nettest"
)

// TestWiring builds two namespaces joined by a veth and checks each
// operation against what the kernel then reports: addresses and routes by
// traffic, the MTU, transmit checksum offload, sysctls (per namespace,
// not leaking to the host), the Udp NoPorts counter growing by exactly the
// datagrams sent to a closed port, and RunIn entering by path.
func TestWiring(t *testing.T) {
	nettest.RequireRoot(t)
	a, b := nettest.NewNS(t, "a").NS, nettest.NewNS(t, "b").NS
	if err := netns.Veth(a, "va", b, "vb"); err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{
		a.AddAddr("va", "192.0.2.1/24"),
		b.AddAddr("vb", "192.0.2.2/24"),
		a.AddAddr("lo", "198.51.100.1/32"),
		b.AddRouteDev("198.51.100.1/32", "vb", "192.0.2.1"),
		a.SetMTU("va", 1400),
		a.SetTxChecksum("va", false),
		a.Sysctl("net.ipv4.ip_forward", "1"),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	if mtu, err := a.MTU("va"); err != nil || mtu != 1400 {
		t.Errorf("MTU of va = %d, %v; want 1400", mtu, err)
	}
	for _, c := range []struct {
		ns  *netns.NS
		if_ string
		on  bool
	}{{a, "va", false}, {b, "vb", true}} {
		if on, err := c.ns.TxChecksum(c.if_); err != nil || on != c.on {
			t.Errorf("%s: tx checksum offload %v, %v; want %v", c.if_, on, err, c.on)
		}
	}
	if v, err := a.ReadSysctl("net.ipv4.ip_forward"); err != nil || v != "1" {
		t.Errorf("ip_forward in a = %q, %v; want 1", v, err)
	}
	// b starts clean, whatever the host's forwarding (Create), and a's
	// setting does not leak into it.
	if v, err := b.ReadSysctl("net/ipv4/ip_forward"); err != nil || v != "0" {
		t.Errorf("ip_forward in b = %q, %v; want 0 (sysctls are per namespace, and a new one starts clean)", v, err)
	}

	// b reaches a's loopback address only through the route above.
	before, err := a.UDPNoPorts()
	if err != nil {
		t.Fatal(err)
	}
	const sent = 5
	// Unconnected: a connected socket would turn the ICMP error of one
	// datagram into a failed write of the next.
	c, err := b.ListenPacket("udp4", "192.0.2.2:0")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	dst := &net.UDPAddr{IP: net.IPv4(198, 51, 100, 1), Port: 9}
	for range sent {
		if _, err := c.WriteTo([]byte("x"), dst); err != nil {
			t.Fatal(err)
		}
	}
	var got uint64
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		after, err := a.UDPNoPorts()
		if err != nil {
			t.Fatal(err)
		}
		if got, err = netns.Growth(before, after); err != nil {
			t.Fatal(err)
		}
		if got >= sent || time.Now().After(deadline) {
			break
		}
	}
	if got != sent {
		t.Errorf("Udp NoPorts grew by %d, want %d", got, sent)
	}
	if ce, err := a.ChecksumErrors(); err != nil || ce != (netns.ChecksumErrors{}) {
		t.Errorf("checksum errors %+v, %v", ce, err)
	}

	err = netns.RunIn(b.Path, func() error {
		_, err := net.InterfaceByName("vb")
		return err
	})
	if err != nil {
		t.Errorf("RunIn(%s): vb not found: %v", b.Path, err)
	}
	if err := netns.RunIn(filepath.Join(netns.Dir, "tlbt-does-not-exist"), func() error { return nil }); err == nil {
		t.Error("RunIn of a missing namespace succeeded")
	}
}

// TestRemoveStaleKeepsLiveNamespaces checks that RemoveStale removes a
// namespace of a dead process and keeps this process's.
func TestRemoveStaleKeepsLiveNamespaces(t *testing.T) {
	nettest.RequireRoot(t)
	live := nettest.NewNS(t, "live")
	// A pid that cannot exist stands for a crashed run.
	stale, err := netns.Create(nettest.Prefix + "999999999-1-crashed")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stale.Delete() })
	if err := netns.RemoveStale(nettest.Prefix); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale.Path); !os.IsNotExist(err) {
		t.Errorf("stale namespace still there: %v", err)
	}
	if _, err := os.Stat(live.Path); err != nil {
		t.Errorf("live namespace removed: %v", err)
	}
	// Deleting what is already gone is not an error.
	if err := stale.Delete(); err != nil {
		t.Errorf("second Delete: %v", err)
	}
}

// TestNICStats reads a veth's driver statistics by name: its peer's
// ifindex, which netlink reports too, and its receive queue's XDP
// verdicts, all 0 without an XDP program.
func TestNICStats(t *testing.T) {
	nettest.RequireRoot(t)
	a, b := nettest.NewNS(t, "a").NS, nettest.NewNS(t, "b").NS
	if err := netns.Veth(a, "va", b, "vb"); err != nil {
		t.Fatal(err)
	}
	stats, err := a.NICStats("va")
	if err != nil {
		t.Fatal(err)
	}
	peer, err := b.Netlink().LinkByName("vb")
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := stats["peer_ifindex"]; !ok || got != uint64(peer.Attrs().Index) {
		t.Errorf("peer_ifindex = %d (%v), want %d; stats %v", got, ok, peer.Attrs().Index, stats)
	}
	for _, name := range []string{"rx_queue_0_xdp_tx", "rx_queue_0_xdp_redirect", "rx_queue_0_xdp_packets"} {
		if got, ok := stats[name]; !ok || got != 0 {
			t.Errorf("%s = %d (%v), want 0", name, got, ok)
		}
	}
	if _, err := a.NICStats("nonexistent0"); err == nil {
		t.Error("statistics of an interface that does not exist: no error")
	}
}
