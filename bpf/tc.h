/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The tc (skb) half of every hook that balances at a tcx ingress: tc_lb
 * on pod veths (scope internal) and tc_uplink_lb on uplinks where XDP
 * cannot transmit (scope external). One path for both: the core (lb.h),
 * the rewrite with the skb checksum helpers, which know CHECKSUM_PARTIAL
 * (nat.h), and forwarding with bpf_redirect, bpf_redirect_neigh and
 * bpf_redirect_peer (fwd.h). The entry file defines LB_SCOPE_DEFAULT
 * before including this header; only the reject's way out differs by
 * scope (tc_reject). */
#ifndef TOPOLB_TC_H
#define TOPOLB_TC_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

/* Every program here reads an skb (lb.h's new-flow checks read the frame). */
#define LB_FRAME struct __sk_buff
#include "lb.h"
#include "fwd.h"
#include "icmp.h"
#include "nat.h"
#include "nat6.h"
#include "reject.h"

/* tc_pull makes the first len bytes of the frame linear, where it has
 * them, so packet pointers reach them. */
static __always_inline void tc_pull(struct __sk_buff *skb, __u32 len)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;

	if (data + len > data_end && skb->len > data_end - data)
		bpf_skb_pull_data(skb, skb->len < len ? skb->len : len);
}

/* tc_tagged reports whether skb carries a VLAN tag. The kernel keeps an
 * skb's outer tag out of the frame: skb_vlan_untag takes it off before tc
 * ingress, and a VLAN device (or bpf_skb_vlan_push) hands its tag down
 * that way on egress, so the frame looks untagged. Such a packet belongs
 * to a VLAN topolb does not serve: it passes untouched, as a frame with
 * a tag still in it (an inner one) does, whose EtherType the parser does
 * not take. */
static __always_inline int tc_tagged(const struct __sk_buff *skb)
{
	return skb->vlan_present;
}

/* tc_icmp translates an ICMP or ICMPv6 error (fam, a constant) about a
 * translated flow (icmp.h). ICMP passes but for an error about a flow
 * that arrived where that flow's packets do not come from (dropped): an
 * error about a flow we do not know is not ours, nor are informational
 * messages. */
static __always_inline int tc_icmp(int fam, struct __sk_buff *skb, const struct packet *pkt)
{
	int ret;

	if (fam == PKT_IPV6) {
		tc_pull(skb, ICMP6_PARSE_LEN);
		ret = icmp6_xlate((void *)(long)skb->data, (void *)(long)skb->data_end, pkt, skb->ingress_ifindex);
	} else {
		tc_pull(skb, ICMP_PARSE_LEN);
		ret = icmp4_xlate((void *)(long)skb->data, (void *)(long)skb->data_end, pkt, skb->ingress_ifindex);
	}
	return ret == LB_DROP ? TC_ACT_SHOT : TC_PASS;
}

/* tc_reject answers pkt, of family fam (a constant), to an empty reject
 * frontend, in place, and sends the reply back where pkt came from.
 *   From a pod (scope internal): straight into the pod
 *     (bpf_redirect_peer). Not out of the veth: the packet may be
 *     CHECKSUM_PARTIAL, and a device without checksum offload would then
 *     "complete" the full checksum the reply already carries; delivered
 *     to the pod, CHECKSUM_PARTIAL is trusted, and a full checksum is
 *     right for any other state.
 *   From the wire (scope external): back out of the uplink (bpf_redirect
 *     to its egress), as XDP's XDP_TX. A NIC's frames are never
 *     CHECKSUM_PARTIAL; a veth uplink's are when a process on its peer's
 *     side sent them with offload on, and the reply is then trusted by
 *     the peer's stack, which is where such a sender is. */
static __always_inline int tc_reject(int fam, struct __sk_buff *skb, const struct packet *pkt)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	void *f;
	int len;
	__u32 rest;

	if (fam == PKT_IPV6) {
		f = reject6_frame_get();
		if (!f)
			return TC_ACT_SHOT;
		len = reject6_prepare(skb, data, data_end, pkt, f);
	} else {
		f = reject4_frame_get();
		if (!f)
			return TC_ACT_SHOT;
		len = reject4_prepare(data, data_end, pkt, f);
	}
	if (len < ETH_HLEN || len > REJECT6_MAX_LEN)
		return TC_ACT_SHOT;
	/* The length is handed to bpf_skb_store_bytes as the Ethernet header
	 * plus a masked, opaque rest: clang may spill len before its lower
	 * bound is tested, and 5.10's verifier does not carry the test to
	 * the spilled copy, so it would see a length that may be 0 (as in
	 * reject6_udp). */
	rest = len - ETH_HLEN;
	asm volatile("" : "+r"(rest));
	len = ETH_HLEN + (rest & REJECT6_LEN_MASK);
	if (bpf_skb_change_tail(skb, len, 0) || bpf_skb_store_bytes(skb, 0, f + REJECT_FRAME_OFF, len, 0)) {
		stat_inc(STAT_DROP_REWRITE);
		return TC_ACT_SHOT;
	}
	stat_inc(STAT_REJECT);
	if (cfg_scope == SCOPE_EXTERNAL)
		return bpf_redirect(skb->ifindex, 0);
	return bpf_redirect_peer(skb->ifindex, 0);
}

