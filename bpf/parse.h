/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Header parsing shared by every hook: the Ethernet header here, the IP
 * family's header in its own file (ipv4.h), the L4 headers in packet.h.
 * Works on [data, data_end) only; the tc entry makes sure the headers are
 * in the linear area first. */
#ifndef TOPOLB_PARSE_H
#define TOPOLB_PARSE_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"
#include "ipv4.h"
#include "ipv6.h"
#include "packet.h"

/* Longest Ethernet + IPv4 (with options) + TCP header prefix we read. */
#define MAX_PARSE_LEN (ETH_HLEN + IP_MAX_HLEN + sizeof(struct tcphdr))

/* parse_packet fills pkt from the frame. frame_len is the full frame length
 * (which can exceed data_end - data for non-linear skbs). */
static __always_inline int parse_packet(void *data, void *data_end, __u32 frame_len,
					struct packet *pkt)
{
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return PARSE_SKIP; /* runt frame: not IPv4 as far as we can tell */
	if (eth->h_proto != bpf_htons(ETH_P_IPV4))
		return PARSE_SKIP;
	return parse_ipv4(data, data_end, frame_len, pkt);
}

/* frame_creates_state reports whether the packet in [data, data_end),
 * which parse_packet read into pkt (PARSE_OK), may create state: what the
 * receiving kernel would drop must not take a conntrack entry, a SNAT
 * port or a reject. It checks what parse_packet leaves out because the
 * hit path should not pay for it (ipv4_creates_state, l4_creates_state).
 * fam (enum pkt_family) is the family's, a constant of the caller.
 * A packet of an established flow that fails is translated all the same:
 * the incremental checksum update keeps a bad checksum bad, and the
 * receiver drops it. */
static __always_inline int frame_creates_state(int fam, const void *data, const void *data_end,
					       const struct packet *pkt)
{
	if (fam == PKT_IPV6)
		return ipv6_creates_state(data, data_end, pkt);
	return ipv4_creates_state(data, data_end, pkt);
}

#endif
