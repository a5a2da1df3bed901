package maps

import (
	"encoding/binary"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/nettest"
)

// TestPodToLoopbackTraffic: a pod that builds its own frames (a packet
// socket) to the node's 127.0.0.1 does not reach a service listening
// there, nor one from 127.0.0.1 a service on the node's address, even
// where the node lets loopback addresses in from its interfaces
// (route_localnet, as kube-proxy sets it): tc on the pod's veth drops
// the frames and counts them. The same frame to the node's own
// address on the veth arrives, so the frames are delivered at all.
func TestPodToLoopbackTraffic(t *testing.T) {
	requirePrivileges(t)
	node, p := nettest.NewNS(t, "lo-node"), nettest.NewNS(t, "lo-pod")
	pod(t, node, p, "hp", "10.1.0")
	for _, k := range []string{"net.ipv4.conf.all.route_localnet", "net.ipv4.conf.hp.route_localnet"} {
		must(t, node.Sysctl(k, "1"))
	}
	must(t, node.Sysctl("net.ipv4.conf.all.rp_filter", "0"))
	must(t, node.Sysctl("net.ipv4.conf.hp.rp_filter", "0"))
	d := newDatapath(t, Options{NetNS: node.Path})
	must(t, d.AttachPod("hp"))

	listen := func(addr string) net.PacketConn {
		c, err := node.ListenPacket("udp4", addr)
		must(t, err)
		t.Cleanup(func() { c.Close() })
		return c
	}
	local, control := listen("127.0.0.1:9999"), listen("10.1.0.1:9998")
	hostMAC, err := node.HardwareAddr("hp")
	must(t, err)
	podMAC, err := p.HardwareAddr("eth0")
	must(t, err)
	send := func(src, dst string) {
		t.Helper()
		f := udpFrame(src, dst, "from the pod")
		copy(f.srcMAC[:], podMAC)
		copy(f.dstMAC[:], hostMAC)
		must(t, p.Do(func() error { return sendFrame("eth0", f.bytes()) }))
	}
	received := func(c net.PacketConn) bool {
		t.Helper()
		must(t, c.SetReadDeadline(time.Now().Add(time.Second)))
		buf := make([]byte, 64)
		_, _, err := c.ReadFrom(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return false
		}
		must(t, err)
		return true
	}

	before, err := d.Counters()
	must(t, err)
	send("10.1.0.2:40000", "127.0.0.1:9999")
	send("127.0.0.1:40000", "10.1.0.1:9998")
	if received(local) {
		t.Error("a pod's frame to 127.0.0.1 reached the node's localhost listener")
	}
	if received(control) {
		t.Error("a pod's frame from 127.0.0.1 reached the node's listener")
	}
	send("10.1.0.2:40000", "10.1.0.1:9998")
	if !received(control) {
		t.Fatal("the pod's frame to the node's address on its veth did not arrive: the test sends nothing")
	}
	after, err := d.Counters()
	must(t, err)
	if got := after.Stats[StatDropLoopback] - before.Stats[StatDropLoopback]; got != 2 {
		t.Errorf("drop_loopback delta = %d, want 2", got)
	}
}

// sendFrame sends the Ethernet frame b out of ifname, as built, with a
// packet socket of the calling thread's namespace.
func sendFrame(ifname string, b []byte) error {
	ifi, err := net.InterfaceByName(ifname)
	if err != nil {
		return err
	}
	var proto [2]byte
	binary.BigEndian.PutUint16(proto[:], unix.ETH_P_ALL)
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(binary.NativeEndian.Uint16(proto[:])))
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Sendto(fd, b, 0, &unix.SockaddrLinklayer{Ifindex: ifi.Index, Halen: 6})
}
