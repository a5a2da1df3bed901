/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Map definitions shared by both hooks. Both objects declare the same maps;
 * the loader creates them once, pins them and hands them to the second
 * object, so tc and XDP see one conntrack. max_entries are defaults that the
 * loader replaces with Options. */
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

/* backend id -> (service, backend) currently permitted under that id. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEFAULT_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct registry_value);
} tlb_registry SEC(".maps");

/* Both directions of every flow. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, DEFAULT_MAX_CONNTRACK);
	__type(key, struct ct_key);
	__type(value, struct ct_value);
} tlb_conntrack SEC(".maps");

/* Forward packets and bytes per service id. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, DEFAULT_MAX_FRONTENDS + 1);
	__type(key, __u32);
	__type(value, struct traffic);
} tlb_svc_stats SEC(".maps");

/* Forward packets per backend id. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, DEFAULT_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, __u64);
} tlb_be_stats SEC(".maps");

/* Named global counters. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_MAX);
	__type(key, enum stat_reason);
	__type(value, __u64);
} tlb_stats SEC(".maps");

/* Layout version of everything above, checked before pinned maps are
 * adopted. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct meta);
} tlb_meta SEC(".maps");

#endif
