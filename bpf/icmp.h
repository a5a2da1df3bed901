/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* ICMP errors that follow their flow (docs/datapath.md, "ICMP errors").
 *
 * An ICMP error (destination unreachable, fragmentation needed included,
 * or time exceeded) quotes the IPv4 header and first 8 bytes of the packet
 * it is about. When that packet belongs to a flow the datapath translated,
 * the quote and the error's own addresses name what was on the wire where
 * the error was sent (a backend, the node's address after source NAT), which
 * the receiver never talked to: its socket would ignore the error. So the
 * error is translated the way the flow's packets going the same direction
 * are:
 *   - the quoted packet went the other way, so the flow's entry for this
 *     direction is the conntrack entry of the quote's reversed tuple;
 *   - that entry's rewrite of the source applies to the quote's
 *     destination, its rewrite of the destination to the quote's source;
 *   - the error's own source is rewritten only when it is the quote's
 *     destination (the backend, or the client, answering itself), not a
 *     router on the path; its destination only when it is the quote's
 *     source.
 * Every checksum is kept: the quoted IPv4 header's, the quoted L4 one (UDP's
 * sits in the quoted 8 bytes, 0 stays 0; TCP's only when the whole TCP
 * header is quoted, as Linux quotes up to 576 bytes), the ICMP checksum over
 * all of that, and the outer IPv4 header's. Every change inside the ICMP
 * message is balanced in the ICMP checksum and every change of the outer
 * header in its own checksum, so the packet's overall sum, and a tc skb's
 * CHECKSUM_COMPLETE value, stay right: the same in-place code serves tc
 * (after pulling the headers into the linear area) and XDP.
 *
 * An error whose flow is unknown or expired passes untouched.
 *
 * ICMPv6 (icmp6_xlate) is IPv4's twin over the same plan (icmp_flow_plan):
 * destination unreachable, packet too big (which IPv6 needs: routers
 * never fragment, so a packet too big that never reaches the sender is a
 * black hole for large transfers) and time exceeded quote the IPv6
 * packet, extension headers walked as the parser walks them. There is no
 * IP header checksum; the ICMPv6 checksum covers a pseudo-header with
 * the error's own addresses (RFC 4443 2.3), so a change of those is
 * balanced in it too, and the packet's overall sum still does not
 * change. Informational messages (echo, NDP, router advertisements, MLD)
 * and parameter problems pass untouched. */
#ifndef TOPOLB_ICMP_H
#define TOPOLB_ICMP_H

#include "lb.h"
#include "csum.h"
#include "ct.h"

/* The ICMP header of an error (RFC 792): type, code, checksum, and 4 bytes
 * that errors leave unused (but for the next-hop MTU of "fragmentation
 * needed"). Declared here: linux/icmp.h pulls in libc headers. */
struct icmp_hdr {
	__u8 type;
	__u8 code;
	__sum16 checksum;
	__be32 rest;
};
#define ICMP_HLEN 8
_Static_assert(sizeof(struct icmp_hdr) == ICMP_HLEN, "ICMP header is 8 bytes");
/* The L4 bytes every ICMP error quotes (RFC 792): ports, and for UDP its
 * length and checksum. */
#define ICMP_QUOTED_L4 8
/* Longest prefix of an ICMP error read: Ethernet, IPv4 with options, ICMP
 * header, quoted IPv4 with options, quoted TCP header. tc pulls this much. */
#define ICMP_PARSE_LEN (ETH_HLEN + IP_MAX_HLEN + ICMP_HLEN + IP_MAX_HLEN + sizeof(struct tcphdr))
/* The quoted packet's offsets are at most ETH_HLEN + 2 * IP_MAX_HLEN +
 * ICMP_HLEN; masking with this tells the verifier so. */
#define ICMP_OFF_MASK 0xff
_Static_assert(ETH_HLEN + 2 * IP_MAX_HLEN + ICMP_HLEN <= ICMP_OFF_MASK, "ICMP_OFF_MASK must cover the quoted L4 offset");
#define UDP_CSUM_NONE 0
#define UDP_CSUM_ZERO_SENT 0xffff /* a computed 0 is sent as all ones (RFC 768) */

