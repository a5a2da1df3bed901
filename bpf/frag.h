/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* IPv4 fragments of datagrams to and from Services. Only a datagram's
 * first fragment carries its ports; the later ones carry the IP header
 * and payload. The first fragment is balanced like any packet (lb.h),
 * and, when the datagram is ours (of a flow conntrack knows, or a new
 * flow to a frontend that the core will accept), its ports are
 * remembered in tlb_frags under the datagram's reassembly key as it
 * arrived (source, destination, IP id, protocol: RFC 791). A later
 * fragment takes the ports from there, finds its first's conntrack entry
 * and gets the same translation, of its IP header only (NAT_F_L3,
 * nat.h); it creates and changes no state.
 *
 * Order: the entry stays until FRAG_TIMEOUT or the LRU takes it, not
 * until the last fragment (the one without MF may arrive before the
 * middle ones), so every later fragment that arrives after the first
 * follows it, in any order. A later fragment that arrives before its
 * first (or after the entry is gone) finds nothing: it passes
 * untranslated, counted as STAT_FRAGMENT, to the frontend's address, and
 * its datagram never reaches the backend whole (the receiver's
 * reassembly times out, as for a lost fragment). Datagrams not ours take
 * no entry.
 *
 * Check first, remember after: a first fragment of a new flow takes an
 * entry only when it passes what the core checks before it creates a
 * flow and can tell without the frame (frag_accepts_new): a frontend
 * with backends, the source ranges, the per-source budget. A source
 * outside the ranges or over its budget can neither fill tlb_frags
 * (evicting others' datagrams) nor have later fragments translated.
 *
 * The hooks into the packet path: parse.h returns later fragments as
 * PARSE_FRAGMENT, lb4_classify calls frag4_remember before balancing a
 * packet and frag4_follow for later fragments, nat.h rewrites NAT_F_L3.
 * The later fragments' path is separate from lb_process on purpose:
 * nothing fragment-specific is on its path, whose verification is at the
 * limit.
 *
 * IPv6 the same way, over its own table (tlb_frags6, keyed by RFC 8200
 * 4.5's reassembly key with the fragment header's 32-bit identification,
 * beside IPv4's 12-byte key as the conntrack tables are): parse_ipv6
 * takes a fragment header where its walk ends, followed by the L4
 * header; lb6_classify calls frag6_remember and frag6_follow. Their keys
 * are built in a per-CPU slot (tlb_frag6_scratch): IPv6's hooks have no
 * stack left. A later IPv6 fragment rewrites its IPv6 header's addresses
 * only (NAT_F_L3; IPv6 has no header checksum). */
#ifndef TOPOLB_FRAG_H
#define TOPOLB_FRAG_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>

#include "addr.h"
#include "compat.h"
#include "conntrack6.h"
#include "consts.h"
#include "conntrack.h"
#include "ct.h"
#include "ipv6.h"
#include "maps.h"
#include "nat.h"
#include "node.h"
#include "parse.h"
#include "srcrange.h"
#include "stats.h"
#include "structs.h"

/* frag4_key_of fills the reassembly key of the fragment pkt, whose IPv4
 * header is ip. */
static __always_inline void frag4_key_of(const struct iphdr *ip, const struct packet *pkt, struct frag_key *key)
{
	key->saddr = pkt->saddr;
	key->daddr = pkt->daddr;
	key->id = ip->id;
	key->proto = pkt->proto;
}

/* frag_accepts_new reports whether the core would accept a new flow
 * from saddr to frontend svc, as far as it can tell without taking
 * anything: the frontend has an active backend (an empty one drops or
 * rejects), the source is inside its source ranges (srcrange.h), and
 * the source's budget of new flows is not spent (conntrack.h). range is
 * scratch for the source-range key. Counts nothing: the core counts the
 * refusals when it drops the fragment. */
static __always_inline int frag_accepts_new(const struct svc_value *svc, __be32 saddr, struct src_range_key *range)
{
	if (svc->count == 0)
		return 0;
	range->prefixlen = SRC_RANGE_HOST_LEN;
	range->svc_id = bpf_htonl(svc->id);
	range->addr = addr_from4(saddr);
	if (!src_range_holds(svc, range))
		return 0;
	return ct_src_has(PKT_IPV4, &saddr, compat_now());
}

/* frag_ours reports whether a datagram with the tuple key is one the
 * datapath translates: of a flow conntrack knows (a reply, an
 * established flow), or to a frontend of this hook's scope (svc, filled
 * here) that accepts it as a new flow (frag_accepts_new). */
static __always_inline int frag_ours(const struct ct_key *key, struct svc_key *svc, struct src_range_key *range)
{
	const struct svc_value *v;

	if (ct_find4(key))
		return 1;
	svc->vip = addr_from4(key->daddr);
	svc->port = key->dport;
	svc->proto = key->proto;
	svc->scope = cfg_scope;
	v = bpf_map_lookup_elem(&tlb_services, svc);
	return v && frag_accepts_new(v, key->saddr, range);
}

/* frag4_remember_first records the ports of a datagram's first fragment
 * (its frag_off has MF; the caller passes nothing else) for the later
 * ones, when the datagram is ours (frag_ours). Called before the core
 * balances the fragment, which then creates the flow the later ones
 * follow; frag_ours asks first what the core will ask. A refusal it
 * cannot foresee (the frame checks, conntrack full) leaves an entry that
 * translates nothing: the later fragments find no flow and pass. A
 * reused IP id overwrites an older datagram's entry; losing the
 * entry to the LRU only loses the later fragments' translation.
 *
 * A global function, verified once on its own: inlined, or called after
 * lb_process, it multiplied the states the verifier walks (tc_uplink_lb
 * went over the million instructions). Its stack adds to the caller's
 * (512 bytes together): the lookups' keys and the entry share one area.
 * It takes scalars only, as 5.10 requires of a global function's
 * arguments: addresses and ports in network byte order as in struct
 * packet, the ports as sport | dport << 16, the header's id and frag_off
 * (network byte order) as id | frag_off << 16. Returns 0. */
__noinline int frag4_remember_first(__u32 saddr, __u32 daddr, __u32 ports, __u32 proto, __u32 id_frag_off)
{
	union {
		struct {
			struct ct_key key;
			struct svc_key svc;
			struct src_range_key range;
		} find;
		struct {
			struct frag_key key;
			struct frag_value v;
		} put;
	} u;

	if (!((id_frag_off >> 16) & bpf_htons(IP_MF)))
		return 0;
	__builtin_memset(&u, 0, sizeof(u));
	u.find.key.saddr = saddr;
	u.find.key.daddr = daddr;
	u.find.key.sport = ports & 0xffff;
	u.find.key.dport = ports >> 16;
	u.find.key.proto = proto;
	if (!frag_ours(&u.find.key, &u.find.svc, &u.find.range))
		return 0;
	/* The entry is built over the lookup's keys: the addresses stay
	 * where they are (frag_key puts them where ct_key does), the ports
	 * move to the value before the id takes their place. Fewer values
	 * live across the calls: none spilled to the stack. */
	u.put.v.sport = u.find.key.sport;
	u.put.v.dport = u.find.key.dport;
	u.put.v.pad = 0;
	u.put.key.id = id_frag_off & 0xffff;
	u.put.key.proto = proto;
	u.put.key.pad = 0;
	u.put.v.expires = compat_now() + FRAG_TIMEOUT * NSEC_PER_SEC;
	bpf_map_update_elem(&tlb_frags, &u.put.key, &u.put.v, BPF_ANY);
	stat_inc(STAT_FRAG_FIRST);
	return 0;
}
_Static_assert(__builtin_offsetof(struct frag_key, saddr) == __builtin_offsetof(struct ct_key, saddr) &&
		       __builtin_offsetof(struct frag_key, daddr) == __builtin_offsetof(struct ct_key, daddr),
	       "frag4_remember_first leaves the addresses where ct_key has them");

/* frag4_remember calls frag4_remember_first for pkt (PARSE_OK) in the
 * frame [data, data_end). */
static __always_inline void frag4_remember(const void *data, const void *data_end, const struct packet *pkt)
{
	const struct iphdr *ip = data + ETH_HLEN;

	if ((void *)(ip + 1) > data_end || !(ip->frag_off & bpf_htons(IP_MF)))
		return;
	frag4_remember_first(pkt->saddr, pkt->daddr, pkt->sport | (__u32)pkt->dport << 16, pkt->proto,
			    ip->id | (__u32)ip->frag_off << 16);
}

/* frag_follow_ct translates pkt, a later fragment of family fam whose
 * datagram's ports the caller found and wrote into pkt, as the entry
 * found under key (the family's conntrack key) says. Returns LB_PASS
 * when the flow is gone or expired, or, with replies_only, not a
 * reply. */
static __always_inline int frag_follow_ct(int fam, const struct packet *pkt, const void *key, int replies_only,
					  __u64 now, struct nat *nat)
{
	struct ct_value *ct = ct_find_fam(fam, key);

	if (!ct || now > ct->expires || (replies_only && ct->dir != CT_REVERSE))
		return LB_PASS;
	if (ct->dir == CT_FORWARD) {
		struct backend_stats *rec = bpf_map_lookup_elem(&tlb_backend_stats, &ct->backend_id);

		if (rec && rec->gen == ct->backend_gen) {
			rec->packets += 1;
			rec->bytes += pkt->l3_len;
		}
		nat_forward(nat, ct);
	} else {
		nat_reverse(nat, ct);
		stat_inc(STAT_REVERSE_NAT);
	}
	if (fam == PKT_IPV6)
		nat6_addrs(nat, ct);
	nat->flags |= NAT_F_L3;
	stat_inc(STAT_FRAG_FOLLOWED);
	return LB_REWRITE;
}

/* frag4_follow translates pkt, a PARSE_FRAGMENT, as its datagram's first
 * fragment was: it fills pkt's ports and nat, and returns LB_REWRITE.
 * With replies_only, only a reply is (tc egress: lb_stack_reply).
 * Returns LB_PASS, counted, for an ICMP fragment and for a later
 * fragment whose first was not translated within FRAG_TIMEOUT or whose
 * flow has expired. */
static __always_inline int frag4_follow(const void *data, const void *data_end, struct packet *pkt,
				       int replies_only, struct nat *nat)
{
	const struct iphdr *ip = data + ETH_HLEN;
	struct frag_key fkey = {};
	struct ct_key key = {};
	struct frag_value *f;
	__u64 now;

	if ((void *)(ip + 1) > data_end || !(ip->frag_off & bpf_htons(IP_OFFSET)) ||
	    (pkt->proto != IP_PROTO_TCP && pkt->proto != IP_PROTO_UDP))
		goto pass;
	frag4_key_of(ip, pkt, &fkey);
	f = bpf_map_lookup_elem(&tlb_frags, &fkey);
	now = compat_now();
	if (!f || now > f->expires)
		goto pass;
	pkt->sport = f->sport;
	pkt->dport = f->dport;
	key.saddr = pkt->saddr;
	key.daddr = pkt->daddr;
	key.sport = pkt->sport;
	key.dport = pkt->dport;
	key.proto = pkt->proto;
	if (frag_follow_ct(PKT_IPV4, pkt, &key, replies_only, now, nat) == LB_REWRITE)
		return LB_REWRITE;
pass:
	stat_inc(STAT_FRAGMENT);
	return LB_PASS;
}

/* frag6_scratch_get is this CPU's slot for an IPv6 fragment's keys,
 * zeroed (the keys' padding must be). */
static __always_inline struct frag6_scratch *frag6_scratch_get(void)
{
	__u32 zero = 0;
	struct frag6_scratch *s = bpf_map_lookup_elem(&tlb_frag6_scratch, &zero);

	if (s)
		__builtin_memset(s, 0, sizeof(*s));
	return s;
}

/* frag6_header is the fragment header of pkt, an IPv6 fragment (parse_ipv6
 * left its L4 offset just after it), or NULL. */
static __always_inline const struct ip6_frag *frag6_header(const void *data, const void *data_end,
							   const struct packet *pkt)
{
	const struct ip6_frag *fh = data + ((pkt->l4_off - sizeof(*fh)) & L4_OFF_MASK);

	if ((void *)(fh + 1) > data_end)
		return NULL;
	return fh;
}

/* frag6_key_of fills key, the reassembly key of pkt, whose fragment
 * header is fh. */
static __always_inline void frag6_key_of(const struct ip6_frag *fh, const struct packet6 *pkt, struct frag6_key *key)
{
	key->saddr = pkt->saddr;
	key->daddr = pkt->daddr;
	key->id = fh->id;
	key->proto = pkt->p.proto;
}

#if defined(LB_FRAME)
/* frag6_remember_first is frag4_remember_first for IPv6: the ports of the
 * first fragment in ctx's frame, whose L4 header is at l4_off (after its
 * fragment header: parse_ipv6 found both, and the TCP or UDP header
 * complete), remembered in tlb_frags6 when its datagram is ours. A
 * global function, as IPv4's and for the same reason (called inline
 * before lb_process, it took tc_lb_egress past the verifier's million
 * instructions); it reads the frame again from its context, as 5.10
 * allows a global function no other pointer, and keeps its keys in the
 * per-CPU slot (tlb_frag6_scratch), so its frame adds almost nothing to
 * its caller's. Returns 0. */
__noinline int frag6_remember_first(LB_FRAME *ctx, __u32 l4_off)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	const struct ipv6hdr *ip = data + ETH_HLEN;
	const struct ip6_frag *fh = data + ((l4_off - sizeof(*fh)) & L4_OFF_MASK);
	const struct udphdr *l4 = data + (l4_off & L4_OFF_MASK);
	struct frag6_scratch *s;

	if ((void *)(ip + 1) > data_end || (void *)(fh + 1) > data_end || (void *)(l4 + 1) > data_end)
		return 0;
	s = frag6_scratch_get();
	if (!s)
		return 0;
	/* TCP's ports sit where UDP's do (packet.h). */
	__builtin_memcpy(&s->svc.vip, &ip->daddr, sizeof(s->svc.vip));
	s->svc.port = l4->dest;
	s->svc.proto = fh->nexthdr;
	s->svc.scope = cfg_scope;
	__builtin_memcpy(&s->ct.saddr, &ip->saddr, sizeof(s->ct.saddr));
	s->ct.daddr = s->svc.vip;
	s->ct.sport = l4->source;
	s->ct.dport = l4->dest;
	s->ct.proto = fh->nexthdr;
	if (!bpf_map_lookup_elem(&tlb_services, &s->svc) && !ct_find_fam(PKT_IPV6, &s->ct))
		return 0;
	s->key.saddr = s->ct.saddr;
	s->key.daddr = s->ct.daddr;
	s->key.id = fh->id;
	s->key.proto = fh->nexthdr;
	s->v.sport = l4->source;
	s->v.dport = l4->dest;
	s->v.expires = compat_now() + FRAG_TIMEOUT * NSEC_PER_SEC;
	bpf_map_update_elem(&tlb_frags6, &s->key, &s->v, BPF_ANY);
	stat_inc(STAT_FRAG_FIRST);
	return 0;
}

/* frag6_remember calls frag6_remember_first for pkt (PARSE_OK), of the
 * frame of ctx, when it is a datagram's first fragment. */
static __always_inline void frag6_remember(void *ctx, const struct packet6 *pkt)
{
	if (pkt->p.frag_first)
		frag6_remember_first(ctx, pkt->p.l4_off);
}
#else
/* A hook without a frame (the socket hooks) balances no packet. */
static __always_inline void frag6_remember(void *ctx, const struct packet6 *pkt)
{
}
#endif

/* frag6_follow is frag4_follow for pkt, an IPv6 PARSE_FRAGMENT (its nat a
 * struct nat6): the ports from tlb_frags6, the translation of its
 * first's flow, of the IPv6 header's addresses only. */
static __always_inline int frag6_follow(const void *data, const void *data_end, struct packet6 *pkt,
					int replies_only, struct nat *nat)
{
	const struct ip6_frag *fh;
	struct frag6_scratch *s;
	struct frag_value *f;
	__u64 now;

	if (pkt->p.proto != IP_PROTO_TCP && pkt->p.proto != IP_PROTO_UDP)
		goto pass;
	fh = frag6_header(data, data_end, &pkt->p);
	s = frag6_scratch_get();
	if (!fh || !s)
		goto pass;
	frag6_key_of(fh, pkt, &s->key);
	f = bpf_map_lookup_elem(&tlb_frags6, &s->key);
	now = compat_now();
	if (!f || now > f->expires)
		goto pass;
	pkt->p.sport = f->sport;
	pkt->p.dport = f->dport;
	ct6_key_of(pkt, &s->ct);
	if (frag_follow_ct(PKT_IPV6, &pkt->p, &s->ct, replies_only, now, nat) == LB_REWRITE)
		return LB_REWRITE;
pass:
	stat_inc(STAT_FRAGMENT);
	return LB_PASS;
}

#endif
