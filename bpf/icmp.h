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
 * An error whose flow is unknown or expired passes untouched. */
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

static __always_inline int icmp_is_error(__u8 type)
{
	return type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED;
}

/* An address and port of the quote, before and after translation. */
struct icmp_end {
	__be32 addr, new_addr;
	__be16 port, new_port;
};

/* icmp_flow_rewrite fills the new ends of the quote (src, dst) from ct,
 * the entry of the flow's packets going the error's way. */
static __always_inline void icmp_flow_rewrite(const struct ct_value *ct, struct icmp_end *src,
					      struct icmp_end *dst)
{
	int snat = ct->flags & CT_F_SNAT;

	src->new_addr = src->addr;
	src->new_port = src->port;
	dst->new_addr = dst->addr;
	dst->new_port = dst->port;
	if (ct->dir == CT_REVERSE) {
		/* Replies get the frontend as source (and, source-NATed, the
		 * client as destination): the quote, a forward packet, gets
		 * the frontend as destination (and the client as source). */
		dst->new_addr = ct->addr;
		dst->new_port = ct->port;
		if (snat) {
			src->new_addr = ct->nat_addr;
			src->new_port = ct->nat_port;
		}
	} else {
		/* Forward packets get the backend as destination (and the
		 * node's address as source): the quote, a reply, gets the
		 * backend as source (and the node's address as destination). */
		src->new_addr = ct->addr;
		src->new_port = ct->port;
		if (snat) {
			dst->new_addr = ct->nat_addr;
			dst->new_port = ct->nat_port;
		}
	}
}

/* icmp_xlate translates, in place, an ICMP error about a translated flow.
 * pkt is the error as parse_packet read it (PARSE_ICMP); [data, data_end)
 * must hold its headers up to ICMP_PARSE_LEN where the frame has them.
 * Returns LB_REWRITE when it translated the error, LB_PASS otherwise (not
 * an error, not about a translated flow, or not quoting enough). */
static __always_inline int icmp_xlate(void *data, void *data_end, const struct packet *pkt)
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
	if (!icmp_is_error(icmp->type))
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
	ct = ct_find(&key);
	if (!ct || compat_now() > ct->expires)
		return LB_PASS;
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

#endif
