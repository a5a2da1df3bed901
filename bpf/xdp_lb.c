// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* XDP on the node's uplinks: DNAT for frontends of scope external (traffic
 * arriving from outside the node), with source NAT when the backend is on
 * another node, and reverse NAT of replies that backends on other nodes
 * send back over the wire; then the translated frame is forwarded
 * (fwd.h): XDP_TX or XDP_REDIRECT with the cached MACs, or handed to
 * tc_uplink (tc_uplink.c) for delivery into a local pod, or up the stack.
 * Frames from the wire carry full checksums, so the incremental update in
 * csum.h is correct here (it would not be for CHECKSUM_PARTIAL pod
 * traffic, which is why pods are served by tc). */

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define LB_SCOPE_DEFAULT SCOPE_EXTERNAL
#include "lb.h"
#include "fwd.h"
#include "nat.h"

SEC("xdp")
int xdp_lb(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct packet pkt = {};
	struct nat nat = {};

	switch (lb_classify(ctx, ctx->ingress_ifindex, data, data_end, data_end - data, &pkt, &nat)) {
	case LB_REWRITE:
		if (nat_rewrite_xdp(ctx, &pkt, &nat)) {
			stat_inc(STAT_DROP_REWRITE);
			return XDP_DROP;
		}
		fwd_refresh(ctx, ctx->ingress_ifindex, nat_new_src(&pkt, &nat), nat_new_dst(&pkt, &nat), pkt.proto,
			    nat.no_stack, nat.ct, &nat.fwd);
		return fwd_xdp(ctx, &nat.fwd, nat.no_stack);
	case LB_DROP:
		return XDP_DROP;
	default:
		return XDP_PASS;
	}
}

char _license[] SEC("license") = "Dual BSD/GPL";
