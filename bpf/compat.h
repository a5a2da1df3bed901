/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Kernels older than a helper or flag the datapath uses (Linux 5.10 is the
 * oldest supported; README, "Requirements"). Each wrapper here has the
 * modern path and a fallback, chosen by a knob the agent sets at load from
 * its probe of the kernel (maps/kernel.go, compatKnobs): the knobs are
 * volatile const, so the verifier prunes the branch a knob rules out and
 * never checks a helper the kernel lacks. A knob at its default (0) takes
 * the modern path. The tests force each fallback on a new kernel by
 * setting its knob (maps/compat_test.go).
 *
 * Call sites use the wrappers in one line each; the fallbacks live only
 * here. */
#ifndef TOPOLB_COMPAT_H
#define TOPOLB_COMPAT_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

/* cfg_no_coarse_clock: no bpf_ktime_get_coarse_ns (Linux < 5.11). The
 * datapath's clock is then CLOCK_MONOTONIC (bpf_ktime_get_ns) instead of
 * CLOCK_MONOTONIC_COARSE, and the agent's expiry math reads the same clock
 * (maps/conntrack.go, datapathClock). */
volatile const __u8 cfg_no_coarse_clock = 0;
/* cfg_no_check_mtu: no bpf_check_mtu (Linux < 5.12): compat_mtu_fits asks
 * the FIB instead. */
volatile const __u8 cfg_no_check_mtu = 0;
/* cfg_no_xdp_store_bytes: no bpf_xdp_store_bytes (Linux < 5.18): direct
 * packet writes, byte by byte. */
volatile const __u8 cfg_no_xdp_store_bytes = 0;
/* cfg_no_set_retval: no bpf_set_retval in cgroup programs (Linux < 5.18):
 * a socket hook that refuses a call can only say EPERM. */
volatile const __u8 cfg_no_set_retval = 0;
/* cfg_no_fib_src: no BPF_FIB_LOOKUP_SRC (Linux < 6.7, unless backported):
 * the source address of a source-NATed flow is the egress interface's
 * entry of cfg_src_ifindex and cfg_src_addr (IPv4) or cfg_src_addr6
 * (IPv6). */
volatile const __u8 cfg_no_fib_src = 0;

/* COMPAT_SRC_MAX is how many interfaces cfg_src_* name; the agent fills
 * them in order (maps/compat.go, compatSrcMax: change both together). */
#define COMPAT_SRC_MAX 8
/* The node's interfaces with a global address of either family when the
 * agent loaded the programs, by ifindex (host byte order, 0 ends the
 * list), each one's source addresses (network byte order; 0, or ::,
 * where it has none of that family: maps/compat.go, sourceAddrs, says
 * which address of several) and MTU. Read only with cfg_no_fib_src
 * (addresses) or cfg_no_check_mtu (MTUs). */
volatile const __u32 cfg_src_ifindex[COMPAT_SRC_MAX] = {};
volatile const __be32 cfg_src_addr[COMPAT_SRC_MAX] = {};
volatile const __be32 cfg_src_addr6[COMPAT_SRC_MAX][4] = {};
volatile const __u32 cfg_src_mtu[COMPAT_SRC_MAX] = {};

/* compat_iface returns ifindex's slot in cfg_src_*, or -1. A global
 * function, verified once on its own: its callers see an unknown slot.
 * Inlined, each interface the agent names gave every caller a path of its
 * own with a known slot, address and MTU, which Linux 5.10's verifier
 * followed through the rest of xdp_lb: over its limit of 1,000,000
 * instructions with 4 interfaces (about 100,000 with none). */
__noinline int compat_iface(__u32 ifindex)
{
	int i;

#pragma unroll
	for (i = 0; i < COMPAT_SRC_MAX; i++) {
		if (!cfg_src_ifindex[i])
			break;
		if (cfg_src_ifindex[i] == ifindex)
			return i;
	}
	return -1;
}

/* compat_now is the datapath's clock in ns. */
static __always_inline __u64 compat_now(void)
{
	if (cfg_no_coarse_clock)
		return bpf_ktime_get_ns();
	return bpf_ktime_get_coarse_ns();
}

/* compat_fib_flags is the bpf_fib_lookup flag that asks for the route's
 * preferred source address when want_src is set and the kernel has it. */
static __always_inline __u32 compat_fib_flags(int want_src)
{
	return want_src && !cfg_no_fib_src ? BPF_FIB_LOOKUP_SRC : 0;
}

/* compat_fib_src4 is the source address for traffic leaving by the
 * lookup p: the FIB's answer, or the address the agent gave for the egress
 * interface; 0 when there is none. */
static __always_inline __be32 compat_fib_src4(const struct bpf_fib_lookup *p)
{
	int i;

	if (!cfg_no_fib_src)
		return p->ipv4_src;
	i = compat_iface(p->ifindex);
	return i < 0 ? 0 : cfg_src_addr[i & (COMPAT_SRC_MAX - 1)];
}

/* compat_fib_src6 is compat_fib_src4 for an IPv6 lookup p: it writes the
 * source address to out, :: when there is none. */
static __always_inline void compat_fib_src6(const struct bpf_fib_lookup *p, __be32 out[4])
{
	int i;

	if (!cfg_no_fib_src) {
		__builtin_memcpy(out, p->ipv6_src, sizeof(p->ipv6_src));
		return;
	}
	i = compat_iface(p->ifindex);
	if (i < 0) {
		__builtin_memset(out, 0, sizeof(p->ipv6_src));
		return;
	}
	i &= COMPAT_SRC_MAX - 1;
	out[0] = cfg_src_addr6[i][0];
	out[1] = cfg_src_addr6[i][1];
	out[2] = cfg_src_addr6[i][2];
	out[3] = cfg_src_addr6[i][3];
}

