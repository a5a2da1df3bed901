/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The load-balancing core every hook calls: conntrack, backend choice, the
 * NAT decision (nat.h) and where the translated packet goes (fwd.h). It
 * never touches the packet; the hook applies the rewrite with the checksum
 * method that fits it, then forwards.
 *
 * Map lookups per packet (docs/datapath.md, "The hit path"):
 *   established forward packet: tlb_conntrack, tlb_backend_stats
 *   reply:                      tlb_conntrack, tlb_stats
 * Everything else (state changes, refreshing expiry and the peer entry,
 * the registry check of a SYN, new flows with their FIB lookups, resolving
 * a forwarding target again) is the rare path. */
#ifndef TOPOLB_LB_H
#define TOPOLB_LB_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "anchors.h"
#include "consts.h"
#include "structs.h"
#include "maps.h"
#include "nat.h"
#include "parse.h"
#include "srcrange.h"
#include "stats.h"

#ifndef LB_SCOPE_DEFAULT
#error "entry file must define LB_SCOPE_DEFAULT before including lb.h"
#endif

/* Node configuration, fixed at load time (the verifier prunes dead
 * branches). */

/* cfg_scope is the frontend scope this hook balances (enum scope): tc on
 * pod veths SCOPE_INTERNAL, XDP on uplinks SCOPE_EXTERNAL. */
volatile const __u8 cfg_scope = LB_SCOPE_DEFAULT;
/* cfg_hash_seed seeds the flow hash; must match on every program of a node
 * so every hook would pick the same slot. */
volatile const __u32 cfg_hash_seed = 0x746c6221;

#define rol32(v, s) (((v) << (s)) | ((v) >> (32 - (s))))

/* jhash_3words from the kernel's jhash.h (Bob Jenkins' lookup3 final mix). */
static __always_inline __u32 jhash_3words(__u32 a, __u32 b, __u32 c, __u32 initval)
{
	a += 0xdeadbeef + (3 << 2) + initval;
	b += 0xdeadbeef + (3 << 2) + initval;
	c += 0xdeadbeef + (3 << 2) + initval;
	c ^= b; c -= rol32(b, 14);
	a ^= c; a -= rol32(c, 11);
	b ^= a; b -= rol32(a, 25);
	c ^= b; c -= rol32(b, 16);
	a ^= c; a -= rol32(c, 4);
	b ^= a; b -= rol32(a, 14);
	c ^= b; c -= rol32(b, 24);
	return c;
}

static __always_inline __u32 flow_hash(const struct packet *pkt)
{
	return jhash_3words(pkt->saddr, pkt->daddr,
			    ((__u32)pkt->sport << 16 | pkt->dport) ^ pkt->proto,
			    cfg_hash_seed);
}

static __always_inline int is_syn(const struct packet *pkt)
{
	return (pkt->tcp_flags & (TCP_F_SYN | TCP_F_ACK)) == TCP_F_SYN;
}

/* ct_lifetime is how long an entry in state lives without packets, in ns. */
static __always_inline __u64 ct_lifetime(__u8 state)
{
	switch (state) {
	case CT_TCP_ESTABLISHED:
		return CT_TIMEOUT_TCP_ESTABLISHED * NSEC_PER_SEC;
	case CT_TCP_CLOSING:
		return CT_TIMEOUT_TCP_CLOSING * NSEC_PER_SEC;
	case CT_UDP:
		return CT_TIMEOUT_UDP * NSEC_PER_SEC;
	default:
		return CT_TIMEOUT_TCP_SYN * NSEC_PER_SEC;
	}
}

/* ct_first_state is the state of a flow created by pkt. */
static __always_inline __u8 ct_first_state(const struct packet *pkt)
{
	if (pkt->proto != IP_PROTO_TCP)
		return CT_UDP;
	if (pkt->tcp_flags & (TCP_F_FIN | TCP_F_RST))
		return CT_TCP_CLOSING;
	return CT_TCP_SYN_SENT;
}

/* ct_next_state is the state after pkt, seen in direction dir: FIN or RST
 * either way closes, the first reply establishes. States never go back. */
static __always_inline __u8 ct_next_state(__u8 state, __u8 dir, const struct packet *pkt)
{
	if (pkt->proto != IP_PROTO_TCP)
		return state;
	if (pkt->tcp_flags & (TCP_F_FIN | TCP_F_RST))
		return CT_TCP_CLOSING;
	if (state == CT_TCP_SYN_SENT && dir == CT_REVERSE)
		return CT_TCP_ESTABLISHED;
	return state;
}

