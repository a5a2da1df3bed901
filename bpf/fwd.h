/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Forwarding after translation: where a translated packet goes, and how
 * it gets there without the host stack (docs/datapath.md, "Forwarding
 * after translation").
 *
 * Each direction of a flow carries its target in its conntrack entry
 * (ct_value.redirect, ifindex, smac, dmac), resolved from the kernel's FIB
 * and tlb_ifaces when the flow is created, so an established packet needs
 * no lookup to be forwarded:
 *   PEER   into the pod behind a host veth: tc bpf_redirect_peer; XDP
 *          cannot redirect into a veth's peer, so it hands the target to
 *          tc_uplink (tcx ingress of the same uplink) in packet metadata;
 *   XDP    out of an uplink with the cached MACs: XDP_TX on the interface
 *          it came in on, XDP_REDIRECT to another, tc bpf_redirect;
 *   NEIGH  resolve again (next hop not yet in the neighbour table, or a
 *          periodic refresh); meanwhile out of ifindex with the kernel
 *          resolving the next hop: tc bpf_redirect_neigh, XDP through
 *          tc_uplink;
 *   STACK  up the host stack.
 * ct_touch_fam (conntrack.h) marks both entries of an active flow NEIGH at most once
 * a second, so a changed route, next hop or pod interface is picked up
 * (entries on the STACK path stay there).
 *
 * A packet leaves its flow's path for the stack when the kernel must
 * answer it: TTL expiring (time exceeded) or larger than the egress MTU
 * (fragmentation needed). The forward packets of a source-NATed flow
 * never go up the stack: their source is this node's own address, which
 * the stack drops as a martian; they are dropped and counted instead.
 *
 * TTL: every path here replaces a forwarding hop of the node, so the TTL
 * is decremented exactly where the stack's ip_forward would have.
 *
 * IPv6 takes the same paths on XDP and tc (fwd_resolve6, fwd_xdp_fam
 * and fwd_skb_fam with PKT_IPV6), its hop limit where IPv4 has the TTL,
 * and the stack answers "packet too big" and "time exceeded" for what
 * falls back. One difference: a NEIGH target of IPv6 keeps no next hop
 * (fwd_target's is IPv4's 4 bytes): bpf_redirect_neigh then routes the
 * packet's destination itself out of the interface. */
#ifndef TOPOLB_FWD_H
#define TOPOLB_FWD_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "addr.h"
#include "compat.h"
#include "consts.h"
#include "csum.h"
#include "ipv4.h"
#include "ipv6.h"
#include "maps.h"
#include "stats.h"
#include "structs.h"

#define AF_INET 2
#define AF_INET6 10

/* Not ours, or translated: hand the packet on. TC_ACT_UNSPEC is TCX_NEXT,
 * so tcx programs attached after this one (a CNI's, for example) still see
 * it; with none left the packet passes. */
#define TC_PASS TC_ACT_UNSPEC

/* Where one direction of a flow goes: ct_value's forwarding fields, and,
 * for a target just resolved, its next hop. */
struct fwd_target {
	__u32 ifindex; /* host byte order; 0 with CT_REDIRECT_STACK */
	__u8 kind;     /* enum ct_redirect */
	__u8 pad;
	__u8 smac[ETH_ALEN]; /* PEER (when dmac is known) and XDP */
	__u8 dmac[ETH_ALEN];
	__u16 pad2;
	__be32 nexthop; /* network byte order; NEIGH: the address to resolve (not cached) */
};

/* What XDP hands to tc_uplink in front of a frame it passes up
 * (bpf_xdp_adjust_meta): deliver into a pod, or out of an interface
 * through the neighbour subsystem. tc_uplink acts only on a frame whose
 * metadata is exactly this size and starts with FWD_META_MAGIC. 28 bytes:
 * metadata must be a multiple of 4, at most 32. */
struct fwd_meta {
	__u32 magic;   /* FWD_META_MAGIC */
	__u32 ifindex; /* host byte order */
	__u8 kind;     /* CT_REDIRECT_PEER or CT_REDIRECT_NEIGH */
	__u8 flags;    /* enum fwd_meta_flag bits */
	__u8 dmac[ETH_ALEN]; /* PEER: the pod's MAC when known, else zero */
	__u8 smac[ETH_ALEN];
	__u16 pad;           /* zero */
	__be32 nexthop;      /* NEIGH: the next hop to resolve, network byte order */
};
_Static_assert(sizeof(struct fwd_meta) % 4 == 0 && sizeof(struct fwd_meta) <= 32,
	       "XDP metadata is a multiple of 4 bytes, at most 32");

enum fwd_meta_const {
	FWD_META_MAGIC = 0x746c6266, /* "tlbf" */
};

enum fwd_meta_flag {
	FWD_META_F_NO_STACK = 1, /* drop rather than pass up the stack (source-NATed forward packets) */
};

static __always_inline int mac_is_zero(const __u8 *mac)
{
	return !(mac[0] | mac[1] | mac[2] | mac[3] | mac[4] | mac[5]);
}

/* fwd_stat is the counter of a direction's path. */
static __always_inline __u32 fwd_stat(__u8 kind)
{
	switch (kind) {
	case CT_REDIRECT_PEER:
		return STAT_FWD_PEER;
	case CT_REDIRECT_NEIGH:
		return STAT_FWD_NEIGH;
	case CT_REDIRECT_XDP:
		return STAT_FWD_L2;
	default:
		return STAT_FWD_STACK;
	}
}

/* fwd_classify fills t from the FIB's answer rc to p: PEER for a pod
 * interface (tlb_ifaces kind IFACE_POD), XDP for an uplink whose next hop
 * is in the neighbour table, NEIGH for one whose next hop is not, STACK
 * otherwise (no route, a local address, forwarding disabled on the
 * ingress interface, an interface topolb is not attached to). no_stack
 * (the forward direction of a source-NATed flow) turns STACK into NEIGH
 * whenever the FIB names an egress interface. Either family. */
static __always_inline void fwd_classify(long rc, const struct bpf_fib_lookup *p, int no_stack, struct fwd_target *t)
{
	__u32 ifindex = p->ifindex;
	struct iface_value *ifc;

	__builtin_memset(t, 0, sizeof(*t));
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return;
	ifc = bpf_map_lookup_elem(&tlb_ifaces, &ifindex);
	if (ifc && ifc->kind == IFACE_POD) {
		t->kind = CT_REDIRECT_PEER;
		t->ifindex = ifindex;
		if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
			__builtin_memcpy(t->smac, p->smac, ETH_ALEN);
			__builtin_memcpy(t->dmac, p->dmac, ETH_ALEN);
		}
	} else if (ifc && ifc->kind == IFACE_UPLINK && rc == BPF_FIB_LKUP_RET_SUCCESS) {
		t->kind = CT_REDIRECT_XDP;
		t->ifindex = ifindex;
		__builtin_memcpy(t->smac, p->smac, ETH_ALEN);
		__builtin_memcpy(t->dmac, p->dmac, ETH_ALEN);
	} else if ((ifc && ifc->kind == IFACE_UPLINK) || no_stack) {
		t->kind = CT_REDIRECT_NEIGH;
		t->ifindex = ifindex;
		if (p->family == AF_INET)
			t->nexthop = p->ipv4_dst; /* the gateway, or dst itself on link */
	}
}

