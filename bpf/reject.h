/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Rejects: the answer to a new flow for a frontend without an active
 * backend that asks for it (SVC_F_REJECT: the Service has no usable
 * endpoint anywhere), so clients are refused at once instead of waiting
 * for their timeout, as kube-proxy's REJECT rules do. A frontend that is
 * empty by policy (traffic policy Local, topology keys) has no
 * SVC_F_REJECT and keeps dropping.
 *
 *   TCP: a reset (RFC 9293 3.10.7.1: to a segment with ACK, seq = its
 *        ack; otherwise RST+ACK acknowledging the segment), never to a
 *        reset;
 *   UDP: ICMP port unreachable quoting the datagram's IPv4 header and
 *        first 8 bytes (RFC 792); in IPv6, ICMPv6 destination
 *        unreachable, port unreachable (type 1 code 4), quoting as much
 *        of the datagram as fits in the minimum MTU (RFC 4443 2.4, 3.1).
 *        The quote is what the client's socket matches to report
 *        ECONNREFUSED.
 * Both come from the frontend's address and port and go back where the
 * packet came from (MACs swapped). The reply is built in a buffer from the
 * packet's headers; the hook puts it in place of the packet (tc:
 * bpf_skb_change_tail and bpf_skb_store_bytes, then a redirect into the
 * pod; XDP: resized at the head or tail and bpf_xdp_store_bytes, then
 * XDP_TX). Socket hooks refuse with ECONNREFUSED instead (sock_lb.c).
 * The families are twins over shared helpers: the Ethernet header, the
 * reset's segment, the pseudo-header's sum and the rate limit are
 * shared; each family fills its own IP header and quote (reject_* and
 * reject6_*). Only tc hooks answer IPv6 (ipv6.h), so the IPv6 quote is
 * read with bpf_skb_load_bytes: it may reach past the linear area.
 *
 * Rejects are rate-limited per hook and CPU (enum reject_limit), a
 * generic cell rate algorithm over reject_budget; over the limit a new
 * flow is dropped and counted as STAT_REJECT_LIMITED. */
#ifndef TOPOLB_REJECT_H
#define TOPOLB_REJECT_H

#include "lb.h"
#include "gcra.h"
#include "icmp.h"

#define IP_DEFAULT_TTL 64
#define IP_F_DF 0x4000 /* don't fragment, host byte order */
#define TCP_WORDS_NO_OPTIONS 5
#define REJECT_INTERVAL_NS (NSEC_PER_SEC / REJECT_RATE)

/* The reply as it is built: two bytes of padding put the IP header on
 * a 4-byte boundary (the verifier wants aligned stack accesses); the frame
 * starts at eth. reject_frame is IPv4's, reject6_frame IPv6's; both are
 * views of one per-CPU buffer (reject_room). */
struct reject_frame {
	__u8 pad[2];
	struct ethhdr eth;
	struct iphdr ip;
	union {
		struct tcphdr tcp;
		struct {
			struct icmp_hdr icmp;
			__u8 quote[IP_MAX_HLEN + ICMP_QUOTED_L4];
		};
	};
};

/* An ICMPv6 error quotes as much of the invoking packet as fits in the
 * minimum IPv6 MTU (RFC 4443 2.4 (c)). */
#define REJECT6_QUOTE_MAX (IP6_MIN_MTU - IP6_HLEN - ICMP_HLEN)

struct reject6_frame {
	__u8 pad[2];
	struct ethhdr eth;
	struct ipv6hdr ip6;
	union {
		struct tcphdr tcp;
		struct {
			struct icmp_hdr icmp;
			__u8 quote[REJECT6_QUOTE_MAX];
		};
	};
};
#define REJECT_FRAME_OFF __builtin_offsetof(struct reject_frame, eth)
#define REJECT_MAX_LEN (sizeof(struct reject_frame) - REJECT_FRAME_OFF)
#define REJECT6_MAX_LEN (sizeof(struct reject6_frame) - REJECT_FRAME_OFF)
/* What reject6_frame_get zeroes: the headers, the reset's included; the
 * quote is written whole (reject6_udp). */
