/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The load-balancing core every hook calls: conntrack, backend choice, the
 * NAT decision (nat.h) and where the translated packet goes (fwd.h). It
 * never touches the packet; the hook applies the rewrite with the checksum
 * method that fits it, then forwards.
 *
 * Map lookups per packet (docs/datapath.md, "The hit path"):
 *   established forward packet: tlb_conntrack (its counters are in the
 *                               entry; a gone backend's flows are marked
 *                               stale by the agent)
 *   established reply:          tlb_conntrack, tlb_stats
 *   a flow not established yet: tlb_ct_new after a tlb_conntrack miss
 * Everything else (state changes, refreshing expiry and the peer entry,
 * promotion into tlb_conntrack, the registry check of a SYN, new flows
 * with their per-source budget and FIB lookups, resolving a forwarding
 * target again) is the rare path. */
#ifndef TOPOLB_LB_H
#define TOPOLB_LB_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "anchors.h"
#include "compat.h"
#include "consts.h"
#include "ct.h"
#include "gcra.h"
#include "structs.h"
#include "maps.h"
#include "nat.h"
#include "parse.h"
#include "srcrange.h"
#include "stats.h"

#ifndef LB_SCOPE_DEFAULT
#error "entry file must define LB_SCOPE_DEFAULT before including lb.h"
#endif

/* LB_FRAME is the hook's context type when it has a frame (struct xdp_md,
 * struct __sk_buff: both name it data and data_end); a hook without one
 * (the socket hooks, which never balance a packet) defines LB_NO_FRAME.
 * lb_frame_creates_state reads the frame again from the context, on the
 * new-flow path only: passing the frame pointers down would cost tc's
 * stack, which is at its limit. */
#if defined(LB_FRAME)
#define lb_frame_creates_state(ctx, pkt)                                                    \
	frame_creates_state((void *)(long)((LB_FRAME *)(ctx))->data,                       \
			    (void *)(long)((LB_FRAME *)(ctx))->data_end, pkt)
#elif defined(LB_NO_FRAME)
#define lb_frame_creates_state(ctx, pkt) 1
#else
#error "entry file must define LB_FRAME (its context type) or LB_NO_FRAME before including lb.h"
#endif

/* Node configuration, fixed at load time (the verifier prunes dead
 * branches). */

/* cfg_scope is the frontend scope this hook balances (enum scope): tc on
 * pod veths SCOPE_INTERNAL, XDP on uplinks SCOPE_EXTERNAL. */
volatile const __u8 cfg_scope = LB_SCOPE_DEFAULT;
/* cfg_hash_seed seeds the flow hash; must match on every program of a node
 * so every hook would pick the same slot. */
volatile const __u32 cfg_hash_seed = 0x746c6221;
/* cfg_ct_src_interval and cfg_ct_src_burst are the per-source budget of
 * new flows (enum ct_src_limit): one flow every interval ns, bursts of
 * up to burst. Interval 0: no limit. */
volatile const __u64 cfg_ct_src_interval = NSEC_PER_SEC / CT_SRC_RATE_DEFAULT;
volatile const __u32 cfg_ct_src_burst = CT_SRC_RATE_DEFAULT;

/* After the node configuration, which it reads (cfg_scope). */
#include "frag.h"

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

/* ct_lifetime is how long an entry in state with flags lives without
 * packets, in ns. Only an assured TCP flow gets the long lifetime; a
 * source-NATed flow the backend has not answered yet gets the short one
 * (enum ct_timeout says why). */
static __always_inline __u64 ct_lifetime(__u8 state, __u8 flags)
{
	if (state == CT_TCP_CLOSING)
		return CT_TIMEOUT_TCP_CLOSING * NSEC_PER_SEC;
	if ((flags & (CT_F_SNAT | CT_F_REPLIED)) == CT_F_SNAT)
		return CT_TIMEOUT_SNAT_UNREPLIED * NSEC_PER_SEC;
	if (state == CT_UDP)
		return CT_TIMEOUT_UDP * NSEC_PER_SEC;
	if (state == CT_TCP_ESTABLISHED && (flags & CT_F_ASSURED))
		return CT_TIMEOUT_TCP_ESTABLISHED * NSEC_PER_SEC;
	return CT_TIMEOUT_TCP_SYN * NSEC_PER_SEC;
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
 * that pkt matched as ct. The agent's sweep mirrors it (ctPeerKey in
 * maps/conntrack.go): change both together. */
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

