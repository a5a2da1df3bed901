// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* The floor of a node-local service proxy, for the benchmark (issue 23):
 * per hook, what no implementation can skip for an established packet.
 * Parse, ONE lookup in a flow table (an LRU hash with conntrack's key and
 * value, filled by the benchmark with conntrack's keys, as many), the same
 * rewrite with the same checksum updates as the hit path (nat.h), pass.
 * The benchmark's floor_ratio is the real program's ns over this one's. */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "nat.h"
#include "parse.h"
#include "structs.h"

/* floor_flows: the flow table. Sized by the benchmark as conntrack. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_CONNTRACK);
	__type(key, struct ct_key);
	__type(value, struct ct_value);
} floor_flows SEC(".maps");

/* floor_lookup parses the frame and fills n from its flow's entry, as the
 * hit path's nat_forward or nat_reverse. Returns 0 when there is one. */
static __always_inline int floor_lookup(void *data, void *data_end, __u32 frame_len, struct packet *pkt,
					struct nat *n)
{
	struct ct_key key = {};
	struct ct_value *v;

	if (parse_packet(data, data_end, frame_len, pkt) != PARSE_OK)
		return -1;
	key.saddr = pkt->saddr;
	key.daddr = pkt->daddr;
	key.sport = pkt->sport;
	key.dport = pkt->dport;
	key.proto = pkt->proto;
	v = bpf_map_lookup_elem(&floor_flows, &key);
	if (!v)
		return -1;
	if (v->dir == CT_FORWARD)
		nat_forward(n, v);
	else
		nat_reverse(n, v);
	return 0;
}

SEC("tcx/ingress")
int tc_floor(struct __sk_buff *skb)
{
	struct packet pkt = {};
	struct nat n = {};

	if (floor_lookup((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, &pkt, &n))
		return TC_ACT_UNSPEC;
	if (nat_rewrite_skb(skb, &pkt, &n))
		return TC_ACT_SHOT;
	return TC_ACT_UNSPEC;
}

SEC("xdp")
int xdp_floor(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct packet pkt = {};
	struct nat n = {};

	if (floor_lookup(data, data_end, data_end - data, &pkt, &n))
		return XDP_PASS;
	if (nat_rewrite_xdp(ctx, &pkt, &n))
		return XDP_DROP;
	return XDP_PASS;
}

char _license[] SEC("license") = "Dual BSD/GPL";
