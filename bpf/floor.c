// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* The floor of a node-local service proxy, for the benchmark (issue 23):
 * per hook, what no implementation can skip for an established packet.
 * Parse, ONE lookup in a flow table (an LRU hash with conntrack's key and
 * value, filled by the benchmark with conntrack's keys, as many), the same
 * rewrite with the same checksum updates as the hit path (nat.h), pass.
 * The benchmark's floor_ratio is the real program's ns over this one's.
 *
 * cfg_floor_steps (enum floor_step bits, 0 for the floor itself) adds,
 * one at a time, each step the real path takes beyond the floor, calling
 * the real path's own helpers (lb.h, tc.h, fwd.h), so the benchmark's
 * step rows show where the gap between a program and its floor goes:
 *   tc_floor, xdp_floor: the established packet (ct_forward_hit);
 *   tc_floor6, xdp_floor6: tc_floor and xdp_floor for IPv6
 *     (floor_flows6: ct6_key, ct6_value; the rewrites of nat6.h and
 *     nat.h), without steps;
 *   tc_floor_new: the first packet of a flow (lb_new_flow, flow4_create),
 *     whose steps replay flow4_create's parts in its order; it passes
 *     what it does not balance, and drops what the real path drops.
 * The steps replay the real path's order; a step's cost is the variant's
 * ns minus the one before it, measured in the same interleaved round. */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#define LB_SCOPE_DEFAULT SCOPE_INTERNAL
#include "tc.h"

/* Bits of cfg_floor_steps; the benchmark reads them from BTF
 * (floorFloorStep in maps/floor_bpfel.go). */
enum floor_step {
	/* The established packet. */
	FLOOR_NO_REWRITE = 1 << 0, /* skip the rewrite: what the floor's rewrite costs */
	FLOOR_PROLOGUE = 1 << 1,   /* tc: the VLAN test and the pull; both: frag4_remember */
	FLOOR_CT = 1 << 2,         /* the real tables (ct_find_fam) instead of floor_flows */
	FLOOR_EXPIRY = 1 << 3,     /* the clock (ct_now) and the expiry test */
	FLOOR_SYN = 1 << 4,        /* the SYN test (and the registry on a SYN) */
	FLOOR_TOUCH = 1 << 5,      /* ct_touch_fam: state, reply flag and refresh checks; ct_tcp_learn */
	FLOOR_COUNT = 1 << 6,      /* the per-flow counters in the entry */
	FLOOR_FWD = 1 << 7,        /* fwd_refresh4 and the forwarding step (fwd_skb4, fwd_xdp4) */
	/* The first packet of a flow (tc_floor_new). */
	FLOOR_NEW_CT_MISS = 1 << 8,   /* both conntrack tables miss (ct_find_fam) */
	FLOOR_NEW_SERVICE = 1 << 9,   /* tlb_services, the frame and source-range checks */
	FLOOR_NEW_SRC = 1 << 10,      /* the per-source budget (tlb_ct_src) */
	FLOOR_NEW_SLOT = 1 << 11,     /* choose_backend: the slot (and affinity) lookups */
	FLOOR_NEW_FIB = 1 << 12,      /* fwd_resolve4 both ways: FIB and tlb_ifaces */
	FLOOR_NEW_REPLY_DEL = 1 << 13, /* the delete of a reply key in tlb_conntrack */
	FLOOR_NEW_INSERT = 1 << 14,   /* the two tlb_ct_new inserts (LRU, evicting when full) */
	FLOOR_NEW_REWRITE = 1 << 15,  /* the rewrite to the backend and the flow's counters */
};

/* An enum, so its values reach Go through BTF (bpf2go -type). */
volatile const enum floor_step cfg_floor_steps = 0;

/* What tc_floor and xdp_floor answer for a packet that missed (no entry,
 * or one the steps would not honour): verdicts the hit never gives, so
 * the benchmark can tell that every timed run took the whole chain. */
#define FLOOR_MISS_TC TC_ACT_OK
#define FLOOR_MISS_XDP XDP_TX

#define floor_has(step) (cfg_floor_steps & (step))

/* floor_flows: the flow table. Sized by the benchmark as conntrack. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_CONNTRACK);
	__type(key, struct ct_key);
	__type(value, struct ct_value);
} floor_flows SEC(".maps");

/* floor_flows6: the IPv6 flow table (tlb_ct6's key and value). Sized by
 * the benchmark as conntrack. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_CONNTRACK);
	__type(key, struct ct6_key);
	__type(value, struct ct6_value);
} floor_flows6 SEC(".maps");

/* floor4_lookup parses the frame and fills n from its flow's entry, as the
 * hit path's nat_forward or nat_reverse, with the steps cfg_floor_steps
 * adds. Returns 0 when there is one. */
static __always_inline int floor4_lookup(void *data, void *data_end, __u32 frame_len, struct packet *pkt,
					struct nat *n)
{
	struct ct_key key = {};
	struct ct_value *v;
	__u64 now = 0;

	if (parse_packet(data, data_end, frame_len, pkt) != PARSE_OK)
		return -1;
	if (floor_has(FLOOR_PROLOGUE))
		frag4_remember(data, data_end, pkt);
	ct4_key_of(pkt, &key);
	v = floor_has(FLOOR_CT) ? ct_find4(&key) : bpf_map_lookup_elem(&floor_flows, &key);
	if (!v)
		return -1;
	if (v->dir != CT_FORWARD) {
		nat_reverse(n, v);
		return 0;
	}
	if (floor_has(FLOOR_EXPIRY)) {
		now = ct_now();
		if (now > v->expires)
			return -1;
	}
	if (floor_has(FLOOR_SYN) && is_syn(pkt) && syn_reopens(v))
		return -1;
	if (floor_has(FLOOR_TOUCH)) {
		v = ct_touch4(pkt, &key, v, now);
		if (!v)
			return -1;
		ct_tcp_learn(v, pkt);
	}
	if (floor_has(FLOOR_COUNT)) {
		v->packets += 1;
		v->bytes += pkt->l3_len;
	}
	nat_forward(n, v);
	return 0;
}

SEC("tcx/ingress")
int tc_floor(struct __sk_buff *skb)
{
	struct packet pkt = {};
	struct nat n = {};

	if (floor_has(FLOOR_PROLOGUE)) {
		if (tc_tagged(skb))
			return TC_PASS;
		tc_pull(skb, MAX_PARSE_LEN);
	}
	if (floor4_lookup((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, &pkt, &n))
		return FLOOR_MISS_TC;
	if (!floor_has(FLOOR_NO_REWRITE) && nat4_rewrite_skb(skb, &pkt, &n))
		return TC_ACT_SHOT;
	if (floor_has(FLOOR_FWD)) {
		fwd_refresh4(skb, skb->ingress_ifindex, nat4_new_src(&pkt, &n), nat4_new_dst(&pkt, &n), pkt.proto,
			    n.no_stack, n.ct, &n.fwd);
		return fwd_skb4(skb, &n.fwd, n.no_stack);
	}
	return TC_ACT_UNSPEC;
}

/* floor6_lookup is floor4_lookup for IPv6, without steps: parse, one
 * lookup in floor_flows6, and n (a struct nat6) filled from the entry.
 * Returns 0 when there is one. */
static __always_inline int floor6_lookup(void *data, void *data_end, __u32 frame_len, struct packet6 *pkt,
					 struct nat6 *n)
{
	struct ct6_key key = {};
	struct ct6_value *v;

	if (parse_ipv6(data, data_end, frame_len, pkt) != PARSE_OK)
		return -1;
	ct6_key_of(pkt, &key);
	v = bpf_map_lookup_elem(&floor_flows6, &key);
	if (!v)
		return -1;
	if (v->ct.dir == CT_FORWARD)
		nat_forward(&n->n, &v->ct);
	else
		nat_reverse(&n->n, &v->ct);
	nat6_addrs(&n->n, &v->ct);
	return 0;
}

/* tc_floor6 is the floor of tc's IPv6 hit path (tc_balance6): parse,
 * one lookup, the rewrite. */
SEC("tcx/ingress")
int tc_floor6(struct __sk_buff *skb)
{
	struct packet6 pkt = {};
	struct nat6 n = {};

	if (floor6_lookup((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, &pkt, &n))
		return FLOOR_MISS_TC;
	if (nat6_rewrite_skb(skb, &pkt.p, &n.n))
		return TC_ACT_SHOT;
	return TC_ACT_UNSPEC;
}

/* xdp_floor6 is the floor of XDP's IPv6 hit path (xdp_lb6): parse, one
 * lookup, the rewrite. */
SEC("xdp")
int xdp_floor6(struct xdp_md *ctx)
{
	struct packet6 pkt = {};
	struct nat6 n = {};

	if (floor6_lookup((void *)(long)ctx->data, (void *)(long)ctx->data_end, ctx->data_end - ctx->data, &pkt, &n))
		return FLOOR_MISS_XDP;
	if (nat_rewrite_xdp_fam(PKT_IPV6, ctx, &pkt.p, &n.n))
		return XDP_DROP;
	return XDP_PASS;
}

SEC("xdp")
int xdp_floor(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct packet pkt = {};
	struct nat n = {};

	if (floor4_lookup(data, data_end, data_end - data, &pkt, &n))
		return FLOOR_MISS_XDP;
	if (!floor_has(FLOOR_NO_REWRITE) && nat_rewrite_xdp4(ctx, &pkt, &n))
		return XDP_DROP;
	if (floor_has(FLOOR_FWD)) {
		fwd_refresh4(ctx, ctx->ingress_ifindex, nat4_new_src(&pkt, &n), nat4_new_dst(&pkt, &n), pkt.proto,
			    n.no_stack, n.ct, &n.fwd);
		return fwd_xdp4(ctx, &n.fwd, n.no_stack);
	}
	return XDP_PASS;
}

/* floor_new_flow replays the first packet of a flow to an internal
 * frontend (lb_new_flow, then flow4_create without source NAT, the tc
 * path's), step by step. Returns a tc verdict. */
static __always_inline int floor_new_flow(struct __sk_buff *skb, struct packet *pkt)
{
	struct svc_key skey = {
		.vip = addr_from4(pkt->daddr),
		.port = pkt->dport,
		.proto = pkt->proto,
		.scope = cfg_scope,
	};
	struct ct_key key = {}, rev_key = {};
	struct fwd_target to_backend = {}, to_client = {};
	struct backend_value be = {};
	struct svc_value svc, *sv;
	struct ct_pair *pair;
	struct nat n = {};
	union tlb_addr client = addr_from4(pkt->saddr);
	__u32 zero = 0;
	__u64 now;

	ct4_key_of(pkt, &key);
	if (floor_has(FLOOR_NEW_CT_MISS) ? ct_find4(&key) != NULL
					 : bpf_map_lookup_elem(&floor_flows, &key) != NULL)
		return TC_ACT_UNSPEC;
	if (!floor_has(FLOOR_NEW_SERVICE))
		return TC_ACT_UNSPEC;
	sv = bpf_map_lookup_elem(&tlb_services, &skey);
	if (!sv)
		return TC_ACT_UNSPEC;
	svc = *sv;
	if (!lb_frame_creates_state4(skb, pkt) || !src_range_allows(&svc, pkt->saddr) || svc.count == 0)
		return TC_ACT_SHOT;
	now = compat_now();
	if (floor_has(FLOOR_NEW_SRC) && !ct_src_take(PKT_IPV4, &pkt->saddr, now))
		return TC_ACT_SHOT;
	if (floor_has(FLOOR_NEW_SLOT) && choose_backend(&client, flow_hash4(pkt), &skey, &svc, now, &be))
		return TC_ACT_SHOT;
	rev_key.saddr = addr_v4(&be.addr);
	rev_key.daddr = pkt->saddr;
	rev_key.sport = be.port;
	rev_key.dport = pkt->sport;
	rev_key.proto = pkt->proto;
	if (floor_has(FLOOR_NEW_FIB)) {
		fwd_resolve4(skb, skb->ingress_ifindex, pkt->saddr, addr_v4(&be.addr), pkt->proto, 0, 0, &to_backend);
		fwd_resolve4(skb, to_backend.ifindex ? to_backend.ifindex : skb->ingress_ifindex, pkt->daddr,
			    pkt->saddr, pkt->proto, 0, 0, &to_client);
	}
	if (floor_has(FLOOR_NEW_REPLY_DEL))
		bpf_map_delete_elem(&tlb_conntrack, &rev_key);
	pair = bpf_map_lookup_elem(&tlb_ct_scratch, &zero);
	if (!pair)
		return TC_ACT_SHOT;
	__builtin_memset(pair, 0, sizeof(*pair));
	pair->a.addr = addr_v4(&be.addr);
	pair->a.port = be.port;
	pair->a.dir = CT_FORWARD;
	pair->b.addr = pkt->daddr;
	pair->b.port = pkt->dport;
	pair->b.dir = CT_REVERSE;
	pair->a.expires = pair->b.expires = now + ct_lifetime(ct_first_state(pkt), 0);
	fwd_to_ct(&pair->a, &to_backend);
	fwd_to_ct(&pair->b, &to_client);
	if (floor_has(FLOOR_NEW_INSERT) && (ct_put(&rev_key, &pair->b) < 0 || ct_put(&key, &pair->a) < 0))
		return TC_ACT_SHOT;
	if (!floor_has(FLOOR_NEW_REWRITE))
		return TC_ACT_UNSPEC;
	stat_inc(STAT_CT_CREATED);
	stat_inc(fwd_stat(to_backend.kind));
	stat_inc(fwd_stat(to_client.kind));
	nat_forward(&n, &pair->a);
	n.ct = NULL;
	if (nat4_rewrite_skb(skb, pkt, &n))
		return TC_ACT_SHOT;
	return fwd_skb4(skb, &n.fwd, n.no_stack);
}

SEC("tcx/ingress")
int tc_floor_new(struct __sk_buff *skb)
{
	struct packet pkt = {};

	if (tc_tagged(skb))
		return TC_PASS;
	tc_pull(skb, MAX_PARSE_LEN);
	if (parse_packet((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, &pkt) != PARSE_OK)
		return TC_ACT_UNSPEC;
	return floor_new_flow(skb, &pkt);
}

char _license[] SEC("license") = "Dual BSD/GPL";
