/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Address translation of IPv6 packets on tc (pod veths and uplinks):
 * the packet's addresses after struct nat6 (nat.h, beside struct nat and
 * XDP's rewrite of both families), and its rewrite of an skb. IPv6 has
 * no header checksum; the L4 checksum covers a pseudo header with both
 * addresses (RFC 8200 8.1), so each rewritten address is one checksum
 * difference (bpf_csum_diff over its 16 bytes) handed to the csum
 * helper, which knows CHECKSUM_PARTIAL (nat.h). */
#ifndef TOPOLB_NAT6_H
#define TOPOLB_NAT6_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>

#include "ipv6.h"
#include "nat.h"
#include "structs.h"

/* nat6_new_src and nat6_new_dst are nat4_new_src and nat4_new_dst (nat.h)
 * of an IPv6 packet. */
static __always_inline const union tlb_addr *nat6_new_src(const struct packet *pkt, const struct nat *n)
{
	return n->flags & NAT_F_SRC ? &nat6_of(n)->saddr : &packet6_of(pkt)->saddr;
}

static __always_inline const union tlb_addr *nat6_new_dst(const struct packet *pkt, const struct nat *n)
{
	return n->flags & NAT_F_DST ? &nat6_of(n)->daddr : &packet6_of(pkt)->daddr;
}

/* nat6_skb_l4_csum updates the L4 checksum at csum_off for one address
 * (16 bytes, part of the pseudo header) and one port. */
static __always_inline int nat6_skb_l4_csum(struct __sk_buff *skb, __u32 csum_off, __u64 mangled0,
					    union tlb_addr *old_addr, union tlb_addr *new_addr,
					    __be16 old_port, __be16 new_port)
{
	__s64 diff = bpf_csum_diff(old_addr->v6, sizeof(*old_addr), new_addr->v6, sizeof(*new_addr), 0);

	if (diff < 0 || bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR | mangled0))
		return -1;
	return nat_skb_port_csum(skb, csum_off, mangled0, old_port, new_port);
}

/* nat6_rewrite_skb applies n (a struct nat6) to the IPv6 packet pkt (a
 * struct packet6): L4 checksum through the helpers, then the ports and
 * addresses written directly; a later fragment's addresses only
 * (NAT_F_L3). Returns 0 on success. */
static __always_inline int nat6_rewrite_skb(struct __sk_buff *skb, const struct packet *pkt, const struct nat *n)
{
	struct packet6 *p6 = (struct packet6 *)packet6_of(pkt);
	struct nat6 *n6 = nat6_of(n);
	__u32 l4_off = pkt->l4_off & L4_OFF_MASK;
	__u32 csum_off;
	__u64 mangled0;
	struct ipv6hdr *ip;

	if (n->flags & NAT_F_L3) {
		void *data = (void *)(long)skb->data;
		void *data_end = (void *)(long)skb->data_end;

		ip = data + ETH_HLEN;
		if ((void *)(ip + 1) > data_end)
			return -1;
		nat6_rewrite_ip(ip, n);
		return 0;
	}
	csum_off = nat_skb_csum_off(pkt, &mangled0);
	if ((n->flags & NAT_F_DST) &&
	    nat6_skb_l4_csum(skb, csum_off, mangled0, &p6->daddr, &n6->daddr, pkt->dport, n->dport))
		return -1;
	if ((n->flags & NAT_F_SRC) &&
	    nat6_skb_l4_csum(skb, csum_off, mangled0, &p6->saddr, &n6->saddr, pkt->sport, n->sport))
		return -1;

	ip = nat_skb_ports(skb, l4_off, sizeof(*ip), n);
	if (!ip)
		return -1;
	nat6_rewrite_ip(ip, n);
	return 0;
}

#endif
