/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Incremental Internet checksum updates (RFC 1624, eqn. 3). Only valid for
 * checksum fields that hold a full checksum: every field of frames from
 * the wire (the XDP hook, which has no skb and no csum helpers) and the
 * IPv4 header checksum of every packet (tc too). Not a CHECKSUM_PARTIAL L4
 * checksum, which holds only the pseudo-header sum: that is why pod
 * traffic is translated by tc, whose L4 csum helper knows the difference.
 *
 * One's-complement sums do not depend on byte order as long as every word
 * is taken as it sits in memory, so values are used raw, unswapped. */
#ifndef TOPOLB_CSUM_H
#define TOPOLB_CSUM_H

#include <linux/types.h>

static __always_inline __u16 csum_fold32(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)sum;
}

/* csum_add_diff4 adds to the unfolded sum the change of a 32-bit field
 * going from -> to. */
static __always_inline __u32 csum_add_diff4(__u32 sum, __u32 from, __u32 to)
{
	sum += (__u16)~(from & 0xffff);
	sum += (__u16)~(from >> 16);
	sum += to & 0xffff;
	sum += to >> 16;
	return sum;
}

/* csum_replace4 returns check updated for a 32-bit field going from -> to. */
static __always_inline __u16 csum_replace4(__u16 check, __u32 from, __u32 to)
{
	return (__u16)~csum_fold32(csum_add_diff4((__u16)~check, from, to));
}

/* csum_replace16 returns check updated for a 16-byte field (an IPv6
 * address, as four 32-bit words) going from -> to. */
static __always_inline __u16 csum_replace16(__u16 check, const __u32 *from, const __u32 *to)
{
	__u32 sum = (__u16)~check;

	for (int i = 0; i < 4; i++)
		sum = csum_add_diff4(sum, from[i], to[i]);
	return (__u16)~csum_fold32(sum);
}

/* csum_replace2 returns check updated for a 16-bit field going from -> to. */
static __always_inline __u16 csum_replace2(__u16 check, __u16 from, __u16 to)
{
	__u32 sum = (__u16)~check;

	sum += (__u16)~from;
	sum += to;
	return (__u16)~csum_fold32(sum);
}

#endif
