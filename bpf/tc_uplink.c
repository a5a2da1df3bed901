// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* tcx ingress on the node's uplinks: finishes what xdp_lb started for
 * frames it translated but cannot forward itself. XDP cannot redirect
 * into the peer of a pod's veth, nor resolve a next hop; it hands the
 * target over in the frame's metadata (struct fwd_meta, fwd.h), and this
 * program delivers the skb into the pod with bpf_redirect_peer or sends it
 * out through the neighbour subsystem with bpf_redirect_neigh, skipping
 * the host stack. Frames without topolb's metadata pass untouched. */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "fwd.h"
#include "stats.h"

SEC("tcx/ingress")
int tc_uplink(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	struct fwd_meta *m = (void *)(long)skb->data_meta;
	struct fwd_target t = {};
	int no_stack;

	/* Exactly our metadata, or none of our business. The bound is
	 * checked on its own first: it is what tells the verifier m is
	 * readable. */
	if ((void *)(m + 1) > data)
		return TC_PASS;
	if (m->magic != FWD_META_MAGIC)
		return TC_PASS;
	asm volatile("" ::: "memory");
	if ((void *)(m + 1) != data)
		return TC_PASS;
	t.kind = m->kind;
	t.ifindex = m->ifindex;
	__builtin_memcpy(t.dmac, m->dmac, ETH_ALEN);
	__builtin_memcpy(t.smac, m->smac, ETH_ALEN);
	t.nexthop = m->nexthop;
	no_stack = m->flags & FWD_META_F_NO_STACK;
	/* Consumed: an skb that comes back through this hook (the stack
	 * may re-inject one) is not forwarded twice. */
	m->magic = 0;
	if (t.kind != CT_REDIRECT_PEER && t.kind != CT_REDIRECT_NEIGH)
		return TC_PASS;
	return fwd_skb(skb, &t, no_stack);
}

char _license[] SEC("license") = "Dual BSD/GPL";