/* fwd_resolve4 asks the FIB where IPv4 packets from src to dst, arriving
 * on iif, go, and fills t (fwd_classify). want_src asks the FIB for the
 * route's preferred source address (BPF_FIB_LOOKUP_SRC, Linux 6.7+).
 * Returns that address, 0 when not asked for or there is none. The
 * lookup is an ingress lookup, as the stack's ip_forward does it: policy
 * routing by iif, and STACK where forwarding is off. */
static __always_inline __be32 fwd_resolve4(void *ctx, __u32 iif, __be32 src, __be32 dst, __u8 proto,
					  int want_src, int no_stack, struct fwd_target *t)
{
	struct bpf_fib_lookup p = {
		.family = AF_INET,
		.l4_protocol = proto,
		/* A length that fits any MTU: the route, not this packet's
		 * size, is what the flow caches (each packet's size is checked
		 * on its way out). Without it, tc's lookup would fail a large
		 * first packet with FRAG_NEEDED. */
		.tot_len = sizeof(struct iphdr),
		.ifindex = iif,
		.ipv4_src = src,
		.ipv4_dst = dst,
	};
	long rc;

	rc = bpf_fib_lookup(ctx, &p, sizeof(p), compat_fib_flags(want_src));
	fwd_classify(rc, &p, no_stack, t);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return 0;
	return want_src ? compat_fib_src4(&p) : 0;
}

/* tlb_fib6_scratch holds the parameters of an IPv6 FIB lookup
 * (fwd_resolve6), 64 bytes that tc_lb6's stack, filled by IPv6's
 * addresses, does not have; the helper takes them from a map value as
 * well. One slot per CPU, used within one lookup. Not shared and not
 * pinned. Bytes, not the struct: bpf2go mirrors every map value in Go,
 * and the struct's anonymous unions have no mirror. */
