/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Creating an IPv6 flow: flow.h's flow4_create for a packet6, on every
 * hook that translates IPv6: tc on pod veths (scope internal) and XDP
 * or tc on uplinks (scope external, xdp_lb and tc_uplink_lb), with the same
 * forwarding targets (fwd_resolve6) and, for a flow from outside to
 * another node's backend, the same source NAT (snat_claim, over the IPv6
 * tables) to the node's IPv6 address the FIB prefers towards the
 * backend. */
#ifndef TOPOLB_FLOW6_H
#define TOPOLB_FLOW6_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "addr.h"
#include "conntrack6.h"
#include "consts.h"
#include "flow.h"
#include "fwd.h"
#include "hash.h"
#include "maps.h"
#include "nat.h"
#include "nat6.h"
#include "node.h"
#include "packet.h"
#include "stats.h"
#include "structs.h"

/* flow6_create is flow4_create (flow.h) for pkt, a struct packet6, whose
 * nat is a struct nat6: both directions' entries in tlb_ct6_new, each
 * with where its translated packets go, source-NATed where flow4_create
 * would. */
static __always_inline int flow6_create(void *ctx, __u32 iif, const struct packet *pkt, __u32 svc_id,
					const struct backend_value *be, __u64 now, struct nat *nat)
{
	const struct packet6 *p6 = packet6_of(pkt);
	int snat = cfg_scope == SCOPE_EXTERNAL && !(be->flags & BACKEND_F_NODE_LOCAL);
	__u8 state = ct_first_state(pkt);
	struct ct6_key *fwd_key, *rev_key;
	struct ct6_value *fwd, *rev;
	int rev_replaced = 0, fwd_replaced;
	struct ct6_pair *pair;
	__u32 zero = 0;

	pair = bpf_map_lookup_elem(&tlb_ct6_scratch, &zero);
	if (!pair)
		return -1; /* cannot happen (one slot per CPU) */
	fwd = &pair->a;
	rev = &pair->b;
	fwd_key = &pair->a_key;
	rev_key = &pair->b_key;
	__builtin_memset(pair, 0, sizeof(*pair));
	rev_key->saddr = be->addr;
	rev_key->daddr = p6->saddr;
	rev_key->sport = be->port;
	rev_key->dport = pkt->sport;
	rev_key->proto = pkt->proto;
	fwd->addr = be->addr;
	rev->addr = p6->daddr;
	flow_entries(&fwd->ct, &rev->ct, pkt, svc_id, be, state, now + ct_lifetime(state, snat ? CT_F_SNAT : 0));
	ct6_key_of(p6, fwd_key);

	/* Each direction's target is resolved into nat->fwd, which
	 * nat_forward fills from the forward entry at the end, and stored in
	 * its entry at once: IPv6's keys leave no stack for targets of their
	 * own. The source NAT address goes straight into the forward
	 * entry. */
	fwd_resolve6(ctx, iif, &p6->saddr, &be->addr, pkt->proto, snat, &nat->fwd, snat ? &fwd->nat_addr : NULL);
	if (snat && addr_is_zero(&fwd->nat_addr)) {
		stat_inc(STAT_DROP_SNAT_NO_ROUTE);
		return -1;
	}
	fwd_to_ct(&fwd->ct, &nat->fwd);
	/* Where each direction's packets come from (flow4_create). */
	fwd->ct.iif = iif;
	rev->ct.iif = fwd->ct.ifindex;
	/* Replies arrive where the forward packets leave. */
	fwd_resolve6(ctx, fwd->ct.ifindex ? fwd->ct.ifindex : iif, &p6->daddr, &p6->saddr, pkt->proto, 0, &nat->fwd,
		     NULL);
	fwd_to_ct(&rev->ct, &nat->fwd);

	/* Reverse first (flow4_create says why). */
	if (snat) {
		fwd->ct.flags = rev->ct.flags = CT_F_SNAT;
		rev->nat_addr = p6->saddr;
		rev->ct.nat_port = pkt->sport;
		rev_key->daddr = fwd->nat_addr;
		if (snat_claim(PKT_IPV6, flow_hash_fam(PKT_IPV6, pkt), rev_key, &rev->ct, now))
			return -1;
		fwd->ct.nat_port = rev_key->dport;
		stat_inc(STAT_SNAT_FLOWS);
	} else {
		/* An older flow's reply entry under the same key in tlb_ct6
		 * is deleted (flow4_create says why). */
		int hidden = !bpf_map_delete_elem(&tlb_ct6, rev_key);

		rev_replaced = ct_put_in(&tlb_ct6_new, rev_key, &rev->ct);
		if (rev_replaced < 0) {
			stat_inc(STAT_DROP_MAP_FULL);
			return -1;
		}
		rev_replaced += hidden;
	}
	fwd_replaced = ct_put_in(&tlb_ct6_new, fwd_key, &fwd->ct);
	if (fwd_replaced < 0) {
		stat_inc(STAT_DROP_MAP_FULL);
		return -1;
	}
	stat_inc(fwd_stat(fwd->ct.redirect));
	stat_inc(fwd_stat(rev->ct.redirect));
	nat_forward(nat, &fwd->ct);
	nat6_addrs(nat, &fwd->ct);
	nat->ct = NULL;
	return rev_replaced + fwd_replaced;
}

#endif
