// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* XDP on the node's uplinks: DNAT for frontends of scope external (traffic
 * arriving from outside the node), with source NAT when the backend is on
 * another node, reverse NAT of replies that backends on other nodes send
 * back over the wire, ICMP errors from other nodes and routers about
 * translated flows (icmp.h), and rejects for empty reject frontends, sent
 * back out of the uplink (reject.h). A translated frame is forwarded
 * (fwd.h): XDP_TX or XDP_REDIRECT with the cached MACs, or handed to
 * tc_uplink (tc_uplink.c) for delivery into a local pod, or up the stack.
 * Frames from the wire carry full checksums, so the incremental update in
 * csum.h is correct here (it would not be for CHECKSUM_PARTIAL pod
 * traffic, which is why pods are served by tc). IPv6 passes up untouched
 * (XDP_PASS, the parser takes IPv4 only): tc_uplink, on the same
 * uplink's tc ingress, balances it (tc_uplink.c), which keeps xdp_lb
 * within 5.10's verifier limit and its frame for IPv4. */

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define LB_FRAME struct xdp_md
#define LB_SCOPE_DEFAULT SCOPE_EXTERNAL
#include "lb.h"
#include "fwd.h"
#include "icmp.h"
#include "nat.h"
#include "reject.h"

_Static_assert(REJECT_MAX_LEN <= COMPAT_STORE_MAX, "a reply fits compat_xdp_store_bytes");

/* xdp_resize makes the frame len bytes long: a longer one grows at the
 * head, where every driver leaves XDP_PACKET_HEADROOM (the tail of a
 * veth's frame may have no room), a shorter one is cut at the tail. The
 * bytes are the caller's to write. Returns 0 on success. */
static __always_inline int xdp_resize(struct xdp_md *ctx, int len)
{
	int delta = len - (int)(ctx->data_end - ctx->data);

	if (delta > 0)
		return bpf_xdp_adjust_head(ctx, -delta);
	if (delta < 0)
		return bpf_xdp_adjust_tail(ctx, delta);
	return 0;
}

/* xdp_reject answers pkt, from outside to an empty reject frontend, in
 * place and sends the reply back out of the uplink. */
static __always_inline int xdp_reject(struct xdp_md *ctx, const struct packet *pkt)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct reject_frame *f = reject_frame_get();
	int len;

	if (!f)
		return XDP_DROP;
	len = reject_prepare(data, data_end, pkt, f);
	if (len < 0)
		return XDP_DROP;
	len &= REJECT_LEN_MASK;
	if (len > REJECT_MAX_LEN || xdp_resize(ctx, len) ||
	    compat_xdp_store_bytes(ctx, (void *)f + REJECT_FRAME_OFF, len)) {
		stat_inc(STAT_DROP_REWRITE);
		return XDP_DROP;
	}
	stat_inc(STAT_REJECT);
	return XDP_TX;
}

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
	case LB_ICMP:
		icmp_xlate(data, data_end, &pkt);
		return XDP_PASS;
	case LB_REJECT:
		return xdp_reject(ctx, &pkt);
	case LB_DROP:
		return XDP_DROP;
	default:
		return XDP_PASS;
	}
}

char _license[] SEC("license") = "Dual BSD/GPL";
