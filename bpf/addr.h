/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* union tlb_addr (structs.h), an address of either family: IPv4 stored
 * IPv4-mapped (::ffff:a.b.c.d, RFC 4291 2.5.5.2), as the kernel shows an
 * IPv4 peer to an IPv6 socket and as Go's netip.Addr.As16 writes it. */
#ifndef TOPOLB_ADDR_H
#define TOPOLB_ADDR_H

#include <linux/types.h>
#include <bpf/bpf_endian.h>

#include "structs.h"

/* The IPv4-mapped prefix's third word; the IPv4 address is the fourth. */
#define V4_MAPPED_PREFIX 0x0000ffff
#define V4_MAPPED_WORD 3

/* addr_from4 is the IPv4 address a (network byte order) as a tlb_addr. */
static __always_inline union tlb_addr addr_from4(__be32 a)
{
	union tlb_addr r = { .v6 = { 0, 0, bpf_htonl(V4_MAPPED_PREFIX), a } };

	return r;
}

/* addr_is4 reports whether a is an IPv4 address (IPv4-mapped). */
static __always_inline int addr_is4(const union tlb_addr *a)
{
	return a->v6[0] == 0 && a->v6[1] == 0 && a->v6[2] == bpf_htonl(V4_MAPPED_PREFIX);
}

/* addr_v4 is the IPv4 address of a, which addr_is4. */
static __always_inline __be32 addr_v4(const union tlb_addr *a)
{
	return a->v6[V4_MAPPED_WORD];
}

static __always_inline int addr_eq(const union tlb_addr *a, const union tlb_addr *b)
{
	return a->v6[0] == b->v6[0] && a->v6[1] == b->v6[1] && a->v6[2] == b->v6[2] && a->v6[3] == b->v6[3];
}

/* addr_is_zero reports whether a is the unspecified address (::), which
 * no packet is from and a helper answers when it found none. */
static __always_inline int addr_is_zero(const union tlb_addr *a)
{
	return !(a->v6[0] | a->v6[1] | a->v6[2] | a->v6[3]);
}

/* addr_fold folds a into 32 bits for a hash's input. */
static __always_inline __u32 addr_fold(const union tlb_addr *a)
{
	return a->v6[0] ^ a->v6[1] ^ a->v6[2] ^ a->v6[3];
}

#endif