#define REJECT6_HEAD_LEN (__builtin_offsetof(struct reject6_frame, tcp) + sizeof(struct tcphdr))
_Static_assert(__builtin_offsetof(struct reject_frame, ip) % 4 == 0, "IPv4 header aligned");
_Static_assert(__builtin_offsetof(struct reject_frame, icmp) % 4 == 0, "ICMP header aligned");
_Static_assert(__builtin_offsetof(struct reject6_frame, ip6) % 4 == 0, "IPv6 header aligned");
_Static_assert(__builtin_offsetof(struct reject6_frame, eth) == REJECT_FRAME_OFF, "both frames start at one offset");
_Static_assert(REJECT_MAX_LEN <= L4_OFF_MASK, "reply length fits its mask");
#define REJECT_LEN_MASK L4_OFF_MASK
/* IPv6 replies are longer (the quote): their lengths, and every length
 * csum_buf sums, are masked with this. */
#define REJECT6_LEN_MASK 0x7ff
_Static_assert(REJECT6_MAX_LEN <= REJECT6_LEN_MASK, "IPv6 reply length fits its mask");
_Static_assert(sizeof(struct reject6_frame) >= sizeof(struct reject_frame), "the IPv6 frame is the larger");

/* Where a reply is built: per-CPU scratch space, not the stack, which the
 * hooks' new-flow paths have filled to the 512-byte limit. The verifier
 * bounds the reads of the frame (the checksum over its headers, the copy
 * into the packet) by the lengths' mask, not by the frame's size: room
 * for a masked length behind any byte of it. */
struct reject_room {
	__u8 room[sizeof(struct reject6_frame) + REJECT6_LEN_MASK + 1];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct reject_room);
} tlb_reject_scratch SEC(".maps");

/* reject_room_get returns this CPU's reply buffer, or NULL (which cannot
 * happen: one slot per CPU). Map values are 8-byte aligned: so is the
 * frame. */
static __always_inline void *reject_room_get(void)
{
	__u32 zero = 0;
	struct reject_room *r = bpf_map_lookup_elem(&tlb_reject_scratch, &zero);

	return r ? r->room : NULL;
}

/* reject4_frame_get returns this CPU's IPv4 reply frame, zeroed, or NULL. */
static __always_inline struct reject_frame *reject4_frame_get(void)
{
	struct reject_frame *f = reject_room_get();

	if (f)
		__builtin_memset(f, 0, sizeof(*f));
	return f;
}

/* reject6_frame_get returns this CPU's IPv6 reply frame, its headers
 * zeroed, or NULL. */
static __always_inline struct reject6_frame *reject6_frame_get(void)
{
	struct reject6_frame *f = reject_room_get();

	if (f)
		__builtin_memset(f, 0, REJECT6_HEAD_LEN);
	return f;
}

/* reject_budget is the per-CPU state of the rate limit: the theoretical
 * arrival time of the next reject, CLOCK_MONOTONIC_COARSE ns. Each object
 * that rejects has its own (not pinned: a restart refills it). */
struct reject_budget_value {
	__u64 tat;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct reject_budget_value);
} reject_budget SEC(".maps");

/* reject_allowed takes one reject from this CPU's budget; 0 when it is
 * spent. */
static __always_inline int reject_allowed(void)
{
	__u32 zero = 0;
	struct reject_budget_value *b = bpf_map_lookup_elem(&reject_budget, &zero);

	if (!b)
		return 0;
	return gcra_take(&b->tat, compat_now(), REJECT_INTERVAL_NS, REJECT_BURST);
}

/* bpf_csum_diff sums at most this many bytes a call (before Linux 6.12:
 * its scratch buffer). */
#define CSUM_DIFF_MAX 512
#define CSUM_BUF_CHUNKS ((REJECT6_LEN_MASK + 1) / CSUM_DIFF_MAX)

