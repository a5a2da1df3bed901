/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Address translation: what a flow's conntrack entries say to rewrite,
 * the rewrite itself for each hook, and the choice of a source port for
 * source-NATed flows.
 *
 * A flow is DNATed (client -> backend, replies backend -> frontend) and,
 * for an external frontend whose backend is on another node, also
 * source-NATed to this node's address N and a port P chosen here, so the
 * backend's replies come back through this node. The two entries of a
 * flow C:c -> F:f served by B:b (docs/datapath.md, "Source NAT"):
 *
 *   forward, key {C, F, c, f}:     dir FORWARD, addr:port = B:b;
 *                                  with CT_F_SNAT nat_addr:nat_port = N:P
 *   reverse, key {B, C, b, c}      dir REVERSE, addr:port = F:f
 *       or, SNAT, {B, N, b, P}:    with CT_F_SNAT nat_addr:nat_port = C:c
 *
 * A forward packet gets destination addr:port and, with CT_F_SNAT, source
 * nat_addr:nat_port; a reply gets source addr:port and, with CT_F_SNAT,
 * destination nat_addr:nat_port. */
#ifndef TOPOLB_NAT_H
#define TOPOLB_NAT_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"
#include "csum.h"
#include "ct.h"
#include "fwd.h"
#include "maps.h"
#include "parse.h"
#include "stats.h"
#include "structs.h"

/* The SNAT port range, host byte order, inclusive (enum snat_config has
 * the default and why). Set at load time from the agent's --snat-ports. */
volatile const __u16 cfg_snat_port_min = SNAT_PORT_MIN_DEFAULT;
volatile const __u16 cfg_snat_port_max = SNAT_PORT_MAX_DEFAULT;
/* cfg_snat_port_seeded: 1 starts a new flow's port walk (snat_claim) at
 * its flow hash, so the same flow is offered the same ports (maps' tests
 * predict them); 0, what the agent loads, at a random point, so nobody
 * can predict the port a flow from outside gets and aim forged replies
 * at it. */
volatile const __u8 cfg_snat_port_seeded = 0;

#define UDP_CSUM_ALL_ONES 0xffff
/* EEXIST (asm-generic/errno-base.h): what BPF_NOEXIST fails with. */
#define ERR_EXIST 17

/* Bits of nat.flags. */
enum nat_flag {
	NAT_F_DST = 1, /* rewrite the destination to daddr:dport */
	NAT_F_SRC = 2, /* rewrite the source to saddr:sport */
	NAT_F_L3 = 4,  /* a later fragment: rewrite the IP header only, it carries no ports (frag.h) */
};

/* What the core tells a hook to do with a packet: rewrite it, and send it
 * along fwd. Addresses and ports in network byte order. */
struct nat {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 flags;    /* enum nat_flag bits */
	__u8 no_stack; /* a forward packet of a source-NATed flow: its source is this node's */
	__u16 pad;
	struct fwd_target fwd;
	/* The entry the packet matched, where fwd_refresh4 stores what it
	 * learns; NULL for a packet that created its flow. */
	struct ct_value *ct;
};

/* nat_forward fills n for a forward packet of the flow ct. */
static __always_inline void nat_forward(struct nat *n, struct ct_value *ct)
{
	n->flags = NAT_F_DST;
	n->daddr = ct->addr;
	n->dport = ct->port;
	n->no_stack = 0;
	if (ct->flags & CT_F_SNAT) {
		n->flags |= NAT_F_SRC;
		n->saddr = ct->nat_addr;
		n->sport = ct->nat_port;
		n->no_stack = 1;
	}
	fwd_from_ct(&n->fwd, ct);
	n->ct = ct;
}

/* nat_reverse fills n for a reply of the flow ct. */
static __always_inline void nat_reverse(struct nat *n, struct ct_value *ct)
{
	n->flags = NAT_F_SRC;
	n->saddr = ct->addr;
	n->sport = ct->port;
	n->no_stack = 0;
	if (ct->flags & CT_F_SNAT) {
		n->flags |= NAT_F_DST;
		n->daddr = ct->nat_addr;
		n->dport = ct->nat_port;
	}
	fwd_from_ct(&n->fwd, ct);
	n->ct = ct;
}

/* nat4_new_src and nat4_new_dst are the packet's addresses after n. */
static __always_inline __be32 nat4_new_src(const struct packet *pkt, const struct nat *n)
{
	return n->flags & NAT_F_SRC ? n->saddr : pkt->saddr;
}

