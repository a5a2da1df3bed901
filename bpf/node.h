/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Node configuration of the balancing core, fixed at load time (the
 * verifier prunes dead branches). The entry file defines LB_SCOPE_DEFAULT
 * before it includes anything that includes this. */
#ifndef TOPOLB_NODE_H
#define TOPOLB_NODE_H

#include <linux/types.h>

#include "consts.h"

#ifndef LB_SCOPE_DEFAULT
#error "entry file must define LB_SCOPE_DEFAULT before including lb.h"
#endif

/* cfg_scope is the frontend scope this hook balances (enum scope): tc on
 * pod veths SCOPE_INTERNAL, XDP on uplinks SCOPE_EXTERNAL. */
volatile const __u8 cfg_scope = LB_SCOPE_DEFAULT;
/* cfg_hash_seed seeds the flow hash; must match on every program of a node
 * so every hook would pick the same slot. The agent draws it at random
 * when it creates the node's maps and keeps it in tlb_meta (struct meta),
 * so a restart or an upgrade moves no flow or affinity, and nobody
 * outside can predict which backend or SNAT port a flow gets. The default
 * is the constant of layout 7, which an upgrade from it keeps. */
volatile const __u32 cfg_hash_seed = 0x746c6221;
/* cfg_ct_src_interval and cfg_ct_src_burst are the per-source budget of
 * new flows (enum ct_src_limit): one flow every interval ns, bursts of
 * up to burst. Interval 0: no limit. */
volatile const __u64 cfg_ct_src_interval = NSEC_PER_SEC / CT_SRC_RATE_DEFAULT;
volatile const __u32 cfg_ct_src_burst = CT_SRC_RATE_DEFAULT;
/* cfg_ct_src_seed keys the hash that picks a source's budget cell
 * (ct_src_budget): drawn at random by the agent for each load, the same
 * for every program of that load, so which sources share a cell cannot
 * be aimed at from outside. */
volatile const __u32 cfg_ct_src_seed = 0;

#endif
