/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Map definitions shared by every hook. Each object declares the same maps;
 * the loader creates them once, pins them and hands them to the other
 * objects, so every hook sees one conntrack. max_entries are defaults that
 * the loader replaces with Options. */
#ifndef TOPOLB_MAPS_H
#define TOPOLB_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"
#include "structs.h"

/* Frontend -> service. No prealloc: an update swaps in a freshly allocated
 * element, so readers see the old or the new value, never a mix. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, DEFAULT_MAX_FRONTENDS);
	__type(key, struct svc_key);
	__type(value, struct svc_value);
} tlb_services SEC(".maps");

/* (service, buffer, slot) -> backend. Holds both buffers during a flip, so
 * the loader sizes it at twice Options.MaxBackends; entries are allocated on
 * demand. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 2 * DEFAULT_MAX_BACKENDS);
	__type(key, struct backend_key);
	__type(value, struct backend_value);
} tlb_backends SEC(".maps");

/* backend id -> (service, backend, state) the id stands for. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEFAULT_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct registry_value);
} tlb_registry SEC(".maps");

/* backend id -> generation and forward counters, per CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, DEFAULT_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct backend_stats);
} tlb_backend_stats SEC(".maps");

/* Conntrack is two tables, so that a flood of new flows can never evict
 * an established one (docs/datapath.md, "Conntrack"). Both entries of a
 * flow (both directions) are always in the same table; CT_F_ASSURED in
 * the value says which.
 *
 * tlb_conntrack: assured flows: TCP whose client answered the backend's
 * reply (the handshake's last ACK), UDP that got a reply. A plain hash, not LRU: nothing is evicted to make room. When it
 * is full, a promotion is refused (STAT_CT_PROMOTE_FULL) and the flow
 * goes on from tlb_ct_new. Entries leave when they close (moved back to
 * tlb_ct_new), or expire and are swept by the agent. Looked up first: an
 * established packet costs this one lookup. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, DEFAULT_MAX_CONNTRACK);
	__type(key, struct ct_key);
	__type(value, struct ct_value);
} tlb_conntrack SEC(".maps");

/* tlb_ct_new: flows not assured yet, and closing ones: a bounded budget
 * that floods churn. LRU; looked up only when tlb_conntrack misses. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_CONNTRACK);
	__type(key, struct ct_key);
	__type(value, struct ct_value);
} tlb_ct_new SEC(".maps");

/* tlb_ct_src: the per-source budgets of new flows (enum ct_src_limit),
 * read only by new flows and promotions: CT_SRC_CELLS cells of a generic
 * cell rate algorithm, a source's cell picked by a keyed hash of it
 * (ct_src_budget). A fixed array: taking from a budget inserts nothing
 * (an LRU insert for every new source before layout 7, a third of a new
 * flow's cost in a flood of new sources) and no flood of sources evicts
 * anything. Two sources whose hashes meet share one budget, so all
 * sources together never start more than CT_SRC_CELLS budgets' worth.
 * Shared by the CPUs, not per-CPU: a source's budget is the configured
 * one whichever queue its flows arrive on (per-CPU cells would give it
 * one per CPU), and a promotion seen on another CPU than the new flow
 * (the reply on another queue or hook) gives back to the cell it took
 * from. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CT_SRC_CELLS);
	__type(key, __u32);
	__type(value, struct ct_src);
} tlb_ct_src SEC(".maps");

/* tlb_ct_proven: sources that proved their address (a TCP client that
 * answered our reply: ct_touch_fam's promotion), by exact address, both
 * families (IPv4-mapped), each with its own budget of new flows
 * (conntrack.h, ct_src_take). A proven source is charged there instead of
 * in its tlb_ct_src cell, which a flood spoofing its address (or, for
 * IPv6, addresses of its /64) exhausts. LRU: written on promotions only,
 * which a spoofer cannot make; a flood of real handshakes from more than
 * CT_PROVEN_SOURCES sources evicts the oldest, which then share cells
 * again. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, CT_PROVEN_SOURCES);
	__type(key, union tlb_addr);
	__type(value, struct ct_proven);
} tlb_ct_proven SEC(".maps");

/* Room for the two entries of a flow: written from when it moves between
 * the conntrack tables (ct_touch_fam), built in when it is created
 * (flow4_create): 144 bytes the hooks' 512-byte stacks do not have. One
 * slot per CPU, used within one packet only, by one of the two. Not
 * shared and not pinned: each program object has its own. */
