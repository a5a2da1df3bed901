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
 * traffic, which is why pods are served by tc).
 *
 * Both families, each in its own subprogram (xdp_lb4, xdp_lb6) over the
 * same core (lb.h), rewrite (nat_rewrite_xdp_fam) and forwarding
 * (fwd_xdp_fam), as tc_lb4 and tc_lb6 are on tc: IPv6's flows, new and
 * established, their replies and source NAT are balanced here as IPv4's
 * are. What IPv6 leaves to tc_uplink, on the same uplink's tc ingress,
 * passes up untouched (XDP_PASS): ICMPv6 (errors about translated flows
 * are translated there, icmp6_xlate; NDP, router advertisements, MLD and
 * echo are the kernel's), rejects (reject6_prepare reads the quoted
 * datagram with skb helpers) and every packet not ours; fragments are
 * translated here as IPv4's (frag.h). A
 * translated IPv6 frame that cannot leave as its flow says (hop limit
 * expiring, larger than the egress MTU) goes up the stack as IPv4's does;
 * one whose next hop has no MAC yet is handed to tc_uplink
 * (fwd_xdp_handoff), which forwards it as an IPv6 skb. */

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define LB_FRAME struct xdp_md
#define LB_SCOPE_DEFAULT SCOPE_EXTERNAL
/* IPv6 rejects pass up to tc_uplink, which counts them (lb.h). */
#define LB_REJECT6_PASSES 1
#include "lb.h"
#include "fwd.h"
#include "icmp.h"
#include "nat.h"
#include "nat6.h"
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
	struct reject_frame *f = reject4_frame_get();
	int len;

	if (!f)
		return XDP_DROP;
	len = reject4_prepare(data, data_end, pkt, f);
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

/* xdp_icmp translates an ICMP error about a translated flow (icmp.h) in
 * place, and passes it up; one that arrived where its flow's packets do
 * not come from is dropped. A global function, verified once on its own:
 * with only the context to go by, it parses the frame again, which only
 * ICMP messages pay. Inlined into xdp_lb4, the verifier walked it once
 * for each state the parser left, about 440,000 of xdp_lb's
 * instructions on Linux 6.18, room that xdp_lb6 needs (docs/datapath.md,
 * "Older kernels"). */
__noinline int xdp_icmp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct packet pkt = {};

	if (parse_packet(data, data_end, data_end - data, &pkt) == PARSE_ICMP &&
	    icmp4_xlate(data, data_end, &pkt, ctx->ingress_ifindex) == LB_DROP)
		return XDP_DROP;
	return XDP_PASS;
}

/* xdp_lb4 balances an IPv4 frame (or passes what is not IPv4). */
static __attribute__((noinline)) int xdp_lb4(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct packet pkt = {};
	struct nat nat = {};

	switch (lb4_classify(ctx, ctx->ingress_ifindex, data, data_end, data_end - data, &pkt, &nat)) {
	case LB_REWRITE:
		if (nat_rewrite_xdp4(ctx, &pkt, &nat)) {
			stat_inc(STAT_DROP_REWRITE);
			return XDP_DROP;
		}
		fwd_refresh4(ctx, ctx->ingress_ifindex, nat4_new_src(&pkt, &nat), nat4_new_dst(&pkt, &nat), pkt.proto,
			    nat.no_stack, nat.ct, &nat.fwd);
		return fwd_xdp4(ctx, &nat.fwd, nat.no_stack);
	case LB_ICMP:
		return xdp_icmp(ctx);
	case LB_REJECT:
		return xdp_reject(ctx, &pkt);
	case LB_DROP:
		return XDP_DROP;
	default:
		return XDP_PASS;
	}
}

/* xdp_lb6 is xdp_lb4 for an IPv6 frame: parse, decide (lb.h, with the
 * IPv6 conntrack), rewrite and forward as IPv4 is; ICMPv6 and rejects
 * pass up to tc_uplink (the header comment says why). */
static __attribute__((noinline)) int xdp_lb6(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct packet6 pkt = {};
	struct nat6 nat = {};

	switch (lb6_classify(ctx, ctx->ingress_ifindex, data, data_end, data_end - data, &pkt, &nat)) {
	case LB_REWRITE:
		if (nat_rewrite_xdp_fam(PKT_IPV6, ctx, &pkt.p, &nat.n)) {
			stat_inc(STAT_DROP_REWRITE);
			return XDP_DROP;
		}
		fwd_refresh6(ctx, ctx->ingress_ifindex, nat6_new_src(&pkt.p, &nat.n), nat6_new_dst(&pkt.p, &nat.n),
			     pkt.p.proto, nat.n.no_stack, nat.n.ct, &nat.n.fwd);
		return fwd_xdp_fam(PKT_IPV6, ctx, &nat.n.fwd, nat.n.no_stack);
	case LB_DROP:
		return XDP_DROP;
	default:
		return XDP_PASS;
	}
}

/* xdp_is6 reports whether the frame carries IPv6 (xdp_lb6's); a tagged
 * frame's EtherType is its tag's, and it passes as in IPv4 (parse.h). */
static __always_inline int xdp_is6(const struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;

	return (void *)(eth + 1) <= data_end && eth->h_proto == bpf_htons(ETH_P_IPV6);
}

/* Each family balances in its own subprogram, as on tc (tc.h, tc_lb4 and
 * tc_lb6): each needs most of the 512-byte stack. */
SEC("xdp")
int xdp_lb(struct xdp_md *ctx)
{
	if (xdp_is6(ctx))
		return xdp_lb6(ctx);
	return xdp_lb4(ctx);
}

char _license[] SEC("license") = "Dual BSD/GPL";
