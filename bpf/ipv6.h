/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* What only IPv6 has, beside ipv4.h: the fixed header with 16-byte
 * addresses, the extension header chain, the hop limit, and the parsed
 * packet with its addresses (struct packet6). The L4 headers and the
 * family-neutral part of the parsed packet are packet.h's.
 *
 * tc translates IPv6 on pod veths and uplinks (tc_lb6, tc.h), XDP on
 * uplinks (xdp_lb6, xdp_lb.c). */
#ifndef TOPOLB_IPV6_H
#define TOPOLB_IPV6_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ipv6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "addr.h"
#include "consts.h"
#include "packet.h"
#include "structs.h"

/* Next-header values (RFC 8200 4, IANA "Assigned Internet Protocol
 * Numbers"). */
#define IP6_NEXT_HOP_BY_HOP 0
#define IP6_NEXT_ROUTING 43
#define IP6_NEXT_FRAGMENT 44
#define IP6_NEXT_DEST_OPTS 60
#define IP6_PROTO_ICMPV6 58

/* ICMPv6 error types and codes (RFC 4443 3): every type below 128 is an
 * error; informational messages (echo, NDP, router advertisements, MLD)
 * are 128 and above. */
#define ICMP6_DEST_UNREACH 1
#define ICMP6_PACKET_TOO_BIG 2
#define ICMP6_TIME_EXCEEDED 3
#define ICMP6_PORT_UNREACH 4 /* a code of ICMP6_DEST_UNREACH */

/* The extension headers walked before the L4 header: at most
 * IP6_MAX_EXT of them (hop-by-hop, destination options, routing,
 * destination options again is RFC 8200 4.1's longest sane chain), in at
 * most IP6_MAX_EXT_LEN bytes, so the L4 header starts within
 * L4_OFF_MASK like IPv4's (packet.h) and every L4 helper serves both
 * families. A longer chain is never translated: addressed to a frontend
 * it is dropped (lb6_chain_frontend, lb.h), else the kernel takes it. */
#define IP6_MAX_EXT 4
#define IP6_MAX_EXT_LEN 64
/* An extension header's length field counts 8-byte units after the
 * first 8 (RFC 8200 4.3, 4.4, 4.6). */
#define IP6_EXT_UNIT 8
#define IP6_HLEN 40
/* The fragment header (RFC 8200 4.5), 8 bytes: the offset of the
 * fragment's data in 8-byte units in frag_off's 13 high bits, M (more
 * fragments) its lowest; host byte order masks. */
struct ip6_frag {
	__u8 nexthdr;   /* the first header of the fragmentable part: the L4 protocol when it is TCP, UDP or ICMPv6 */
	__u8 reserved;
	__be16 frag_off;
	__be32 id;
};
#define IP6_FRAG_OFFSET 0xfff8
#define IP6_FRAG_MF 0x0001
_Static_assert(sizeof(struct ip6_frag) == 8, "the fragment header is 8 bytes");
_Static_assert(ETH_HLEN + IP6_HLEN + IP6_MAX_EXT_LEN + sizeof(struct ip6_frag) <= L4_OFF_MASK,
	       "L4_OFF_MASK must cover an L4 header after the walk and a fragment header");
/* Every IPv6 link carries packets of this size (RFC 8200 5). */
#define IP6_MIN_MTU 1280
_Static_assert(sizeof(struct ipv6hdr) == IP6_HLEN, "the fixed IPv6 header is 40 bytes");
_Static_assert(ETH_HLEN + IP6_HLEN + IP6_MAX_EXT_LEN <= L4_OFF_MASK, "L4_OFF_MASK must cover every IPv6 L4 offset");

/* Longest Ethernet + IPv6 (with extension headers and a fragment
 * header) + TCP header prefix we read. */
#define MAX_PARSE6_LEN (ETH_HLEN + IP6_HLEN + IP6_MAX_EXT_LEN + sizeof(struct ip6_frag) + sizeof(struct tcphdr))

/* An IPv6 packet as the core sees it: the family-neutral part first (its
 * family PKT_IPV6), so a struct packet pointer to it serves every shared
 * helper, and the addresses, network byte order. */
struct packet6 {
	struct packet p;
	union tlb_addr saddr;
	union tlb_addr daddr;
};

/* packet6_of is the packet6 that pkt (family PKT_IPV6) heads. */
static __always_inline const struct packet6 *packet6_of(const struct packet *pkt)
{
	return (const struct packet6 *)pkt;
}

/* ip6_ext_len is the length of the extension header at h, whose type is
 * next, or 0 for a type that ends the walk here. */
static __always_inline __u32 ip6_ext_len(__u8 next, const __u8 *h)
{
	switch (next) {
	case IP6_NEXT_HOP_BY_HOP:
	case IP6_NEXT_ROUTING:
	case IP6_NEXT_DEST_OPTS:
		return ((__u32)h[1] + 1) * IP6_EXT_UNIT;
	default:
		return 0;
	}
}

/* ip6_walk walks the extension headers of an IPv6 packet from off, the
 * offset of the first header after the fixed one, whose type is *next:
 * at most IP6_MAX_EXT of them, ending by limit (the L4 header's furthest
 * offset). Returns the offset of the header that ends the walk, its type
 * in *next, or 0 when the chain is longer than the walk or leaves the
 * frame. */
static __always_inline __u32 ip6_walk(void *data, void *data_end, __u32 off, __u32 limit, __u8 *next)
{
	for (int i = 0; i < IP6_MAX_EXT; i++) {
		const __u8 *h = data + off;
		__u32 len;

		if ((void *)(h + 2) > data_end)
			return 0;
		len = ip6_ext_len(*next, h);
		if (!len)
			break;
		off += len;
		if (off > limit)
			return 0;
		*next = h[0];
	}
	return off;
}