/* tc_balance6 is tc_balance4 for an IPv6 frame (skb->protocol): parse,
 * decide (lb.h, with the IPv6 conntrack), rewrite (nat6.h) and forward
 * (fwd.h), as IPv4 is. A new flow to an empty reject frontend is answered
 * as in IPv4 (reject.h: a TCP reset, ICMPv6 port unreachable), and an
 * ICMPv6 error about a translated flow is translated (icmp.h). Only an
 * entry that translates IPv6 calls it, each from its own subprogram
 * (tc_lb6).
 */
static __always_inline int tc_balance6(struct __sk_buff *skb)
{
	struct packet6 pkt = {};
	struct nat6 nat = {};
	void *data, *data_end;

	if (tc_tagged(skb))
		return TC_PASS;
	tc_pull(skb, MAX_PARSE6_LEN);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	switch (lb6_classify(skb, skb->ingress_ifindex, data, data_end, skb->len, &pkt, &nat)) {
	case LB_REWRITE:
		if (nat6_rewrite_skb(skb, &pkt.p, &nat.n)) {
			stat_inc(STAT_DROP_REWRITE);
			return TC_ACT_SHOT;
		}
		fwd_refresh6(skb, skb->ingress_ifindex, nat6_new_src(&pkt.p, &nat.n), nat6_new_dst(&pkt.p, &nat.n),
			     pkt.p.proto, nat.n.no_stack, nat.n.ct, &nat.n.fwd);
		return fwd_skb_fam(PKT_IPV6, skb, &nat.n.fwd, nat.n.no_stack);
	case LB_ICMP:
		return tc_icmp(PKT_IPV6, skb, &pkt.p);
	case LB_REJECT:
		return tc_reject(PKT_IPV6, skb, &pkt.p);
	case LB_DROP:
		return TC_ACT_SHOT;
	default:
		return TC_PASS;
	}
}

/* tc_balance4 is the whole balancing path of a tcx ingress: parse, decide
 * (lb.h), rewrite and forward, answer ICMP errors and rejects. */
static __always_inline int tc_balance4(struct __sk_buff *skb)
{
	struct packet pkt = {};
	struct nat nat = {};
	void *data, *data_end;

	if (tc_tagged(skb))
		return TC_PASS;
	/* Headers of pod traffic are normally linear already. */
	tc_pull(skb, MAX_PARSE_LEN);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;

	switch (lb4_classify(skb, skb->ingress_ifindex, data, data_end, skb->len, &pkt, &nat)) {
	case LB_REWRITE:
		if (nat4_rewrite_skb(skb, &pkt, &nat)) {
			stat_inc(STAT_DROP_REWRITE);
			return TC_ACT_SHOT;
		}
		fwd_refresh4(skb, skb->ingress_ifindex, nat4_new_src(&pkt, &nat), nat4_new_dst(&pkt, &nat), pkt.proto,
			    nat.no_stack, nat.ct, &nat.fwd);
		return fwd_skb4(skb, &nat.fwd, nat.no_stack);
	case LB_ICMP:
		return tc_icmp(PKT_IPV4, skb, &pkt);
	case LB_REJECT:
		return tc_reject(PKT_IPV4, skb, &pkt);
	case LB_DROP:
		return TC_ACT_SHOT;
	default:
		return TC_PASS;
	}
}

/* Each family balances in its own subprogram: each needs most of the
 * 512-byte stack, and a program's stack is that of its deepest call
 * chain, so the two inlined into one frame would not fit. */
static __attribute__((noinline, unused)) int tc_lb4(struct __sk_buff *skb)
{
	return tc_balance4(skb);
}

static __attribute__((noinline, unused)) int tc_lb6(struct __sk_buff *skb)
{
	return tc_balance6(skb);
}

/* tc_is6 reports whether skb carries IPv6 (tc_lb6's), by the protocol
 * the kernel read from the frame. */
static __always_inline int tc_is6(const struct __sk_buff *skb)
{
	return skb->protocol == bpf_htons(ETH_P_IPV6);
}

#endif