/* compat_fib_mtu_fits asks the FIB whether the IPv4 packet ip, arriving on
 * iif, fits the route it takes: Linux 5.10's lookup answers FRAG_NEEDED
 * for an XDP frame whose tot_len exceeds the route's MTU and for an skb
 * its egress device would not forward (is_skb_forwardable; a GSO skb
 * always passes, its segments unchecked). tot_len is the IP length for
 * XDP and 0 for an skb (later kernels check a non-zero one against the
 * route's MTU, which a GSO skb's length exceeds). Without a neighbour entry the
 * skb lookup stops before its check: such a packet is let through, and
 * an oversized one is lost at the device instead of answered with
 * "fragmentation needed". */
static __always_inline int compat_fib_mtu_fits(void *ctx, __u32 iif, const struct iphdr *ip, __u16 tot_len)
{
	struct bpf_fib_lookup p = {
		.family = 2, /* AF_INET */
		.l4_protocol = ip->protocol,
		.tot_len = tot_len,
		.ifindex = iif,
		.ipv4_src = ip->saddr,
		.ipv4_dst = ip->daddr,
	};

	return bpf_fib_lookup(ctx, &p, sizeof(p), 0) != BPF_FIB_LKUP_RET_FRAG_NEEDED;
}

/* compat_xdp_mtu_fits says whether the frame whose IPv4 header is ip
 * (NULL for an IPv6 frame) may leave by ifindex. Without bpf_check_mtu:
 * its IP length (an IPv6 frame's is the frame's after the Ethernet
 * header: it is never short enough to be padded) against the MTU the
 * agent gave for ifindex, or, for an interface it did not name, the
 * FIB's check of the route's MTU (IPv4 only: an IPv6 frame is let
 * through, as compat_skb_mtu_fits lets an IPv6 skb). */
static __always_inline int compat_xdp_mtu_fits(struct xdp_md *ctx, __u32 ifindex, const struct iphdr *ip)
{
	__u32 mtu_len = 0;
	int i;

	if (cfg_no_check_mtu) {
		i = compat_iface(ifindex);
		if (i >= 0) {
			mtu_len = ip ? bpf_ntohs(ip->tot_len) : ctx->data_end - ctx->data - ETH_HLEN;
			return mtu_len <= cfg_src_mtu[i & (COMPAT_SRC_MAX - 1)];
		}
		return !ip || compat_fib_mtu_fits(ctx, ctx->ingress_ifindex, ip, bpf_ntohs(ip->tot_len));
	}
	return bpf_check_mtu(ctx, ifindex, &mtu_len, 0, 0) == BPF_MTU_CHK_RET_SUCCESS;
}

/* compat_skb_mtu_fits says whether skb (segment by segment for GSO), whose
 * IPv4 header is ip (NULL for an IPv6 packet), may leave by ifindex.
 * Without bpf_check_mtu: a GSO skb fits, another fits the MTU the agent
 * gave for ifindex, or, for an interface it did not name, the FIB's check
 * (IPv4 only: an IPv6 packet is let through, and one too big is lost at
 * the device rather than answered with "packet too big"). */
static __always_inline int compat_skb_mtu_fits(struct __sk_buff *skb, __u32 ifindex, const struct iphdr *ip)
{
	__u32 mtu_len = 0;
	int i;

	if (cfg_no_check_mtu) {
		if (skb->gso_size)
			return 1;
		i = compat_iface(ifindex);
		if (i >= 0)
			return skb->len <= ETH_HLEN + cfg_src_mtu[i & (COMPAT_SRC_MAX - 1)];
		return !ip || compat_fib_mtu_fits(skb, skb->ingress_ifindex, ip, 0);
	}
	return bpf_check_mtu(skb, ifindex, &mtu_len, 0, BPF_MTU_CHK_SEGS) == BPF_MTU_CHK_RET_SUCCESS;
}

/* COMPAT_STORE_MAX bounds compat_xdp_store_bytes's copy. */
#define COMPAT_STORE_MAX 128

/* compat_xdp_store_bytes writes len bytes (at most COMPAT_STORE_MAX) of
 * from at the start of the frame. Returns 0 on success. */
static __always_inline int compat_xdp_store_bytes(struct xdp_md *ctx, const void *from, __u32 len)
{
	__u8 *data = (void *)(long)ctx->data;
	__u8 *data_end = (void *)(long)ctx->data_end;
	__u32 i;

	if (!cfg_no_xdp_store_bytes)
		return bpf_xdp_store_bytes(ctx, 0, (void *)from, len);
	if (len > COMPAT_STORE_MAX)
		return -1;
#pragma clang loop unroll(disable)
	for (i = 0; i < COMPAT_STORE_MAX; i++) {
		if (i >= len)
			break;
		if (data + i + 1 > data_end)
			return -1;
		data[i] = ((const __u8 *)from)[i];
	}
	return 0;
}

/* compat_set_retval makes a refusing cgroup hook's call fail with err
 * (negative), where the kernel lets it choose; else the call fails with
 * EPERM. */
static __always_inline void compat_set_retval(int err)
{
	if (!cfg_no_set_retval)
		bpf_set_retval(err);
}

#endif