/* parse_ipv6 fills pkt from the IPv6 frame in [data, data_end) (the
 * caller checked the Ethernet header). frame_len is the full frame length
 * (which can exceed data_end - data for non-linear skbs). Returns
 * PARSE_OK for TCP and UDP with their headers complete, a datagram's
 * first fragment included (frag_first set: its ports are remembered for
 * the later ones, frag.h), PARSE_FRAGMENT for a later fragment and for a
 * fragment of ICMPv6 (addresses, proto, l4_off set, ports 0: frag.h
 * follows the first or passes it), PARSE_ICMP for ICMPv6 (addresses and
 * l4_off set, ports 0: icmp.h translates errors about our flows and
 * passes the rest, NDP, router advertisements, MLD and echo, untouched),
 * PARSE_CHAIN for an extension chain longer than the walk (lb.h drops
 * it when it is addressed to a frontend), PARSE_SKIP for everything
 * else: other protocols, a fragment header followed by another extension
 * header, IPv4-mapped addresses, jumbograms, and what is malformed: the
 * kernel takes those, and drops what it must. The fragment header is
 * taken where the walk ends, followed by the L4 header, as Linux's
 * ip6_fragment builds it. */
static __always_inline int parse_ipv6(void *data, void *data_end, __u32 frame_len, struct packet6 *pkt)
{
	struct ipv6hdr *ip = data + ETH_HLEN;
	__be16 frag_off = 0;
	__u32 off, payload;
	int frag = 0;
	__u8 next;

	if ((void *)(ip + 1) > data_end || ip->version != 6)
		return PARSE_SKIP;
	payload = bpf_ntohs(ip->payload_len);
	/* Payload length 0 is a jumbogram's (RFC 2675) or BIG TCP's. */
	if (payload == 0 || IP6_HLEN + payload > frame_len - ETH_HLEN)
		return PARSE_SKIP;
	next = ip->nexthdr;
	off = ip6_walk(data, data_end, ETH_HLEN + IP6_HLEN, ETH_HLEN + IP6_HLEN + IP6_MAX_EXT_LEN, &next);
	/* The walk stopped short of the chain's end, or at a header it
	 * would have walked had it gone on. */
	if (!off || next == IP6_NEXT_HOP_BY_HOP || next == IP6_NEXT_ROUTING || next == IP6_NEXT_DEST_OPTS)
		return PARSE_CHAIN;
	if (next == IP6_NEXT_FRAGMENT) {
		const struct ip6_frag *fh = data + (off & L4_OFF_MASK);

		if ((void *)(fh + 1) > data_end)
			return PARSE_SKIP;
		next = fh->nexthdr;
		frag_off = fh->frag_off;
		off += sizeof(*fh);
		frag = 1;
	}
	if (next != IP_PROTO_TCP && next != IP_PROTO_UDP && next != IP6_PROTO_ICMPV6)
		return PARSE_SKIP;
	if (off - ETH_HLEN > IP6_HLEN + payload)
		return PARSE_SKIP;

	__builtin_memcpy(&pkt->saddr, &ip->saddr, sizeof(pkt->saddr));
	__builtin_memcpy(&pkt->daddr, &ip->daddr, sizeof(pkt->daddr));
	/* IPv4-mapped addresses are how IPv4 is stored (addr.h), never an
	 * IPv6 packet's on the wire (RFC 4291 2.5.5.2): such a packet must
	 * not reach an IPv4 frontend or flow. */
	if (addr_is4(&pkt->saddr) || addr_is4(&pkt->daddr))
		return PARSE_SKIP;
	pkt->p.family = PKT_IPV6;
	pkt->p.proto = next;
	pkt->p.tcp_flags = 0;
	pkt->p.l4_off = off;
	pkt->p.l3_len = IP6_HLEN + payload;
	/* A later fragment has no L4 header; ICMPv6 behind a fragment header
	 * is no error we translate (as a fragmented ICMP message in IPv4).
	 * frag, a constant on each path, keeps the verifier from walking
	 * icmp.h again for the fragment header's offsets. An atomic fragment
	 * (offset 0, no M: RFC 6946) is a whole datagram. */
	if (frag && ((frag_off & bpf_htons(IP6_FRAG_OFFSET)) || next == IP6_PROTO_ICMPV6)) {
		pkt->p.sport = 0;
		pkt->p.dport = 0;
		return PARSE_FRAGMENT;
	}
	if (next == IP6_PROTO_ICMPV6) {
		pkt->p.sport = 0;
		pkt->p.dport = 0;
		return PARSE_ICMP;
	}
	if (parse_l4(data + (off & L4_OFF_MASK), data_end, IP6_HLEN + payload - (off - ETH_HLEN), &pkt->p) != PARSE_OK)
		return PARSE_SKIP;
	pkt->p.frag_first = !!(frag_off & bpf_htons(IP6_FRAG_MF));
	return PARSE_OK;
}

/* ipv6_creates_state is frame_creates_state (parse.h) for IPv6: no
 * header checksum to check, so the L4 header's checks only (a first
 * fragment's payload holds only the start of what UDP's length counts). */
static __always_inline int ipv6_creates_state(const void *data, const void *data_end, const struct packet *pkt)
{
	return l4_creates_state(data, data_end, pkt, pkt->frag_first);
}

/* ip6_hop_limit_expires reports whether forwarding would take ip's hop
 * limit to 0. */
static __always_inline int ip6_hop_limit_expires(const struct ipv6hdr *ip)
{
	return ip->hop_limit <= 1;
}

#endif
