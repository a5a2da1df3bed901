package maps

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/topolb/topolb/internal/nettest"
)

// tagEgress makes every frame ifname in ns sends carry VLAN tag vid, as a
// VLAN subinterface over it would: a tc program on its egress calls
// bpf_skb_vlan_push, which keeps the tag in the skb (a veth transmits it
// so, and its peer receives it so) rather than in the frame. 8021q, which
// would make a real subinterface, is not built into every test kernel.
func tagEgress(t *testing.T, ns *nettest.NS, ifname string, vid int32) {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.SchedCLS,
		Instructions: asm.Instructions{
			// bpf_skb_vlan_push(skb, htons(ETH_P_8021Q), vid)
			asm.Mov.Imm(asm.R2, 0x0081), // 0x8100 in network byte order, as the helper takes it
			asm.Mov.Imm(asm.R3, vid),
			asm.FnSkbVlanPush.Call(),
			asm.Mov.Imm(asm.R0, 0), // TC_ACT_OK
			asm.Return(),
		},
		License: "GPL",
	})
	if err != nil {
		t.Fatalf("load the tagging program: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	attachInNS(t, ns, ifname, func(ifindex int) (link.Link, error) {
		return link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: ebpf.AttachTCXEgress})
	})
}

// TestVLANTaggedTraffic sends a pod's datagrams and connections to a
// Service with a VLAN tag, as a pod with a VLAN subinterface would: the
// kernel hands tc the tag in the skb (skb->vlan_present), not in the
// frame, which looks untagged. They are not ours: no flow is created, no
// packet translated, and the pod does not reach the Service through them.
// Untagged, the same pod does (the control).
func TestVLANTaggedTraffic(t *testing.T) {
	requirePrivileges(t)
	tb := newTestbed(t)
	d := newDatapath(t, Options{NetNS: tb.node1.Path})
	tb.b1.ServeUDPName(t, ":5353", "b1")
	tb.b1.ServeHTTPName(t, ":8080", "b1")
	const vipDNS, vipHTTP = "10.96.0.10:53", "10.96.0.10:80"
	mustSet(t, d, fe(vipDNS, UDP), be("10.1.1.2:5353"))
	mustSet(t, d, fe(vipHTTP, TCP), be("10.1.1.2:8080"))
	for _, ifname := range []string{"hc", "hb1"} {
		must(t, d.AttachPod(ifname))
	}
	if got := udpQueries(t, tb.client, vipDNS, 3); got["b1"] != 3 {
		t.Fatalf("untagged: answers %v, want 3 from b1", got)
	}

	tagEgress(t, tb.client, "eth0", 42)
	before, err := d.Counters()
	must(t, err)
	c, err := tb.client.ListenPacket("udp4", "0.0.0.0:0")
	must(t, err)
	defer c.Close()
	to, err := net.ResolveUDPAddr("udp4", vipDNS)
	must(t, err)
	const n = 5
	for range n {
		if _, err := c.WriteTo([]byte("q"), to); err != nil {
			t.Fatal(err)
		}
	}
	must(t, c.SetReadDeadline(time.Now().Add(time.Second)))
	if _, from, err := c.ReadFrom(make([]byte, 64)); err == nil {
		t.Errorf("a tagged datagram to %s was answered (from %s)", vipDNS, from)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	if conn, err := tb.client.DialContext(ctx, "tcp4", vipHTTP); err == nil {
		conn.Close()
		t.Errorf("a tagged connection to %s was answered", vipHTTP)
	}
	after, err := d.Counters()
	must(t, err)
	for _, s := range []Stat{StatConntrackCreated, StatReverseNAT, StatDropParseError, StatTCPMidflowMiss} {
		if got := after.Stats[s] - before.Stats[s]; got != 0 {
			t.Errorf("tagged traffic moved %s by %d, want 0: it was taken for ours", s, got)
		}
	}
}
