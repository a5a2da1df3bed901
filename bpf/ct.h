/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The two conntrack tables (maps.h): which one holds a key, and the
 * take-over of an expired entry. Both entries of a flow are always in the
 * same table, the one CT_F_ASSURED names. */
#ifndef TOPOLB_CT_H
#define TOPOLB_CT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"
#include "maps.h"
#include "structs.h"

/* ct_find returns key's entry: from tlb_conntrack, or, only when that
 * misses, from tlb_ct_new. An established packet stops at the first
 * lookup. */
static __always_inline struct ct_value *ct_find(const struct ct_key *key)
{
	struct ct_value *ct = bpf_map_lookup_elem(&tlb_conntrack, key);

	if (ct)
		return ct;
	return bpf_map_lookup_elem(&tlb_ct_new, key);
}

/* ct_find_in returns key's entry in the table of a flow with flags. */
static __always_inline struct ct_value *ct_find_in(__u8 flags, const struct ct_key *key)
{
	if (flags & CT_F_ASSURED)
		return bpf_map_lookup_elem(&tlb_conntrack, key);
	return bpf_map_lookup_elem(&tlb_ct_new, key);
}

/* ct_delete_in deletes key from the table of a flow with flags. Returns
 * 1 when it was there. */
static __always_inline int ct_delete_in(__u8 flags, const struct ct_key *key)
{
	if (flags & CT_F_ASSURED)
		return !bpf_map_delete_elem(&tlb_conntrack, key);
	return !bpf_map_delete_elem(&tlb_ct_new, key);
}

/* ct_claim_expired reports whether this CPU may take over the key of v,
 * an entry that expired before now. Two new flows may find the same
 * expired entry at once: the compare-and-swap of its expiry lets exactly
 * one of them win (and makes the entry look alive to the other, and to
 * anyone else, for a second). */
static __always_inline int ct_claim_expired(struct ct_value *v, __u64 now)
{
	__u64 seen = v->expires;

	if (now <= seen)
		return 0;
	return __sync_val_compare_and_swap(&v->expires, seen, now + NSEC_PER_SEC) == seen;
}

#endif