/* ct_peer_key fills the key of the other direction's entry of the flow
 * that pkt matched as ct. */
static __always_inline void ct_peer_key(const struct packet *pkt, const struct ct_value *ct,
					struct ct_key *peer)
{
	int snat = ct->flags & CT_F_SNAT;

	peer->proto = pkt->proto;
	if (ct->dir == CT_FORWARD) {
		peer->saddr = ct->addr;
		peer->sport = ct->port;
		peer->daddr = snat ? ct->nat_addr : pkt->saddr;
		peer->dport = snat ? ct->nat_port : pkt->sport;
	} else {
		peer->saddr = snat ? ct->nat_addr : pkt->daddr;
		peer->sport = snat ? ct->nat_port : pkt->dport;
		peer->daddr = ct->addr;
		peer->dport = ct->port;
	}
}

/* ct_touch applies pkt's state change to the flow and refreshes its
 * expiry when it is more than CT_REFRESH_INTERVAL stale, in both
 * directions' entries: a one-way stream keeps its other half. Both
 * entries' forwarding targets are then resolved again by their next
 * packets (fwd_mark_stale). Rare: the peer is looked up at most once a
 * second per flow, plus state changes. */
static __always_inline void ct_touch(const struct packet *pkt, struct ct_value *ct, __u64 now)
{
	__u8 state = ct_next_state(ct->state, ct->dir, pkt);
	__u64 expires = now + ct_lifetime(state);
	struct ct_key peer_key = {};
	struct ct_value *peer;

	if (state == ct->state && expires <= ct->expires + CT_REFRESH_INTERVAL * NSEC_PER_SEC)
		return;
	ct->state = state;
	ct->expires = expires;
	fwd_mark_stale(ct);
	ct_peer_key(pkt, ct, &peer_key);
	peer = bpf_map_lookup_elem(&tlb_conntrack, &peer_key);
	if (peer) {
		peer->state = state;
		peer->expires = expires;
		fwd_mark_stale(peer);
	}
}

/* syn_reopens reports whether a SYN on an established flow starts a new
 * one: when the flow is closing, or its backend is no longer active in its
 * frontend's set (draining). */
static __always_inline int syn_reopens(const struct ct_value *ct)
{
	struct registry_value *reg;

	if (ct->state == CT_TCP_CLOSING)
		return 1;
	reg = bpf_map_lookup_elem(&tlb_registry, &ct->backend_id);
	return !reg || reg->state != BACKEND_ACTIVE || reg->gen != ct->backend_gen ||
	       reg->svc_id != ct->svc_id;
}

/* ct_forward_hit translates a packet of an established flow. Returns
 * LB_CONTINUE when the flow cannot be honoured (expired, backend gone, a
 * SYN reopening it): the packet is then balanced as a new flow. */
static __always_inline int ct_forward_hit(const struct packet *pkt, struct ct_value *ct,
					  struct nat *nat)
{
	__u64 now = bpf_ktime_get_coarse_ns();
	struct backend_stats *rec;

	if (now > ct->expires) {
		stat_inc(STAT_CT_EXPIRED);
		return LB_CONTINUE;
	}
	/* The one lookup that both validates and counts. */
	rec = bpf_map_lookup_elem(&tlb_backend_stats, &ct->backend_id);
	if (!rec || rec->gen != ct->backend_gen) {
		stat_inc(STAT_CT_STALE_BACKEND);
		return LB_CONTINUE;
	}
	if (is_syn(pkt) && syn_reopens(ct)) {
		stat_inc(STAT_CT_SYN_REOPEN);
		return LB_CONTINUE;
	}
	ct_touch(pkt, ct, now);
	rec->packets += 1;
	rec->bytes += pkt->l3_len;
	nat_forward(nat, ct);
	return LB_REWRITE;
}

/* ct_reverse_hit translates a reply back to the frontend address. Replies
 * are translated even after the backend left the set: the client must only
 * ever see the service address. */
static __always_inline int ct_reverse_hit(const struct packet *pkt, struct ct_value *ct,
					  struct nat *nat)
{
	__u64 now = bpf_ktime_get_coarse_ns();

