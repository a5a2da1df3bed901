// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* XDP on the node's uplinks: DNAT for frontends of scope external (traffic
 * arriving from outside the node), reverse NAT of replies that backends on
 * other nodes send back over the wire, ICMP errors from other nodes and
 * routers about translated flows (icmp.h), and rejects for empty reject
 * frontends, sent back out of the uplink (reject.h). Frames from the wire
 * carry full checksums, so the incremental update in csum.h is correct
 * here (it would not be for CHECKSUM_PARTIAL pod traffic, which is why
 * pods are served by tc). Rewritten frames go up the stack with XDP_PASS;
 * redirecting them (ct_value.redirect) is the forwarding step's job. */

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define LB_SCOPE_DEFAULT SCOPE_EXTERNAL
#include "lb.h"
#include "csum.h"
#include "icmp.h"
#include "reject.h"

#define UDP_CSUM_ALL_ONES 0xffff

/* xdp_rewrite applies nat in place. Returns 0 on success. */
static __always_inline int xdp_rewrite(struct xdp_md *ctx, const struct packet *pkt,
				       const struct nat *nat)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct iphdr *ip = data + ETH_HLEN;
	void *l4 = data + (pkt->l4_off & L4_OFF_MASK);
	__u16 *check;
	__be16 *port;

	if ((void *)(ip + 1) > data_end)
		return -1;

	if (pkt->proto == IP_PROTO_TCP) {
		struct tcphdr *tcp = l4;

		if ((void *)(tcp + 1) > data_end)
			return -1;
		check = &tcp->check;
		port = nat->dst ? &tcp->dest : &tcp->source;
	} else {
		struct udphdr *udp = l4;

		if ((void *)(udp + 1) > data_end)
			return -1;
		check = &udp->check;
		port = nat->dst ? &udp->dest : &udp->source;
	}

	/* UDP checksum 0 means "none" and stays 0; a computed 0 is sent as
	 * its one's-complement twin, all ones (RFC 768). */
	if (pkt->proto != IP_PROTO_UDP || *check != 0) {
		__u16 sum = csum_replace4(*check, nat->old_addr, nat->new_addr);

		sum = csum_replace2(sum, nat->old_port, nat->new_port);
		if (pkt->proto == IP_PROTO_UDP && sum == 0)
			sum = UDP_CSUM_ALL_ONES;
		*check = sum;
	}
	*port = nat->new_port;

	ip->check = csum_replace4(ip->check, nat->old_addr, nat->new_addr);
	if (nat->dst)
		ip->daddr = nat->new_addr;
	else
		ip->saddr = nat->new_addr;
	return 0;
}

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
	struct reject_frame f = {};
	int len;

	len = reject_prepare(data, data_end, pkt, &f);
	if (len < 0)
		return XDP_DROP;
	len &= REJECT_LEN_MASK;
	if (len > REJECT_MAX_LEN || xdp_resize(ctx, len) ||
	    bpf_xdp_store_bytes(ctx, 0, (void *)&f + REJECT_FRAME_OFF, len)) {
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

	switch (lb_classify(data, data_end, data_end - data, &pkt, &nat)) {
	case LB_REWRITE:
		if (xdp_rewrite(ctx, &pkt, &nat)) {
			stat_inc(STAT_DROP_REWRITE);
			return XDP_DROP;
		}
		return XDP_PASS;
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
