/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Backend choice of a new flow: the weighted slot table of the service's
 * active buffer (tlb_backends), or the client's remembered backend with
 * ClientIP session affinity (tlb_affinity). */
#ifndef TOPOLB_BACKEND_H
#define TOPOLB_BACKEND_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "addr.h"
#include "consts.h"
#include "maps.h"
#include "stats.h"
#include "structs.h"

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
static __always_inline int affinity_pick(const union tlb_addr *client, const struct svc_value *svc,
					 __u64 now, struct backend_value *be)
{
	struct affinity_key key = { .client = *client, .svc_id = svc->id };
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
static __always_inline void affinity_remember(const union tlb_addr *client, const struct svc_value *svc,
					      __u64 now, const struct backend_value *be)
{
	struct affinity_key key = { .client = *client, .svc_id = svc->id };
	struct affinity_value v = {
		.backend_id = be->id,
		.backend_gen = be->gen,
		.expires = now + (__u64)svc->affinity_timeout * NSEC_PER_SEC,
	};

	/* Losing the memory only costs stickiness; the flow goes on. */
	bpf_map_update_elem(&tlb_affinity, &key, &v, BPF_ANY);
}

/* choose_backend picks the backend of a new flow of client to svc: the
 * client's remembered one for affinity frontends, else slot hash % count.
 * Returns 0 on success. */
static __always_inline int choose_backend(const union tlb_addr *client, __u32 hash, const struct svc_key *key,
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

#endif