	if (now > ct->expires) {
		stat_inc(STAT_CT_EXPIRED);
		return LB_CONTINUE;
	}
	ct_touch(pkt, ct, now);
	stat_inc(STAT_REVERSE_NAT);
	nat_reverse(nat, ct);
	return LB_REWRITE;
}

/* ct_lookup returns pkt's conntrack entry (its own direction's), or NULL. */
static __always_inline struct ct_value *ct_lookup(const struct packet *pkt)
{
	struct ct_key key = {
		.saddr = pkt->saddr,
		.daddr = pkt->daddr,
		.sport = pkt->sport,
		.dport = pkt->dport,
		.proto = pkt->proto,
	};

	return bpf_map_lookup_elem(&tlb_conntrack, &key);
}

/* lb_stack_reply translates back a reply that the node's own stack sends
 * (seen at a tcx egress): a host-network backend on this node answering a
 * flow that was translated to one of the node's addresses. No program saw
 * such a reply arrive, so this is the only place it can be translated.
 * Returns LB_REWRITE with nat filled when pkt is such a reply of a live
 * flow, LB_PASS otherwise. */
static __always_inline int lb_stack_reply(const struct packet *pkt, struct nat *nat)
{
	struct ct_value *ct = ct_lookup(pkt);

	if (!ct || ct->dir != CT_REVERSE)
		return LB_PASS;
	if (ct_reverse_hit(pkt, ct, nat) != LB_REWRITE)
		return LB_PASS;
	return LB_REWRITE;
}

/* pick_backend copies the backend for slot hash % count of the service's
 * active buffer into be. Returns 0 on success. */
static __always_inline int pick_backend(const struct svc_value *svc, __u32 hash,
					struct backend_value *be)
{
	struct backend_key key = {
		.svc_id = svc->id,
		.slot = hash % svc->count,
		.buffer = svc->buffer,
	};
	struct backend_value *v = bpf_map_lookup_elem(&tlb_backends, &key);

	if (!v)
		return -1;
	*be = *v;
	return 0;
}

/* affinity_pick copies the client's remembered backend into be when the
 * memory has not expired and that backend is still active in this
 * frontend's set under the same id and generation. Returns 0 then. */
static __always_inline int affinity_pick(__be32 client, const struct svc_value *svc,
					 __u64 now, struct backend_value *be)
{
	struct affinity_key key = { .client = client, .svc_id = svc->id };
	struct affinity_value *a = bpf_map_lookup_elem(&tlb_affinity, &key);
	struct registry_value *reg;
	struct backend_stats *rec;
	__u64 expires;

	if (!a || now > a->expires)
		return -1;
	reg = bpf_map_lookup_elem(&tlb_registry, &a->backend_id);
	if (!reg || reg->svc_id != svc->id || reg->state != BACKEND_ACTIVE ||
	    reg->gen != a->backend_gen)
		return -1;
	/* A released id keeps its registry entry; its generation tells. */
	rec = bpf_map_lookup_elem(&tlb_backend_stats, &a->backend_id);
	if (!rec || rec->gen != a->backend_gen)
		return -1;
	be->addr = reg->addr;
	be->port = reg->port;
	be->flags = reg->flags;
	be->id = a->backend_id;
	be->gen = a->backend_gen;
	expires = now + (__u64)svc->affinity_timeout * NSEC_PER_SEC;
	if (expires > a->expires + CT_REFRESH_INTERVAL * NSEC_PER_SEC)
		a->expires = expires;
	return 0;
}

/* affinity_remember records be as the client's backend for svc. */
static __always_inline void affinity_remember(__be32 client, const struct svc_value *svc,
					      __u64 now, const struct backend_value *be)
{
	struct affinity_key key = { .client = client, .svc_id = svc->id };
	struct affinity_value v = {
		.backend_id = be->id,
		.backend_gen = be->gen,
		.expires = now + (__u64)svc->affinity_timeout * NSEC_PER_SEC,
	};

	/* Losing the memory only costs stickiness; the flow goes on. */
	bpf_map_update_elem(&tlb_affinity, &key, &v, BPF_ANY);
}

/* ct_put inserts an entry, or overwrites an existing one. Returns the
 * number of entries overwritten (0 or 1), or -1 when the map refused. */
static __always_inline int ct_put(const struct ct_key *key, const struct ct_value *v)
{
	/* NOEXIST fails cheaply on an existing key, which tells replaced
	 * entries apart without a lookup on the common path. */
	if (!bpf_map_update_elem(&tlb_conntrack, key, v, BPF_NOEXIST))
		return 0;
	if (bpf_map_update_elem(&tlb_conntrack, key, v, BPF_ANY))
		return -1;
	return 1;
}

