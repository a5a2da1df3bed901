/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The two conntrack tables (maps.h) of each family: which one holds a
 * key, and the take-over of an expired entry. Both entries of a flow are always in the
 * same table, the one CT_F_ASSURED names. */
#ifndef TOPOLB_CT_H
#define TOPOLB_CT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"
#include "maps.h"
#include "packet.h"
#include "structs.h"

/* The tables of a family (enum pkt_family): an IPv6 flow's entries are
 * in tlb_ct6 and tlb_ct6_new, with ct6_key and ct6_value (structs.h), an
 * IPv4 flow's in tlb_conntrack and tlb_ct_new. Every helper here and in
 * conntrack.h takes the family as a constant its caller names, so each
 * family's code is compiled with its own tables and nothing else, and a
 * key or value pointer is of that family's type. */
static __always_inline void *ct_table(int fam, __u8 flags)
{
	if (fam == PKT_IPV6)
		return flags & CT_F_ASSURED ? (void *)&tlb_ct6 : (void *)&tlb_ct6_new;
	return flags & CT_F_ASSURED ? (void *)&tlb_conntrack : (void *)&tlb_ct_new;
}

/* ct_find_fam returns key's entry: from the assured table, or, only when
 * that misses, from the new one. An established packet stops at the
 * first lookup. */
static __always_inline struct ct_value *ct_find_fam(int fam, const void *key)
{
	struct ct_value *ct = bpf_map_lookup_elem(ct_table(fam, CT_F_ASSURED), key);

	if (ct)
		return ct;
	return bpf_map_lookup_elem(ct_table(fam, 0), key);
}

/* ct_find4 is ct_find_fam for IPv4. */
static __always_inline struct ct_value *ct_find4(const struct ct_key *key)
{
	return ct_find_fam(PKT_IPV4, key);
}

/* ct_find_in returns key's entry in the table of a flow with flags. */
static __always_inline struct ct_value *ct_find_in(int fam, __u8 flags, const void *key)
{
	if (flags & CT_F_ASSURED)
		return bpf_map_lookup_elem(ct_table(fam, CT_F_ASSURED), key);
	return bpf_map_lookup_elem(ct_table(fam, 0), key);
}

/* ct_delete_in deletes key from the table of a flow with flags. Returns
 * 1 when it was there. */
static __always_inline int ct_delete_in(int fam, __u8 flags, const void *key)
{
	if (flags & CT_F_ASSURED)
		return !bpf_map_delete_elem(ct_table(fam, CT_F_ASSURED), key);
	return !bpf_map_delete_elem(ct_table(fam, 0), key);
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
