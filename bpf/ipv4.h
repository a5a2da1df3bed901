/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* What only IPv4 has: the header with its length, options and checksum,
 * the TTL, fragment offsets in the header. The L4 headers and the parsed
 * packet are packet.h's, shared by both families. */
#ifndef TOPOLB_IPV4_H
#define TOPOLB_IPV4_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"
#include "csum.h"
#include "packet.h"

/* IPv4 header length bounds: IHL counts 32-bit words, 5 to 15. */
#define IP_WORD_LEN 4
#define IP_MIN_IHL 5
#define IP_MAX_HLEN 60
/* The largest tot_len; tot_len 0 above it marks a BIG TCP GSO packet. */
#define IP_MAX_TOT_LEN 0xffff
_Static_assert(ETH_HLEN + IP_MAX_HLEN <= L4_OFF_MASK, "L4_OFF_MASK must cover every L4 offset");

/* parse_ipv4 fills pkt from the IPv4 frame in [data, data_end) (parse.h's
 * parse_packet checked the Ethernet header). frame_len is the full frame
 * length (which can exceed data_end - data for non-linear skbs). */
static __always_inline int parse_ipv4(void *data, void *data_end, __u32 frame_len, struct packet *pkt)
{
	struct iphdr *ip = data + ETH_HLEN;
	__u32 ihl_len, tot_len, l3_avail;

	if ((void *)(ip + 1) > data_end)
		return PARSE_ERROR;
	if (ip->version != 4 || ip->ihl < IP_MIN_IHL)
		return PARSE_ERROR;
	ihl_len = ip->ihl * IP_WORD_LEN;
	if ((void *)ip + ihl_len > data_end)
		return PARSE_ERROR;

	l3_avail = frame_len - ETH_HLEN;
	tot_len = bpf_ntohs(ip->tot_len);
	/* tot_len 0 is BIG TCP's marker for a >64KiB GSO packet. */
	if (tot_len == 0 && l3_avail > IP_MAX_TOT_LEN)
		tot_len = l3_avail;
	if (tot_len < ihl_len || tot_len > l3_avail)
		return PARSE_ERROR;

	pkt->saddr = ip->saddr;
	pkt->daddr = ip->daddr;
	pkt->proto = ip->protocol;
	pkt->tcp_flags = 0;
	pkt->l4_off = ETH_HLEN + ihl_len;
	pkt->l3_len = tot_len;
	/* A first fragment carries the L4 header and goes on as any packet;
	 * the later ones have none (frag.h). */
	if (ip->frag_off & bpf_htons(IP_OFFSET)) {
		pkt->sport = 0;
		pkt->dport = 0;
		return PARSE_FRAGMENT;
	}

	if (ip->protocol == IP_PROTO_TCP || ip->protocol == IP_PROTO_UDP)
		return parse_l4((void *)ip + ihl_len, data_end, tot_len - ihl_len, pkt);
	if (ip->protocol == IP_PROTO_ICMP) {
		pkt->sport = 0;
		pkt->dport = 0;
		/* A fragmented ICMP message is no error we translate. */
		return ip->frag_off & bpf_htons(IP_MF) ? PARSE_FRAGMENT : PARSE_ICMP;
	}
	return PARSE_SKIP;
}

/* ipv4_creates_state is frame_creates_state (parse.h) for IPv4: what the
 * hit path leaves out because it should not pay for it (up to 30 16-bit
 * words of header sum): the IPv4 header checksum (ip_rcv drops a packet
 * that fails), then the L4 header's checks (l4_creates_state). */
static __always_inline int ipv4_creates_state(const void *data, const void *data_end,
					      const struct packet *pkt)
{
	const struct iphdr *ip = data + ETH_HLEN;
	const __u16 *word = (const __u16 *)ip;
	__u32 words, sum = 0;

	if ((void *)(ip + 1) > data_end)
		return 0;
	/* The fixed header, which the bound above covers, then options. */
	for (__u32 i = 0; i < sizeof(*ip) / sizeof(*word); i++)
		sum += word[i];
	words = ip->ihl * IP_WORD_LEN / sizeof(*word);
	for (__u32 i = sizeof(*ip) / sizeof(*word); i < IP_MAX_HLEN / sizeof(*word); i++) {
		const __u16 *w = word + i;

		if (i >= words)
			break;
		/* Keep clang from folding the bound into one the verifier
		 * cannot follow. */
		asm volatile("" : "+r"(w));
		if ((void *)(w + 1) > data_end)
			return 0;
		sum += *w;
	}
	if (csum_fold32(sum) != 0xffff)
		return 0;

	return l4_creates_state(data, data_end, pkt, ip->frag_off & bpf_htons(IP_MF));
}

/* The 16-bit word of the IPv4 header that holds TTL (high byte on the
 * wire) and protocol, for the checksum update of a TTL decrement. */
#define IP_TTL_WORD_OFF offsetof(struct iphdr, ttl)
_Static_assert(__builtin_offsetof(struct iphdr, protocol) == __builtin_offsetof(struct iphdr, ttl) + 1, "ttl and protocol share a word");

/* ip_ttl_expires reports whether forwarding would take ip's TTL to 0. */
static __always_inline int ip_ttl_expires(const struct iphdr *ip)
{
	return ip->ttl <= 1;
}

/* ip_decrease_ttl decrements the TTL and updates the header checksum,
 * as the stack's ip_forward does. The header's sum is unchanged, so is
 * an skb's CHECKSUM_COMPLETE csum. */
static __always_inline void ip_decrease_ttl(struct iphdr *ip)
{
	__u16 *word = (void *)ip + IP_TTL_WORD_OFF;
	__u16 old = *word;

	ip->ttl--;
	ip->check = csum_replace2(ip->check, old, *word);
}

#endif