static __always_inline __be32 nat4_new_dst(const struct packet *pkt, const struct nat *n)
{
	return n->flags & NAT_F_DST ? n->daddr : pkt->daddr;
}

/* ---- source ports ---- */

/* fmix32 is MurmurHash3's finaliser: every input bit moves every output
 * bit. */
static __always_inline __u32 fmix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

/* snat_port is the try-th port (host byte order) offered to a flow whose
 * walk starts at h: a pseudo-random walk over the configured range. */
static __always_inline __u16 snat_port(__u32 h, __u32 try)
{
	__u32 n = (__u32)cfg_snat_port_max - cfg_snat_port_min + 1;

	return cfg_snat_port_min + fmix32(h + try) % n;
}

/* snat_taken reports whether the reverse entry old, found under a port a
 * new flow tries, keeps its port: while it is alive. An expired one is
 * claimed (ct_claim_expired) and its port taken over: a closed or
 * abandoned flow gives its port back when it expires, sweep or not. */
static __always_inline int snat_taken(struct ct_value *old, __u64 now)
{
	if (!ct_claim_expired(old, now)) {
		stat_inc(STAT_SNAT_COLLISION);
		return 1;
	}
	stat_inc(STAT_SNAT_RECLAIMED);
	stat_inc(STAT_CT_REPLACED);
	return 0;
}

/* snat_key_set_port sets the destination port of key, a reverse key of
 * family fam, to port (host byte order). */
static __always_inline void snat_key_set_port(int fam, void *key, __u16 port)
{
	if (fam == PKT_IPV6)
		((struct ct6_key *)key)->dport = bpf_htons(port);
	else
		((struct ct_key *)key)->dport = bpf_htons(port);
}

/* snat_unassured reports whether a flow with state and flags (both its
 * entries carry them) is source-NATed, answered by its backend and not
 * yet by its client: a TCP handshake whose last ACK has not come, a UDP
 * flow whose client has not sent since the reply. A spoofed source's flow
 * stays so for good. Such a flow lives CT_TIMEOUT_SNAT_UNASSURED, and
 * snat_claim may evict it. Not a closing one (its peers may still need
 * their last segments translated), nor one whose promotion found the
 * established table full (CT_F_FULL: its client did answer). */
static __always_inline int snat_unassured(__u8 state, __u8 flags)
{
	return state != CT_TCP_CLOSING &&
	       (flags & (CT_F_SNAT | CT_F_REPLIED | CT_F_ASSURED | CT_F_FULL)) == (CT_F_SNAT | CT_F_REPLIED);
}

/* snat_evict hands the port of key, whose holder in fam's new-flow table
 * (where unassured flows live) snat_claim_in found unassured
 * (snat_unassured), to rev: it deletes the holder's reverse entry and
 * inserts rev in its place. Returns 0 when rev holds the port; -1,
 * counted as exhausted, when another new flow took the port first (the
 * delete lets one of two flows evicting the same holder win) or the map
 * refused. The holder's forward entry is left to go as an orphan: its
 * next packet finds its reply entry gone (STAT_CT_ORPHAN) and is
 * balanced as new, and the sweep or the LRU deletes it otherwise; its
 * key would need a second key's room on a stack that has none left
 * (snat_claim). */
static __always_inline int snat_evict(int fam, void *key, const struct ct_value *rev)
{
	void *table = ct_table(fam, 0);

	if (bpf_map_delete_elem(table, key) || bpf_map_update_elem(table, key, rev, BPF_NOEXIST)) {
		stat_inc(STAT_DROP_SNAT_EXHAUSTED);
		return -1;
	}
	stat_inc(STAT_SNAT_EVICTED);
	stat_inc(STAT_CT_REPLACED);
	return 0;
}

/* snat_claim_in (through snat_claim) inserts the reverse entry rev of a
 * source-NATed flow of family fam (a constant: a struct ct6_key and
 * ct6_value for IPv6) into its family's new-flow table under the first port of the
 * flow's walk that no live entry of either of the family's tables holds
 * (so a port in use by any flow with the same backend and address is
 * never taken; an expired holder is taken over), sets the key's
 * destination port to it and returns 0. When all SNAT_RETRIES ports tried
 * were taken, the holder of the last one, when unassured (snat_unassured:
 * answered by the backend, not by its client, most likely a spoofed
 * source), loses its port to rev (snat_evict): a
 * flood from spoofed sources that the backend answers cannot hold the
 * ports against real clients, and an assured flow never loses its port.
 * Returns -1, counted, when none could be evicted, or when the map
 * refused. One allocator for both families: the walk, the range and the
 * take-over are the same, only the tables differ (ct.h). */
