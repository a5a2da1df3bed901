/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Header parsing shared by every hook. Works on [data, data_end) only; the
 * tc entry makes sure the headers are in the linear area first. */
#ifndef TOPOLB_PARSE_H
#define TOPOLB_PARSE_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"
#include "csum.h"

/* IPv4 header length bounds: IHL counts 32-bit words, 5 to 15. TCP's data
 * offset counts the same words, at least 5. */
#define IP_WORD_LEN 4
#define IP_MIN_IHL 5
#define IP_MAX_HLEN 60
#define TCP_MIN_DOFF 5
/* The largest tot_len; tot_len 0 above it marks a BIG TCP GSO packet. */
#define IP_MAX_TOT_LEN 0xffff
/* Longest Ethernet + IPv4 (with options) + TCP header prefix we read. */
#define MAX_PARSE_LEN (ETH_HLEN + IP_MAX_HLEN + sizeof(struct tcphdr))
/* packet.l4_off is at most ETH_HLEN + IP_MAX_HLEN; masking with this
 * tells the verifier so before it is added to a packet pointer. */
#define L4_OFF_MASK 0x7f
_Static_assert(ETH_HLEN + IP_MAX_HLEN <= L4_OFF_MASK, "L4_OFF_MASK must cover every L4 offset");
/* The flag bits (enum TCP_F_*) in tcp_flag_word() after bpf_ntohl. */
#define TCP_FLAGS_SHIFT 16
/* TCP and UDP put their ports at the same offsets: the rewrite relies on
 * it. */
_Static_assert(__builtin_offsetof(struct tcphdr, source) == __builtin_offsetof(struct udphdr, source), "source port offsets");
_Static_assert(__builtin_offsetof(struct tcphdr, dest) == __builtin_offsetof(struct udphdr, dest), "destination port offsets");

enum parse_result {
	PARSE_OK = 0,       /* TCP or UDP, headers complete: unfragmented, or a datagram's first fragment */
	PARSE_SKIP = 1,     /* not ours: non-IPv4, other protocols */
	PARSE_FRAGMENT = 2, /* a later IPv4 fragment (no L4 header) or an ICMP one: addresses, proto, l4_off (the payload) and l3_len set, ports 0 (frag.h) */
	PARSE_ERROR = 3,    /* malformed IPv4/TCP/UDP: the kernel would drop it too */
	PARSE_ICMP = 4,     /* ICMP, unfragmented: addresses and l4_off set, ports 0 */
};

/* What the core needs to know about a packet. All addresses and ports in
 * network byte order, as on the wire. */
struct packet {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 tcp_flags; /* TCP_F_* bits; 0 for UDP */
	__u16 l4_off;   /* offset of the L4 header from the start of the frame */
	__u32 l3_len;   /* IPv4 total length, for byte counters */
};

/* parse_packet fills pkt from the frame. frame_len is the full frame length
 * (which can exceed data_end - data for non-linear skbs). */
static __always_inline int parse_packet(void *data, void *data_end, __u32 frame_len,
					struct packet *pkt)
{
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_HLEN;
	__u32 ihl_len, tot_len, l3_avail;

	if ((void *)(eth + 1) > data_end)
		return PARSE_SKIP; /* runt frame: not IPv4 as far as we can tell */
	if (eth->h_proto != bpf_htons(ETH_P_IPV4))
		return PARSE_SKIP;
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

	if (ip->protocol == IP_PROTO_TCP) {
		struct tcphdr *tcp = (void *)ip + ihl_len;

		if ((void *)(tcp + 1) > data_end || tot_len < ihl_len + sizeof(*tcp))
			return PARSE_ERROR;
		if (tcp->doff < TCP_MIN_DOFF)
			return PARSE_ERROR;
		pkt->sport = tcp->source;
		pkt->dport = tcp->dest;
		pkt->tcp_flags = bpf_ntohl(tcp_flag_word(tcp)) >> TCP_FLAGS_SHIFT;
		return PARSE_OK;
	}
	if (ip->protocol == IP_PROTO_UDP) {
		struct udphdr *udp = (void *)ip + ihl_len;

		if ((void *)(udp + 1) > data_end || tot_len < ihl_len + sizeof(*udp))
			return PARSE_ERROR;
		pkt->sport = udp->source;
		pkt->dport = udp->dest;
		return PARSE_OK;
	}
	if (ip->protocol == IP_PROTO_ICMP) {
		pkt->sport = 0;
		pkt->dport = 0;
		/* A fragmented ICMP message is no error we translate. */
		return ip->frag_off & bpf_htons(IP_MF) ? PARSE_FRAGMENT : PARSE_ICMP;
	}
	return PARSE_SKIP;
}

/* frame_creates_state reports whether the IPv4 packet in [data, data_end),
 * which parse_packet read into pkt (PARSE_OK), may create state: what the
 * receiving kernel would drop must not take a conntrack entry, a SNAT
 * port or a reject. It checks what parse_packet leaves out because the
 * hit path should not pay for it (up to 30 16-bit words of header sum):
 *   - the IPv4 header checksum (ip_rcv drops a packet that fails);
 *   - TCP: options (doff) reaching beyond the datagram (tcp_v4_rcv drops);
 *   - UDP: a length field below the header or beyond the IP payload
 *     (udp_rcv drops a "short packet"; shorter than the payload is
 *     padding, which it trims); a first fragment's payload is only the
 *     start of what the field counts.
 * A packet of an established flow that fails is translated all the same:
 * the incremental checksum update keeps a bad checksum bad, and the
 * receiver drops it. */
static __always_inline int frame_creates_state(const void *data, const void *data_end,
					       const struct packet *pkt)
{
	const struct iphdr *ip = data + ETH_HLEN;
	const __u16 *word = (const __u16 *)ip;
	__u32 words, l4_len, sum = 0;
	const void *l4;

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

	l4 = data + (pkt->l4_off & L4_OFF_MASK);
	l4_len = pkt->l3_len - (pkt->l4_off - ETH_HLEN);
	if (pkt->proto == IP_PROTO_TCP) {
		const struct tcphdr *tcp = l4;

		if ((void *)(tcp + 1) > data_end)
			return 0;
		return tcp->doff * IP_WORD_LEN <= l4_len;
	}
	if (pkt->proto == IP_PROTO_UDP) {
		const struct udphdr *udp = l4;
		__u32 udp_len;

		if ((void *)(udp + 1) > data_end)
			return 0;
		udp_len = bpf_ntohs(udp->len);
		/* A first fragment holds only the start of what the length
		 * counts. */
		return udp_len >= sizeof(*udp) && (udp_len <= l4_len || (ip->frag_off & bpf_htons(IP_MF)));
	}
	return 1;
}

#endif
