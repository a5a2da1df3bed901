// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* tcx on the host side of pod veths.
 *   tc_lb, ingress (from the pod): frames to or from a loopback address
 *     dropped (tc_loopback_frame), pod -> frontend DNAT for frontends of
 *     scope internal, reverse NAT of replies from local backends, ICMP
 *     errors from pods about translated flows (icmp.h), and rejects for
 *     empty reject frontends (reject.h), sent back into the pod. A
 *     translated packet is forwarded without the host stack where the
 *     kernel allows (fwd.h): into a local pod with bpf_redirect_peer, out
 *     of an uplink with bpf_redirect (cached MACs) or bpf_redirect_neigh.
 *   tc_lb_egress, egress (to the pod; also on uplinks): what the node's
 *     own stack sends: ICMP and ICMPv6 errors about a translated flow,
 *     for example "fragmentation needed" or "packet too big" when it
 *     forwards a too-big packet that tc_lb translated, and replies of
 *     host-network backends on this node, translated back to the
 *     frontend.
 * Pods send CHECKSUM_PARTIAL packets, so L4 checksums are updated with the
 * skb csum helper, which knows the difference (nat.h). */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#define LB_SCOPE_DEFAULT SCOPE_INTERNAL
#include "tc.h"

/* 127.0.0.0/8, network byte order: the IPv4 loopback network. */
#define LOOPBACK4_MASK bpf_htonl(0xff000000)
#define LOOPBACK4_NET bpf_htonl(0x7f000000)

/* loopback4 reports whether a (network byte order) is in 127.0.0.0/8. */
static __always_inline int loopback4(__be32 a)
{
	return (a & LOOPBACK4_MASK) == LOOPBACK4_NET;
}

/* loopback6 reports whether a is ::1. */
static __always_inline int loopback6(const struct in6_addr *a)
{
	return a->in6_u.u6_addr32[0] == 0 && a->in6_u.u6_addr32[1] == 0 && a->in6_u.u6_addr32[2] == 0 &&
	       a->in6_u.u6_addr32[3] == bpf_htonl(1);
}

/* tc_loopback_frame reports whether skb, a frame a pod sent, is
 * addressed to or from a loopback address (127.0.0.0/8, ::1). None is
 * legitimate: a pod's own loopback traffic never leaves the pod, and the
 * node's loopback is not the pod's to reach or to pose as. Only a
 * hand-built frame gets here. One to a loopback address would reach what
 * listens on the node's localhost: the core translates it to a NodePort
 * served on 127.0.0.1 (scope internal) before the kernel could call it
 * a martian, and the kernel lets it in anyway where route_localnet is on
 * (kube-proxy turns it on). One from a loopback address the core would
 * translate to a backend all the same, posing as the node's own
 * processes. A header read per packet, no lookup. */
static __always_inline int tc_loopback_frame(struct __sk_buff *skb)
{
	void *data, *data_end;
	struct ipv6hdr *ip6;
	struct iphdr *ip;

	tc_pull(skb, ETH_HLEN + sizeof(struct ipv6hdr));
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		ip = data + ETH_HLEN;
		return (void *)(ip + 1) <= data_end && (loopback4(ip->daddr) || loopback4(ip->saddr));
	}
	if (!tc_is6(skb))
		return 0;
	ip6 = data + ETH_HLEN;
	return (void *)(ip6 + 1) <= data_end && (loopback6(&ip6->daddr) || loopback6(&ip6->saddr));
}

SEC("tcx/ingress")
int tc_lb(struct __sk_buff *skb)
{
	if (tc_loopback_frame(skb)) {
		stat_inc(STAT_DROP_LOOPBACK);
		return TC_ACT_SHOT;
	}
	if (tc_is6(skb))
		return tc_lb6(skb);
	return tc_lb4(skb);
}

/* tc_lb_egress, on the tcx egress of pod veths and uplinks, sees what the
 * node's own stack sends there. Its ICMP and ICMPv6 errors about a
 * translated flow are translated (icmp.h). Replies of host-network
 * backends on this node (a pod's or an outside client's flow translated
 * to one of the node's own addresses) are translated back to the
 * frontend: they leave the node's sockets, so no ingress program sees
 * them. Only packets the node itself originates are looked up
 * (ingress_ifindex 0): forwarded and redirected packets were translated
 * where they entered, and skip the lookup. Each family in its own
 * subprogram, as tc_lb's. */
static __attribute__((noinline)) int tc_egress4(struct __sk_buff *skb)
{
	struct packet pkt = {};
	struct nat nat = {};
	void *data, *data_end;

	tc_pull(skb, MAX_PARSE_LEN);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	switch (parse_packet(data, data_end, skb->len, &pkt)) {
	case PARSE_ICMP:
		return tc_icmp(PKT_IPV4, skb, &pkt);
	case PARSE_OK:
		if (skb->ingress_ifindex != 0 || lb_stack_reply(PKT_IPV4, &pkt, &nat) != LB_REWRITE)
			return TC_PASS;
		frag4_remember(data, data_end, &pkt);
		break;
	case PARSE_FRAGMENT:
		/* A host-network backend's reply, too big for the path
		 * (frag.h). */
		if (skb->ingress_ifindex != 0 || frag4_follow(data, data_end, &pkt, 1, &nat) != LB_REWRITE)
			return TC_PASS;
		break;
	default:
		return TC_PASS;
	}
	if (nat4_rewrite_skb(skb, &pkt, &nat)) {
		stat_inc(STAT_DROP_REWRITE);
		return TC_ACT_SHOT;
	}
	return TC_PASS;
}

/* tc_egress6 is tc_egress4 for IPv6, fragments included (frag.h); every
 * other ICMPv6 message passes untouched. */
static __attribute__((noinline)) int tc_egress6(struct __sk_buff *skb)
{
	struct packet6 pkt = {};
	struct nat6 nat = {};
	void *data, *data_end;

	tc_pull(skb, MAX_PARSE6_LEN);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	switch (parse_ipv6(data, data_end, skb->len, &pkt)) {
	case PARSE_ICMP:
		return tc_icmp(PKT_IPV6, skb, &pkt.p);
	case PARSE_OK:
		if (skb->ingress_ifindex != 0 || lb_stack_reply(PKT_IPV6, &pkt.p, &nat.n) != LB_REWRITE)
			return TC_PASS;
		frag6_remember(skb, &pkt);
		break;
	case PARSE_FRAGMENT:
		/* A host-network backend's reply, too big for the path. */
		if (skb->ingress_ifindex != 0 || frag6_follow(data, data_end, &pkt, 1, &nat.n) != LB_REWRITE)
			return TC_PASS;
		break;
	default:
		return TC_PASS;
	}
	if (nat6_rewrite_skb(skb, &pkt.p, &nat.n)) {
		stat_inc(STAT_DROP_REWRITE);
		return TC_ACT_SHOT;
	}
	return TC_PASS;
}

SEC("tcx/egress")
int tc_lb_egress(struct __sk_buff *skb)
{
	if (tc_tagged(skb))
		return TC_PASS;
	if (tc_is6(skb))
		return tc_egress6(skb);
	return tc_egress4(skb);
}

char _license[] SEC("license") = "Dual BSD/GPL";