static __always_inline int snat_claim_in(int fam, __u32 h, void *key, const struct ct_value *rev, __u64 now)
{
	struct ct_value *old;
	__u32 try;

	for (try = 0; try < SNAT_RETRIES; try++) {
		long err;

		snat_key_set_port(fam, key, snat_port(h, try));
		old = bpf_map_lookup_elem(ct_table(fam, CT_F_ASSURED), key);
		if (old) {
			if (snat_taken(old, now))
				continue;
			bpf_map_delete_elem(ct_table(fam, CT_F_ASSURED), key);
		} else {
			old = bpf_map_lookup_elem(ct_table(fam, 0), key);
			if (old) {
				if (snat_taken(old, now))
					continue;
				if (!bpf_map_update_elem(ct_table(fam, 0), key, rev, BPF_EXIST))
					return 0;
				/* Evicted meanwhile: insert afresh. */
			}
		}
		err = bpf_map_update_elem(ct_table(fam, 0), key, rev, BPF_NOEXIST);
		if (!err)
			return 0;
		if (err != -ERR_EXIST) {
			stat_inc(STAT_DROP_MAP_FULL);
			return -1;
		}
		stat_inc(STAT_SNAT_COLLISION);
	}
	/* The last port tried, still in key: its holder is evicted when
	 * unassured. One candidate, not the oldest of all the walk saw: a
	 * record of the walk's candidates, or a second pass over them, cost
	 * the frame room it does not have (snat_claim) or the verifier more
	 * states than its limit allows (tc_uplink_lb). Under a flood of
	 * spoofed sources nearly every holder is unassured; an assured one
	 * is never evicted. */
	old = bpf_map_lookup_elem(ct_table(fam, 0), key);
	if (old && snat_unassured(old->state, old->flags))
		return snat_evict(fam, key, rev);
	stat_inc(STAT_DROP_SNAT_EXHAUSTED);
	return -1;
}

/* snat_claim is snat_claim_in for fam, a constant of each caller, whose
 * walk starts at h, the flow's hash, or at random (cfg_snat_port_seeded).
 * The family is branched on once, outside the walk: each walk keeps only
 * its own values across the helper calls, so the subprogram's frame stays
 * what IPv4's alone needed (tc_lb6's stack and this frame add up to the
 * 512-byte limit). */
static __noinline __attribute__((unused)) int snat_claim(int fam, __u32 h, void *key, const struct ct_value *rev,
							 __u64 now)
{
	if (!cfg_snat_port_seeded)
		h = bpf_get_prandom_u32();
	if (fam == PKT_IPV6)
		return snat_claim_in(PKT_IPV6, h, key, rev, now);
	return snat_claim_in(PKT_IPV4, h, key, rev, now);
}

/* nat4_rewrite_ip applies n's addresses to the IPv4 header ip, with the
 * header checksum updated in place (always a full one; the update keeps
 * the header's sum, and so an skb's csum, unchanged). */
static __always_inline void nat4_rewrite_ip(struct iphdr *ip, const struct packet *pkt, const struct nat *n)
{
	if (n->flags & NAT_F_DST) {
		ip->check = csum_replace4(ip->check, pkt->daddr, n->daddr);
		ip->daddr = n->daddr;
	}
	if (n->flags & NAT_F_SRC) {
		ip->check = csum_replace4(ip->check, pkt->saddr, n->saddr);
		ip->saddr = n->saddr;
	}
}

/* nat6 is struct nat for an IPv6 packet: the flags, ports and forwarding
 * target there, the addresses here (n.saddr and n.daddr stay zero). n
 * comes first: a pointer to it is a pointer to this. */
struct nat6 {
	struct nat n;
	union tlb_addr saddr;
	union tlb_addr daddr;
};

static __always_inline struct nat6 *nat6_of(const struct nat *n)
{
	return (struct nat6 *)n;
}

/* nat6_rewrite_ip applies n's addresses (a struct nat6's) to the IPv6
 * header ip, which has no checksum of its own. */
