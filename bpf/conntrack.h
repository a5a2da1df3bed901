/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* A flow's conntrack entries, one per direction, in the two tables of
 * ct.h, for both families (the IPv6 addresses are conntrack6.h's; each
 * helper taking a family, fam, is compiled per family): states and lifetimes, the other direction's key, the per-source
 * budget of new flows, promotion and demotion between the tables, and
 * what a packet of a known flow does (ct_forward_hit, ct_reverse_hit).
 * Creating a flow is flow.h's. */
#ifndef TOPOLB_CONNTRACK_H
#define TOPOLB_CONNTRACK_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "addr.h"
#include "compat.h"
#include "consts.h"
#include "conntrack6.h"
#include "ct.h"
#include "fwd.h"
#include "gcra.h"
#include "hash.h"
#include "maps.h"
#include "nat.h"
#include "node.h"
#include "packet.h"
#include "stats.h"
#include "structs.h"

/* ct_clock caches the datapath's clock (compat_now) with the tick it was
 * read in: the established packet reads the time from here, not through
 * a helper call. Per program object, in .bss; written by every CPU once
 * per tick at most. */
static struct {
	__u64 jiffies; /* bpf_jiffies64 when now was read */
	__u64 now;     /* compat_now then, in ns */
} ct_clock;

/* ct_now is the datapath's clock as of the last tick: compat_now read
 * once per tick (jiffy) and cached. bpf_jiffies64 is a load of the
 * kernel's tick count (the verifier inlines it on 64-bit JITs);
 * CLOCK_MONOTONIC_COARSE itself moves only at a tick, so the cached time
 * is behind the clock by a tick at most, and never ahead of it: conntrack
 * refreshes and expiries count in seconds. No agent keeps it: it is the
 * kernel's own tick, so it goes on across agent restarts. A concurrent
 * refill of the cache by another CPU can only leave an older time of the
 * same tick (now is written before jiffies). */
static __always_inline __u64 ct_now(void)
{
	__u64 j = bpf_jiffies64(), now;

	if (*(volatile __u64 *)&ct_clock.jiffies == j)
		return *(volatile __u64 *)&ct_clock.now;
	now = compat_now();
	*(volatile __u64 *)&ct_clock.now = now;
	*(volatile __u64 *)&ct_clock.jiffies = j;
	return now;
}

static __always_inline int is_syn(const struct packet *pkt)
{
	return (pkt->tcp_flags & (TCP_F_SYN | TCP_F_ACK)) == TCP_F_SYN;
}

/* ct_lifetime is how long an entry in state with flags lives without
 * packets, in ns. Only an assured TCP flow gets the long lifetime; a
 * source-NATed flow the backend has not answered yet, or whose client
 * has not answered the backend yet (snat_unassured), gets a short one
 * (enum ct_timeout says why). */