/* ct_is_peer reports whether peer, found under the key ct_peer_key gave
 * for ct (matched by pkt), is the other direction of ct's flow, and not
 * the entry of a flow that took the key over (an expired SNAT port
 * reclaimed, the same client port to another frontend). */
static __always_inline int ct_is_peer(const struct packet *pkt, const struct ct_value *ct,
				      const struct ct_value *peer)
{
	int snat = ct->flags & CT_F_SNAT;

	if (peer->dir == ct->dir || peer->backend_id != ct->backend_id || peer->backend_gen != ct->backend_gen)
		return 0;
	/* A reply's addr:port is the frontend, the forward packet's
	 * destination; with SNAT its nat pair is the client, the forward
	 * packet's source. A forward entry's addr:port is the backend, the
	 * reply's source; with SNAT its nat pair is the node's, the reply's
	 * destination. */
	if (ct->dir == CT_FORWARD)
		return peer->addr == pkt->daddr && peer->port == pkt->dport &&
		       (!snat || (peer->nat_addr == pkt->saddr && peer->nat_port == pkt->sport));
	return peer->addr == pkt->saddr && peer->port == pkt->sport &&
	       (!snat || (peer->nat_addr == pkt->daddr && peer->nat_port == pkt->dport));
}

/* ct_client is the client address of the flow whose entry ct pkt
 * matched: the forward packet's source, the reply's destination (before
 * the reverse source NAT). */
static __always_inline __be32 ct_client(const struct packet *pkt, const struct ct_value *ct)
{
	if (ct->dir == CT_FORWARD)
		return pkt->saddr;
	return ct->flags & CT_F_SNAT ? ct->nat_addr : pkt->daddr;
}

/* ct_src_take takes one new flow from src's budget (tlb_ct_src). Returns
 * 0 when it is spent. A source not in the table (new, or forgotten by the
 * LRU) starts with a full budget. */
static __always_inline int ct_src_take(__be32 src, __u64 now)
{
	struct ct_src *b, fresh = {};

	if (!cfg_ct_src_interval)
		return 1;
	b = bpf_map_lookup_elem(&tlb_ct_src, &src);
	if (b)
		return gcra_take(&b->tat, now, cfg_ct_src_interval, cfg_ct_src_burst);
	gcra_take(&fresh.tat, now, cfg_ct_src_interval, cfg_ct_src_burst);
	/* Losing the record only refills the budget. */
	bpf_map_update_elem(&tlb_ct_src, &src, &fresh, BPF_NOEXIST);
	return 1;
}

/* ct_src_give gives src back the share of a flow that got promoted: a
 * client whose handshakes complete never runs out. */
static __always_inline void ct_src_give(__be32 src)
{
	struct ct_src *b;

	if (!cfg_ct_src_interval)
		return;
	b = bpf_map_lookup_elem(&tlb_ct_src, &src);
	if (b)
		gcra_give(&b->tat, cfg_ct_src_interval);
}

/* ct_move writes both entries of a flow, a (under key) and b (under
 * peer_key), into the table their flags name and deletes them from the
 * other: a promotion into tlb_conntrack or a demotion out of it. The peer
 * first, undone when the second insert fails, so the two live and die
 * together; both stay in the old table until both are in the new one.
 * Returns a's entry in its new table, or NULL when the insert was refused
 * (tlb_conntrack full; an LRU insert does not fail for room): then
 * nothing moved. */
static __always_inline struct ct_value *ct_move(const struct ct_key *key, const struct ct_value *a,
						const struct ct_key *peer_key, const struct ct_value *b)
{
	__u8 to = a->flags, from = to ^ CT_F_ASSURED;
	void *table = to & CT_F_ASSURED ? (void *)&tlb_conntrack : (void *)&tlb_ct_new;

	if (bpf_map_update_elem(table, peer_key, b, BPF_ANY))
		return NULL;
	if (bpf_map_update_elem(table, key, a, BPF_ANY)) {
		bpf_map_delete_elem(table, peer_key);
		return NULL;
	}
	ct_delete_in(from, key);
	ct_delete_in(from, peer_key);
	return ct_find_in(to, key);
}

