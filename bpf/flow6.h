/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Creating an IPv6 flow: flow.h's flow_create for a packet6, on the hooks
 * that translate IPv6 (tc on pod veths, scope internal: destination NAT
 * only, never source NAT). Both directions go up the host stack
 * (CT_REDIRECT_STACK), which routes the translated packet; the FIB
 * lookups and redirects IPv4 flows get (fwd.h) are not done for IPv6
 * yet. */
#ifndef TOPOLB_FLOW6_H
#define TOPOLB_FLOW6_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "conntrack6.h"
#include "consts.h"
#include "flow.h"
#include "fwd.h"
#include "maps.h"
#include "nat6.h"
#include "node.h"
#include "packet.h"
#include "stats.h"
#include "structs.h"

/* flow6_create is flow_create (flow.h) for pkt, a struct packet6, whose
 * nat is a struct nat6: both directions' entries in tlb_ct6_new. A hook
 * of scope external would source-NAT some flows, which IPv6 does not do
 * yet: it refuses (-1) and never gets here (only tc_lb translates
 * IPv6). */
static __always_inline int flow6_create(void *ctx, __u32 iif, const struct packet *pkt, __u32 svc_id,
					const struct backend_value *be, __u64 now, struct nat *nat)
{
	const struct packet6 *p6 = packet6_of(pkt);
	__u8 state = ct_first_state(pkt);
	struct ct6_key fwd_key = {}, rev_key = {
		.saddr = be->addr,
		.daddr = p6->saddr,
		.sport = be->port,
		.dport = pkt->sport,
		.proto = pkt->proto,
	};
	int rev_replaced, fwd_replaced, hidden;
	struct ct6_pair *pair;
	__u32 zero = 0;

	if (cfg_scope == SCOPE_EXTERNAL)
		return -1;
	pair = bpf_map_lookup_elem(&tlb_ct6_scratch, &zero);
	if (!pair)
		return -1; /* cannot happen (one slot per CPU) */
	__builtin_memset(pair, 0, sizeof(*pair));
	pair->a.addr = be->addr;
	pair->b.addr = p6->daddr;
	flow_entries(&pair->a.ct, &pair->b.ct, pkt, svc_id, be, state, now + ct_lifetime(state, 0));
	ct6_key_of(p6, &fwd_key);

	/* Reverse first, and an older flow's reply entry under the same key
	 * in tlb_ct6 deleted (flow_create says why). */
	hidden = !bpf_map_delete_elem(&tlb_ct6, &rev_key);
	rev_replaced = ct_put_in(&tlb_ct6_new, &rev_key, &pair->b.ct);
	if (rev_replaced < 0) {
		stat_inc(STAT_DROP_MAP_FULL);
		return -1;
	}
	fwd_replaced = ct_put_in(&tlb_ct6_new, &fwd_key, &pair->a.ct);
	if (fwd_replaced < 0) {
		stat_inc(STAT_DROP_MAP_FULL);
		return -1;
	}
	stat_add(STAT_FWD_STACK, 2);
	nat_forward(nat, &pair->a.ct);
	nat6_addrs(nat, &pair->a.ct);
	nat->ct = NULL;
	return hidden + rev_replaced + fwd_replaced;
}

#endif
