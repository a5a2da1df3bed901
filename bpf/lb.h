/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The load-balancing core every hook calls: conntrack, backend choice, the
 * NAT decision (nat.h) and where the translated packet goes (fwd.h). It
 * never touches the packet; the hook applies the rewrite with the checksum
 * method that fits it, then forwards. Its parts, by concern: conntrack.h
 * (a known flow), backend.h (backend choice), flow.h (creating a flow),
 * hash.h, and the node configuration they read (node.h).
 *
 * Map lookups per packet (docs/datapath.md, "The hit path"):
 *   established forward packet: tlb_conntrack (its counters are in the
 *                               entry; a gone backend's flows are marked
 *                               stale by the agent)
 *   established reply:          tlb_conntrack, tlb_stats
 *   a flow not established yet: tlb_ct_new after a tlb_conntrack miss
 * Everything else (state changes, refreshing expiry and the peer entry,
 * promotion into tlb_conntrack, the registry check of a SYN, new flows
 * with their per-source budget and FIB lookups, resolving a forwarding
 * target again) is the rare path. */
#ifndef TOPOLB_LB_H
#define TOPOLB_LB_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "addr.h"
#include "anchors.h"
#include "compat.h"
#include "backend.h"
#include "conntrack.h"
#include "consts.h"
#include "ct.h"
#include "flow.h"
#include "flow6.h"
#include "frag.h"
#include "hash.h"
#include "maps.h"
#include "nat.h"
#include "node.h"
#include "parse.h"
#include "srcrange.h"
#include "stats.h"
#include "structs.h"

/* LB_FRAME is the hook's context type when it has a frame (struct xdp_md,
 * struct __sk_buff: both name it data and data_end); a hook without one
 * (the socket hooks, which never balance a packet) defines LB_NO_FRAME.
 * lb_frame_creates_state4 reads the frame again from the context, on the
 * new-flow path only: passing the frame pointers down would cost tc's
 * stack, which is at its limit. */
#if defined(LB_FRAME)
#define lb_frame_creates_state_fam(fam, ctx, pkt)                                           \
	frame_creates_state(fam, (void *)(long)((LB_FRAME *)(ctx))->data,                  \
			    (void *)(long)((LB_FRAME *)(ctx))->data_end, pkt)
#elif defined(LB_NO_FRAME)
#define lb_frame_creates_state_fam(fam, ctx, pkt) 1
#else
#error "entry file must define LB_FRAME (its context type) or LB_NO_FRAME before including lb.h"
#endif
#define lb_frame_creates_state4(ctx, pkt) lb_frame_creates_state_fam(PKT_IPV4, ctx, pkt)

/* LB_REJECT6_PASSES: the entry file sets it to 1 when its hook does not
 * answer IPv6 rejects itself but passes them to a hook that runs the
 * core again on the same packet (xdp_lb.c: tc_uplink beside it).
 * lb_new_flow then returns LB_REJECT before counting anything the
 * second hook counts. */
#ifndef LB_REJECT6_PASSES
#define LB_REJECT6_PASSES 0
#endif

/* lb_src_take takes a new flow of pkt from its source's budget
 * (conntrack.h, conntrack6.h). Returns 0 when it is spent. */
static __always_inline int lb_src_take(int fam, const struct packet *pkt, __u64 now)
{
	if (fam == PKT_IPV6)
		return ct_src_take(fam, &packet6_of(pkt)->saddr, now);
	return ct_src_take(fam, &pkt->saddr, now);
}

/* lb_ct_key fills pkt's conntrack key (its own direction's) of family
 * fam (a constant) into key4 or key6, and returns the one it filled. */
static __always_inline void *lb_ct_key(int fam, const struct packet *pkt, struct ct_key *key4, struct ct6_key *key6)
{
	if (fam == PKT_IPV6) {
		ct6_key_of(packet6_of(pkt), key6);
		return key6;
	}
	ct4_key_of(pkt, key4);
	return key4;
}

/* lb_stack_reply translates back a reply of family fam (a constant; an
 * IPv6 packet is a struct packet6, its nat a struct nat6) that the node's
 * own stack sends (seen at a tcx egress): a host-network backend on this
 * node answering a flow that was translated to one of the node's
 * addresses. No program saw such a reply arrive, so this is the only
 * place it can be translated. Returns LB_REWRITE with nat filled when pkt
 * is such a reply of a live flow, LB_PASS otherwise. */
static __always_inline int lb_stack_reply(int fam, const struct packet *pkt, struct nat *nat)
{
	struct ct_key key4 = {};
	struct ct6_key key6 = {};
	void *key = lb_ct_key(fam, pkt, &key4, &key6);
	struct ct_value *ct;

	ct = ct_find_fam(fam, key);
	if (!ct || ct->dir != CT_REVERSE)
		return LB_PASS;
	if (ct_reverse_hit(fam, pkt, key, ct, nat) != LB_REWRITE)
		return LB_PASS;
	return LB_REWRITE;
}

