// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* tcx on the host side of pod veths.
 *   tc_lb, ingress (from the pod): pod -> frontend DNAT for frontends of
 *     scope internal, reverse NAT of replies from local backends, ICMP
 *     errors from pods about translated flows (icmp.h), and rejects for
 *     empty reject frontends (reject.h), sent back into the pod. A
 *     translated packet is forwarded without the host stack where the
 *     kernel allows (fwd.h): into a local pod with bpf_redirect_peer, out
 *     of an uplink with bpf_redirect (cached MACs) or bpf_redirect_neigh.
 *   tc_lb_egress, egress (to the pod; also on uplinks): what the node's
 *     own stack sends: ICMP errors about a translated flow, for example
 *     "fragmentation needed" when it forwards a too-big packet that tc_lb
 *     translated, and replies of host-network backends on this node,
 *     translated back to the frontend.
 * Pods send CHECKSUM_PARTIAL packets, so L4 checksums are updated with the
 * skb csum helper, which knows the difference (nat.h). */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#define LB_FRAME struct __sk_buff
#define LB_SCOPE_DEFAULT SCOPE_INTERNAL
#include "lb.h"
#include "fwd.h"
#include "icmp.h"
#include "nat.h"
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

	if (tc_tagged(skb))
		return TC_PASS;
	/* Headers of pod traffic are normally linear already. */
	tc_pull(skb, MAX_PARSE_LEN);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;

	verdict = lb_classify(skb, skb->ingress_ifindex, data, data_end, skb->len, &pkt, &nat);
	switch (verdict) {
	case LB_REWRITE:
		if (nat_rewrite_skb(skb, &pkt, &nat)) {
			stat_inc(STAT_DROP_REWRITE);
			return TC_ACT_SHOT;
		}
		fwd_refresh(skb, skb->ingress_ifindex, nat_new_src(&pkt, &nat), nat_new_dst(&pkt, &nat), pkt.proto,
			    nat.no_stack, nat.ct, &nat.fwd);
		return fwd_skb(skb, &nat.fwd, nat.no_stack);
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

/* tc_lb_egress, on the tcx egress of pod veths and uplinks, sees what the
 * node's own stack sends there. Its ICMP errors about a translated flow
 * are translated (icmp.h). Replies of host-network backends on this node
 * (a pod's or an outside client's flow translated to one of the node's
 * own addresses) are translated back to the frontend: they leave the
 * node's sockets, so no ingress program sees them. Only packets the node
 * itself originates are looked up (ingress_ifindex 0): forwarded and
 * redirected packets were translated where they entered, and skip the
 * lookup. */
SEC("tcx/egress")
int tc_lb_egress(struct __sk_buff *skb)
{
	struct packet pkt = {};
	struct nat nat = {};

	if (tc_tagged(skb))
		return TC_PASS;
	tc_pull(skb, MAX_PARSE_LEN);
	switch (parse_packet((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, &pkt)) {
	case PARSE_ICMP:
		return tc_icmp(skb, &pkt);
	case PARSE_OK:
		break;
	default:
		return TC_PASS;
	}
	if (skb->ingress_ifindex != 0 || lb_stack_reply(&pkt, &nat) != LB_REWRITE)
		return TC_PASS;
	if (nat_rewrite_skb(skb, &pkt, &nat)) {
		stat_inc(STAT_DROP_REWRITE);
		return TC_ACT_SHOT;
	}
	return TC_PASS;
}

char _license[] SEC("license") = "Dual BSD/GPL";
