package maps

import (
	"net"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/topolb/topolb/internal/nettest"
)

// TestChecksumHarnessCatchesXDPOnPodVeth is the negative control of
// TestRealTraffic: the XDP program, switched to the internal scope, does on
// the client's veth what tc does there. Pods send CHECKSUM_PARTIAL packets,
// whose checksum field holds only the pseudo-header sum; XDP cannot tell
// and updates it as a full checksum, so the port rewrite corrupts it. The
// testbed must see that as checksum errors at the backends — otherwise its
// "zero errors" would prove nothing.
func TestChecksumHarnessCatchesXDPOnPodVeth(t *testing.T) {
	requirePrivileges(t)
	pin := filepath.Join(bpffs(t), "topolb")
	tb := newTestbed(t)
	d := newDatapath(t, Options{PinPath: pin, NetNS: tb.node1.Path})
	mustSet(t, d, fe("10.96.0.10:53", UDP), be("10.1.1.2:5353"), be("10.1.2.2:5353"))
	tb.b1.ServeUDPName(t, ":5353", "b1")
	tb.b2.ServeUDPName(t, ":5353", "b2")

	spec, err := loadXdp()
	if err != nil {
		t.Fatal(err)
	}
	sizeMaps(spec, d.opts)
	if err := spec.Variables[xdpVarCfgScope].Set(uint8(ScopeInternal)); err != nil {
		t.Fatal(err)
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: d.sharedMapSet()})
	if err != nil {
		t.Fatal(err)
	}
	defer coll.Close()
	err = tb.node1.Do(func() error {
		iface, err := net.InterfaceByName("hc")
		if err != nil {
			return err
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: coll.Programs[xdpProgXdpLb], Interface: iface.Index})
		if err != nil {
			return err
		}
		t.Cleanup(func() { l.Close() })
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	to := net.UDPAddrFromAddrPort(netip.MustParseAddrPort("10.96.0.10:53"))
	for i := 0; i < 20; i++ {
		c, err := tb.client.ListenPacket("udp4", "0.0.0.0:0")
		if err != nil {
			t.Fatal(err)
		}
		c.WriteTo([]byte("query"), to)
		c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		c.ReadFrom(make([]byte, 64)) // no answer expected
		c.Close()
	}
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Frontends[fe("10.96.0.10:53", UDP)].Packets; got != 20 {
		t.Fatalf("XDP translated %d of 20 queries", got)
	}
	var errs uint64
	for _, ns := range []*nettest.NS{tb.b1, tb.b2} {
		ce, err := ns.ChecksumErrors()
		if err != nil {
			t.Fatal(err)
		}
		errs += ce.UDP
	}
	t.Logf("UDP checksum errors at the backends: %d of 20", errs)
	if errs == 0 {
		t.Error("XDP rewrote CHECKSUM_PARTIAL packets, yet no receiver counted a checksum error: the testbed would not catch a broken checksum")
	}
}