/* lb_new_flow balances the first packet of a flow of family fam (a
 * constant: an IPv6 packet is a struct packet6) to a frontend of this
 * hook's scope. had_entry says the packet matched a conntrack entry that
 * could not be honoured. Returns LB_PASS when pkt is not addressed to a
 * frontend, LB_REJECT when the frontend has no active backend and asks
 * for rejects (the hook answers, reject.h, and counts). */
static __always_inline int lb_new_flow(int fam, void *ctx, __u32 iif, const struct packet *pkt, int had_entry,
				       struct nat *nat)
{
	struct svc_key key = {
		.vip = fam == PKT_IPV6 ? packet6_of(pkt)->daddr : addr_from4(pkt->daddr),
		.port = pkt->dport,
		.proto = pkt->proto,
		.scope = cfg_scope,
	};
	struct backend_value be;
	struct svc_value svc, *v;
	union tlb_addr client;
	int replaced;
	__u64 now;

	v = bpf_map_lookup_elem(&tlb_services, &key);
	if (!v)
		return LB_PASS;
	svc = *v;
	/* What the receiver would drop creates no state and draws no
	 * reject. */
	if (!lb_frame_creates_state_fam(fam, ctx, pkt)) {
		stat_inc(STAT_DROP_PARSE_ERROR);
		return LB_DROP;
	}
	if (fam == PKT_IPV6 ? !src_range_allows_addr(&svc, &packet6_of(pkt)->saddr) : !src_range_allows(&svc, pkt->saddr))
		return LB_DROP;
	/* A hook that leaves IPv6 rejects to the next one (xdp_lb, whose
	 * tc_uplink answers them) hands the packet over before counting:
	 * the next hook decides it again and counts it, once. */
	if (fam == PKT_IPV6 && LB_REJECT6_PASSES && svc.count == 0 && (svc.flags & SVC_F_REJECT))
		return LB_REJECT;
	if (!had_entry && pkt->proto == IP_PROTO_TCP && !(pkt->tcp_flags & TCP_F_SYN))
		stat_inc(STAT_TCP_MIDFLOW_MISS);
	if (svc.count == 0) {
		if (svc.flags & SVC_F_REJECT)
			return LB_REJECT;
		stat_inc(STAT_DROP_NO_BACKEND);
		return LB_DROP;
	}

	now = compat_now();
	if (!lb_src_take(fam, pkt, now)) {
		stat_inc(STAT_DROP_CT_SOURCE_LIMIT);
		return LB_DROP;
	}
	client = fam == PKT_IPV6 ? packet6_of(pkt)->saddr : addr_from4(pkt->saddr);
	if (choose_backend(&client, flow_hash_fam(fam, pkt), &key, &svc, now, &be)) {
		stat_inc(STAT_DROP_NO_BACKEND);
		return LB_DROP;
	}
	if (fam == PKT_IPV6)
		replaced = flow6_create(ctx, iif, pkt, svc.id, &be, now, nat);
	else
		replaced = flow4_create(ctx, iif, pkt, svc.id, &be, now, nat);
	if (replaced < 0)
		return LB_DROP;
	stat_inc(STAT_CT_CREATED);
	if (replaced)
		stat_add(STAT_CT_REPLACED, replaced);

	return LB_REWRITE;
}

/* lb_process decides what happens to a parsed TCP/UDP packet of family
 * fam (a constant; an IPv6 packet is a struct packet6, its nat a struct
 * nat6) that arrived on iif: pass, drop, or rewrite as nat says and
 * forward along nat->fwd. A reply that arrived elsewhere than its flow's
 * replies do (ct_iif_plausible) is dropped and counted. */
static __always_inline int lb_process(int fam, void *ctx, __u32 iif, const struct packet *pkt, struct nat *nat)
{
	struct ct_key key4 = {};
	struct ct6_key key6 = {};
	void *key = lb_ct_key(fam, pkt, &key4, &key6);
	struct ct_value *ct;
	int ret;

	ct = ct_find_fam(fam, key);
	if (!ct)
		return lb_new_flow(fam, ctx, iif, pkt, 0, nat);
	if (ct->dir == CT_REVERSE) {
		/* A reply is translated only from where its backend is: one
		 * compare on the hit path. */
		if (ct->iif != iif && !ct_iif_plausible(ct, iif)) {
			stat_inc(STAT_DROP_REPLY_IFACE);
			return LB_DROP;
		}
		ret = ct_reverse_hit(fam, pkt, key, ct, nat);
	} else
		ret = ct_forward_hit(fam, pkt, key, ct, nat);
	if (ret != LB_CONTINUE)
		return ret;
	return lb_new_flow(fam, ctx, iif, pkt, 1, nat);
}

