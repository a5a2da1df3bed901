// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* cgroup v2 socket hooks for the node's own processes (host network):
 *   sock_connect4, sock_sendmsg4, sock_connect6, sock_sendmsg6 (IPv6
 *     frontends, and IPv4 ones by IPv4-mapped addresses of dual-stack IPv6
 *     sockets, whose unconnected UDP sends the kernel passes to the IPv4
 *     hook): a connect, or an unconnected UDP send,
 *     to a frontend of scope internal is sent to a backend chosen with the
 *     same core, slot tables, weights, affinity and backend states as tc,
 *     before any packet exists: nothing to translate on the wire, and no
 *     conntrack entry. The socket's (cookie, backend) -> frontend goes into
 *     tlb_sock_revnat. An empty reject frontend refuses the call with
 *     ECONNREFUSED; an empty frontend that drops by policy is left alone
 *     (the packets go to the frontend's address untranslated, where
 *     nothing answers, as a drop would), counted as STAT_DROP_NO_BACKEND.
 *   sock_recvmsg4, sock_getpeername4 and their IPv6 twins: the backend a socket's datagram came from,
 *     or a connected socket's peer, is shown as the frontend the socket
 *     asked for.
 *   A frontend with loadBalancerSourceRanges refuses the call with EPERM
 *     unless a range holds the node's address (srcrange.h).
 * Attached to the cgroup v2 root they see every socket of the machine and
 * act only on those of this node's network namespace (cfg_netns_cookie):
 * pods keep the tc path, and several nodes on one machine never translate
 * each other's sockets.
 *
 * A flow here is a socket's traffic to one frontend: its slot is a hash of
 * the socket cookie and the frontend, so an unconnected UDP socket's
 * datagrams to a frontend stay on one backend while the slot table holds
 * still. All of the node's processes are one client for ClientIP
 * affinity (the unspecified address). Host flows count as flows in
 * tlb_backend_stats, not as packets or bytes: the hooks see calls, not
 * packets. */

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <asm-generic/errno.h>

#define LB_NO_FRAME
#define LB_SCOPE_DEFAULT SCOPE_INTERNAL
#include "addr.h"
#include "lb.h"

/* Return values of cgroup sock_addr programs. */
#define SOCK_REJECT 0
#define SOCK_PROCEED 1

/* cfg_netns_cookie is the network namespace whose sockets the hooks act
 * on (SO_NETNS_COOKIE), set at load; 0 acts on none. */
volatile const __u64 cfg_netns_cookie = 0;

static __always_inline int sock_in_node(void *ctx)
{
	return cfg_netns_cookie != 0 && bpf_get_netns_cookie(ctx) == cfg_netns_cookie;
}

/* sock_remember records that the socket's traffic to be stands for fe.
 * Returns 1 when the record is new (a new flow), 0 when it was there, or a
 * negative error. Written only when it changes: sendmsg calls it for every
 * datagram. */
static __always_inline int sock_remember(__u64 cookie, const struct backend_value *be,
					 const struct svc_key *fe)
{
	struct sock_revnat_key k = { .cookie = cookie, .addr = be->addr, .port = be->port };
	struct sock_revnat_value v = { .addr = fe->vip, .port = fe->port };
	struct sock_revnat_value *old = bpf_map_lookup_elem(&tlb_sock_revnat, &k);
	long err;

	if (old && addr_eq(&old->addr, &v.addr) && old->port == v.port)
		return 0;
	/* The socket sent to another frontend with the same backend before:
	 * a reply carries only the backend's address, so from now on it is
	 * shown as coming from this frontend, also a late answer to the
	 * other one. */
	if (old)
		stat_inc(STAT_SOCK_REVNAT_CLOBBER);
	err = bpf_map_update_elem(&tlb_sock_revnat, &k, &v, BPF_ANY);
	return err ? (int)err : 1;
}