struct fib_room {
	__u8 room[sizeof(struct bpf_fib_lookup)];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fib_room);
} tlb_fib6_scratch SEC(".maps");

/* fwd_resolve6 is fwd_resolve4 for IPv6 packets from src to dst. With
 * src_out, it asks for the route's preferred source address and writes
 * it there (compat_fib_src6: the FIB's answer, or on a kernel without
 * BPF_FIB_LOOKUP_SRC the egress interface's address the agent gave; ::
 * when there is none: no route, no usable address). */
static __always_inline void fwd_resolve6(void *ctx, __u32 iif, const union tlb_addr *src, const union tlb_addr *dst,
					 __u8 proto, int no_stack, struct fwd_target *t, union tlb_addr *src_out)
{
	int want_src = src_out != NULL;
	struct bpf_fib_lookup *p;
	__u32 zero = 0;
	long rc;

	if (src_out)
		__builtin_memset(src_out, 0, sizeof(*src_out));
	/* Map values are 8-byte aligned: so is p. */
	p = bpf_map_lookup_elem(&tlb_fib6_scratch, &zero);
	if (!p) {
		/* Cannot happen (one slot per CPU): the flow goes by the
		 * stack. */
		__builtin_memset(t, 0, sizeof(*t));
		return;
	}
	__builtin_memset(p, 0, sizeof(*p));
	p->family = AF_INET6;
	p->l4_protocol = proto;
	/* fwd_resolve4's length that fits any MTU. */
	p->tot_len = sizeof(struct ipv6hdr);
	p->ifindex = iif;
	__builtin_memcpy(p->ipv6_src, src, sizeof(p->ipv6_src));
	__builtin_memcpy(p->ipv6_dst, dst, sizeof(p->ipv6_dst));
	rc = bpf_fib_lookup(ctx, p, sizeof(*p), compat_fib_flags(want_src));
	fwd_classify(rc, p, no_stack, t);
	if (want_src && (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH))
		compat_fib_src6(p, src_out->v6);
}

/* fwd_mark_stale makes the next packet of an entry resolve its target
 * again (ct_touch_fam, at most once a second per active flow): a route, a
 * next hop's MAC or a pod's interface may have changed since. A flow the
 * stack forwards stays with the stack: its route leads through an
 * interface topolb does not own, and asking again every second would
 * cost a FIB lookup for nothing. */
static __always_inline void fwd_mark_stale(struct ct_value *ct)
{
	if (ct->redirect != CT_REDIRECT_STACK)
		ct->redirect = CT_REDIRECT_NEIGH;
}

/* fwd_from_ct copies a conntrack entry's target. */
static __always_inline void fwd_from_ct(struct fwd_target *t, const struct ct_value *ct)
{
	t->kind = ct->redirect;
	t->ifindex = ct->ifindex;
	__builtin_memcpy(t->smac, ct->smac, ETH_ALEN);
	__builtin_memcpy(t->dmac, ct->dmac, ETH_ALEN);
}

/* fwd_to_ct stores a target in a conntrack entry. */
static __always_inline void fwd_to_ct(struct ct_value *ct, const struct fwd_target *t)
{
	ct->ifindex = t->ifindex;
	__builtin_memcpy(ct->smac, t->smac, ETH_ALEN);
	__builtin_memcpy(ct->dmac, t->dmac, ETH_ALEN);
	ct->redirect = t->kind;
}

/* fwd_refresh4 resolves a NEIGH target again for a packet of its flow
 * (dst is the packet's destination after translation) and, when the FIB
 * now knows more, stores the result in the flow's entry ct (NULL for a
 * flow created by this packet: it was resolved a moment ago). */
static __always_inline void fwd_refresh4(void *ctx, __u32 iif, __be32 src, __be32 dst, __u8 proto,
					int no_stack, struct ct_value *ct, struct fwd_target *t)
{
	if (t->kind != CT_REDIRECT_NEIGH || !ct)
		return;
	fwd_resolve4(ctx, iif, src, dst, proto, 0, no_stack, t);
	fwd_to_ct(ct, t);
}

/* fwd_refresh6 is fwd_refresh4 for an IPv6 packet. */
static __always_inline void fwd_refresh6(void *ctx, __u32 iif, const union tlb_addr *src, const union tlb_addr *dst,
					 __u8 proto, int no_stack, struct ct_value *ct, struct fwd_target *t)
{
	if (t->kind != CT_REDIRECT_NEIGH || !ct)
		return;
	fwd_resolve6(ctx, iif, src, dst, proto, no_stack, t, NULL);
	fwd_to_ct(ct, t);
}