/* flow_create records both directions of a new flow of pkt to backend be
 * of service svc_id, each with where its translated packets go, and fills
 * nat for pkt. A flow from outside (scope external) to a backend on
 * another node is also source-NATed: to the address the FIB prefers on
 * the way to the backend and a port snat_claim finds free, so the
 * backend's replies come back here. iif is the interface pkt arrived on.
 * Returns the number of existing entries it overwrote, or -1 (counted)
 * when the flow cannot be created. */
static __always_inline int flow_create(void *ctx, __u32 iif, const struct packet *pkt, __u32 svc_id,
				       const struct backend_value *be, __u64 now, struct nat *nat)
{
	int snat = cfg_scope == SCOPE_EXTERNAL && !(be->flags & BACKEND_F_NODE_LOCAL);
	__u8 state = ct_first_state(pkt);
	__u64 expires = now + ct_lifetime(state);
	struct ct_key fwd_key = {
		.saddr = pkt->saddr,
		.daddr = pkt->daddr,
		.sport = pkt->sport,
		.dport = pkt->dport,
		.proto = pkt->proto,
	};
	struct ct_value fwd = {
		.addr = be->addr,
		.port = be->port,
		.dir = CT_FORWARD,
		.state = state,
		.svc_id = svc_id,
		.backend_id = be->id,
		.backend_gen = be->gen,
		.expires = expires,
	};
	struct ct_key rev_key = {
		.saddr = be->addr,
		.daddr = pkt->saddr,
		.sport = be->port,
		.dport = pkt->sport,
		.proto = pkt->proto,
	};
	struct ct_value rev = {
		.addr = pkt->daddr,
		.port = pkt->dport,
		.dir = CT_REVERSE,
		.state = state,
		.svc_id = svc_id,
		.backend_id = be->id,
		.backend_gen = be->gen,
		.expires = expires,
	};
	struct fwd_target to_backend, to_client;
	int rev_replaced = 0, fwd_replaced;
	__be32 src;

	src = fwd_resolve(ctx, iif, pkt->saddr, be->addr, pkt->proto, snat, snat, &to_backend);
	if (snat && !src) {
		stat_inc(STAT_DROP_SNAT_NO_ROUTE);
		return -1;
	}
	/* Replies arrive where the forward packets leave. */
	fwd_resolve(ctx, to_backend.ifindex ? to_backend.ifindex : iif, pkt->daddr, pkt->saddr, pkt->proto,
		    0, 0, &to_client);
	fwd_to_ct(&fwd, &to_backend);
	fwd_to_ct(&rev, &to_client);

	/* Reverse first: a forward entry without its reverse would leak
	 * backend addresses to the client. */
	if (snat) {
		fwd.flags = rev.flags = CT_F_SNAT;
		rev.nat_addr = pkt->saddr;
		rev.nat_port = pkt->sport;
		rev_key.daddr = src;
		if (snat_claim(flow_hash(pkt), &rev_key, &rev))
			return -1;
		fwd.nat_addr = src;
		fwd.nat_port = rev_key.dport;
		stat_inc(STAT_SNAT_FLOWS);
	} else {
		rev_replaced = ct_put(&rev_key, &rev);
		if (rev_replaced < 0) {
			stat_inc(STAT_DROP_MAP_FULL);
			return -1;
		}
	}
	fwd_replaced = ct_put(&fwd_key, &fwd);
	if (fwd_replaced < 0) {
		stat_inc(STAT_DROP_MAP_FULL);
		return -1;
	}
	stat_inc(fwd_stat(to_backend.kind));
	stat_inc(fwd_stat(to_client.kind));
	nat_forward(nat, &fwd);
	nat->fwd.nexthop = to_backend.nexthop;
	nat->ct = NULL;
	return rev_replaced + fwd_replaced;
}

/* choose_backend picks the backend of a new flow of client to svc: the
 * client's remembered one for affinity frontends, else slot hash % count.
 * Returns 0 on success. */
static __always_inline int choose_backend(__be32 client, __u32 hash, const struct svc_key *key,
					  struct svc_value *svc, __u64 now,
					  struct backend_value *be)
{
	struct svc_value *v;

