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
 *        first 8 bytes (RFC 792), which is what the client's socket
 *        matches to report ECONNREFUSED.
 * Both come from the frontend's address and port and go back where the
 * packet came from (MACs swapped). The reply is built in a buffer from the
 * packet's headers; the hook puts it in place of the packet (tc:
 * bpf_skb_change_tail and bpf_skb_store_bytes, then a redirect into the
 * pod; XDP: resized at the head or tail and bpf_xdp_store_bytes, then
 * XDP_TX). Socket hooks refuse with ECONNREFUSED instead (sock_lb.c).
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

/* The reply as it is built: two bytes of padding put the IPv4 header on
 * a 4-byte boundary (the verifier wants aligned stack accesses); the frame
 * starts at eth. */
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
#define REJECT_FRAME_OFF __builtin_offsetof(struct reject_frame, eth)
#define REJECT_MAX_LEN (sizeof(struct reject_frame) - REJECT_FRAME_OFF)
_Static_assert(__builtin_offsetof(struct reject_frame, ip) % 4 == 0, "IPv4 header aligned");
_Static_assert(__builtin_offsetof(struct reject_frame, icmp) % 4 == 0, "ICMP header aligned");
_Static_assert(REJECT_MAX_LEN <= L4_OFF_MASK, "reply length fits its mask");
#define REJECT_LEN_MASK L4_OFF_MASK

/* Where a reply is built: per-CPU scratch space, not the stack, which the
 * hooks' new-flow paths have filled to the 512-byte limit. The verifier
 * bounds the reads of the frame (the checksum over its headers, the copy
 * into the packet) by the lengths' mask, not by the frame's size: room
 * for a masked length behind any byte of it. */
struct reject_room {
	__u8 room[sizeof(struct reject_frame) + REJECT_LEN_MASK + 1];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct reject_room);
} tlb_reject_scratch SEC(".maps");

/* reject_frame_get returns this CPU's reply frame, zeroed, or NULL (which
 * cannot happen: one slot per CPU). */
static __always_inline struct reject_frame *reject_frame_get(void)
{
	__u32 zero = 0;
	struct reject_room *r = bpf_map_lookup_elem(&tlb_reject_scratch, &zero);

	if (!r)
		return NULL;
	/* Map values are 8-byte aligned: so is the frame. */
	__builtin_memset(r->room, 0, sizeof(struct reject_frame));
	return (struct reject_frame *)r->room;
}

/* The TCP pseudo-header (RFC 9293 3.1). */
struct tcp_pseudo {
	__be32 saddr;
	__be32 daddr;
	__u8 zero;
	__u8 proto;
	__be16 len;
};

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

/* csum_buf returns the folded one's-complement sum of n bytes at buf
 * (n a multiple of 4, at most REJECT_MAX_LEN) added to seed, or -1. */
static __always_inline int csum_buf(void *buf, __u32 n, __u32 seed, __u32 *sum)
{
	__s64 s = bpf_csum_diff(0, 0, buf, n & REJECT_LEN_MASK, seed);

	if (s < 0)
		return -1;
	*sum = (__u32)s;
	return 0;
}

/* reject_headers fills the Ethernet and IPv4 headers of a reply to the
 * packet at data: back to its sender, from its destination. */
static __always_inline int reject_headers(void *data, void *data_end, struct reject_frame *f,
					  __u8 proto, __u16 l3_len)
{
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_HLEN;
	__u32 sum;

	if ((void *)(ip + 1) > data_end)
		return -1;
	__builtin_memcpy(f->eth.h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(f->eth.h_source, eth->h_dest, ETH_ALEN);
	f->eth.h_proto = bpf_htons(ETH_P_IPV4);
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

/* reject_tcp builds the reset for the TCP segment pkt. Returns the frame
 * length, or -1 when the segment is a reset (never answered) or its
 * header cannot be read. */
static __always_inline int reject_tcp(void *data, void *data_end, const struct packet *pkt,
				      struct reject_frame *f)
{
	struct tcphdr *in = data + (pkt->l4_off & L4_OFF_MASK);
	__u32 in_hlen = pkt->l4_off - ETH_HLEN;
	struct tcp_pseudo ph = {};
	__u32 seg_len, sum;

	if ((void *)(in + 1) > data_end || in->rst)
		return -1;
	if (reject_headers(data, data_end, f, IP_PROTO_TCP, sizeof(f->ip) + sizeof(f->tcp)))
		return -1;
	f->tcp.source = in->dest;
	f->tcp.dest = in->source;
	f->tcp.doff = TCP_WORDS_NO_OPTIONS;
	f->tcp.rst = 1;
	if (in->ack) {
		f->tcp.seq = in->ack_seq;
	} else {
		/* Acknowledge everything the segment occupies: its data, and
		 * SYN and FIN, one sequence number each. */
		seg_len = pkt->l3_len - in_hlen - in->doff * IP_WORD_LEN + in->syn + in->fin;
		f->tcp.ack_seq = bpf_htonl(bpf_ntohl(in->seq) + seg_len);
		f->tcp.ack = 1;
	}
	ph.saddr = f->ip.saddr;
	ph.daddr = f->ip.daddr;
	ph.proto = IP_PROTO_TCP;
	ph.len = bpf_htons(sizeof(f->tcp));
	if (csum_buf(&ph, sizeof(ph), 0, &sum) || csum_buf(&f->tcp, sizeof(f->tcp), sum, &sum))
		return -1;
	f->tcp.check = ~csum_fold32(sum);
	return ETH_HLEN + sizeof(f->ip) + sizeof(f->tcp);
}

/* reject_udp builds the ICMP port unreachable for the UDP datagram pkt.
 * Returns the frame length, or -1. */
static __always_inline int reject_udp(void *data, void *data_end, const struct packet *pkt,
				      struct reject_frame *f)
{
	__u32 quote_len = (pkt->l4_off - ETH_HLEN + ICMP_QUOTED_L4) & REJECT_LEN_MASK;
	__u32 icmp_len = sizeof(f->icmp) + quote_len;
	__u8 *from = data + ETH_HLEN;
	__u32 sum, i;

	if (quote_len > sizeof(f->quote) || (void *)from + quote_len > data_end)
		return -1;
	if (reject_headers(data, data_end, f, IP_PROTO_ICMP, sizeof(f->ip) + icmp_len))
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

/* reject_build builds the answer to pkt, a new flow to an empty reject
 * frontend, into f. Returns its length from f->eth, or -1 when there is
 * nothing to answer. */
static __always_inline int reject_build(void *data, void *data_end, const struct packet *pkt,
					struct reject_frame *f)
{
	if (pkt->proto == IP_PROTO_TCP)
		return reject_tcp(data, data_end, pkt, f);
	return reject_udp(data, data_end, pkt, f);
}

/* reject_prepare builds the answer to pkt and takes it from the budget.
 * Returns the frame length, or -1 with the packet counted: not answered
 * (a reset, STAT_DROP_NO_BACKEND) or over the limit (STAT_REJECT_LIMITED).
 * The hook counts STAT_REJECT once the answer is on its way. */
static __always_inline int reject_prepare(void *data, void *data_end, const struct packet *pkt,
					  struct reject_frame *f)
{
	int len = reject_build(data, data_end, pkt, f);

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

#endif
