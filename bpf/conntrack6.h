/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* What IPv6 conntrack has of its own: the 16-byte addresses of its key
 * (ct6_key) and value (ct6_value), and the per-source budget's key.
 * Everything else, states, lifetimes, promotion and demotion between the
 * two tables, orphans, counters, forwarding targets, is conntrack.h's and
 * ct.h's, which call these for a flow of family PKT_IPV6. */
#ifndef TOPOLB_CONNTRACK6_H
#define TOPOLB_CONNTRACK6_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "addr.h"
#include "consts.h"
#include "gcra.h"
#include "ipv6.h"
#include "maps.h"
#include "nat6.h"
#include "node.h"
#include "packet.h"
#include "structs.h"

/* The per-source budget (a cell of tlb_ct6_src) of an IPv6 source is its /64 on a
 * hook that balances what arrives from outside (scope external): whoever
 * sends from one address holds the whole /64 around it (RFC 7421: SLAAC
 * and temporary addresses pick the interface identifier), so a budget
 * per address would be one per address it cares to use. On pod veths
 * (scope internal) it is the full address: pods of a node share the
 * node's pod prefix, often one /64, and each pod gets its own address
 * from the CNI, so a /64 would make every pod of the node share one
 * budget. */
#define CT6_SRC_PREFIX_WORDS_EXTERNAL 2

/* ct6_of is the ct6_value whose ct is ct (an entry of an IPv6 table). */
static __always_inline struct ct6_value *ct6_of(const struct ct_value *ct)
{
	return (struct ct6_value *)ct;
}

/* ct6_key_of fills pkt's conntrack key (its own direction's). */
static __always_inline void ct6_key_of(const struct packet6 *pkt, struct ct6_key *key)
{
	key->saddr = pkt->saddr;
	key->daddr = pkt->daddr;
	key->sport = pkt->p.sport;
	key->dport = pkt->p.dport;
	key->proto = pkt->p.proto;
}

/* ct6_peer_key is ct4_peer_key (conntrack.h) for IPv6. */
static __always_inline void ct6_peer_key(const struct packet *pkt, const struct ct_value *ct, struct ct6_key *peer)
{
	const struct packet6 *p6 = packet6_of(pkt);
	const struct ct6_value *v = ct6_of(ct);
	int snat = ct->flags & CT_F_SNAT;

	peer->proto = pkt->proto;
	if (ct->dir == CT_FORWARD) {
		peer->saddr = v->addr;
		peer->sport = ct->port;
		peer->daddr = snat ? v->nat_addr : p6->saddr;
		peer->dport = snat ? ct->nat_port : pkt->sport;
	} else {
		peer->saddr = snat ? v->nat_addr : p6->daddr;
		peer->sport = snat ? ct->nat_port : pkt->dport;
		peer->daddr = v->addr;
		peer->dport = ct->port;
	}
}

/* ct6_is_peer_addr is ct_is_peer's (conntrack.h) address part for IPv6:
 * peer's addresses are those pkt, matched as ct, says they must be. */
static __always_inline int ct6_is_peer_addr(const struct packet *pkt, const struct ct_value *ct,
					    const struct ct_value *peer)
{
	const struct packet6 *p6 = packet6_of(pkt);
	const struct ct6_value *v = ct6_of(peer);
	int snat = ct->flags & CT_F_SNAT;

	if (ct->dir == CT_FORWARD)
		return addr_eq(&v->addr, &p6->daddr) && peer->port == pkt->dport &&
		       (!snat || (addr_eq(&v->nat_addr, &p6->saddr) && peer->nat_port == pkt->sport));
	return addr_eq(&v->addr, &p6->saddr) && peer->port == pkt->sport &&
	       (!snat || (addr_eq(&v->nat_addr, &p6->daddr) && peer->nat_port == pkt->dport));
}

/* ct6_client is ct4_client (conntrack.h) for IPv6. */
static __always_inline const union tlb_addr *ct6_client(const struct packet *pkt, const struct ct_value *ct)
{
	if (ct->dir == CT_FORWARD)
		return &packet6_of(pkt)->saddr;
	return ct->flags & CT_F_SNAT ? &ct6_of(ct)->nat_addr : &packet6_of(pkt)->daddr;
}

/* ct6_src_key is what of src picks its cell of tlb_ct6_src: its /64 on a hook of scope
 * external, the address elsewhere (CT6_SRC_PREFIX_WORDS_EXTERNAL says
 * why). */
static __always_inline union tlb_addr ct6_src_key(const union tlb_addr *src)
{
	union tlb_addr k = *src;

	if (cfg_scope == SCOPE_EXTERNAL)
		k.v6[2] = k.v6[3] = 0;
	return k;
}

/* nat6_addrs completes n, which nat_forward or nat_reverse filled from
 * ct, with ct's IPv6 addresses. */
static __always_inline void nat6_addrs(struct nat *n, const struct ct_value *ct)
{
	struct nat6 *n6 = nat6_of(n);
	const struct ct6_value *v = ct6_of(ct);

	if (ct->dir == CT_FORWARD) {
		n6->daddr = v->addr;
		n6->saddr = v->nat_addr;
	} else {
		n6->saddr = v->addr;
		n6->daddr = v->nat_addr;
	}
}

#endif
