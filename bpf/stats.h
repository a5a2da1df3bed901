/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Named counters (tlb_stats, enum stat_reason): one per-CPU slot each. */
#ifndef TOPOLB_STATS_H
#define TOPOLB_STATS_H

#include <bpf/bpf_helpers.h>

#include "maps.h"

static __always_inline void stat_add(__u32 reason, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&tlb_stats, &reason);

	if (v)
		*v += n;
}

static __always_inline void stat_inc(__u32 reason)
{
	stat_add(reason, 1);
}

#endif
