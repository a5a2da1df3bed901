/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Constants shared by both hooks. Anything the Go side must agree on is an
 * enum, so bpf2go exports it from BTF instead of a hand-synced copy. */
#ifndef TOPOLB_CONSTS_H
#define TOPOLB_CONSTS_H

#include <linux/types.h>

#define ETH_HLEN_ 14
#define ETH_P_IPV4 0x0800
#define IP_PROTO_TCP 6
#define IP_PROTO_UDP 17
#define IP_MF 0x2000
#define IP_OFFSET 0x1fff

/* Default map sizes; the loader overrides max_entries from Options. */
#define DEFAULT_MAX_FRONTENDS 100000
#define DEFAULT_MAX_BACKENDS 1000000
#define DEFAULT_MAX_CONNTRACK 262144

/* Global counters, one per-CPU slot each (map tlb_stats). */
enum stat_reason {
	STAT_DROP_NO_BACKEND = 0,  /* service frontend with zero permitted backends */
	STAT_DROP_MAP_FULL = 1,    /* conntrack insert failed */
	STAT_DROP_PARSE_ERROR = 2, /* malformed IPv4/TCP/UDP header */
	STAT_DROP_REWRITE = 3,     /* a tc rewrite helper failed (should not happen) */
	STAT_REVERSE_NAT = 4,      /* replies rewritten back to the service address */
	STAT_FRAGMENT = 5,         /* IPv4 fragments, passed untouched */
	STAT_MAX = 6,
};

/* Bits of backend_value.flags. Informational for the datapath: the agent
 * only ever programs backends this node may use. */
enum backend_flag {
	BACKEND_F_NODE_LOCAL = 1,
	BACKEND_F_ZONE_LOCAL = 2,
};

/* ct_value.dir */
enum ct_dir {
	CT_FORWARD = 1, /* client -> frontend: rewrite destination to backend */
	CT_REVERSE = 2, /* backend -> client: rewrite source to frontend */
};

/* Verdicts of the shared core (lb.h); each hook maps them to its own. */
enum lb_verdict {
	LB_PASS = 0,
	LB_DROP = 1,
	LB_REWRITE = 2,
};

/* "Keep going" sentinel for helpers that otherwise return a verdict. */
#define LB_CONTINUE -1

#endif
