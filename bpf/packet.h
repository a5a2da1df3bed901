/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The parsed packet the core works on, and the L4 headers (TCP, UDP)
 * every IP family carries the same way. */
#ifndef TOPOLB_PACKET_H
#define TOPOLB_PACKET_H

#include <linux/bpf.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"

/* TCP's data offset counts 32-bit words, at least 5. */
#define TCP_WORD_LEN 4
#define TCP_MIN_DOFF 5
/* The flag bits (enum TCP_F_*) in tcp_flag_word() after bpf_ntohl. */
#define TCP_FLAGS_SHIFT 16
/* packet.l4_off is at most ETH_HLEN + IP_MAX_HLEN (ipv4.h); masking with
 * this tells the verifier so before it is added to a packet pointer. */
#define L4_OFF_MASK 0x7f
/* TCP and UDP put their ports at the same offsets: the rewrite relies on
 * it. */
_Static_assert(__builtin_offsetof(struct tcphdr, source) == __builtin_offsetof(struct udphdr, source), "source port offsets");
_Static_assert(__builtin_offsetof(struct tcphdr, dest) == __builtin_offsetof(struct udphdr, dest), "destination port offsets");

enum parse_result {
	PARSE_OK = 0,       /* TCP or UDP, headers complete: unfragmented, or a datagram's first fragment */
	PARSE_SKIP = 1,     /* not ours: families and protocols we do not parse, IPv6 extension chains longer than the walk (ipv6.h) */
	PARSE_FRAGMENT = 2, /* a later fragment (no L4 header) or an ICMP one, of either family: addresses, proto, l4_off (the payload) and l3_len set, ports 0 (frag.h) */
	PARSE_ERROR = 3,    /* malformed IPv4/TCP/UDP: the kernel would drop it too */
	PARSE_ICMP = 4,     /* ICMP, unfragmented, or ICMPv6: addresses and l4_off set, ports 0 */
	PARSE_CHAIN = 5,    /* IPv6 whose extension chain is longer than the walk, or leaves the frame: nothing set (lb.h looks further for a frontend) */
};

/* packet.family. IPv4 is 0, so a zeroed packet (every hook starts from
 * one) is an IPv4 packet without a store on IPv4's path. */
enum pkt_family {
	PKT_IPV4 = 0,
	PKT_IPV6 = 1, /* the addresses are in the packet6 (ipv6.h) this packet heads */
};

/* What the core needs to know about a packet. All addresses and ports in
 * network byte order, as on the wire. The addresses are IPv4's; an IPv6
 * packet's are in the struct packet6 (ipv6.h) that holds this one first,
 * so every family-neutral helper (ports, protocol, TCP state, lengths)
 * takes a struct packet whatever the family. */
struct packet {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 tcp_flags; /* TCP_F_* bits; 0 for UDP */
	__u16 l4_off;   /* offset of the L4 header from the start of the frame */
	__u32 l3_len;   /* IPv4 total length, IPv6 header plus payload length: for byte counters */
	__u8 family;    /* enum pkt_family */
	__u8 frag_first; /* IPv6: a datagram's first fragment (offset 0, M set), its fragment header just before l4_off (frag.h) */
	/* TCP only, host byte order (conntrack's window check,
	 * conntrack.h): the sequence number, the acknowledgement number,
	 * and the sequence number after the segment (its payload, and one
	 * each for SYN and FIN). */
	__u32 tcp_seq;
	__u32 tcp_ack;
	__u32 tcp_end;
};

/* parse_l4 reads the TCP or UDP header at l4 (pkt->proto says which) into
 * pkt, a TCP header's sequence numbers included. l4_len is the IP payload's length. Returns PARSE_OK, PARSE_ERROR
 * for a header cut short, PARSE_SKIP for other protocols. */
static __always_inline int parse_l4(const void *l4, const void *data_end, __u32 l4_len, struct packet *pkt)
{
	if (pkt->proto == IP_PROTO_TCP) {
		const struct tcphdr *tcp = l4;
		__u32 hdr_len;

		if ((void *)(tcp + 1) > data_end || l4_len < sizeof(*tcp))
			return PARSE_ERROR;
		if (tcp->doff < TCP_MIN_DOFF)
			return PARSE_ERROR;
		pkt->sport = tcp->source;
		pkt->dport = tcp->dest;
		pkt->tcp_flags = bpf_ntohl(tcp_flag_word(tcp)) >> TCP_FLAGS_SHIFT;
		pkt->tcp_seq = bpf_ntohl(tcp->seq);
		pkt->tcp_ack = bpf_ntohl(tcp->ack_seq);
		/* Options reaching beyond the datagram leave no payload (the
		 * receiver drops such a segment; it creates no flow). */
		hdr_len = tcp->doff * TCP_WORD_LEN;
		pkt->tcp_end = pkt->tcp_seq + (l4_len > hdr_len ? l4_len - hdr_len : 0) +
			       !!(pkt->tcp_flags & TCP_F_SYN) + !!(pkt->tcp_flags & TCP_F_FIN);
		return PARSE_OK;
	}
	if (pkt->proto == IP_PROTO_UDP) {
		const struct udphdr *udp = l4;

		if ((void *)(udp + 1) > data_end || l4_len < sizeof(*udp))
			return PARSE_ERROR;
		pkt->sport = udp->source;
		pkt->dport = udp->dest;
		return PARSE_OK;
	}
	return PARSE_SKIP;
}

/* l4_creates_state is frame_creates_state's (parse.h) L4 part, for the
 * TCP or UDP header pkt->l4_off points at:
 *   - TCP: options (doff) reaching beyond the datagram (the receiver
 *     drops);
 *   - UDP: a length field below the header or beyond the IP payload
 *     (udp_rcv drops a "short packet"; shorter than the payload is
 *     padding, which it trims); a first fragment's payload (more_frags)
 *     is only the start of what the field counts. */
static __always_inline int l4_creates_state(const void *data, const void *data_end, const struct packet *pkt,
					    int more_frags)
{
	__u32 l4_len;
	const void *l4;

	l4 = data + (pkt->l4_off & L4_OFF_MASK);
	l4_len = pkt->l3_len - (pkt->l4_off - ETH_HLEN);
	if (pkt->proto == IP_PROTO_TCP) {
		const struct tcphdr *tcp = l4;

		if ((void *)(tcp + 1) > data_end)
			return 0;
		return tcp->doff * TCP_WORD_LEN <= l4_len;
	}
	if (pkt->proto == IP_PROTO_UDP) {
		const struct udphdr *udp = l4;
		__u32 udp_len;

		if ((void *)(udp + 1) > data_end)
			return 0;
		udp_len = bpf_ntohs(udp->len);
		/* A first fragment holds only the start of what the length
		 * counts. */
		return udp_len >= sizeof(*udp) && (udp_len <= l4_len || more_frags);
	}
	return 1;
}

#endif
