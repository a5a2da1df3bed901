package maps

import (
	"net/netip"
	"testing"
)

// TestPodToLoopback: tc on a pod's veth drops, and counts, every frame
// the pod addresses to or from a loopback address (127.0.0.0/8, ::1): a
// hand-built frame to a NodePort served on 127.0.0.1 is not translated
// to its backend, nor does one to another port reach what listens on the
// node's localhost, nor one from 127.0.0.1 pose as the node's own
// processes. The node's other frontends are served as before, and
// the uplinks' hooks never see such traffic (their scope has no loopback
// frontend; the kernel drops a martian from the wire).
func TestPodToLoopback(t *testing.T) {
	d := setupTable(t)
	nodePort := fe("127.0.0.1:30080", TCP)
	mustSet(t, d, nodePort, be(beTCP))
	loop := stats{StatDropLoopback: 1}
	pod6 := tcFamilies[1].addrs.client
	runTable(t, d, []pktCase{
		{name: "syn_to_a_nodeport_on_127.0.0.1", hook: hookTC, in: tcpFrame(client, nodePort.Addr.String(), tcpSYN, ""), want: drop, stats: loop},
		{name: "syn_to_a_localhost_service", hook: hookTC, in: tcpFrame(client, "127.0.0.1:22", tcpSYN, ""), want: drop, stats: loop},
		{name: "udp_to_elsewhere_in_127/8", hook: hookTC, in: udpFrame(client, "127.53.0.1:53", "q"), want: drop, stats: loop},
		{name: "icmp_to_127.0.0.1", hook: hookTC, in: frame{src: netip.MustParseAddrPort(client), dst: netip.MustParseAddrPort("127.0.0.1:0"),
			proto: protoICMP, payload: []byte("ping")}, want: drop, stats: loop},
		{name: "first_fragment_to_127.0.0.1", hook: hookTC, in: fragmentsOf(udpFrame(client, "127.0.0.1:53", fragPayload(9)), fragSize)[0],
			want: drop, stats: loop},
		{name: "later_fragment_to_127.0.0.1", hook: hookTC, in: fragmentsOf(udpFrame(client, "127.0.0.1:53", fragPayload(9)), fragSize)[1],
			want: drop, stats: loop},
		{name: "syn_to_ipv6_loopback", hook: hookTC, in: tcpFrame(pod6, "[::1]:22", tcpSYN, ""), want: drop, stats: loop},
		{name: "udp_to_ipv6_loopback", hook: hookTC, in: udpFrame(pod6, "[::1]:53", "q"), want: drop, stats: loop},
		// A loopback source poses as the node's own processes.
		{name: "syn_from_127.0.0.1_to_a_frontend", hook: hookTC, in: tcpFrame("127.0.0.1:40000", vipTCP, tcpSYN, ""), want: drop, stats: loop},
		{name: "udp_from_127.0.0.1_to_the_node", hook: hookTC, in: udpFrame("127.0.0.1:40000", "10.0.0.1:53", "q"), want: drop, stats: loop},
		{name: "syn_from_ipv6_loopback", hook: hookTC, in: tcpFrame("[::1]:40000", tcFamilies[1].addrs.vipTCP, tcpSYN, ""), want: drop, stats: loop},
		// Neighbours of the loopback ranges are addresses like any.
		{name: "syn_to_128.0.0.1_not_ours", hook: hookTC, in: tcpFrame(client, "128.0.0.1:22", tcpSYN, ""), want: pass},
		{name: "syn_to_ipv6_::2_not_ours", hook: hookTC, in: tcpFrame(pod6, "[::2]:22", tcpSYN, ""), want: pass},
		{name: "a_frontend_still_served", hook: hookTC, in: tcpFrame(client, vipTCP, tcpSYN, ""),
			out: ptr(tcpFrame(client, beTCP, tcpSYN, "")), fwd: fe(vipTCP, TCP), newFlow: true, stats: newFlowStats(nil)},
	})
}
