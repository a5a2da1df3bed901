// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* tcx on the host side of pod veths.
 *   tc_lb, ingress (from the pod): pod -> frontend DNAT for frontends of
 *     scope internal, reverse NAT of replies from local backends, ICMP
 *     errors from pods about translated flows (icmp.h), and rejects for
 *     empty reject frontends (reject.h), sent back into the pod.
 *   tc_lb_egress, egress (to the pod): ICMP errors the node's own stack
 *     sends to a pod about a translated flow, for example "fragmentation
 *     needed" when it forwards a too-big packet that tc_lb translated.
 * Pods send CHECKSUM_PARTIAL packets, so L4 checksums are updated with the
 * skb csum helper, which knows the difference (BPF_F_PSEUDO_HDR). */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#define LB_SCOPE_DEFAULT SCOPE_INTERNAL
#include "lb.h"
#include "csum.h"
#include "icmp.h"
#include "reject.h"

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

/* tc_pull makes the first len bytes of the frame linear, where it has
 * them, so packet pointers reach them. */
static __always_inline void tc_pull(struct __sk_buff *skb, __u32 len)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;

	if (data + len > data_end && skb->len > data_end - data)
		bpf_skb_pull_data(skb, skb->len < len ? skb->len : len);
}

/* tc_icmp translates an ICMP error about a translated flow (icmp.h). ICMP
 * always passes: an error about a flow we do not know is not ours. */
static __always_inline int tc_icmp(struct __sk_buff *skb, const struct packet *pkt)
{
	tc_pull(skb, ICMP_PARSE_LEN);
	icmp_xlate((void *)(long)skb->data, (void *)(long)skb->data_end, pkt);
	return TC_PASS;
}

/* tc_reject answers pkt, from a pod to an empty reject frontend, in place:
 * the reply replaces the packet and goes straight into the pod
 * (bpf_redirect_peer). Not out of the veth: the packet may be
 * CHECKSUM_PARTIAL, and a device without checksum offload would then
 * "complete" the full checksum the reply already carries; delivered to the
 * pod, CHECKSUM_PARTIAL is trusted, and a full checksum is right for any
 * other state. */
static __always_inline int tc_reject(struct __sk_buff *skb, const struct packet *pkt)
{
	struct reject_frame f = {};
	int len;

	len = reject_prepare((void *)(long)skb->data, (void *)(long)skb->data_end, pkt, &f);
	if (len < 0)
		return TC_ACT_SHOT;
	len &= REJECT_LEN_MASK;
	if (len > REJECT_MAX_LEN || bpf_skb_change_tail(skb, len, 0) ||
	    bpf_skb_store_bytes(skb, 0, (void *)&f + REJECT_FRAME_OFF, len, 0)) {
		stat_inc(STAT_DROP_REWRITE);
		return TC_ACT_SHOT;
	}
	stat_inc(STAT_REJECT);
	return bpf_redirect_peer(skb->ifindex, 0);
}

SEC("tcx/ingress")
int tc_lb(struct __sk_buff *skb)
{
	struct packet pkt = {};
	struct nat nat = {};
	void *data, *data_end;
	int verdict;

	/* Headers of pod traffic are normally linear already. */
	tc_pull(skb, MAX_PARSE_LEN);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;

	verdict = lb_classify(data, data_end, skb->len, &pkt, &nat);
	switch (verdict) {
	case LB_REWRITE:
		if (tc_rewrite(skb, &pkt, &nat)) {
			stat_inc(STAT_DROP_REWRITE);
			return TC_ACT_SHOT;
		}
		return TC_PASS;
	case LB_ICMP:
		return tc_icmp(skb, &pkt);
	case LB_REJECT:
		return tc_reject(skb, &pkt);
	case LB_DROP:
		return TC_ACT_SHOT;
	default:
		return TC_PASS;
	}
}

SEC("tcx/egress")
int tc_lb_egress(struct __sk_buff *skb)
{
	struct packet pkt = {};

	if (parse_packet((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, &pkt) != PARSE_ICMP)
		return TC_PASS;
	return tc_icmp(skb, &pkt);
}

char _license[] SEC("license") = "Dual BSD/GPL";