	if (svc->flags & SVC_F_AFFINITY) {
		if (!affinity_pick(client, svc, now, be)) {
			stat_inc(STAT_AFFINITY_HIT);
			return 0;
		}
		stat_inc(STAT_AFFINITY_NEW);
	}
	if (!pick_backend(svc, hash, be))
		goto chosen;
	/* The buffer we read may have been retired between the two lookups;
	 * the service entry then points at the new one. */
	v = bpf_map_lookup_elem(&tlb_services, key);
	if (!v || v->count == 0)
		return -1;
	*svc = *v;
	if (pick_backend(svc, hash, be))
		return -1;
chosen:
	if (svc->flags & SVC_F_AFFINITY)
		affinity_remember(client, svc, now, be);
	return 0;
}

/* lb_new_flow balances the first packet of a flow to a frontend of this
 * hook's scope. had_entry says the packet matched a conntrack entry that
 * could not be honoured. Returns LB_PASS when pkt is not addressed to a
 * frontend, LB_REJECT when the frontend has no active backend and asks
 * for rejects (the hook answers, reject.h, and counts). */
static __always_inline int lb_new_flow(void *ctx, __u32 iif, const struct packet *pkt, int had_entry,
				       struct nat *nat)
{
	struct svc_key key = {
		.vip = pkt->daddr,
		.port = pkt->dport,
		.proto = pkt->proto,
		.scope = cfg_scope,
	};
	struct backend_value be;
	struct backend_stats *rec;
	struct svc_value svc, *v;
	int replaced;
	__u64 now;

	v = bpf_map_lookup_elem(&tlb_services, &key);
	if (!v)
		return LB_PASS;
	svc = *v;
	if (!src_range_allows(&svc, pkt->saddr))
		return LB_DROP;
	if (!had_entry && pkt->proto == IP_PROTO_TCP && !(pkt->tcp_flags & TCP_F_SYN))
		stat_inc(STAT_TCP_MIDFLOW_MISS);
	if (svc.count == 0) {
		if (svc.flags & SVC_F_REJECT)
			return LB_REJECT;
		stat_inc(STAT_DROP_NO_BACKEND);
		return LB_DROP;
	}

	now = bpf_ktime_get_coarse_ns();
	if (choose_backend(pkt->saddr, flow_hash(pkt), &key, &svc, now, &be)) {
		stat_inc(STAT_DROP_NO_BACKEND);
		return LB_DROP;
	}
	replaced = flow_create(ctx, iif, pkt, svc.id, &be, now, nat);
	if (replaced < 0)
		return LB_DROP;
	stat_inc(STAT_CT_CREATED);
	if (replaced)
		stat_add(STAT_CT_REPLACED, replaced);

	rec = bpf_map_lookup_elem(&tlb_backend_stats, &be.id);
	if (rec) {
		rec->flows += 1;
		rec->packets += 1;
		rec->bytes += pkt->l3_len;
	}
	return LB_REWRITE;
}

/* lb_process decides what happens to a parsed TCP/UDP packet that arrived
 * on iif: pass, drop, or rewrite as nat says and forward along nat->fwd. */
static __always_inline int lb_process(void *ctx, __u32 iif, const struct packet *pkt, struct nat *nat)
{
	struct ct_value *ct = ct_lookup(pkt);
	int ret;

	if (!ct)
		return lb_new_flow(ctx, iif, pkt, 0, nat);
	if (ct->dir == CT_REVERSE)
		ret = ct_reverse_hit(pkt, ct, nat);
	else
		ret = ct_forward_hit(pkt, ct, nat);
	if (ret != LB_CONTINUE)
		return ret;
	return lb_new_flow(ctx, iif, pkt, 1, nat);
}

/* lb_classify runs the parser and the core; shared prologue of every hook. */
static __always_inline int lb_classify(void *ctx, __u32 iif, void *data, void *data_end, __u32 frame_len,
				       struct packet *pkt, struct nat *nat)
{
	switch (parse_packet(data, data_end, frame_len, pkt)) {
	case PARSE_OK:
		return lb_process(ctx, iif, pkt, nat);
	case PARSE_FRAGMENT:
		stat_inc(STAT_FRAGMENT);
		return LB_PASS;
	case PARSE_ERROR:
		stat_inc(STAT_DROP_PARSE_ERROR);
		return LB_DROP;
	case PARSE_ICMP:
		return LB_ICMP;
	default:
		return LB_PASS;
	}
}

#endif