/* Longest prefix of an ICMPv6 error read: Ethernet, IPv6 with extension
 * headers, ICMPv6 header, the quoted IPv6 packet's, quoted TCP header. */
#define ICMP6_PARSE_LEN (ETH_HLEN + 2 * (IP6_HLEN + IP6_MAX_EXT_LEN) + ICMP_HLEN + sizeof(struct tcphdr))
_Static_assert(ETH_HLEN + 2 * (IP6_HLEN + IP6_MAX_EXT_LEN) + ICMP_HLEN <= ICMP_OFF_MASK,
	       "ICMP_OFF_MASK must cover the quoted IPv6 L4 offset");

static __always_inline int icmp4_is_error(__u8 type)
{
	return type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED;
}

static __always_inline int icmp6_is_error(__u8 type)
{
	return type == ICMP6_DEST_UNREACH || type == ICMP6_PACKET_TOO_BIG || type == ICMP6_TIME_EXCEEDED;
}

/* Where an end of the quote (its source or its destination) takes its
 * new address and port from (icmp_flow_plan). */
enum icmp_end_from {
	ICMP_END_KEEP = 0, /* unchanged */
	ICMP_END_CT = 1,   /* the entry's addr and port */
	ICMP_END_NAT = 2,  /* the entry's nat_addr and nat_port */
};

/* icmp_flow_plan says where the quote's ends (src, dst) take their new
 * values from: ct is the entry of the flow's packets going the error's
 * way. Both families follow it (icmp_flow_rewrite, icmp6_xlate). */
static __always_inline void icmp_flow_plan(const struct ct_value *ct, __u8 *src, __u8 *dst)
{
	__u8 nat = ct->flags & CT_F_SNAT ? ICMP_END_NAT : ICMP_END_KEEP;

	if (ct->dir == CT_REVERSE) {
		/* Replies get the frontend as source (and, source-NATed, the
		 * client as destination): the quote, a forward packet, gets
		 * the frontend as destination (and the client as source). */
		*dst = ICMP_END_CT;
		*src = nat;
	} else {
		/* Forward packets get the backend as destination (and the
		 * node's address as source): the quote, a reply, gets the
		 * backend as source (and the node's address as destination). */
		*src = ICMP_END_CT;
		*dst = nat;
	}
}

/* icmp_end_port is the new port of an end of the quote whose port is
 * port, as from says (icmp_flow_plan). */
static __always_inline __be16 icmp_end_port(__u8 from, const struct ct_value *ct, __be16 port)
{
	if (from == ICMP_END_CT)
		return ct->port;
	if (from == ICMP_END_NAT)
		return ct->nat_port;
	return port;
}

/* An address and port of an IPv4 quote, before and after translation. */
struct icmp_end {
	__be32 addr, new_addr;
	__be16 port, new_port;
};

/* icmp_flow_rewrite fills the new ends of an IPv4 quote (src, dst) from
 * ct, the entry of the flow's packets going the error's way. */
static __always_inline void icmp_flow_rewrite(const struct ct_value *ct, struct icmp_end *src,
					      struct icmp_end *dst)
{
	__u8 src_from, dst_from;

	icmp_flow_plan(ct, &src_from, &dst_from);
	src->new_addr = src_from == ICMP_END_CT ? ct->addr : src_from == ICMP_END_NAT ? ct->nat_addr : src->addr;
	dst->new_addr = dst_from == ICMP_END_CT ? ct->addr : dst_from == ICMP_END_NAT ? ct->nat_addr : dst->addr;
	src->new_port = icmp_end_port(src_from, ct, src->port);
	dst->new_port = icmp_end_port(dst_from, ct, dst->port);
}