/* sock_choose decides a connect or sendmsg of a socket of this node to
 * vip:port (an IPv4 vip IPv4-mapped, addr.h). It returns SOCK_REJECT
 * (refused), or SOCK_PROCEED with be set to the backend to send to, or
 * with be->port 0 when the call is left alone. A backend has its
 * frontend's family. */
static __always_inline int sock_choose(struct bpf_sock_addr *ctx, const union tlb_addr *vip, __be16 port,
				       struct backend_value *be)
{
	struct svc_key key = {
		.vip = *vip,
		.port = port,
		.proto = (__u8)ctx->protocol,
		.scope = cfg_scope,
	};
	/* The node's own processes share one affinity client, the
	 * unspecified address, which no other client has. */
	union tlb_addr node_client = {};
	struct backend_stats *rec;
	struct svc_value svc, *v;
	__u64 cookie;
	int fresh;

	be->port = 0;
	if (!sock_in_node(ctx) || (key.proto != IP_PROTO_TCP && key.proto != IP_PROTO_UDP))
		return SOCK_PROCEED;
	v = bpf_map_lookup_elem(&tlb_services, &key);
	if (!v)
		return SOCK_PROCEED;
	svc = *v;
	/* Refused at once with EPERM (kube-proxy's OUTPUT rule drops the
	 * SYNs instead, and the connect times out). */
	if (!src_range_allows_node(&svc)) {
		compat_set_retval(-EPERM);
		return SOCK_REJECT;
	}
	if (svc.count == 0) {
		if (svc.flags & SVC_F_REJECT) {
			stat_inc(STAT_REJECT);
			compat_set_retval(-ECONNREFUSED);
			return SOCK_REJECT;
		}
		stat_inc(STAT_DROP_NO_BACKEND);
		return SOCK_PROCEED;
	}
	cookie = bpf_get_socket_cookie(ctx);
	if (choose_backend(&node_client,
			   jhash_3words((__u32)cookie, (__u32)(cookie >> 32),
					addr_fold(&key.vip) ^ ((__u32)key.port << 16 | key.proto), cfg_hash_seed),
			   &key, &svc, compat_now(), be)) {
		be->port = 0;
		stat_inc(STAT_DROP_NO_BACKEND);
		return SOCK_PROCEED;
	}
	fresh = sock_remember(cookie, be, &key);
	if (fresh < 0) {
		/* Without the record the answers would show the backend. */
		be->port = 0;
		stat_inc(STAT_DROP_MAP_FULL);
		compat_set_retval(-ENOMEM);
		return SOCK_REJECT;
	}
	if (fresh) {
		rec = bpf_map_lookup_elem(&tlb_backend_stats, &be->id);
		if (rec)
			rec->flows += 1;
	}
	stat_inc(STAT_SOCK_XLATE);
	return SOCK_PROCEED;
}

/* sock_frontend returns the frontend a socket of this node sent to when
 * addr:port is the backend it was sent to, or NULL. */
static __always_inline struct sock_revnat_value *sock_frontend(struct bpf_sock_addr *ctx,
							       const union tlb_addr *addr, __be16 port)
{
	struct sock_revnat_key k = {};
	struct sock_revnat_value *v;

	if (!sock_in_node(ctx))
		return 0;
	k.cookie = bpf_get_socket_cookie(ctx);
	k.addr = *addr;
	k.port = port;
	v = bpf_map_lookup_elem(&tlb_sock_revnat, &k);
	if (v)
		stat_inc(STAT_SOCK_REVNAT);
	return v;
}

/* sock_addr6 is an IPv6 socket's address (an IPv4 peer of a dual-stack
 * socket IPv4-mapped, as tlb_addr keeps it). user_ip6 is read a word at a
 * time, as the verifier allows. */
static __always_inline union tlb_addr sock_addr6(const struct bpf_sock_addr *ctx)
{
	union tlb_addr a = { .v6 = { ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3] } };

	return a;
}

