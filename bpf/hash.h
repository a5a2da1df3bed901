/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The flow hash that picks a backend's slot (backend.h) and a source NAT
 * port's first try (nat.h's snat_claim is handed it), and the jhash under
 * it, which also picks a source's budget cell (conntrack.h). */
#ifndef TOPOLB_HASH_H
#define TOPOLB_HASH_H

#include <linux/types.h>

#include "addr.h"
#include "ipv6.h"
#include "node.h"
#include "packet.h"

#define rol32(v, s) (((v) << (s)) | ((v) >> (32 - (s))))

/* jhash_3words from the kernel's jhash.h (Bob Jenkins' lookup3 final mix). */
static __always_inline __u32 jhash_3words(__u32 a, __u32 b, __u32 c, __u32 initval)
{
	a += 0xdeadbeef + (3 << 2) + initval;
	b += 0xdeadbeef + (3 << 2) + initval;
	c += 0xdeadbeef + (3 << 2) + initval;
	c ^= b; c -= rol32(b, 14);
	a ^= c; a -= rol32(c, 11);
	b ^= a; b -= rol32(a, 25);
	c ^= b; c -= rol32(b, 16);
	a ^= c; a -= rol32(c, 4);
	b ^= a; b -= rol32(a, 14);
	c ^= b; c -= rol32(b, 24);
	return c;
}

/* flow_hash_of hashes pkt's flow from its addresses src and dst, each
 * folded into 32 bits (an IPv4 address is its own fold; addr_fold folds
 * an IPv6 one), with its ports and protocol. maps' flowHash mirrors it. */
static __always_inline __u32 flow_hash_of(__u32 src, __u32 dst, const struct packet *pkt)
{
	return jhash_3words(src, dst, ((__u32)pkt->sport << 16 | pkt->dport) ^ pkt->proto, cfg_hash_seed);
}

static __always_inline __u32 flow_hash4(const struct packet *pkt)
{
	return flow_hash_of(pkt->saddr, pkt->daddr, pkt);
}

/* flow_hash_fam is pkt's flow hash in its family fam (a constant; an
 * IPv6 packet is a struct packet6): backend choice and the first SNAT
 * port try of either family hash the same way. */
static __always_inline __u32 flow_hash_fam(int fam, const struct packet *pkt)
{
	if (fam == PKT_IPV6)
		return flow_hash_of(addr_fold(&packet6_of(pkt)->saddr), addr_fold(&packet6_of(pkt)->daddr), pkt);
	return flow_hash4(pkt);
}

#endif