/* fwd_fallback counts a packet that cannot follow its flow's path and
 * returns whether it may go up the stack (1) or must be dropped (0). */
static __always_inline int fwd_fallback(int no_stack, __u32 reason)
{
	if (no_stack) {
		stat_inc(STAT_DROP_SNAT_FALLBACK);
		return 0;
	}
	stat_inc(reason);
	return 1;
}

/* fwd_l3_fits reports whether the L3 header of family fam (a constant)
 * at l3 lies within the frame. */
static __always_inline int fwd_l3_fits(int fam, void *l3, void *data_end)
{
	if (fam == PKT_IPV6)
		return l3 + sizeof(struct ipv6hdr) <= data_end;
	return l3 + sizeof(struct iphdr) <= data_end;
}

/* fwd_hops_expire reports whether forwarding would take the TTL (IPv4)
 * or hop limit (IPv6) of the header at l3, of family fam, to 0. */
static __always_inline int fwd_hops_expire(int fam, void *l3)
{
	if (fam == PKT_IPV6)
		return ip6_hop_limit_expires(l3);
	return ip_ttl_expires(l3);
}

/* fwd_hops_decrease decrements the TTL or hop limit of the header at l3
 * as a forwarding hop does (IPv6 has no header checksum to keep). */
static __always_inline void fwd_hops_decrease(int fam, void *l3)
{
	if (fam == PKT_IPV6)
		((struct ipv6hdr *)l3)->hop_limit--;
	else
		ip_decrease_ttl(l3);
}

/* ---- XDP (frames from the wire) ---- */

/* fwd_xdp_l2 sends a translated frame of family fam (a constant) out of
 * an uplink with t's MACs. */
static __always_inline int fwd_xdp_l2(int fam, struct xdp_md *ctx, const struct fwd_target *t, int no_stack)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	void *l3 = data + ETH_HLEN;

	if (!fwd_l3_fits(fam, l3, data_end))
		return XDP_DROP;
	if (fwd_hops_expire(fam, l3))
		return fwd_fallback(no_stack, STAT_FWD_FALLBACK_TTL) ? XDP_PASS : XDP_DROP;
	/* A frame fits the interface it arrived on. */
	if (t->ifindex != ctx->ingress_ifindex &&
	    !compat_xdp_mtu_fits(ctx, t->ifindex, fam == PKT_IPV6 ? NULL : l3))
		return fwd_fallback(no_stack, STAT_FWD_FALLBACK_MTU) ? XDP_PASS : XDP_DROP;
	fwd_hops_decrease(fam, l3);
	__builtin_memcpy(eth->h_dest, t->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, t->smac, ETH_ALEN);
	if (t->ifindex == ctx->ingress_ifindex)
		return XDP_TX;
	return bpf_redirect(t->ifindex, 0);
}

/* fwd_xdp_handoff passes a translated frame of family fam up to
 * tc_uplink with its target in the metadata; tc_uplink forwards it as
 * the skb's family (tc_is6). The Ethernet header stays as it arrived
 * (the uplink's own address), so the stack takes the frame if tc_uplink
 * does not. */
static __always_inline int fwd_xdp_handoff(int fam, struct xdp_md *ctx, const struct fwd_target *t, int no_stack)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	void *l3 = data + ETH_HLEN;
	struct fwd_meta *m;

	if (!fwd_l3_fits(fam, l3, data_end))
		return XDP_DROP;
	if (fwd_hops_expire(fam, l3))
		return fwd_fallback(no_stack, STAT_FWD_FALLBACK_TTL) ? XDP_PASS : XDP_DROP;
	if (bpf_xdp_adjust_meta(ctx, -(int)sizeof(*m)))
		return fwd_fallback(no_stack, STAT_FWD_FALLBACK_META) ? XDP_PASS : XDP_DROP;
	data = (void *)(long)ctx->data;
	m = (void *)(long)ctx->data_meta;
	if ((void *)(m + 1) > data)
		return XDP_DROP;
	m->magic = FWD_META_MAGIC;
	m->ifindex = t->ifindex;
	m->kind = t->kind;
	m->flags = no_stack ? FWD_META_F_NO_STACK : 0;
	__builtin_memcpy(m->dmac, t->dmac, ETH_ALEN);
	__builtin_memcpy(m->smac, t->smac, ETH_ALEN);
	m->pad = 0;
	m->nexthop = t->nexthop;
	return XDP_PASS;
}