struct ct_pair {
	struct ct_value a;
	struct ct_value b;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ct_pair);
} tlb_ct_scratch SEC(".maps");

/* IPv6 conntrack: tlb_conntrack's and tlb_ct_new's twins (ct6_key,
 * ct6_value), the same two tables for the same reasons, over the same
 * helpers (ct.h, conntrack.h, conntrack6.h). Sized as their IPv4 twins. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, DEFAULT_MAX_CONNTRACK);
	__type(key, struct ct6_key);
	__type(value, struct ct6_value);
} tlb_ct6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_CONNTRACK);
	__type(key, struct ct6_key);
	__type(value, struct ct6_value);
} tlb_ct6_new SEC(".maps");

/* tlb_ct6_src: tlb_ct_src's IPv6 twin, its cells picked by the hash of
 * the source's budget prefix (conntrack6.h, ct6_src_key says which). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CT_SRC_CELLS);
	__type(key, __u32);
	__type(value, struct ct_src);
} tlb_ct6_src SEC(".maps");

/* tlb_ct_scratch's IPv6 twin: the two entries of an IPv6 flow, and, when
 * flow6_create builds them, their keys (80 bytes that tc_lb6's stack,
 * with IPv6's addresses and a FIB lookup, does not have). Not shared and
 * not pinned. */
struct ct6_pair {
	struct ct6_value a;
	struct ct6_value b;
	struct ct6_key a_key;
	struct ct6_key b_key;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ct6_pair);
} tlb_ct6_scratch SEC(".maps");

/* ClientIP session affinity: (client, service) -> backend. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_AFFINITY);
	__type(key, struct affinity_key);
	__type(value, struct affinity_value);
} tlb_affinity SEC(".maps");

/* ifindex -> what the interface is, for redirects. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, DEFAULT_MAX_IFACES);
	__type(key, __u32);
	__type(value, struct iface_value);
} tlb_ifaces SEC(".maps");

/* Socket hooks: (socket, backend) -> frontend, for recvmsg/getpeername. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_CONNTRACK);
	__type(key, struct sock_revnat_key);
	__type(value, struct sock_revnat_value);
} tlb_sock_revnat SEC(".maps");

/* Named global counters, indexed by enum stat_reason. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
} tlb_stats SEC(".maps");
_Static_assert(STAT_MAX <= STAT_SLOTS, "tlb_stats has a slot for every reason");

/* Fragmented datagrams being translated: the L4 tuple of each first
 * fragment, for the later fragments of the same datagram (frag.h). LRU
 * and short-lived (FRAG_TIMEOUT): memory is bounded whatever arrives; a
 * datagram forgotten loses its later fragments' translation, and the
 * receiver drops the incomplete datagram as it would a lost fragment. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_FRAGS);
	__type(key, struct frag_key);
	__type(value, struct frag_value);
} tlb_frags SEC(".maps");

/* tlb_frags' IPv6 twin (frag6_key: 16-byte addresses, the fragment
 * header's 32-bit identification), sized and kept alike. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_FRAGS);
	__type(key, struct frag6_key);
	__type(value, struct frag_value);
} tlb_frags6 SEC(".maps");

/* Room for the keys of an IPv6 fragment's lookups (frag.h): 116 bytes
 * that tc_lb6's and xdp_lb6's stacks, at the 512-byte limit, do not
 * have. One slot per CPU, used within one packet only. Not shared and
 * not pinned: each program object has its own. */
struct frag6_scratch {
	struct ct6_key ct;
	struct svc_key svc;
	struct frag6_key key;
	struct frag_value v;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct frag6_scratch);
} tlb_frag6_scratch SEC(".maps");

/* Layout version and fingerprint of everything above, checked before
 * pinned maps are adopted. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct meta);
} tlb_meta SEC(".maps");

/* loadBalancerSourceRanges: the allowed source prefixes of frontends with
 * SVC_F_SRC_RANGES, keyed by (svc id, prefix). Read on the new-flow path
 * only (srcrange.h). LPM tries need BPF_F_NO_PREALLOC. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, DEFAULT_MAX_SRC_RANGES);
	__type(key, struct src_range_key);
	__type(value, __u8);
} tlb_src_ranges SEC(".maps");

/* New flows each frontend dropped for coming from outside its source
 * ranges, indexed by svc id (as tlb_services' ids: 1..max_frontends). Not
 * per CPU: rare, and one counter per frontend stays small. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEFAULT_MAX_FRONTENDS + 1);
	__type(key, __u32);
	__type(value, __u64);
} tlb_src_range_drops SEC(".maps");

#endif