static __always_inline void nat6_rewrite_ip(struct ipv6hdr *ip, const struct nat *n)
{
	if (n->flags & NAT_F_DST)
		__builtin_memcpy(&ip->daddr, &nat6_of(n)->daddr, sizeof(ip->daddr));
	if (n->flags & NAT_F_SRC)
		__builtin_memcpy(&ip->saddr, &nat6_of(n)->saddr, sizeof(ip->saddr));
}

/* ---- rewriting frames from the wire (XDP) ---- */

/* nat_csum_addr returns the L4 checksum sum updated for the rewrite of
 * pkt's destination (dst) or source address, of family fam (a constant:
 * an IPv6 packet is a struct packet6, its nat a struct nat6), to n's:
 * part of the pseudo header either way. */
static __always_inline __u16 nat_csum_addr(int fam, __u16 sum, const struct packet *pkt, const struct nat *n, int dst)
{
	if (fam == PKT_IPV6) {
		const struct packet6 *p6 = packet6_of(pkt);
		const struct nat6 *n6 = nat6_of(n);

		if (dst)
			return csum_replace16(sum, p6->daddr.v6, n6->daddr.v6);
		return csum_replace16(sum, p6->saddr.v6, n6->saddr.v6);
	}
	if (dst)
		return csum_replace4(sum, pkt->daddr, n->daddr);
	return csum_replace4(sum, pkt->saddr, n->saddr);
}

/* nat_rewrite_xdp_fam applies n to pkt, of family fam (a constant), in
 * place with incremental checksum updates: frames from the wire carry
 * full checksums (csum.h). The L4 header and its checksum are rewritten
 * the same in both families, only the addresses' share of the checksum
 * (nat_csum_addr) and the IP header differ. Returns 0 on success. */
static __always_inline int nat_rewrite_xdp_fam(int fam, struct xdp_md *ctx, const struct packet *pkt,
					       const struct nat *n)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	void *l3 = data + ETH_HLEN;
	void *l4 = data + (pkt->l4_off & L4_OFF_MASK);
	__u16 *check, sum;
	__be16 *sport, *dport;

	if (!fwd_l3_fits(fam, l3, data_end))
		return -1;
	if (n->flags & NAT_F_L3) {
		if (fam == PKT_IPV6)
			nat6_rewrite_ip(l3, n);
		else
			nat4_rewrite_ip(l3, pkt, n);
		return 0;
	}
	if (pkt->proto == IP_PROTO_TCP) {
		struct tcphdr *tcp = l4;

		if ((void *)(tcp + 1) > data_end)
			return -1;
		check = &tcp->check;
		sport = &tcp->source;
		dport = &tcp->dest;
	} else {
		struct udphdr *udp = l4;

		if ((void *)(udp + 1) > data_end)
			return -1;
		check = &udp->check;
		sport = &udp->source;
		dport = &udp->dest;
	}

	sum = *check;
	if (n->flags & NAT_F_DST) {
		sum = nat_csum_addr(fam, sum, pkt, n, 1);
		sum = csum_replace2(sum, pkt->dport, n->dport);
		*dport = n->dport;
	}
	if (n->flags & NAT_F_SRC) {
		sum = nat_csum_addr(fam, sum, pkt, n, 0);
		sum = csum_replace2(sum, pkt->sport, n->sport);
		*sport = n->sport;
	}
	if (fam == PKT_IPV6)
		nat6_rewrite_ip(l3, n);
	else
		nat4_rewrite_ip(l3, pkt, n);
	/* UDP checksum 0 means "none" and stays 0; a computed 0 is sent as
	 * its one's-complement twin, all ones (RFC 768). */
	if (pkt->proto == IP_PROTO_UDP) {
		if (*check == 0)
			return 0;
		if (sum == 0)
			sum = UDP_CSUM_ALL_ONES;
	}
	*check = sum;
	return 0;
}

/* nat_rewrite_xdp4 is nat_rewrite_xdp_fam for IPv4. */
static __always_inline int nat_rewrite_xdp4(struct xdp_md *ctx, const struct packet *pkt, const struct nat *n)
{
	return nat_rewrite_xdp_fam(PKT_IPV4, ctx, pkt, n);
}

/* ---- rewriting skbs (tc) ---- */

