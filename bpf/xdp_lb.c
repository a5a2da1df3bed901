// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* XDP on the node's uplinks: DNAT for frontends of scope external (traffic
 * arriving from outside the node), and reverse NAT of replies that
 * backends on other nodes send back over the wire. Frames from the wire
 * carry full checksums, so the incremental update in csum.h is correct
 * here (it would not be for CHECKSUM_PARTIAL pod traffic, which is why
 * pods are served by tc). Rewritten frames go up the stack with XDP_PASS;
 * redirecting them (ct_value.redirect) is the forwarding step's job. */

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define LB_SCOPE_DEFAULT SCOPE_EXTERNAL
#include "lb.h"
#include "csum.h"

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
	case LB_DROP:
		return XDP_DROP;
	default:
		return XDP_PASS;
	}
}

char _license[] SEC("license") = "Dual BSD/GPL";