/* ct_fold adds the forward entry ct, about to be deleted, to its
 * backend's record (one flow, its packets and bytes) while the backend
 * still holds its id: the agent reads a flow's counts from its entry while
 * it lives, from the record after. Rare path. */
static __always_inline void ct_fold(const struct ct_value *ct)
{
	struct backend_stats *rec;

	if (ct->dir != CT_FORWARD)
		return;
	rec = bpf_map_lookup_elem(&tlb_backend_stats, &ct->backend_id);
	if (rec && rec->gen == ct->backend_gen) {
		rec->flows += 1;
		rec->packets += ct->packets;
		rec->bytes += ct->bytes;
	}
}

/* ct_touch applies pkt (seen in ct's direction, matching key) to the flow
 * when something changes: the state (FIN or RST either way closes, the
 * first reply establishes), the reply flag, or an expiry more than
 * CT_REFRESH_INTERVAL stale. It writes both directions' entries, so a
 * one-way stream keeps its other half, and marks their forwarding
 * targets to be resolved again (fwd_mark_stale). It moves the flow
 * between the tables:
 *   - promotion into tlb_conntrack. TCP: when the client sends after
 *     the reply (the handshake's last ACK), the step that proves its
 *     address answers, as netfilter's assured bit does: a spoofed SYN
 *     flood that a backend answers never gets there. UDP has no
 *     handshake: the first reply promotes (waiting for the client's next
 *     datagram would leave a request-and-answer flow that then idles,
 *     a long-lived connected socket, to the LRU's churn). Refused when
 *     the table is full: counted, and the flow goes on from tlb_ct_new,
 *     tried again at each refresh (CT_F_FULL);
 *   - demotion back to tlb_ct_new when an assured flow closes, where
 *     netfilter would early-drop it too: a closing flow must not hold
 *     room an established one needs.
 * Returns the flow's entry for pkt (moved or not), or NULL when the flow
 * lost its other direction (an LRU eviction of tlb_ct_new): a forward
 * entry is then deleted and the packet balanced as new; a reply is
 * translated by what its entry says, which is left to expire. Rare: the
 * peer is looked up at most once a second per flow, plus changes. */
static __always_inline struct ct_value *ct_touch(const struct packet *pkt, const struct ct_key *key,
						 struct ct_value *ct, __u64 now)
{
	__u8 state = ct_next_state(ct->state, ct->dir, pkt);
	__u8 flags = ct->flags | (ct->dir == CT_REVERSE ? CT_F_REPLIED : 0);
	int answered = pkt->proto == IP_PROTO_TCP ? ct->dir == CT_FORWARD : ct->dir == CT_REVERSE;
	int promote = answered && state != CT_TCP_CLOSING &&
		      (flags & (CT_F_REPLIED | CT_F_ASSURED)) == CT_F_REPLIED;
	int demote = (flags & CT_F_ASSURED) && state == CT_TCP_CLOSING;
	/* Staleness by the lifetime where the flow is: a promotion refused
	 * for a full table is tried again only once a second. */
	int stale = now + ct_lifetime(state, flags) > ct->expires + CT_REFRESH_INTERVAL * NSEC_PER_SEC;
	struct ct_key peer_key = {};
	struct ct_value *peer, *moved;
	struct ct_pair *pair;
	__u32 zero = 0;
	__u64 expires;