/* fwd_xdp_fam forwards a translated frame of family fam (a constant)
 * along t. */
static __always_inline int fwd_xdp_fam(int fam, struct xdp_md *ctx, const struct fwd_target *t, int no_stack)
{
	switch (t->kind) {
	case CT_REDIRECT_XDP:
		return fwd_xdp_l2(fam, ctx, t, no_stack);
	case CT_REDIRECT_PEER:
	case CT_REDIRECT_NEIGH:
		if (t->ifindex)
			return fwd_xdp_handoff(fam, ctx, t, no_stack);
		/* fall through */
	default:
		if (no_stack) {
			stat_inc(STAT_DROP_SNAT_FALLBACK);
			return XDP_DROP;
		}
		return XDP_PASS;
	}
}

/* fwd_xdp4 is fwd_xdp_fam for IPv4. */
static __always_inline int fwd_xdp4(struct xdp_md *ctx, const struct fwd_target *t, int no_stack)
{
	return fwd_xdp_fam(PKT_IPV4, ctx, t, no_stack);
}

/* ---- tc (skbs) ---- */

/* fwd_skb_prepare checks that the skb, of family fam (a constant), may
 * leave by t (TTL or hop limit, MTU of the egress interface, segment by
 * segment for GSO packets), decrements its TTL or hop limit and, when
 * known, writes t's MACs. Returns 0 when it may, else 1 (the caller falls
 * back). Packet pointers are reloaded here: the rewrite helpers
 * invalidated the caller's. */
static __always_inline int fwd_skb_prepare(int fam, struct __sk_buff *skb, const struct fwd_target *t,
					   int no_stack, int *verdict)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	void *l3 = data + ETH_HLEN;

	if (!fwd_l3_fits(fam, l3, data_end)) {
		*verdict = TC_ACT_SHOT;
		return 1;
	}
	if (fwd_hops_expire(fam, l3)) {
		*verdict = fwd_fallback(no_stack, STAT_FWD_FALLBACK_TTL) ? TC_PASS : TC_ACT_SHOT;
		return 1;
	}
	if (!compat_skb_mtu_fits(skb, t->ifindex, fam == PKT_IPV6 ? NULL : l3)) {
		*verdict = fwd_fallback(no_stack, STAT_FWD_FALLBACK_MTU) ? TC_PASS : TC_ACT_SHOT;
		return 1;
	}
	fwd_hops_decrease(fam, l3);
	if (t->kind != CT_REDIRECT_NEIGH && !mac_is_zero(t->dmac)) {
		__builtin_memcpy(eth->h_dest, t->dmac, ETH_ALEN);
		__builtin_memcpy(eth->h_source, t->smac, ETH_ALEN);
	}
	return 0;
}

/* fwd_skb_fam forwards a translated skb of family fam (a constant) along
 * t from tc ingress. */
static __always_inline int fwd_skb_fam(int fam, struct __sk_buff *skb, const struct fwd_target *t, int no_stack)
{
	int verdict;

	if (t->kind == CT_REDIRECT_STACK || !t->ifindex) {
		if (no_stack) {
			stat_inc(STAT_DROP_SNAT_FALLBACK);
			return TC_ACT_SHOT;
		}
		return TC_PASS;
	}
	if (fwd_skb_prepare(fam, skb, t, no_stack, &verdict))
		return verdict;
	switch (t->kind) {
	case CT_REDIRECT_PEER:
		return bpf_redirect_peer(t->ifindex, 0);
	case CT_REDIRECT_XDP:
		return bpf_redirect(t->ifindex, 0);
	default: {
		/* The next hop as the FIB named it; without it (IPv6's, which
		 * fwd_target does not keep) the helper routes the packet
		 * itself. */
		struct bpf_redir_neigh nh = { .nh_family = AF_INET, .ipv4_nh = t->nexthop };

		if (fam == PKT_IPV6 || !t->nexthop)
			return bpf_redirect_neigh(t->ifindex, NULL, 0, 0);
		return bpf_redirect_neigh(t->ifindex, &nh, sizeof(nh), 0);
	}
	}
}

/* fwd_skb4 is fwd_skb_fam for IPv4. */
static __always_inline int fwd_skb4(struct __sk_buff *skb, const struct fwd_target *t, int no_stack)
{
	return fwd_skb_fam(PKT_IPV4, skb, t, no_stack);
}

#endif
