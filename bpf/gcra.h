/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The generic cell rate algorithm, the one rate limit of the datapath:
 * rejects (reject.h) and the per-source budget of new flows (conntrack.h). */
#ifndef TOPOLB_GCRA_H
#define TOPOLB_GCRA_H

#include <linux/types.h>

/* gcra_take takes one cell at now from the budget whose theoretical
 * arrival time is *tat: cells every interval ns, bursts of up to burst.
 * Returns 1 and advances *tat when allowed, 0 when the budget is spent.
 * Not atomic: concurrent takers on other CPUs may both pass, which
 * loosens the limit slightly and never tightens it. */
static __always_inline int gcra_take(__u64 *tat, __u64 now, __u64 interval, __u64 burst)
{
	__u64 t = *tat > now ? *tat : now;

	if (t + interval > now + burst * interval)
		return 0;
	*tat = t + interval;
	return 1;
}

/* gcra_has reports whether gcra_take would allow a cell at now, without
 * taking it. */
static __always_inline int gcra_has(__u64 tat, __u64 now, __u64 interval, __u64 burst)
{
	__u64 t = tat > now ? tat : now;

	return t + interval <= now + burst * interval;
}

/* gcra_give gives one cell back: *tat moves back by one interval (a
 * budget is never fuller than its burst, since gcra_take starts from
 * now when *tat lies in the past). */
static __always_inline void gcra_give(__u64 *tat, __u64 interval)
{
	__u64 t = *tat;

	*tat = t > interval ? t - interval : 0;
}

#endif