	if (promote)
		flags |= CT_F_ASSURED;
	if (demote)
		flags &= ~(CT_F_ASSURED | CT_F_FULL);
	expires = now + ct_lifetime(state, flags);
	if (state == ct->state && !stale && (flags == ct->flags || (promote && (ct->flags & CT_F_FULL))))
		return ct;
	ct_peer_key(pkt, ct, &peer_key);
	peer = ct_find_in(ct->flags, &peer_key);
	if (!peer || !ct_is_peer(pkt, ct, peer)) {
		/* Another CPU may be moving the flow between the tables (a
		 * promotion or demotion by a packet of the other direction):
		 * its peer is then in the other table already. Not an orphan:
		 * this packet goes on by its entry, the next finds both moved. */
		peer = ct_find_in(ct->flags ^ CT_F_ASSURED, &peer_key);
		if (peer && ct_is_peer(pkt, ct, peer))
			return ct;
		if (ct->dir == CT_REVERSE)
			return ct;
		stat_inc(STAT_CT_ORPHAN);
		ct_fold(ct);
		ct_delete_in(ct->flags, key);
		return NULL;
	}
	/* A reply of a flow whose backend is gone (the agent marked the
	 * forward entry stale): translated by its entry, nothing written,
	 * so the mark stays for the forward packet that re-balances it. */
	if (peer->flags & CT_F_STALE)
		return ct;
	/* The copies live in per-CPU scratch space, not on the stack. */
	pair = (promote || demote) ? bpf_map_lookup_elem(&tlb_ct_scratch, &zero) : NULL;
	if ((promote || demote) && !pair)
		return ct; /* cannot happen (one slot per CPU); changes nothing */
	if (pair) {
		pair->a = *ct;
		pair->b = *peer;
		pair->a.state = pair->b.state = state;
		pair->a.flags = pair->b.flags = flags & ~CT_F_FULL;
		pair->a.expires = pair->b.expires = expires;
		fwd_mark_stale(&pair->a);
		fwd_mark_stale(&pair->b);
		moved = ct_move(key, &pair->a, &peer_key, &pair->b);
		if (moved) {
			if (promote) {
				stat_inc(STAT_CT_PROMOTED);
				/* From the copy: ct's element is freed. */
				ct_src_give(ct_client(pkt, &pair->a));
			} else {
				stat_inc(STAT_CT_DEMOTED);
			}
			return moved;
		}
		/* Only a promotion can be refused: stay, and say so. */
		stat_inc(STAT_CT_PROMOTE_FULL);
		flags = (flags & ~CT_F_ASSURED) | CT_F_FULL;
		expires = now + ct_lifetime(state, flags);
	}
	ct->state = peer->state = state;
	ct->flags = peer->flags = flags;
	ct->expires = peer->expires = expires;
	fwd_mark_stale(ct);
	fwd_mark_stale(peer);
	return ct;
}

/* ct_forget deletes the flow ct (matched by pkt under key) that pkt cannot
 * continue (expired, backend gone, a SYN reopening it), both directions,
 * before pkt creates a new flow: the new entries go to tlb_ct_new, where
 * an old one left in tlb_conntrack would hide them, and an old reply
 * entry must not keep its SNAT port. The peer is deleted only while it is
 * still this flow's. Counts the entries deleted as replaced. Returns
 * LB_CONTINUE. */
