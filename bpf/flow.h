/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Flow creation: both conntrack entries of a new flow, with where each
 * direction's translated packets go (fwd.h) and, for flows from outside
 * to another node's backend, the source NAT port (nat.h). */
#ifndef TOPOLB_FLOW_H
#define TOPOLB_FLOW_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "addr.h"
#include "conntrack.h"
#include "consts.h"
#include "fwd.h"
#include "hash.h"
#include "maps.h"
#include "nat.h"
#include "node.h"
#include "packet.h"
#include "stats.h"
#include "structs.h"

/* ct_put_in inserts an entry of a new flow into table (tlb_ct_new,
 * tlb_ct6_new), or overwrites an existing one. Returns the number of
 * entries overwritten (0 or 1), or -1 when the map refused. */
static __always_inline int ct_put_in(void *table, const void *key, const struct ct_value *v)
{
	/* NOEXIST fails cheaply on an existing key, which tells replaced
	 * entries apart without a lookup on the common path. */
	if (!bpf_map_update_elem(table, key, v, BPF_NOEXIST))
		return 0;
	if (bpf_map_update_elem(table, key, v, BPF_ANY))
		return -1;
	return 1;
}

/* ct_put is ct_put_in for IPv4 (tlb_ct_new). */
static __always_inline int ct_put(const struct ct_key *key, const struct ct_value *v)
{
	return ct_put_in(&tlb_ct_new, key, v);
}

/* flow_entries fills what the two entries of pkt's new flow to backend
 * be of service svc_id share, whatever the family; the caller writes
 * the addresses and the forwarding targets. */
static __always_inline void flow_entries(struct ct_value *fwd, struct ct_value *rev, const struct packet *pkt,
					 __u32 svc_id, const struct backend_value *be, __u8 state, __u64 expires)
{
	fwd->port = be->port;
	fwd->dir = CT_FORWARD;
	rev->port = pkt->dport;
	rev->dir = CT_REVERSE;
	fwd->state = rev->state = state;
	fwd->svc_id = rev->svc_id = svc_id;
	fwd->backend_id = rev->backend_id = be->id;
	fwd->backend_gen = rev->backend_gen = be->gen;
	fwd->expires = rev->expires = expires;
	/* The flow's counts live in its forward entry from its first packet
	 * on (ct_fold hands them to the backend's record when it goes). */
	fwd->packets = 1;
	fwd->bytes = pkt->l3_len;
	/* What the client sent, for the window of its FINs and RSTs
	 * (conntrack.h); the reply direction learns from its first. */
	if (pkt->proto == IP_PROTO_TCP)
		fwd->tcp_next = pkt->tcp_end;
}

/* flow4_create records both directions of a new flow of pkt to backend be
 * of service svc_id in tlb_ct_new (ct_touch_fam promotes them), each with
 * where its translated packets go, and fills
 * nat for pkt. A flow from outside (scope external) to a backend on
 * another node is also source-NATed: to the address the FIB prefers on
 * the way to the backend and a port snat_claim finds free, so the
 * backend's replies come back here. iif is the interface pkt arrived on.
 * Returns the number of existing entries it overwrote, or -1 (counted)
 * when the flow cannot be created. */
static __always_inline int flow4_create(void *ctx, __u32 iif, const struct packet *pkt, __u32 svc_id,
				       const struct backend_value *be, __u64 now, struct nat *nat)
{
	int snat = cfg_scope == SCOPE_EXTERNAL && !(be->flags & BACKEND_F_NODE_LOCAL);
	__u8 state = ct_first_state(pkt);
	__u64 expires = now + ct_lifetime(state, snat ? CT_F_SNAT : 0);
	struct ct_key fwd_key = {
		.saddr = pkt->saddr,
		.daddr = pkt->daddr,
		.sport = pkt->sport,
		.dport = pkt->dport,
		.proto = pkt->proto,
	};
	struct ct_key rev_key = {
		.saddr = addr_v4(&be->addr),
		.daddr = pkt->saddr,
		.sport = be->port,
		.dport = pkt->sport,
		.proto = pkt->proto,
	};
	struct fwd_target to_backend, to_client;
	int rev_replaced = 0, fwd_replaced;
	struct ct_value *fwd, *rev;
	struct ct_pair *pair;
	__u32 zero = 0;
	__be32 src;

	/* The two entries are built in per-CPU scratch space, not on the
	 * stack (tc_uplink_lb's is at its limit); nothing else of this
	 * packet uses it any more (ct_touch_fam's move is over). */
	pair = bpf_map_lookup_elem(&tlb_ct_scratch, &zero);
	if (!pair)
		return -1; /* cannot happen (one slot per CPU) */
	fwd = &pair->a;
	rev = &pair->b;
	__builtin_memset(pair, 0, sizeof(*pair));
	fwd->addr = addr_v4(&be->addr);
	rev->addr = pkt->daddr;
	flow_entries(fwd, rev, pkt, svc_id, be, state, expires);

	src = fwd_resolve4(ctx, iif, pkt->saddr, addr_v4(&be->addr), pkt->proto, snat, snat, &to_backend);
	if (snat && !src) {
		stat_inc(STAT_DROP_SNAT_NO_ROUTE);
		return -1;
	}
	/* Replies arrive where the forward packets leave. */
	fwd_resolve4(ctx, to_backend.ifindex ? to_backend.ifindex : iif, pkt->daddr, pkt->saddr, pkt->proto,
		    0, 0, &to_client);
	fwd_to_ct(fwd, &to_backend);
	fwd_to_ct(rev, &to_client);
	/* Where each direction's packets come from (ct_iif_plausible): the
	 * client's from where this one came, the backend's from where they
	 * are sent to it. */
	fwd->iif = iif;
	rev->iif = to_backend.ifindex;

	/* Reverse first: a forward entry without its reverse would leak
	 * backend addresses to the client. */
	if (snat) {
		fwd->flags = rev->flags = CT_F_SNAT;
		rev->nat_addr = pkt->saddr;
		rev->nat_port = pkt->sport;
		rev_key.daddr = src;
		if (snat_claim(PKT_IPV4, flow_hash4(pkt), &rev_key, rev, now))
			return -1;
		fwd->nat_addr = src;
		fwd->nat_port = rev_key.dport;
		stat_inc(STAT_SNAT_FLOWS);
	} else {
		/* The reply key leaves out the frontend: an entry under it in
		 * tlb_conntrack is an older flow's from the same client port to
		 * the same backend through another frontend (the client reused
		 * the port). It would hide this flow's entry from the replies:
		 * delete it, as an overwrite in one table would. */
		int hidden = !bpf_map_delete_elem(&tlb_conntrack, &rev_key);

		rev_replaced = ct_put(&rev_key, rev);
		if (rev_replaced < 0) {
			stat_inc(STAT_DROP_MAP_FULL);
			return -1;
		}
		rev_replaced += hidden;
	}
	fwd_replaced = ct_put(&fwd_key, fwd);
	if (fwd_replaced < 0) {
		stat_inc(STAT_DROP_MAP_FULL);
		return -1;
	}
	stat_inc(fwd_stat(to_backend.kind));
	stat_inc(fwd_stat(to_client.kind));
	nat_forward(nat, fwd);
	nat->fwd.nexthop = to_backend.nexthop;
	nat->ct = NULL;
	return rev_replaced + fwd_replaced;
}

#endif