/* csum_buf returns the one's-complement sum of n bytes at buf (n a
 * multiple of 4, at most REJECT6_LEN_MASK) added to seed, or -1. */
static __always_inline int csum_buf(void *buf, __u32 n, __u32 seed, __u32 *sum)
{
	__s64 s = seed;

	for (__u32 i = 0; i < CSUM_BUF_CHUNKS; i++) {
		__u32 off = i * CSUM_DIFF_MAX, len;

		if (off >= n)
			break;
		len = n - off < CSUM_DIFF_MAX ? n - off : CSUM_DIFF_MAX;
		s = bpf_csum_diff(0, 0, buf + off, len & REJECT6_LEN_MASK, (__u32)s);
		if (s < 0)
			return -1;
	}
	*sum = (__u32)s;
	return 0;
}

/* csum_pseudo returns in sum the sum of the pseudo-header of an L4
 * message of len bytes and protocol proto (RFC 9293 3.1, RFC 8200 8.1):
 * the source and destination addresses, which both IP headers hold side
 * by side at addrs (addrs_len bytes), the length and the protocol. */
static __always_inline int csum_pseudo(void *addrs, __u32 addrs_len, __u8 proto, __u16 len, __u32 *sum)
{
	return csum_buf(addrs, addrs_len, bpf_htons(proto) + bpf_htons(len), sum);
}

/* reject_eth fills the Ethernet header of a reply to the frame at data:
 * back to its sender. */
