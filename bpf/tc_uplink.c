// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* tcx ingress on the node's uplinks, one of two programs per the uplink's
 * path (the agent probes and chooses, docs/datapath.md "Uplink paths"):
 *   tc_uplink, beside xdp_lb (path xdp): finishes what xdp_lb started for
 *     frames it translated but cannot forward itself. XDP cannot redirect
 *     into the peer of a pod's veth, nor resolve a next hop; it hands the
 *     target over in the frame's metadata (struct fwd_meta, fwd.h), and
 *     this program delivers the skb into the pod with bpf_redirect_peer or
 *     sends it out through the neighbour subsystem with
 *     bpf_redirect_neigh, skipping the host stack, as an skb of its
 *     family. Frames without topolb's metadata pass untouched, but for
 *     the IPv6 that xdp_lb leaves to tc (xdp_lb.c): ICMPv6 errors about
 *     translated flows and rejects, which tc_lb6 answers.
 *   tc_uplink_lb, alone (path tc): balances frontends of scope external
 *     itself, where XDP's transmitted frames would be lost (a veth whose
 *     peer has no NAPI) or XDP has no native mode: the same core, maps
 *     and conntrack as xdp_lb, on skbs (tc.h, as tc_lb on pod veths), for
 *     both families. It also finishes XDP handovers, so the swap between
 *     the two paths loses no frame in flight.
 * IPv6 is balanced the same on both paths, by xdp_lb6 on the XDP path
 * and tc_lb6 on the tc path: frontends of scope external (NodePorts on
 * the node's IPv6 addresses, load-balancer and external IPs), into a
 * local pod or source-NATed to the node's IPv6 address towards another
 * node's backend, and the replies. */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#define LB_SCOPE_DEFAULT SCOPE_EXTERNAL
#include "tc.h"

/* uplink_handover forwards a frame that xdp_lb handed over with its target
 * in the metadata. Returns 1 with the verdict in *verdict for such a
 * frame, 0 for any other. A subprogram of its own: its frame is not
 * added to the balancing subprograms' (tc_lb4, tc_lb6), which need most
 * of the 512-byte stack. */
static __attribute__((noinline)) int uplink_handover(struct __sk_buff *skb, int *verdict)
{
	void *data = (void *)(long)skb->data;
	struct fwd_meta *m = (void *)(long)skb->data_meta;
	struct fwd_target t = {};
	int no_stack;

	/* Exactly our metadata, or none of our business. The bound is
	 * checked on its own first: it is what tells the verifier m is
	 * readable. */
	if ((void *)(m + 1) > data)
		return 0;
	if (m->magic != FWD_META_MAGIC)
		return 0;
	asm volatile("" ::: "memory");
	if ((void *)(m + 1) != data)
		return 0;
	t.kind = m->kind;
	t.ifindex = m->ifindex;
	__builtin_memcpy(t.dmac, m->dmac, ETH_ALEN);
	__builtin_memcpy(t.smac, m->smac, ETH_ALEN);
	t.nexthop = m->nexthop;
	no_stack = m->flags & FWD_META_F_NO_STACK;
	/* Consumed: an skb that comes back through this hook (the stack
	 * may re-inject one) is not forwarded twice. */
	m->magic = 0;
	*verdict = TC_PASS;
	if (t.kind == CT_REDIRECT_PEER || t.kind == CT_REDIRECT_NEIGH)
		*verdict = tc_is6(skb) ? fwd_skb_fam(PKT_IPV6, skb, &t, no_stack) : fwd_skb4(skb, &t, no_stack);
	return 1;
}

SEC("tcx/ingress")
int tc_uplink(struct __sk_buff *skb)
{
	int verdict;

	if (uplink_handover(skb, &verdict))
		return verdict;
	if (tc_is6(skb))
		return tc_lb6(skb);
	return TC_PASS;
}

SEC("tcx/ingress")
int tc_uplink_lb(struct __sk_buff *skb)
{
	int verdict;

	if (uplink_handover(skb, &verdict))
		return verdict;
	if (tc_is6(skb))
		return tc_lb6(skb);
	return tc_lb4(skb);
}

char _license[] SEC("license") = "Dual BSD/GPL";