static __always_inline __u64 ct_lifetime(__u8 state, __u8 flags)
{
	if (state == CT_TCP_CLOSING)
		return CT_TIMEOUT_TCP_CLOSING * NSEC_PER_SEC;
	if ((flags & (CT_F_SNAT | CT_F_REPLIED)) == CT_F_SNAT)
		return CT_TIMEOUT_SNAT_UNREPLIED * NSEC_PER_SEC;
	if (snat_unassured(state, flags))
		return CT_TIMEOUT_SNAT_UNASSURED * NSEC_PER_SEC;
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
 * either way closes (ct_touch_fam takes it back when the segment is out
 * of the window), the first reply establishes. States never go back. */
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

/* ct_tcp_in_window reports whether a segment starting at seq is within
 * CT_TCP_WINDOW of next, the sequence number its direction has reached,
 * either way (serial number arithmetic: the difference wraps). */
static __always_inline int ct_tcp_in_window(__u32 next, __u32 seq)
{
	return seq - (next - CT_TCP_WINDOW) <= 2 * CT_TCP_WINDOW;
}

/* ct_tcp_close_plausible reports whether pkt, a FIN or RST in ct's
 * direction, may close the flow: it starts within the window of what
 * its direction sent (ct->tcp_next), as the endpoints' own checks want
 * it (RFC 9293 3.10.7.4, RFC 5961 3.2). A blind reset or FIN from a
 * spoofed source with a random sequence number is not. Where that is
 * unknown (the direction sent nothing yet, an entry of layout 7) the
 * peer's entry answers, once ct_touch_fam has it (ct_tcp_close_acks_peer). */
static __always_inline int ct_tcp_close_plausible(const struct ct_value *ct, const struct packet *pkt)
{
	__u32 next = ct->tcp_next;

	return !next || ct_tcp_in_window(next, pkt->tcp_seq);
}

/* ct_tcp_close_acks_peer is ct_tcp_close_plausible for a direction that
 * sent nothing we know of: pkt must acknowledge data the other direction
 * sent, within the window of what peer, its entry, says it reached (a
 * backend's reset answering the SYN acknowledges exactly the SYN, RFC
 * 9293 3.10.7.3). A flow of which neither direction is known (carried
 * over from layout 7, silent since) closes as it did there. */
static __always_inline int ct_tcp_close_acks_peer(const struct ct_value *peer, const struct packet *pkt)
{
	if (!peer->tcp_next)
		return 1;
	return (pkt->tcp_flags & TCP_F_ACK) && pkt->tcp_ack - (peer->tcp_next - CT_TCP_WINDOW) <= CT_TCP_WINDOW;
}

/* ct_tcp_learn moves ct->tcp_next, what ct's direction sent, on to the
 * end of pkt (seen in that direction): only forward, and only from a
 * segment in the window of it, so a spoofed segment with a random
 * sequence number teaches nothing. A direction not known yet learns from
 * its first segment that is neither a reset nor a FIN (the reply that
 * establishes the flow; after an upgrade from layout 7, its next
 * packet). A reset carries no data and teaches nothing. The hit path's
 * part: a few compares and at most one store into the entry it has. */
static __always_inline void ct_tcp_learn(struct ct_value *ct, const struct packet *pkt)
{
	__u32 next = ct->tcp_next;

	if (pkt->proto != IP_PROTO_TCP || (pkt->tcp_flags & TCP_F_RST))
		return;
	if (!next) {
		if (!(pkt->tcp_flags & TCP_F_FIN))
			ct->tcp_next = pkt->tcp_end;
		return;
	}
	if (ct_tcp_in_window(next, pkt->tcp_seq) && (__s32)(pkt->tcp_end - next) > 0)
		ct->tcp_next = pkt->tcp_end;
}

/* ct_iif_plausible reports whether a packet of ct's direction that
 * arrived on iif comes from where that direction's packets come from
 * (ct->iif), as strict rp_filter would have it, but by the interface the
 * flow was seen on rather than by a route: a reply must arrive where its
 * backend is, on the backend's pod veth for a local one, on an uplink
 * for a remote one. Not where a pod forging the backend's address sits,
 * nor on an uplink for a local backend. Passes:
 *   - the interface itself (the hit path's one compare, its caller's);
 *   - either unknown (0: the node's own stack, or an entry converted
 *     from layout 7, which predates the field);
 *   - another interface where neither is a pod's veth (tlb_ifaces): a
 *     path that moved between uplinks, a bond's member, an interface
 *     topolb does not attach to. Only a pod's veth tells who sent a
 *     packet; an uplink carries anyone's.
 * Rare path: two lookups, only for a packet on another interface. */
static __always_inline int ct_iif_plausible(const struct ct_value *ct, __u32 iif)
{
	__u32 want = ct->iif;
	struct iface_value *a, *b;

	if (want == iif || !want || !iif)
		return 1;
	a = bpf_map_lookup_elem(&tlb_ifaces, &want);
	b = bpf_map_lookup_elem(&tlb_ifaces, &iif);
	return !(a && a->kind == IFACE_POD) && !(b && b->kind == IFACE_POD);
}

/* ct4_peer_key fills the key of the other direction's entry of the flow
 * that pkt matched as ct. The agent's sweep mirrors it (ctPeerKey in
 * maps/conntrack.go): change both together. */
static __always_inline void ct4_peer_key(const struct packet *pkt, const struct ct_value *ct,
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

/* ct_peer_key_fam is ct4_peer_key for a flow of family fam: peer is a
 * struct ct_key or, for IPv6, a struct ct6_key. */
static __always_inline void ct_peer_key_fam(int fam, const struct packet *pkt, const struct ct_value *ct, void *peer)
{
	if (fam == PKT_IPV6)
		ct6_peer_key(pkt, ct, peer);
	else
		ct4_peer_key(pkt, ct, peer);
}

/* ct_scratch is this CPU's scratch space for the two entries of a flow
 * of family fam (tlb_ct_scratch, tlb_ct6_scratch), or NULL (cannot
 * happen: one slot per CPU). */
static __always_inline void *ct_scratch(int fam)
{
	__u32 zero = 0;

	if (fam == PKT_IPV6)
		return bpf_map_lookup_elem(&tlb_ct6_scratch, &zero);
	return bpf_map_lookup_elem(&tlb_ct_scratch, &zero);
}

/* ct_scratch_copy copies ct and peer, entries of a flow of family fam,
 * into pair, ct_scratch's space, and points a and b at the copies. */
static __always_inline void ct_scratch_copy(int fam, void *pair, const struct ct_value *ct,
					    const struct ct_value *peer, struct ct_value **a, struct ct_value **b)
{
	if (fam == PKT_IPV6) {
		struct ct6_pair *p6 = pair;

		p6->a = *ct6_of(ct);
		p6->b = *ct6_of(peer);
		*a = &p6->a.ct;
		*b = &p6->b.ct;
	} else {
		struct ct_pair *p = pair;

		p->a = *ct;
		p->b = *peer;
		*a = &p->a;
		*b = &p->b;
	}
}

/* ct_is_peer reports whether peer, found under the key ct4_peer_key gave
 * for ct (matched by pkt), is the other direction of ct's flow, and not
 * the entry of a flow that took the key over (an expired SNAT port
 * reclaimed, the same client port to another frontend). */
static __always_inline int ct_is_peer(int fam, const struct packet *pkt, const struct ct_value *ct,
				      const struct ct_value *peer)
{
	int snat = ct->flags & CT_F_SNAT;

	if (peer->dir == ct->dir || peer->backend_id != ct->backend_id || peer->backend_gen != ct->backend_gen)
		return 0;
	if (fam == PKT_IPV6)
		return ct6_is_peer_addr(pkt, ct, peer);
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

/* ct_refreshes_alone reports whether ct's entry refreshes its expiry by
 * itself, without its peer: an assured flow that is not source-NATed.
 * Its entries live in tlb_conntrack, a plain hash that never evicts, so
 * its peer cannot go missing under it (the sweep and the datapath delete
 * a flow's entries together), and each direction's packets keep their
 * own entry alive; the flow lives while either entry does (ct_peer_live,
 * and the sweep: maps/conntrack.go, peerLive). A source-NATed flow's
 * reply entry holds its SNAT port, which a new flow takes over once the
 * entry expired (snat_claim): both its entries are refreshed together,
 * as are a flow's in tlb_ct_new, where the refresh also finds a peer the
 * LRU evicted. */
static __always_inline int ct_refreshes_alone(const struct ct_value *ct)
{
	return (ct->flags & (CT_F_ASSURED | CT_F_SNAT)) == CT_F_ASSURED;
}

/* ct_peer_live reports whether the other direction of ct's flow (matched
 * by pkt) keeps the flow alive though ct expired: a flow whose entries
 * refresh alone (ct_refreshes_alone) and whose one direction was silent
 * for its lifetime (a one-way stream). A reply of a flow whose backend is
 * gone (the forward entry marked stale) is still translated. Rare path:
 * only for an expired entry. */
static __always_inline int ct_peer_live(int fam, const struct packet *pkt, const struct ct_value *ct, __u64 now)
{
	struct ct_key peer_key4 = {};
	struct ct6_key peer_key6 = {};
	void *peer_key = fam == PKT_IPV6 ? (void *)&peer_key6 : (void *)&peer_key4;
	struct ct_value *peer;

	if (!ct_refreshes_alone(ct))
		return 0;
	ct_peer_key_fam(fam, pkt, ct, peer_key);
	peer = ct_find_in(fam, CT_F_ASSURED, peer_key);
	return peer && ct_is_peer(fam, pkt, ct, peer) && (now <= peer->expires || (peer->flags & CT_F_STALE));
}

/* ct4_client is the client address of the flow whose entry ct pkt
 * matched: the forward packet's source, the reply's destination (before
 * the reverse source NAT). */
static __always_inline __be32 ct4_client(const struct packet *pkt, const struct ct_value *ct)
{
	if (ct->dir == CT_FORWARD)
		return pkt->saddr;
	return ct->flags & CT_F_SNAT ? ct->nat_addr : pkt->daddr;
}

/* ct_src_budget is the budget cell of src, a source of family fam (an
 * IPv4 address, or a union tlb_addr: the IPv6 address, which
 * ct6_src_key narrows to its budget prefix), in tlb_ct_src or
 * tlb_ct6_src; NULL cannot happen (the mask keeps the cell in range). */
static __always_inline struct ct_src *ct_src_budget(int fam, const void *src)
{
	union tlb_addr k;
	__u32 cell;

	if (fam == PKT_IPV6) {
		k = ct6_src_key(src);
		cell = jhash_3words(jhash_3words(k.v6[0], k.v6[1], k.v6[2], cfg_ct_src_seed), k.v6[3], 0,
				    cfg_ct_src_seed) & (CT_SRC_CELLS - 1);
		return bpf_map_lookup_elem(&tlb_ct6_src, &cell);
	}
	cell = jhash_3words(*(const __be32 *)src, 0, 0, cfg_ct_src_seed) & (CT_SRC_CELLS - 1);
	return bpf_map_lookup_elem(&tlb_ct_src, &cell);
}

/* ct_proven_key is src, a source of family fam (an IPv4 address, or a
 * union tlb_addr), as tlb_ct_proven's key: the exact address. */
static __always_inline union tlb_addr ct_proven_key(int fam, const void *src)
{
	if (fam == PKT_IPV6)
		return *(const union tlb_addr *)src;
	return addr_from4(*(const __be32 *)src);
}

/* ct_proven_find is the own budget of src, a source of family fam, when
 * it is proven at now (tlb_ct_proven), or NULL. */
static __always_inline struct ct_proven *ct_proven_find(int fam, const void *src, __u64 now)
{
	union tlb_addr k = ct_proven_key(fam, src);
	struct ct_proven *p = bpf_map_lookup_elem(&tlb_ct_proven, &k);

	return p && now <= p->expires ? p : NULL;
}

/* ct_src_give gives src, a source of family fam, back the share of a
 * flow that got promoted in its cell: a client whose handshakes
 * complete never runs out. */
static __always_inline void ct_src_give(int fam, const void *src)
{
	struct ct_src *b;

	if (!cfg_ct_src_interval)
		return;
	b = ct_src_budget(fam, src);
	if (b)
		gcra_give(&b->tat, cfg_ct_src_interval);
}

/* ct_proven_mark records the client of the flow pkt matched as ct, whose
 * handshake just completed, as proven until CT_TIMEOUT_PROVEN from now,
 * and gives back the share of the flow to the budget it took it from
 * (ct_src_take): its own when it was proven already, its cell's
 * otherwise. Promotions only: not on the established path. */
static __always_inline void ct_proven_mark(int fam, const struct packet *pkt, const struct ct_value *ct, __u64 now)
{
	struct ct_proven fresh = { .expires = now + CT_TIMEOUT_PROVEN * NSEC_PER_SEC };
	const void *src;
	union tlb_addr k;
	struct ct_proven *p;
	__be32 src4;

	if (fam == PKT_IPV6) {
		src = ct6_client(pkt, ct);
	} else {
		src4 = ct4_client(pkt, ct);
		src = &src4;
	}
	p = ct_proven_find(fam, src, now);
	if (p) {
		p->expires = fresh.expires;
		if (cfg_ct_src_interval)
			gcra_give(&p->tat, cfg_ct_src_interval / CT_PROVEN_SHARE);
		return;
	}
	ct_src_give(fam, src);
	k = ct_proven_key(fam, src);
	bpf_map_update_elem(&tlb_ct_proven, &k, &fresh, BPF_ANY);
}

/* ct_src_take takes one new flow from the budget of src, a source of
 * family fam: its own when it is proven (tlb_ct_proven: CT_PROVEN_SHARE
 * times a cell's rate and burst, counted), its cell's otherwise
 * (ct_src_budget). Returns 0 when it is spent. A cell never taken from
 * (or not for a burst's time) holds a full budget, as does a source just
 * proven. */
static __always_inline int ct_src_take(int fam, const void *src, __u64 now)
{
	struct ct_proven *p;
	struct ct_src *b;

	if (!cfg_ct_src_interval)
		return 1;
	p = ct_proven_find(fam, src, now);
	if (p) {
		if (!gcra_take(&p->tat, now, cfg_ct_src_interval / CT_PROVEN_SHARE,
			       (__u64)cfg_ct_src_burst * CT_PROVEN_SHARE))
			return 0;
		stat_inc(STAT_CT_SRC_PROVEN);
		return 1;
	}
	b = ct_src_budget(fam, src);
	if (!b)
		return 1;
	return gcra_take(&b->tat, now, cfg_ct_src_interval, cfg_ct_src_burst);
}

/* ct_src_has reports whether ct_src_take would take a new flow of src
 * at now, without taking it (frag.h asks before the core takes). */
static __always_inline int ct_src_has(int fam, const void *src, __u64 now)
{
	struct ct_proven *p;
	struct ct_src *b;

	if (!cfg_ct_src_interval)
		return 1;
	p = ct_proven_find(fam, src, now);
	if (p)
		return gcra_has(p->tat, now, cfg_ct_src_interval / CT_PROVEN_SHARE,
				(__u64)cfg_ct_src_burst * CT_PROVEN_SHARE);
	b = ct_src_budget(fam, src);
	return !b || gcra_has(b->tat, now, cfg_ct_src_interval, cfg_ct_src_burst);
}

/* ct_src_promoted gives the client of the flow pkt matched as ct, just
 * promoted, its share back; a TCP client also proves its address
 * (ct_proven_mark). A UDP flow proves nothing: its first reply promotes
 * it, whoever sent the datagram. */
static __always_inline void ct_src_promoted(int fam, const struct packet *pkt, const struct ct_value *ct, __u64 now)
{
	const void *src;
	__be32 src4;

	if (pkt->proto == IP_PROTO_TCP) {
		ct_proven_mark(fam, pkt, ct, now);
		return;
	}
	if (fam == PKT_IPV6) {
		src = ct6_client(pkt, ct);
	} else {
		src4 = ct4_client(pkt, ct);
		src = &src4;
	}
	ct_src_give(fam, src);
}

/* ct_move writes both entries of a flow, a (under key) and b (under
 * peer_key), into the table their flags name and deletes them from the
 * other: a promotion into tlb_conntrack or a demotion out of it. The peer
 * first, undone when the second insert fails, so the two live and die
 * together; both stay in the old table until both are in the new one.
 * Returns a's entry in its new table, or NULL when the insert was refused
 * (tlb_conntrack full; an LRU insert does not fail for room): then
 * nothing moved. */
static __always_inline struct ct_value *ct_move(int fam, const void *key, const struct ct_value *a,
						const void *peer_key, const struct ct_value *b)
{
	__u8 to = a->flags, from = to ^ CT_F_ASSURED;
	void *table = ct_table(fam, to);

	if (bpf_map_update_elem(table, peer_key, b, BPF_ANY))
		return NULL;
	if (bpf_map_update_elem(table, key, a, BPF_ANY)) {
		bpf_map_delete_elem(table, peer_key);
		return NULL;
	}
	ct_delete_in(fam, from, key);
	ct_delete_in(fam, from, peer_key);
	return ct_find_in(fam, to, key);
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

/* ct_touch_change applies pkt (seen in ct's direction, matching key) to the flow
 * when something changes: the state (FIN or RST either way closes, when
 * in the flow's window, ct_tcp_close_plausible; the first reply
 * establishes), the reply flag, or an expiry more than
 * CT_REFRESH_INTERVAL stale. A change of state or flags writes both
 * directions' entries; a stale expiry alone refreshes ct's own entry
 * where it may (ct_refreshes_alone), both entries otherwise, so a
 * one-way stream keeps its other half either way. The entries written
 * have their forwarding targets resolved again (fwd_mark_stale). It
 * moves the flow
 * between the tables:
 *   - promotion into tlb_conntrack. TCP: when the client sends after
 *     the reply (the handshake's last ACK), the step that proves its
 *     address answers, as netfilter's assured bit does: a spoofed SYN
 *     flood that a backend answers never gets there. UDP has no
 *     handshake: the first reply promotes (waiting for the client's next
 *     datagram would leave a request-and-answer flow that then idles,
 *     a long-lived connected socket, to the LRU's churn), except a
 *     source-NATed flow's, which, as TCP, waits for its client to send
 *     after the reply: until then it holds its port only
 *     CT_TIMEOUT_SNAT_UNASSURED and may lose it to a new flow
 *     (snat_claim), so spoofed datagrams a backend answers cannot hold
 *     the ports of a small range. Refused when
 *     the table is full: counted, and the flow goes on from tlb_ct_new,
 *     tried again at each refresh (CT_F_FULL);
 *   - demotion back to tlb_ct_new when an assured flow closes, where
 *     netfilter would early-drop it too: a closing flow must not hold
 *     room an established one needs.
 * Returns the flow's entry for pkt (moved or not), or NULL when the flow
 * lost its other direction (an LRU eviction of tlb_ct_new): a forward
 * entry is then deleted and the packet balanced as new; a reply is
 * translated by what its entry says, which is left to expire. Rare: the
 * peer is looked up at most once a second per flow not yet assured (or
 * source-NATed), plus changes; an assured flow's refresh writes its own
 * entry only. */
static __always_inline struct ct_value *ct_touch_change(int fam, const struct packet *pkt, const void *key,
							struct ct_value *ct, __u64 now)
{
	__u8 state = ct_next_state(ct->state, ct->dir, pkt);
	__u8 flags = ct->flags | (ct->dir == CT_REVERSE ? CT_F_REPLIED : 0);
	int answered = pkt->proto == IP_PROTO_TCP || (ct->flags & CT_F_SNAT) ? ct->dir == CT_FORWARD
									       : ct->dir == CT_REVERSE;
	int promote = answered && state != CT_TCP_CLOSING &&
		      (flags & (CT_F_REPLIED | CT_F_ASSURED)) == CT_F_REPLIED;
	int demote = (flags & CT_F_ASSURED) && state == CT_TCP_CLOSING;
	/* Staleness by the lifetime where the flow is: a promotion refused
	 * for a full table is tried again only once a second. */
	int stale = now + ct_lifetime(state, flags) > ct->expires + CT_REFRESH_INTERVAL * NSEC_PER_SEC;
	struct ct_key peer_key4 = {};
	struct ct6_key peer_key6 = {};
	void *peer_key = fam == PKT_IPV6 ? (void *)&peer_key6 : (void *)&peer_key4;
	struct ct_value *peer, *moved, *a, *b;
	void *pair;
	__u64 expires;

	/* A FIN or RST that closes the flow must be in its window: out of
	 * it, the segment goes on to its receiver, which drops it too, and
	 * the flow stays as it was, unrefreshed. */
	if (state == CT_TCP_CLOSING && ct->state != CT_TCP_CLOSING && !ct_tcp_close_plausible(ct, pkt)) {
		stat_inc(STAT_CT_TCP_IGNORED);
		return ct;
	}
	if (promote)
		flags |= CT_F_ASSURED;
	if (demote)
		flags &= ~(CT_F_ASSURED | CT_F_FULL);
	expires = now + ct_lifetime(state, flags);
	if (state == ct->state && !stale && (flags == ct->flags || (promote && (ct->flags & CT_F_FULL))))
		return ct;
	/* Only the expiry is stale: the entry refreshes itself, without its
	 * peer's lookup (a second cache miss), where it may. */
	if (state == ct->state && flags == ct->flags && ct_refreshes_alone(ct)) {
		ct->expires = expires;
		fwd_mark_stale(ct);
		return ct;
	}
	ct_peer_key_fam(fam, pkt, ct, peer_key);
	peer = ct_find_in(fam, ct->flags, peer_key);
	if (!peer || !ct_is_peer(fam, pkt, ct, peer)) {
		/* Another CPU may be moving the flow between the tables (a
		 * promotion or demotion by a packet of the other direction):
		 * its peer is then in the other table already. Not an orphan:
		 * this packet goes on by its entry, the next finds both moved. */
		peer = ct_find_in(fam, ct->flags ^ CT_F_ASSURED, peer_key);
		if (peer && ct_is_peer(fam, pkt, ct, peer))
			return ct;
		if (ct->dir == CT_REVERSE)
			return ct;
		stat_inc(STAT_CT_ORPHAN);
		ct_fold(ct);
		ct_delete_in(fam, ct->flags, key);
		return NULL;
	}
	/* A close from a direction whose sequence numbers are unknown is
	 * judged by what it acknowledges of the other's. */
	if (state == CT_TCP_CLOSING && ct->state != CT_TCP_CLOSING && !ct->tcp_next && !ct_tcp_close_acks_peer(peer, pkt)) {
		stat_inc(STAT_CT_TCP_IGNORED);
		return ct;
	}
	/* A reply of a flow whose backend is gone (the agent marked the
	 * forward entry stale): translated by its entry, nothing written,
	 * so the mark stays for the forward packet that re-balances it. */
	if (peer->flags & CT_F_STALE)
		return ct;
	/* The copies live in per-CPU scratch space, not on the stack. */
	pair = (promote || demote) ? ct_scratch(fam) : NULL;
	if ((promote || demote) && !pair)
		return ct; /* cannot happen (one slot per CPU); changes nothing */
	if (pair) {
		ct_scratch_copy(fam, pair, ct, peer, &a, &b);
		a->state = b->state = state;
		a->flags = b->flags = flags & ~CT_F_FULL;
		a->expires = b->expires = expires;
		fwd_mark_stale(a);
		fwd_mark_stale(b);
		moved = ct_move(fam, key, a, peer_key, b);
		if (moved) {
			if (promote) {
				stat_inc(STAT_CT_PROMOTED);
				/* From the copy: ct's element is freed. */
				ct_src_promoted(fam, pkt, a, now);
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

/* ct_touch_fam is ct_touch_change with the hit path's common case taken
 * first, before the peer's key is built: a packet of an assured flow
 * (replied, established or UDP) that carries no FIN or RST and finds its
 * expiry fresh changes nothing (state, flags and expiry all stay), so it
 * returns ct after a few compares. */
static __always_inline struct ct_value *ct_touch_fam(int fam, const struct packet *pkt, const void *key,
						     struct ct_value *ct, __u64 now)
{
	/* ct_lifetime of an assured flow in its two states. */
	__u64 lifetime = ct->state == CT_UDP ? CT_TIMEOUT_UDP * NSEC_PER_SEC : CT_TIMEOUT_TCP_ESTABLISHED * NSEC_PER_SEC;

	if ((ct->flags & (CT_F_ASSURED | CT_F_REPLIED)) == (CT_F_ASSURED | CT_F_REPLIED) &&
	    !(pkt->tcp_flags & (TCP_F_FIN | TCP_F_RST)) &&
	    (ct->state == CT_TCP_ESTABLISHED || ct->state == CT_UDP) &&
	    now + lifetime <= ct->expires + CT_REFRESH_INTERVAL * NSEC_PER_SEC)
		return ct;
	return ct_touch_change(fam, pkt, key, ct, now);
}

/* ct_touch4 is ct_touch_fam for IPv4. */
static __always_inline struct ct_value *ct_touch4(const struct packet *pkt, const struct ct_key *key,
						 struct ct_value *ct, __u64 now)
{
	return ct_touch_fam(PKT_IPV4, pkt, key, ct, now);
}

/* ct_forget deletes the flow ct (matched by pkt under key) that pkt cannot
 * continue (expired, backend gone, a SYN reopening it), both directions,
 * before pkt creates a new flow: the new entries go to tlb_ct_new, where
 * an old one left in tlb_conntrack would hide them, and an old reply
 * entry must not keep its SNAT port. The peer is deleted only while it is
 * still this flow's. Counts the entries deleted as replaced. Returns
 * LB_CONTINUE. */
static __always_inline int ct_forget(int fam, const struct packet *pkt, const void *key, const struct ct_value *ct)
{
	struct ct_key peer_key4 = {};
	struct ct6_key peer_key6 = {};
	void *peer_key = fam == PKT_IPV6 ? (void *)&peer_key6 : (void *)&peer_key4;
	struct ct_value *peer;
	__u8 flags = ct->flags;
	int n = 0;

	ct_peer_key_fam(fam, pkt, ct, peer_key);
	peer = ct_find_in(fam, flags, peer_key);
	if (peer && ct_is_peer(fam, pkt, ct, peer))
		n += ct_delete_in(fam, flags, peer_key);
	ct_fold(ct);
	n += ct_delete_in(fam, flags, key);
	if (n)
		stat_add(STAT_CT_REPLACED, n);
	return LB_CONTINUE;
}

/* syn_reopens reports whether a SYN on a known flow starts a new one:
 * when the flow is closing (an in-window FIN or RST was seen; an expired
 * flow never gets here), or when no reply came yet and its backend is no
 * longer active in its frontend's set (draining): a handshake nobody
 * answered moves at no cost. A SYN on an established flow never reopens
 * it, draining backend or not: it is spoofed, or its client lost the
 * connection; it goes on to the backend, whose challenge ACK (RFC 5961
 * 4) draws the client's in-window reset, which closes the flow for the
 * client's next SYN. */
static __always_inline int syn_reopens(const struct ct_value *ct)
{
	struct registry_value *reg;

	if (ct->state == CT_TCP_CLOSING)
		return 1;
	if (ct->state != CT_TCP_SYN_SENT) {
		stat_inc(STAT_CT_TCP_IGNORED);
		return 0;
	}
	reg = bpf_map_lookup_elem(&tlb_registry, &ct->backend_id);
	return !reg || reg->state != BACKEND_ACTIVE || reg->gen != ct->backend_gen ||
	       reg->svc_id != ct->svc_id;
}

/* ct_forward_hit translates a packet of an established flow, matched
 * under key, counts it in the entry and learns its sequence numbers
 * (ct_tcp_learn). Returns LB_CONTINUE when the
 * flow cannot be honoured (expired, backend gone, a SYN reopening it, its
 * reply entry lost): the flow is forgotten and the packet balanced as a
 * new flow. A gone backend costs no lookup here: the agent marks its
 * flows stale (CT_F_STALE, expired) when it releases the id, and its
 * sweep marks any flow whose generation is no longer its id's
 * (maps/stale.go). */
static __always_inline int ct_forward_hit(int fam, const struct packet *pkt, const void *key,
					  struct ct_value *ct, struct nat *nat)
{
	__u64 now = ct_now();

	if (now > ct->expires && ((ct->flags & CT_F_STALE) || !ct_peer_live(fam, pkt, ct, now))) {
		stat_inc(ct->flags & CT_F_STALE ? STAT_CT_STALE_BACKEND : STAT_CT_EXPIRED);
		return ct_forget(fam, pkt, key, ct);
	}
	if (is_syn(pkt) && syn_reopens(ct)) {
		stat_inc(STAT_CT_SYN_REOPEN);
		return ct_forget(fam, pkt, key, ct);
	}
	ct = ct_touch_fam(fam, pkt, key, ct, now);
	if (!ct)
		return LB_CONTINUE;
	ct_tcp_learn(ct, pkt);
	/* Per flow, not per CPU: a flow's packets come in on one queue
	 * (RSS); a lost increment under a race only undercounts. */
	ct->packets += 1;
	ct->bytes += pkt->l3_len;
	nat_forward(nat, ct);
	if (fam == PKT_IPV6)
		nat6_addrs(nat, ct);
	return LB_REWRITE;
}

/* ct_reverse_hit translates a reply back to the frontend address. Replies
 * are translated even after the backend left the set: the client must only
 * ever see the service address. */
static __always_inline int ct_reverse_hit(int fam, const struct packet *pkt, const void *key,
					  struct ct_value *ct, struct nat *nat)
{
	__u64 now = ct_now();

	if (now > ct->expires && !ct_peer_live(fam, pkt, ct, now)) {
		stat_inc(STAT_CT_EXPIRED);
		return LB_CONTINUE;
	}
	ct = ct_touch_fam(fam, pkt, key, ct, now);
	if (!ct)
		return LB_CONTINUE;
	ct_tcp_learn(ct, pkt);
	stat_inc(STAT_REVERSE_NAT);
	nat_reverse(nat, ct);
	if (fam == PKT_IPV6)
		nat6_addrs(nat, ct);
	return LB_REWRITE;
}

/* ct4_key_of fills pkt's conntrack key (its own direction's). */
static __always_inline void ct4_key_of(const struct packet *pkt, struct ct_key *key)
{
	key->saddr = pkt->saddr;
	key->daddr = pkt->daddr;
	key->sport = pkt->sport;
	key->dport = pkt->dport;
	key->proto = pkt->proto;
}

#endif
