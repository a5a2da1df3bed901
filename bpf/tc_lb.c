// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* tcx ingress on the host side of pod veths: pod -> frontend DNAT for
 * frontends of scope internal, and reverse NAT of replies from local
 * backends; then the translated packet is forwarded without the host
 * stack where the kernel allows (fwd.h): into a local pod with
 * bpf_redirect_peer, out of an uplink with bpf_redirect (cached MACs) or
 * bpf_redirect_neigh. Pods send CHECKSUM_PARTIAL packets, so L4 checksums
 * are updated with the skb csum helper, which knows the difference
 * (nat.h). */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#define LB_SCOPE_DEFAULT SCOPE_INTERNAL
#include "lb.h"
#include "fwd.h"
#include "nat.h"

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
	case LB_DROP:
		return TC_ACT_SHOT;
	default:
		return TC_PASS;
	}
}

char _license[] SEC("license") = "Dual BSD/GPL";