/* icmp4_xlate translates, in place, an ICMP error about a translated flow.
 * pkt is the error as parse_packet read it (PARSE_ICMP), arrived on iif
 * (0: sent by the node's own stack); [data, data_end) must hold its
 * headers up to ICMP_PARSE_LEN where the frame has them.
 * Returns LB_REWRITE when it translated the error, LB_DROP (counted)
 * when it arrived elsewhere than the packets of the direction it travels
 * do (ct_iif_plausible: a forged "fragmentation needed" from a pod or
 * from outside, quoting a flow whose replies come from elsewhere, would
 * lower the client's path MTU), LB_PASS otherwise (not an error, not
 * about a translated flow, or not quoting enough). */
static __always_inline int icmp4_xlate(void *data, void *data_end, const struct packet *pkt, __u32 iif)
{
	__u32 icmp_off = pkt->l4_off & L4_OFF_MASK;
	struct iphdr *ip = data + ETH_HLEN;
	struct icmp_hdr *icmp = data + icmp_off;
	__u32 in_off = icmp_off + ICMP_HLEN, in_l4_off;
	struct icmp_end src, dst;
	struct iphdr *in;
	struct ct_key key = {};
	struct ct_value *ct;
	__be16 *ports, *l4_check = 0;
	__u16 old_in_check, old_l4_check = 0;
	__u16 icmp_check;
	void *l4;

	if ((void *)(ip + 1) > data_end || (void *)(icmp + 1) > data_end)
		return LB_PASS;
	if (!icmp4_is_error(icmp->type))
		return LB_PASS;
	in = data + in_off;
	if ((void *)(in + 1) > data_end)
		return LB_PASS;
	if (in->version != 4 || in->ihl < IP_MIN_IHL)
		return LB_PASS;
	if (in->protocol != IP_PROTO_TCP && in->protocol != IP_PROTO_UDP)
		return LB_PASS;
	/* Only a first fragment quotes ports. */
	if (in->frag_off & bpf_htons(IP_OFFSET))
		return LB_PASS;
	in_l4_off = (in_off + in->ihl * IP_WORD_LEN) & ICMP_OFF_MASK;
	l4 = data + in_l4_off;
	if (l4 + ICMP_QUOTED_L4 > data_end)
		return LB_PASS;
	ports = l4;
	src.addr = in->saddr;
	src.port = ports[0];
	dst.addr = in->daddr;
	dst.port = ports[1];

	/* The flow's entry for the error's direction: the quote reversed. */
	key.saddr = dst.addr;
	key.daddr = src.addr;
	key.sport = dst.port;
	key.dport = src.port;
	key.proto = in->protocol;
	ct = ct_find4(&key);
	if (!ct || compat_now() > ct->expires)
		return LB_PASS;
	if (!ct_iif_plausible(ct, iif)) {
		stat_inc(STAT_DROP_REPLY_IFACE);
		return LB_DROP;
	}
	icmp_flow_rewrite(ct, &src, &dst);

	if (in->protocol == IP_PROTO_UDP) {
		l4_check = l4 + offsetof(struct udphdr, check);
		if (*l4_check == UDP_CSUM_NONE)
			l4_check = 0;
	} else if (l4 + sizeof(struct tcphdr) <= data_end &&
		   in_l4_off + sizeof(struct tcphdr) <= ETH_HLEN + (__u32)bpf_ntohs(ip->tot_len)) {
		l4_check = l4 + offsetof(struct tcphdr, check);
	}

	/* The quote: its L4 checksum, ports, IPv4 checksum and addresses, each
	 * change balanced in the ICMP checksum. */
	icmp_check = icmp->checksum;
	if (l4_check) {
		__u16 sum = old_l4_check = *l4_check;

		sum = csum_replace4(sum, src.addr, src.new_addr);
		sum = csum_replace4(sum, dst.addr, dst.new_addr);
		sum = csum_replace2(sum, src.port, src.new_port);
		sum = csum_replace2(sum, dst.port, dst.new_port);
		if (in->protocol == IP_PROTO_UDP && sum == 0)
			sum = UDP_CSUM_ZERO_SENT;
		*l4_check = sum;
		icmp_check = csum_replace2(icmp_check, old_l4_check, sum);
	}
	ports[0] = src.new_port;
	ports[1] = dst.new_port;
	icmp_check = csum_replace2(icmp_check, src.port, src.new_port);
	icmp_check = csum_replace2(icmp_check, dst.port, dst.new_port);

	old_in_check = in->check;
	in->check = csum_replace4(csum_replace4(in->check, src.addr, src.new_addr), dst.addr, dst.new_addr);
	in->saddr = src.new_addr;
	in->daddr = dst.new_addr;
	icmp_check = csum_replace2(icmp_check, old_in_check, in->check);
	icmp_check = csum_replace4(icmp_check, src.addr, src.new_addr);
	icmp->checksum = csum_replace4(icmp_check, dst.addr, dst.new_addr);

	/* The error's own addresses: the sender only when it is the quote's
	 * destination, the receiver only when it is the quote's source. */
	if (ip->saddr == dst.addr && dst.addr != dst.new_addr) {
		ip->check = csum_replace4(ip->check, ip->saddr, dst.new_addr);
		ip->saddr = dst.new_addr;
	}
	if (ip->daddr == src.addr && src.addr != src.new_addr) {
		ip->check = csum_replace4(ip->check, ip->daddr, src.new_addr);
		ip->daddr = src.new_addr;
	}
	stat_inc(STAT_ICMP_XLATE);
	return LB_REWRITE;
}