/* nat_skb_port_csum updates the L4 checksum at csum_off for one port
 * (nat4_skb_l4_csum). */
static __always_inline int nat_skb_port_csum(struct __sk_buff *skb, __u32 csum_off, __u64 mangled0,
					     __be16 old_port, __be16 new_port)
{
	if (old_port != new_port &&
	    bpf_l4_csum_replace(skb, csum_off, old_port, new_port, mangled0 | sizeof(new_port)))
		return -1;
	return 0;
}

/* nat4_skb_l4_csum updates the L4 checksum at csum_off for one address and
 * one port. The csum helper knows CHECKSUM_PARTIAL (pod traffic, whose
 * field holds only the pseudo-header sum) from a full checksum and keeps
 * skb->csum right. */
static __always_inline int nat4_skb_l4_csum(struct __sk_buff *skb, __u32 csum_off, __u64 mangled0,
					   __be32 old_addr, __be32 new_addr, __be16 old_port, __be16 new_port)
{
	if (bpf_l4_csum_replace(skb, csum_off, old_addr, new_addr, BPF_F_PSEUDO_HDR | mangled0 | sizeof(new_addr)))
		return -1;
	return nat_skb_port_csum(skb, csum_off, mangled0, old_port, new_port);
}

/* nat_skb_csum_off is the offset of pkt's L4 checksum (TCP or UDP) in
 * the frame, and sets *mangled0 to the csum helpers' flag for a UDP
 * checksum 0. */
static __always_inline __u32 nat_skb_csum_off(const struct packet *pkt, __u64 *mangled0)
{
	__u32 l4_off = pkt->l4_off & L4_OFF_MASK;

	*mangled0 = 0;
	if (pkt->proto == IP_PROTO_TCP)
		return l4_off + offsetof(struct tcphdr, check);
	/* UDP checksum 0 means "none" and stays 0. */
	*mangled0 = BPF_F_MARK_MANGLED_0;
	return l4_off + offsetof(struct udphdr, check);
}

/* nat_skb_ports reloads the packet pointers the csum helpers
 * invalidated, writes n's ports into the L4 header at l4_off (TCP's sit
 * where UDP's do, parse.h) and returns the L3 header, checked to hold
 * l3_hlen bytes; NULL when the frame is shorter. */
static __always_inline void *nat_skb_ports(struct __sk_buff *skb, __u32 l4_off, __u32 l3_hlen, const struct nat *n)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	void *l3 = data + ETH_HLEN, *l4 = data + l4_off;

	if (l3 + l3_hlen > data_end || l4 + sizeof(struct udphdr) > data_end)
		return NULL;
	if (n->flags & NAT_F_DST)
		*(__be16 *)(l4 + offsetof(struct udphdr, dest)) = n->dport;
	if (n->flags & NAT_F_SRC)
		*(__be16 *)(l4 + offsetof(struct udphdr, source)) = n->sport;
	return l3;
}

/* nat4_rewrite_skb applies n to the skb: L4 checksum through the helper,
 * then the ports and the IPv4 header (nat4_rewrite_ip) written directly,
 * which is cheaper than bpf_skb_store_bytes. Returns 0 on success. */
static __always_inline int nat4_rewrite_skb(struct __sk_buff *skb, const struct packet *pkt, const struct nat *n)
{
	__u32 l4_off = pkt->l4_off & L4_OFF_MASK;
	__u32 csum_off;
	__u64 mangled0;
	void *data, *data_end;
	struct iphdr *ip;

	if (n->flags & NAT_F_L3) {
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
		ip = data + ETH_HLEN;
		if ((void *)(ip + 1) > data_end)
			return -1;
		nat4_rewrite_ip(ip, pkt, n);
		return 0;
	}
	csum_off = nat_skb_csum_off(pkt, &mangled0);
	if ((n->flags & NAT_F_DST) &&
	    nat4_skb_l4_csum(skb, csum_off, mangled0, pkt->daddr, n->daddr, pkt->dport, n->dport))
		return -1;
	if ((n->flags & NAT_F_SRC) &&
	    nat4_skb_l4_csum(skb, csum_off, mangled0, pkt->saddr, n->saddr, pkt->sport, n->sport))
		return -1;

	ip = nat_skb_ports(skb, l4_off, sizeof(*ip), n);
	if (!ip)
		return -1;
	nat4_rewrite_ip(ip, pkt, n);
	return 0;
}

#endif
