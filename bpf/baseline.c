// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* Parse-and-pass programs for both hooks: the benchmark's baseline. They do
 * the same header work as the real programs and nothing else, so the
 * benchmark ratio measures what load balancing adds. */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "ipv6.h"
#include "parse.h"

/* fold4 keeps the compiler from discarding the parsed fields. */
static __always_inline int fold4(const struct packet *pkt)
{
	volatile __u32 sink = pkt->saddr ^ pkt->daddr ^ pkt->sport ^ pkt->dport ^ pkt->proto;

	return sink == 1;
}

/* fold6 is fold4 for an IPv6 packet: its addresses folded as well. */
static __always_inline int fold6(const struct packet6 *pkt)
{
	volatile __u32 sink = addr_fold(&pkt->saddr) ^ addr_fold(&pkt->daddr) ^ pkt->p.sport ^ pkt->p.dport ^
			      pkt->p.proto;

	return sink == 1;
}

SEC("tcx/ingress")
int tc_baseline(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct packet pkt = {};

	if (parse_packet(data, data_end, skb->len, &pkt) == PARSE_OK && fold4(&pkt))
		return TC_ACT_SHOT;
	return TC_ACT_UNSPEC; /* as tc_lb passes: TCX_NEXT */
}

/* tc_baseline6 is tc_baseline for IPv6 frames (the IPv6 rows' baseline). */
SEC("tcx/ingress")
int tc_baseline6(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct packet6 pkt = {};

	if (parse_ipv6(data, data_end, skb->len, &pkt) == PARSE_OK && fold6(&pkt))
		return TC_ACT_SHOT;
	return TC_ACT_UNSPEC;
}

SEC("xdp")
int xdp_baseline(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct packet pkt = {};

	if (parse_packet(data, data_end, data_end - data, &pkt) == PARSE_OK && fold4(&pkt))
		return XDP_DROP;
	return XDP_PASS;
}

/* xdp_baseline6 is xdp_baseline for IPv6 frames (the xdp6 rows'
 * baseline). */
SEC("xdp")
int xdp_baseline6(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct packet6 pkt = {};

	if (parse_ipv6(data, data_end, data_end - data, &pkt) == PARSE_OK && fold6(&pkt))
		return XDP_DROP;
	return XDP_PASS;
}

char _license[] SEC("license") = "Dual BSD/GPL";