static __always_inline int ct_forget(const struct packet *pkt, const struct ct_key *key, const struct ct_value *ct)
{
	struct ct_key peer_key = {};
	struct ct_value *peer;
	__u8 flags = ct->flags;
	int n = 0;

	ct_peer_key(pkt, ct, &peer_key);
	peer = ct_find_in(flags, &peer_key);
	if (peer && ct_is_peer(pkt, ct, peer))
		n += ct_delete_in(flags, &peer_key);
	ct_fold(ct);
	n += ct_delete_in(flags, key);
	if (n)
		stat_add(STAT_CT_REPLACED, n);
	return LB_CONTINUE;
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

/* ct_forward_hit translates a packet of an established flow, matched
 * under key, and counts it in the entry. Returns LB_CONTINUE when the
 * flow cannot be honoured (expired, backend gone, a SYN reopening it, its
 * reply entry lost): the flow is forgotten and the packet balanced as a
 * new flow. A gone backend costs no lookup here: the agent marks its
 * flows stale (CT_F_STALE, expired) when it releases the id, and its
 * sweep marks any flow whose generation is no longer its id's
 * (maps/stale.go). */
static __always_inline int ct_forward_hit(const struct packet *pkt, const struct ct_key *key,
					  struct ct_value *ct, struct nat *nat)
{
	__u64 now = compat_now();

	if (now > ct->expires) {
		stat_inc(ct->flags & CT_F_STALE ? STAT_CT_STALE_BACKEND : STAT_CT_EXPIRED);
		return ct_forget(pkt, key, ct);
	}
	if (is_syn(pkt) && syn_reopens(ct)) {
		stat_inc(STAT_CT_SYN_REOPEN);
		return ct_forget(pkt, key, ct);
	}
	ct = ct_touch(pkt, key, ct, now);
	if (!ct)
		return LB_CONTINUE;
	/* Per flow, not per CPU: a flow's packets come in on one queue
	 * (RSS); a lost increment under a race only undercounts. */
	ct->packets += 1;
	ct->bytes += pkt->l3_len;
	nat_forward(nat, ct);
	return LB_REWRITE;
}

/* ct_reverse_hit translates a reply back to the frontend address. Replies
 * are translated even after the backend left the set: the client must only
 * ever see the service address. */
static __always_inline int ct_reverse_hit(const struct packet *pkt, const struct ct_key *key,
					  struct ct_value *ct, struct nat *nat)
{
	__u64 now = compat_now();

	if (now > ct->expires) {
		stat_inc(STAT_CT_EXPIRED);
		return LB_CONTINUE;
	}
	ct = ct_touch(pkt, key, ct, now);
	if (!ct)
		return LB_CONTINUE;
	stat_inc(STAT_REVERSE_NAT);
	nat_reverse(nat, ct);
	return LB_REWRITE;
}

/* ct_key_of fills pkt's conntrack key (its own direction's). */
static __always_inline void ct_key_of(const struct packet *pkt, struct ct_key *key)
{
	key->saddr = pkt->saddr;
	key->daddr = pkt->daddr;
	key->sport = pkt->sport;
	key->dport = pkt->dport;
	key->proto = pkt->proto;
}

/* lb_stack_reply translates back a reply that the node's own stack sends
 * (seen at a tcx egress): a host-network backend on this node answering a
 * flow that was translated to one of the node's addresses. No program saw
 * such a reply arrive, so this is the only place it can be translated.
 * Returns LB_REWRITE with nat filled when pkt is such a reply of a live
 * flow, LB_PASS otherwise. */
static __always_inline int lb_stack_reply(const struct packet *pkt, struct nat *nat)
{
	struct ct_key key = {};
	struct ct_value *ct;

	ct_key_of(pkt, &key);
	ct = ct_find(&key);
	if (!ct || ct->dir != CT_REVERSE)
		return LB_PASS;
	if (ct_reverse_hit(pkt, &key, ct, nat) != LB_REWRITE)
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

/* ct_put inserts an entry of a new flow into tlb_ct_new, or overwrites
 * an existing one. Returns the number of entries overwritten (0 or 1), or
 * -1 when the map refused. */
static __always_inline int ct_put(const struct ct_key *key, const struct ct_value *v)
{
	/* NOEXIST fails cheaply on an existing key, which tells replaced
	 * entries apart without a lookup on the common path. */
	if (!bpf_map_update_elem(&tlb_ct_new, key, v, BPF_NOEXIST))
		return 0;
	if (bpf_map_update_elem(&tlb_ct_new, key, v, BPF_ANY))
		return -1;
	return 1;
}

/* flow_create records both directions of a new flow of pkt to backend be
 * of service svc_id in tlb_ct_new (ct_touch promotes them), each with
 * where its translated packets go, and fills
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
	__u64 expires = now + ct_lifetime(state, snat ? CT_F_SNAT : 0);
	struct ct_key fwd_key = {
		.saddr = pkt->saddr,
		.daddr = pkt->daddr,
		.sport = pkt->sport,
		.dport = pkt->dport,
		.proto = pkt->proto,
	};
	struct ct_key rev_key = {
		.saddr = be->addr,
		.daddr = pkt->saddr,
		.sport = be->port,
		.dport = pkt->sport,
		.proto = pkt->proto,
	};
	struct fwd_target to_backend, to_client;
	int rev_replaced = 0, fwd_replaced;
	struct ct_value *fwd, *rev;
	struct ct_pair *pair;
	__u32 zero = 0;
	__be32 src;

	/* The two entries are built in per-CPU scratch space, not on the
	 * stack (tc_uplink_lb's is at its limit); nothing else of this
	 * packet uses it any more (ct_touch's move is over). */
	pair = bpf_map_lookup_elem(&tlb_ct_scratch, &zero);
	if (!pair)
		return -1; /* cannot happen (one slot per CPU) */
	fwd = &pair->a;
	rev = &pair->b;
	__builtin_memset(pair, 0, sizeof(*pair));
	fwd->addr = be->addr;
	fwd->port = be->port;
	fwd->dir = CT_FORWARD;
	rev->addr = pkt->daddr;
	rev->port = pkt->dport;
	rev->dir = CT_REVERSE;
	fwd->state = rev->state = state;
	fwd->svc_id = rev->svc_id = svc_id;
	fwd->backend_id = rev->backend_id = be->id;
	fwd->backend_gen = rev->backend_gen = be->gen;
	fwd->expires = rev->expires = expires;
	/* The flow's counts live in its forward entry from its first packet
	 * on (ct_fold hands them to the backend's record when it goes). */
	fwd->packets = 1;
	fwd->bytes = pkt->l3_len;

	src = fwd_resolve(ctx, iif, pkt->saddr, be->addr, pkt->proto, snat, snat, &to_backend);
	if (snat && !src) {
		stat_inc(STAT_DROP_SNAT_NO_ROUTE);
		return -1;
	}
	/* Replies arrive where the forward packets leave. */
	fwd_resolve(ctx, to_backend.ifindex ? to_backend.ifindex : iif, pkt->daddr, pkt->saddr, pkt->proto,
		    0, 0, &to_client);
	fwd_to_ct(fwd, &to_backend);
	fwd_to_ct(rev, &to_client);

	/* Reverse first: a forward entry without its reverse would leak
	 * backend addresses to the client. */
	if (snat) {
		fwd->flags = rev->flags = CT_F_SNAT;
		rev->nat_addr = pkt->saddr;
		rev->nat_port = pkt->sport;
		rev_key.daddr = src;
		if (snat_claim(flow_hash(pkt), &rev_key, rev, now))
			return -1;
		fwd->nat_addr = src;
		fwd->nat_port = rev_key.dport;
		stat_inc(STAT_SNAT_FLOWS);
	} else {
		/* The reply key leaves out the frontend: an entry under it in
		 * tlb_conntrack is an older flow's from the same client port to
		 * the same backend through another frontend (the client reused
		 * the port). It would hide this flow's entry from the replies:
		 * delete it, as an overwrite in one table would. */
		int hidden = !bpf_map_delete_elem(&tlb_conntrack, &rev_key);

		rev_replaced = ct_put(&rev_key, rev);
		if (rev_replaced < 0) {
			stat_inc(STAT_DROP_MAP_FULL);
			return -1;
		}
		rev_replaced += hidden;
	}
	fwd_replaced = ct_put(&fwd_key, fwd);
	if (fwd_replaced < 0) {
		stat_inc(STAT_DROP_MAP_FULL);
		return -1;
	}
	stat_inc(fwd_stat(to_backend.kind));
	stat_inc(fwd_stat(to_client.kind));
	nat_forward(nat, fwd);
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
	struct svc_value svc, *v;
	int replaced;
	__u64 now;

	v = bpf_map_lookup_elem(&tlb_services, &key);
	if (!v)
		return LB_PASS;
	svc = *v;
	/* What the receiver would drop creates no state and draws no
	 * reject. */
	if (!lb_frame_creates_state(ctx, pkt)) {
		stat_inc(STAT_DROP_PARSE_ERROR);
		return LB_DROP;
	}
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

	now = compat_now();
	if (!ct_src_take(pkt->saddr, now)) {
		stat_inc(STAT_DROP_CT_SOURCE_LIMIT);
		return LB_DROP;
	}
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

	return LB_REWRITE;
}

/* lb_process decides what happens to a parsed TCP/UDP packet that arrived
 * on iif: pass, drop, or rewrite as nat says and forward along nat->fwd. */
static __always_inline int lb_process(void *ctx, __u32 iif, const struct packet *pkt, struct nat *nat)
{
	struct ct_key key = {};
	struct ct_value *ct;
	int ret;

	ct_key_of(pkt, &key);
	ct = ct_find(&key);
	if (!ct)
		return lb_new_flow(ctx, iif, pkt, 0, nat);
	if (ct->dir == CT_REVERSE)
		ret = ct_reverse_hit(pkt, &key, ct, nat);
	else
		ret = ct_forward_hit(pkt, &key, ct, nat);
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
		frag_remember(data, data_end, pkt);
		return lb_process(ctx, iif, pkt, nat);
	case PARSE_FRAGMENT:
		return frag_follow(data, data_end, pkt, 0, nat);
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