/* icmp6_end_addr is the new address of an end of an IPv6 quote whose
 * address is at addr, as from says (icmp_flow_plan); v is the flow's
 * entry. */
static __always_inline const __u32 *icmp6_end_addr(__u8 from, const struct ct6_value *v, const __u32 *addr)
{
	if (from == ICMP_END_CT)
		return v->addr.v6;
	if (from == ICMP_END_NAT)
		return v->nat_addr.v6;
	return addr;
}

/* icmp6_xlate is icmp4_xlate for an ICMPv6 message (pkt a struct packet6,
 * PARSE_ICMP), arrived on iif; [data, data_end) must hold its headers up to
 * ICMP6_PARSE_LEN where the frame has them. The new addresses are read
 * from the flow's entry and the old ones from the packet, every checksum
 * change computed before the address it follows is written. */
static __always_inline int icmp6_xlate(void *data, void *data_end, const struct packet *pkt, __u32 iif)
{
	__u32 icmp_off = pkt->l4_off & L4_OFF_MASK;
	struct ipv6hdr *ip = data + ETH_HLEN;
	struct icmp_hdr *icmp = data + icmp_off;
	__u32 in_off = icmp_off + ICMP_HLEN, in_l4_off;
	const __u32 *src_new, *dst_new;
	__u32 *src, *dst, *out_src, *out_dst;
	struct ct6_key key = {};
	const struct ct6_value *v;
	struct ct_value *ct;
	__u8 src_from, dst_from, next;
	__be16 *ports, *l4_check = 0, src_port, dst_port;
	__u16 old_l4_check, icmp_check;
	int out_src_hit, out_dst_hit;
	struct ipv6hdr *in;
	void *l4;

	if ((void *)(ip + 1) > data_end || (void *)(icmp + 1) > data_end)
		return LB_PASS;
	if (!icmp6_is_error(icmp->type))
		return LB_PASS;
	in = data + in_off;
	if ((void *)(in + 1) > data_end || in->version != 6)
		return LB_PASS;
	next = in->nexthdr;
	in_l4_off = ip6_walk(data, data_end, in_off + IP6_HLEN, in_off + IP6_HLEN + IP6_MAX_EXT_LEN, &next);
	/* A quoted fragment (its header ends the walk) never was a flow of
	 * ours: IPv6 fragments pass untranslated. */
	if (!in_l4_off || (next != IP_PROTO_TCP && next != IP_PROTO_UDP))
		return LB_PASS;
	in_l4_off &= ICMP_OFF_MASK;
	l4 = data + in_l4_off;
	if (l4 + ICMP_QUOTED_L4 > data_end)
		return LB_PASS;
	ports = l4;
	src = in->saddr.in6_u.u6_addr32;
	dst = in->daddr.in6_u.u6_addr32;
	src_port = ports[0];
	dst_port = ports[1];

	/* The flow's entry for the error's direction: the quote reversed. */
	__builtin_memcpy(&key.saddr, dst, sizeof(key.saddr));
	__builtin_memcpy(&key.daddr, src, sizeof(key.daddr));
	key.sport = dst_port;
	key.dport = src_port;
	key.proto = next;
	ct = ct_find_fam(PKT_IPV6, &key);
	if (!ct || compat_now() > ct->expires)
		return LB_PASS;
	if (!ct_iif_plausible(ct, iif)) {
		stat_inc(STAT_DROP_REPLY_IFACE);
		return LB_DROP;
	}
	v = ct6_of(ct);
	icmp_flow_plan(ct, &src_from, &dst_from);
	src_new = icmp6_end_addr(src_from, v, src);
	dst_new = icmp6_end_addr(dst_from, v, dst);

	/* The error's own addresses: the sender only when it is the quote's
	 * destination, the receiver only when it is the quote's source;
	 * decided before the quote changes. */
	out_src = ip->saddr.in6_u.u6_addr32;
	out_dst = ip->daddr.in6_u.u6_addr32;
	out_src_hit = dst_from != ICMP_END_KEEP && addr_eq((const union tlb_addr *)out_src, (const union tlb_addr *)dst);
	out_dst_hit = src_from != ICMP_END_KEEP && addr_eq((const union tlb_addr *)out_dst, (const union tlb_addr *)src);

	if (next == IP_PROTO_UDP) {
		l4_check = l4 + offsetof(struct udphdr, check);
		if (*l4_check == UDP_CSUM_NONE)
			l4_check = 0;
	} else if (l4 + sizeof(struct tcphdr) <= data_end &&
		   in_l4_off + sizeof(struct tcphdr) <= ETH_HLEN + IP6_HLEN + (__u32)bpf_ntohs(ip->payload_len)) {
		l4_check = l4 + offsetof(struct tcphdr, check);
	}

	/* The quote: its L4 checksum (over its pseudo-header), ports and
	 * addresses, each change balanced in the ICMPv6 checksum. */
	icmp_check = icmp->checksum;
	if (l4_check) {
		__u16 sum = old_l4_check = *l4_check;

		sum = csum_replace16(sum, src, src_new);
		sum = csum_replace16(sum, dst, dst_new);
		sum = csum_replace2(sum, src_port, icmp_end_port(src_from, ct, src_port));
		sum = csum_replace2(sum, dst_port, icmp_end_port(dst_from, ct, dst_port));
		if (next == IP_PROTO_UDP && sum == 0)
			sum = UDP_CSUM_ZERO_SENT;
		*l4_check = sum;
		icmp_check = csum_replace2(icmp_check, old_l4_check, sum);
	}
	ports[0] = icmp_end_port(src_from, ct, src_port);
	ports[1] = icmp_end_port(dst_from, ct, dst_port);
	icmp_check = csum_replace2(icmp_check, src_port, ports[0]);
	icmp_check = csum_replace2(icmp_check, dst_port, ports[1]);
	/* The outer addresses are in the ICMPv6 pseudo-header: their
	 * changes are balanced in its checksum as well. */
	if (out_src_hit) {
		icmp_check = csum_replace16(icmp_check, out_src, dst_new);
		__builtin_memcpy(out_src, dst_new, sizeof(ip->saddr));
	}
	if (out_dst_hit) {
		icmp_check = csum_replace16(icmp_check, out_dst, src_new);
		__builtin_memcpy(out_dst, src_new, sizeof(ip->daddr));
	}
	icmp_check = csum_replace16(icmp_check, src, src_new);
	icmp_check = csum_replace16(icmp_check, dst, dst_new);
	icmp->checksum = icmp_check;
	if (src_from != ICMP_END_KEEP)
		__builtin_memcpy(src, src_new, sizeof(in->saddr));
	if (dst_from != ICMP_END_KEEP)
		__builtin_memcpy(dst, dst_new, sizeof(in->daddr));
	stat_inc(STAT_ICMP_XLATE);
	return LB_REWRITE;
}

#endif
