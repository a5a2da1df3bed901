// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* tcx ingress on the host side of pod veths: pod -> frontend DNAT for
 * frontends of scope internal, and reverse NAT of replies from local
 * backends. Pods send CHECKSUM_PARTIAL packets, so L4 checksums are updated
 * with the skb csum helper, which knows the difference (BPF_F_PSEUDO_HDR). */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#define LB_SCOPE_DEFAULT SCOPE_INTERNAL
#include "lb.h"
#include "csum.h"

/* Not ours, or translated: hand the packet on. TC_ACT_UNSPEC is TCX_NEXT,
 * so tcx programs attached after this one (a CNI's, for example) still see
 * it; with none left the packet passes. */
#define TC_PASS TC_ACT_UNSPEC


/* tc_rewrite applies nat to the skb. The L4 checksum is updated with the
 * csum helper, which knows CHECKSUM_PARTIAL from a full checksum and keeps
 * skb->csum right; the IPv4 header checksum is always a full one, so it is
 * updated in place (csum.h), which keeps the header's sum, and so skb->csum,
 * unchanged. The new address and port are then written directly, which is
 * cheaper than bpf_skb_store_bytes. Returns 0 on success. */
static __always_inline int tc_rewrite(struct __sk_buff *skb, const struct packet *pkt,
				      const struct nat *nat)
{
	__u32 l4_off = pkt->l4_off & L4_OFF_MASK;
	__u32 l4_csum_off, mangled0 = 0;
	struct iphdr *ip;
	void *data, *data_end, *l4;
	__be16 *port;

	if (pkt->proto == IP_PROTO_TCP) {
		l4_csum_off = l4_off + offsetof(struct tcphdr, check);
	} else {
		l4_csum_off = l4_off + offsetof(struct udphdr, check);
		/* UDP checksum 0 means "none" and stays 0. */
		mangled0 = BPF_F_MARK_MANGLED_0;
	}

	if (bpf_l4_csum_replace(skb, l4_csum_off, nat->old_addr, nat->new_addr,
				BPF_F_PSEUDO_HDR | mangled0 | sizeof(nat->new_addr)))
		return -1;
	if (nat->old_port != nat->new_port &&
	    bpf_l4_csum_replace(skb, l4_csum_off, nat->old_port, nat->new_port,
				mangled0 | sizeof(nat->new_port)))
		return -1;

	/* The helpers invalidated packet pointers: reload and re-check. */
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	ip = data + ETH_HLEN;
	l4 = data + l4_off;
	if ((void *)(ip + 1) > data_end || l4 + sizeof(struct udphdr) > data_end)
		return -1;
	/* TCP and UDP ports sit at the same offsets (parse.h). */
	port = l4 + (nat->dst ? offsetof(struct udphdr, dest) : offsetof(struct udphdr, source));
	*port = nat->new_port;
	ip->check = csum_replace4(ip->check, nat->old_addr, nat->new_addr);
	if (nat->dst)
		ip->daddr = nat->new_addr;
	else
		ip->saddr = nat->new_addr;
	return 0;
}

SEC("tcx/ingress")
int tc_lb(struct __sk_buff *skb)
{
	struct packet pkt = {};
	struct nat nat = {};
	void *data, *data_end;
	int verdict;

	/* Headers of pod traffic are normally linear already. */
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	if (data + MAX_PARSE_LEN > data_end && skb->len > data_end - data) {
		bpf_skb_pull_data(skb, skb->len < MAX_PARSE_LEN ? skb->len : MAX_PARSE_LEN);
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
	}

	verdict = lb_classify(data, data_end, skb->len, &pkt, &nat);
	switch (verdict) {
	case LB_REWRITE:
		if (tc_rewrite(skb, &pkt, &nat)) {
			stat_inc(STAT_DROP_REWRITE);
			return TC_ACT_SHOT;
		}
		return TC_PASS;
	case LB_DROP:
		return TC_ACT_SHOT;
	default:
		return TC_PASS;
	}
}

char _license[] SEC("license") = "Dual BSD/GPL";