static __always_inline void sock_set_addr6(struct bpf_sock_addr *ctx, const union tlb_addr *a)
{
	ctx->user_ip6[0] = a->v6[0];
	ctx->user_ip6[1] = a->v6[1];
	ctx->user_ip6[2] = a->v6[2];
	ctx->user_ip6[3] = a->v6[3];
}

/* sock_balance4 translates a connect or sendmsg of an IPv4 socket. */
static __always_inline int sock_balance4(struct bpf_sock_addr *ctx)
{
	union tlb_addr vip = addr_from4(ctx->user_ip4);
	struct backend_value be;
	int ret = sock_choose(ctx, &vip, (__be16)ctx->user_port, &be);

	if (be.port && addr_is4(&be.addr)) {
		ctx->user_ip4 = addr_v4(&be.addr);
		ctx->user_port = be.port;
	}
	return ret;
}

/* sock_balance6 translates a connect or sendmsg of an IPv6 socket: to an
 * IPv6 frontend, or to an IPv4 one IPv4-mapped (a dual-stack socket, as
 * Java's). */
static __always_inline int sock_balance6(struct bpf_sock_addr *ctx)
{
	union tlb_addr vip = sock_addr6(ctx);
	struct backend_value be;
	int ret = sock_choose(ctx, &vip, (__be16)ctx->user_port, &be);

	if (be.port) {
		sock_set_addr6(ctx, &be.addr);
		ctx->user_port = be.port;
	}
	return ret;
}

/* sock_unbalance4 shows an IPv4 socket's frontend for its backend. */
static __always_inline void sock_unbalance4(struct bpf_sock_addr *ctx)
{
	union tlb_addr peer = addr_from4(ctx->user_ip4);
	struct sock_revnat_value *v = sock_frontend(ctx, &peer, (__be16)ctx->user_port);

	if (v && addr_is4(&v->addr)) {
		ctx->user_ip4 = addr_v4(&v->addr);
		ctx->user_port = v->port;
	}
}

/* sock_unbalance6 shows an IPv6 socket's frontend for its backend. */
static __always_inline void sock_unbalance6(struct bpf_sock_addr *ctx)
{
	union tlb_addr peer = sock_addr6(ctx);
	struct sock_revnat_value *v = sock_frontend(ctx, &peer, (__be16)ctx->user_port);

	if (v) {
		sock_set_addr6(ctx, &v->addr);
		ctx->user_port = v->port;
	}
}

SEC("cgroup/connect4")
int sock_connect4(struct bpf_sock_addr *ctx)
{
	return sock_balance4(ctx);
}

SEC("cgroup/sendmsg4")
int sock_sendmsg4(struct bpf_sock_addr *ctx)
{
	return sock_balance4(ctx);
}

SEC("cgroup/recvmsg4")
int sock_recvmsg4(struct bpf_sock_addr *ctx)
{
	sock_unbalance4(ctx);
	return SOCK_PROCEED;
}

SEC("cgroup/getpeername4")
int sock_getpeername4(struct bpf_sock_addr *ctx)
{
	sock_unbalance4(ctx);
	return SOCK_PROCEED;
}

SEC("cgroup/connect6")
int sock_connect6(struct bpf_sock_addr *ctx)
{
	return sock_balance6(ctx);
}

SEC("cgroup/sendmsg6")
int sock_sendmsg6(struct bpf_sock_addr *ctx)
{
	return sock_balance6(ctx);
}

SEC("cgroup/recvmsg6")
int sock_recvmsg6(struct bpf_sock_addr *ctx)
{
	sock_unbalance6(ctx);
	return SOCK_PROCEED;
}

SEC("cgroup/getpeername6")
int sock_getpeername6(struct bpf_sock_addr *ctx)
{
	sock_unbalance6(ctx);
	return SOCK_PROCEED;
}

char _license[] SEC("license") = "Dual BSD/GPL";
