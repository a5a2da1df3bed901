/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* loadBalancerSourceRanges, as kube-proxy enforces them: a frontend with
 * SVC_F_SRC_RANGES (a load-balancer IP of a Service with source ranges)
 * takes new flows only from sources inside one of its prefixes in
 * tlb_src_ranges; others are dropped and counted, in tlb_stats
 * (STAT_DROP_SRC_RANGE) and per frontend (tlb_src_range_drops). Only new
 * flows are checked, so established flows survive a change of the ranges;
 * frontends without the flag cost nothing. */
#ifndef TOPOLB_SRCRANGE_H
#define TOPOLB_SRCRANGE_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "addr.h"
#include "consts.h"
#include "structs.h"
#include "maps.h"
#include "stats.h"

/* A source address looked up in tlb_src_ranges: svc_id and all 128 bits. */
#define SRC_RANGE_HOST_LEN (32 + 128)

/* src_range_drop counts a new flow of frontend svc refused. */
static __always_inline void src_range_drop(const struct svc_value *svc)
{
	__u32 id = svc->id;
	__u64 *n = bpf_map_lookup_elem(&tlb_src_range_drops, &id);

	stat_inc(STAT_DROP_SRC_RANGE);
	if (n)
		__sync_fetch_and_add(n, 1);
}

/* src_range_holds reports whether a new flow from key's source may reach
 * frontend svc; counts nothing. */
static __always_inline int src_range_holds(const struct svc_value *svc, const struct src_range_key *key)
{
	return !(svc->flags & SVC_F_SRC_RANGES) || bpf_map_lookup_elem(&tlb_src_ranges, key);
}

/* src_range_lookup reports whether a new flow from key's source may
 * reach frontend svc, and counts the refusals. */
static __always_inline int src_range_lookup(const struct svc_value *svc, const struct src_range_key *key)
{
	if (src_range_holds(svc, key))
		return 1;
	src_range_drop(svc);
	return 0;
}

/* src_range_allows reports whether a new flow from the IPv4 address saddr
 * may reach frontend svc, and counts the refusals. */
static __always_inline int src_range_allows(const struct svc_value *svc, __be32 saddr)
{
	struct src_range_key key = {
		.prefixlen = SRC_RANGE_HOST_LEN,
		.svc_id = bpf_htonl(svc->id),
		.addr = addr_from4(saddr),
	};

	return src_range_lookup(svc, &key);
}

/* src_range_allows_addr is src_range_allows for saddr of either family. */
static __always_inline int src_range_allows_addr(const struct svc_value *svc, const union tlb_addr *saddr)
{
	struct src_range_key key = {
		.prefixlen = SRC_RANGE_HOST_LEN,
		.svc_id = bpf_htonl(svc->id),
		.addr = *saddr,
	};

	return src_range_lookup(svc, &key);
}

/* src_range_allows_node reports whether the node's own processes may open
 * a new flow to frontend svc: their packets leave with the node's address,
 * so exactly when a range holds it (SVC_F_SRC_NODE); counts the
 * refusals. */
static __always_inline int src_range_allows_node(const struct svc_value *svc)
{
	if (!(svc->flags & SVC_F_SRC_RANGES) || (svc->flags & SVC_F_SRC_NODE))
		return 1;
	src_range_drop(svc);
	return 0;
}

#endif