static __always_inline int reject_eth(void *data, void *data_end, struct ethhdr *out, __u16 proto)
{
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return -1;
	__builtin_memcpy(out->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(out->h_source, eth->h_dest, ETH_ALEN);
	out->h_proto = bpf_htons(proto);
	return 0;
}

/* reject4_headers fills the Ethernet and IPv4 headers of a reply to the
 * packet at data: back to its sender, from its destination. */
static __always_inline int reject4_headers(void *data, void *data_end, struct reject_frame *f,
					  __u8 proto, __u16 l3_len)
{
	struct iphdr *ip = data + ETH_HLEN;
	__u32 sum;

	if ((void *)(ip + 1) > data_end || reject_eth(data, data_end, &f->eth, ETH_P_IPV4))
		return -1;
	f->ip.version = 4;
	f->ip.ihl = IP_MIN_IHL;
	f->ip.tot_len = bpf_htons(l3_len);
	f->ip.ttl = IP_DEFAULT_TTL;
	f->ip.protocol = proto;
	f->ip.saddr = ip->daddr;
	f->ip.daddr = ip->saddr;
	if (proto == IP_PROTO_TCP)
		f->ip.frag_off = bpf_htons(IP_F_DF);
	if (csum_buf(&f->ip, sizeof(f->ip), 0, &sum))
		return -1;
	f->ip.check = ~csum_fold32(sum);
	return 0;
}

/* reject6_headers fills the Ethernet and IPv6 headers of a reply to the
 * packet at data, with a payload of payload bytes of protocol proto. */
static __always_inline int reject6_headers(void *data, void *data_end, struct reject6_frame *f,
					   __u8 proto, __u16 payload)
{
	struct ipv6hdr *ip6 = data + ETH_HLEN;

	if ((void *)(ip6 + 1) > data_end || reject_eth(data, data_end, &f->eth, ETH_P_IPV6))
		return -1;
	f->ip6.version = 6;
	f->ip6.payload_len = bpf_htons(payload);
	f->ip6.nexthdr = proto;
	f->ip6.hop_limit = IP_DEFAULT_TTL;
	__builtin_memcpy(&f->ip6.saddr, &ip6->daddr, sizeof(f->ip6.saddr));
	__builtin_memcpy(&f->ip6.daddr, &ip6->saddr, sizeof(f->ip6.daddr));
	return 0;
}

/* reject_segment fills out, the reset for the TCP segment pkt, whose
 * reply's addresses are at addrs (addrs_len bytes, as csum_pseudo takes
 * them). Returns -1 when the segment is a reset (never answered) or its
 * header cannot be read. */
static __always_inline int reject_segment(void *data, void *data_end, const struct packet *pkt, void *addrs,
					  __u32 addrs_len, struct tcphdr *out)
{
	struct tcphdr *in = data + (pkt->l4_off & L4_OFF_MASK);
	__u32 in_hlen = pkt->l4_off - ETH_HLEN;
	__u32 seg_len, sum;

	if ((void *)(in + 1) > data_end || in->rst)
		return -1;
	out->source = in->dest;
	out->dest = in->source;
	out->doff = TCP_WORDS_NO_OPTIONS;
	out->rst = 1;
	if (in->ack) {
		out->seq = in->ack_seq;
	} else {
		/* Acknowledge everything the segment occupies: its data, and
		 * SYN and FIN, one sequence number each. */
		seg_len = pkt->l3_len - in_hlen - in->doff * IP_WORD_LEN + in->syn + in->fin;
		out->ack_seq = bpf_htonl(bpf_ntohl(in->seq) + seg_len);
		out->ack = 1;
	}
	if (csum_pseudo(addrs, addrs_len, IP_PROTO_TCP, sizeof(*out), &sum) || csum_buf(out, sizeof(*out), sum, &sum))
		return -1;
	out->check = ~csum_fold32(sum);
	return 0;
}

/* reject4_tcp builds the reset for the TCP segment pkt. Returns the frame
 * length, or -1 (reject_segment). */
static __always_inline int reject4_tcp(void *data, void *data_end, const struct packet *pkt,
				      struct reject_frame *f)
{
	if (reject4_headers(data, data_end, f, IP_PROTO_TCP, sizeof(f->ip) + sizeof(f->tcp)) ||
	    reject_segment(data, data_end, pkt, &f->ip.saddr, 2 * sizeof(f->ip.saddr), &f->tcp))
		return -1;
	return ETH_HLEN + sizeof(f->ip) + sizeof(f->tcp);
}

/* reject6_tcp is reject4_tcp for IPv6. */
static __always_inline int reject6_tcp(void *data, void *data_end, const struct packet *pkt,
				       struct reject6_frame *f)
{
	if (reject6_headers(data, data_end, f, IP_PROTO_TCP, sizeof(f->tcp)) ||
	    reject_segment(data, data_end, pkt, &f->ip6.saddr, 2 * sizeof(f->ip6.saddr), &f->tcp))
		return -1;
	return ETH_HLEN + sizeof(f->ip6) + sizeof(f->tcp);
}

/* reject4_udp builds the ICMP port unreachable for the UDP datagram pkt.
 * Returns the frame length, or -1. */
static __always_inline int reject4_udp(void *data, void *data_end, const struct packet *pkt,
				      struct reject_frame *f)
{
	__u32 quote_len = (pkt->l4_off - ETH_HLEN + ICMP_QUOTED_L4) & REJECT_LEN_MASK;
	__u32 icmp_len = sizeof(f->icmp) + quote_len;
	__u8 *from = data + ETH_HLEN;
	__u32 sum, i;

	if (quote_len > sizeof(f->quote) || (void *)from + quote_len > data_end)
		return -1;
	if (reject4_headers(data, data_end, f, IP_PROTO_ICMP, sizeof(f->ip) + icmp_len))
		return -1;
	/* The quote is the datagram's IPv4 header and first 8 bytes, as the
	 * client sent them. */
	for (i = 0; i < sizeof(f->quote); i++) {
		if (i >= quote_len || (void *)(from + i + 1) > data_end)
			break;
		f->quote[i] = from[i];
	}
	f->icmp.type = ICMP_DEST_UNREACH;
	f->icmp.code = ICMP_PORT_UNREACH;
	if (csum_buf(&f->icmp, icmp_len, 0, &sum))
		return -1;
	f->icmp.checksum = ~csum_fold32(sum);
	return ETH_HLEN + sizeof(f->ip) + icmp_len;
}

/* reject6_udp builds the ICMPv6 port unreachable for the UDP datagram
 * pkt of skb: the quote is the datagram as the client sent it, up to
 * REJECT6_QUOTE_MAX bytes, and the checksum covers the pseudo-header
 * (RFC 4443 2.3). Returns the frame length, or -1. */
static __always_inline int reject6_udp(struct __sk_buff *skb, void *data, void *data_end,
				       const struct packet *pkt, struct reject6_frame *f)
{
	__u32 quote_len = pkt->l3_len < REJECT6_QUOTE_MAX ? pkt->l3_len : REJECT6_QUOTE_MAX;
	__u32 icmp_len, sum, rest;

	quote_len &= REJECT6_LEN_MASK;
	if (quote_len < IP6_HLEN + ICMP_QUOTED_L4 || quote_len > sizeof(f->quote))
		return -1;
	icmp_len = sizeof(f->icmp) + quote_len;
	/* The length bpf_skb_load_bytes takes is the minimum plus the rest,
	 * masked, computed from an opaque copy: clang spills quote_len
	 * before its lower bound is tested, and 5.10's verifier does not
	 * carry that test to the spilled copy, so it would see a length
	 * that may be 0, which the helper's size argument refuses ("R3 min
	 * value is outside of the allowed memory range"). */
	rest = quote_len - (IP6_HLEN + ICMP_QUOTED_L4);
	asm volatile("" : "+r"(rest));
	if (reject6_headers(data, data_end, f, IP6_PROTO_ICMPV6, icmp_len) ||
	    bpf_skb_load_bytes(skb, ETH_HLEN, f->quote, IP6_HLEN + ICMP_QUOTED_L4 + (rest & REJECT6_LEN_MASK)))
		return -1;
	/* csum_buf sums whole words: the bytes after an odd quote count as
	 * zero padding (the buffer is reused). */
	f->quote[quote_len] = 0;
	f->quote[quote_len + 1] = 0;
	f->quote[quote_len + 2] = 0;
	f->icmp.type = ICMP6_DEST_UNREACH;
	f->icmp.code = ICMP6_PORT_UNREACH;
	if (csum_pseudo(&f->ip6.saddr, 2 * sizeof(f->ip6.saddr), IP6_PROTO_ICMPV6, icmp_len, &sum) ||
	    csum_buf(&f->icmp, (icmp_len + 3) & ~3U, sum, &sum))
		return -1;
	f->icmp.checksum = ~csum_fold32(sum);
	return ETH_HLEN + sizeof(f->ip6) + icmp_len;
}

/* reject_take counts the answer of length len (-1: none) and takes it
 * from the budget. Returns len, or -1 with the packet counted: not
 * answered (a reset, STAT_DROP_NO_BACKEND) or over the limit
 * (STAT_REJECT_LIMITED). The hook counts STAT_REJECT once the answer is
 * on its way. */
static __always_inline int reject_take(int len)
{
	if (len < 0) {
		stat_inc(STAT_DROP_NO_BACKEND);
		return -1;
	}
	if (!reject_allowed()) {
		stat_inc(STAT_REJECT_LIMITED);
		return -1;
	}
	return len;
}

/* reject4_prepare builds the answer to pkt, a new IPv4 flow to an empty
 * reject frontend, into f and takes it from the budget (reject_take). */
static __always_inline int reject4_prepare(void *data, void *data_end, const struct packet *pkt,
					  struct reject_frame *f)
{
	if (pkt->proto == IP_PROTO_TCP)
		return reject_take(reject4_tcp(data, data_end, pkt, f));
	return reject_take(reject4_udp(data, data_end, pkt, f));
}

/* reject6_prepare is reject4_prepare for an IPv6 packet of skb. */
static __always_inline int reject6_prepare(struct __sk_buff *skb, void *data, void *data_end,
					   const struct packet *pkt, struct reject6_frame *f)
{
	if (pkt->proto == IP_PROTO_TCP)
		return reject_take(reject6_tcp(data, data_end, pkt, f));
	return reject_take(reject6_udp(skb, data, data_end, pkt, f));
}

#endif
