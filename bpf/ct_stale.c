// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/* ct_mark_stale: the agent's stale walk (maps/stale.go) in the kernel
 * (issue 38). Run by the agent with BPF_PROG_TEST_RUN, never attached:
 * one bpf_for_each_map_elem (Linux 5.13) over each of the four conntrack
 * tables, so no entry is copied to user space. For every forward entry:
 *   - its counts go to its (id, generation)'s row of tlb_stale_finals,
 *     when it has one (a released member's live flows, read before any
 *     mark: a mark changes no count);
 *   - it is marked stale (CT_F_STALE, expires 0) when tlb_stale_ids holds
 *     its id with another generation (the id was released since the flow
 *     was created) and it is not stale already.
 * Returns how many entries it marked. The agent fills both maps before a
 * run and empties them after; on kernels without the helper it walks in
 * user space with the same rules (markStaleIn). */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "maps.h"

/* At most this many ids, and as many finals, per run; the agent runs
 * again for more. Change staleRunMax in maps/stale.go with it. */
#define STALE_RUN_MAX 1024

/* tlb_stale_finals key: a backend id in one generation. 8 bytes. */
struct stale_id_gen {
	__u32 id;  /* host byte order */
	__u32 gen; /* host byte order */
};

/* tlb_stale_finals value: the counts of one (id, generation)'s live
 * forward entries. 24 bytes. */
struct stale_traffic {
	__u64 flows;   /* host byte order */
	__u64 packets; /* host byte order */
	__u64 bytes;   /* host byte order */
};

/* Released id -> its generation now (host byte order): a forward entry of
 * the id with any other generation is marked stale. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, STALE_RUN_MAX);
	__type(key, __u32);
	__type(value, __u32);
} tlb_stale_ids SEC(".maps");

/* The (id, generation)s whose live flows the run counts, zeroed by the
 * agent before it. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, STALE_RUN_MAX);
	__type(key, struct stale_id_gen);
	__type(value, struct stale_traffic);
} tlb_stale_finals SEC(".maps");

/* stale_walk is the callbacks' context: what the run marked so far. */
struct stale_walk {
	__u32 marked;
};

/* mark_entry handles one entry of a conntrack table of either family: an
 * IPv6 entry's value starts with its ct_value (struct ct6_value). Always
 * 0: the walk goes on. */
static long mark_entry(void *map, void *key, struct ct_value *ct, struct stale_walk *w)
{
	if (ct->dir != CT_FORWARD)
		return 0;
	struct stale_id_gen ig = {.id = ct->backend_id, .gen = ct->backend_gen};
	struct stale_traffic *tr = bpf_map_lookup_elem(&tlb_stale_finals, &ig);
	if (tr) {
		tr->flows++;
		tr->packets += ct->packets;
		tr->bytes += ct->bytes;
	}
	if (ct->flags & CT_F_STALE)
		return 0;
	__u32 *gen = bpf_map_lookup_elem(&tlb_stale_ids, &ig.id);
	if (!gen || *gen == ig.gen)
		return 0;
	ct->flags |= CT_F_STALE;
	ct->expires = 0;
	w->marked++;
	return 0;
}

SEC("tc")
int ct_mark_stale(struct __sk_buff *skb)
{
	struct stale_walk w = {};

	bpf_for_each_map_elem(&tlb_conntrack, mark_entry, &w, 0);
	bpf_for_each_map_elem(&tlb_ct_new, mark_entry, &w, 0);
	bpf_for_each_map_elem(&tlb_ct6, mark_entry, &w, 0);
	bpf_for_each_map_elem(&tlb_ct6_new, mark_entry, &w, 0);
	return w.marked;
}

char _license[] SEC("license") = "Dual BSD/GPL";