/* lb4_classify runs the parser and the core; shared prologue of every hook. */
static __always_inline int lb4_classify(void *ctx, __u32 iif, void *data, void *data_end, __u32 frame_len,
				       struct packet *pkt, struct nat *nat)
{
	switch (parse_packet(data, data_end, frame_len, pkt)) {
	case PARSE_OK:
		frag4_remember(data, data_end, pkt);
		return lb_process(PKT_IPV4, ctx, iif, pkt, nat);
	case PARSE_FRAGMENT:
		return frag4_follow(data, data_end, pkt, 0, nat);
	case PARSE_ERROR:
		stat_inc(STAT_DROP_PARSE_ERROR);
		return LB_DROP;
	case PARSE_ICMP:
		return LB_ICMP;
	default:
		return LB_PASS;
	}
}

#if defined(LB_FRAME)
/* lb6_chain_frontend walks an IPv6 packet's extension chain further than
 * the parser (up to IP6_CHAIN_MAX_EXT headers, the L4 header within
 * IP6_CHAIN_LIMIT bytes of the frame's start, in the frame's linear
 * part) and reports whether the TCP or UDP header it ends at is
 * addressed to a frontend of this hook's scope. Such a packet cannot be
 * translated (every L4 helper masks offsets with L4_OFF_MASK), and passed
 * on it would reach the frontend's address untranslated: a cluster IP's
 * packet would leave the node towards its gateway. A global function,
 * verified once on its own; it reads the frame again from its context.
 * A chain longer still, or beyond the linear part, is the kernel's. */
#define IP6_CHAIN_MAX_EXT 16
#define IP6_CHAIN_LIMIT 512
#define IP6_CHAIN_OFF_MASK 0x3ff
_Static_assert(IP6_CHAIN_LIMIT + sizeof(struct tcphdr) <= IP6_CHAIN_OFF_MASK, "IP6_CHAIN_OFF_MASK covers the walk");

__noinline int lb6_chain_frontend(LB_FRAME *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	const struct ipv6hdr *ip = data + ETH_HLEN;
	__u32 off = ETH_HLEN + IP6_HLEN;
	struct svc_key key = {};
	const struct udphdr *l4;
	__u8 next;

	if ((void *)(ip + 1) > data_end)
		return 0;
	next = ip->nexthdr;
	for (int i = 0; i < IP6_CHAIN_MAX_EXT; i++) {
		const __u8 *h = data + (off & IP6_CHAIN_OFF_MASK);
		__u32 len;

		if ((void *)(h + 2) > data_end)
			return 0;
		len = ip6_ext_len(next, h);
		if (!len)
			break;
		off += len;
		if (off > IP6_CHAIN_LIMIT)
			return 0;
		next = h[0];
	}
	if (next != IP_PROTO_TCP && next != IP_PROTO_UDP)
		return 0;
	/* TCP's ports sit where UDP's do (packet.h). */
	l4 = data + (off & IP6_CHAIN_OFF_MASK);
	if ((void *)(l4 + 1) > data_end)
		return 0;
	__builtin_memcpy(&key.vip, &ip->daddr, sizeof(key.vip));
	/* An IPv4-mapped address is an IPv4 frontend's key (addr.h). */
	if (addr_is4(&key.vip))
		return 0;
	key.port = l4->dest;
	key.proto = next;
	key.scope = cfg_scope;
	return bpf_map_lookup_elem(&tlb_services, &key) != NULL;
}
#else
static __always_inline int lb6_chain_frontend(void *ctx)
{
	return 0;
}
#endif

/* lb6_classify is lb4_classify for an IPv6 frame (ipv6.h): TCP and UDP go
 * to the core (a first fragment's ports remembered first, frag.h), later
 * fragments follow their first, ICMPv6 goes to icmp.h (LB_ICMP), a
 * packet to a frontend behind an extension chain longer than the walk is
 * dropped (lb6_chain_frontend), what the parser does not take passes
 * untouched. pkt and nat are the
 * family's. */
static __always_inline int lb6_classify(void *ctx, __u32 iif, void *data, void *data_end, __u32 frame_len,
					struct packet6 *pkt, struct nat6 *nat)
{
	switch (parse_ipv6(data, data_end, frame_len, pkt)) {
	case PARSE_OK:
		frag6_remember(ctx, pkt);
		return lb_process(PKT_IPV6, ctx, iif, &pkt->p, &nat->n);
	case PARSE_FRAGMENT:
		return frag6_follow(data, data_end, pkt, 0, &nat->n);
	case PARSE_CHAIN:
		if (!lb6_chain_frontend(ctx))
			return LB_PASS;
		stat_inc(STAT_DROP_UNPARSED);
		return LB_DROP;
	case PARSE_ICMP:
		return LB_ICMP;
	default:
		return LB_PASS;
	}
}

#endif
