/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Constants shared by every hook. Anything the Go side must agree on is an
 * enum: bpf2go exports it from BTF (-type), so Go never holds a hand copy.
 * The enums no map key or value names are put into BTF by btf_anchor
 * (anchors.h). */
#ifndef TOPOLB_CONSTS_H
#define TOPOLB_CONSTS_H

#include <linux/types.h>

#define ETH_P_IPV4 0x0800
#define ETH_P_IPV6 0x86DD
#define IP_PROTO_ICMP 1
#define IP_PROTO_TCP 6
#define IP_PROTO_UDP 17
/* IPv4 frag_off bits, host byte order. */
#define IP_MF 0x2000
#define IP_OFFSET 0x1fff
/* TCP flag bits (byte 13 of the header). */
#define TCP_F_FIN 0x01
#define TCP_F_SYN 0x02
#define TCP_F_RST 0x04
#define TCP_F_ACK 0x10
/* ICMP types and codes (RFC 792) the datapath reads or writes. */
#define ICMP_DEST_UNREACH 3
#define ICMP_TIME_EXCEEDED 11
#define ICMP_PORT_UNREACH 3 /* code of ICMP_DEST_UNREACH */

#define NSEC_PER_SEC 1000000000ULL


/* Default map sizes; the loader overrides max_entries from Options.
 * WEIGHTED_SLOTS is the minimum table size of a frontend whose active
 * backends have unequal weights (see maps/table.go). STAT_SLOTS is the
 * size of tlb_stats: room for reasons added later without a new layout. */
enum map_size {
	DEFAULT_MAX_FRONTENDS = 100000,
	DEFAULT_MAX_BACKENDS = 1000000,
	DEFAULT_MAX_CONNTRACK = 262144, /* tlb_conntrack, established flows (2 entries each) */
	CT_SRC_CELLS = 65536,           /* tlb_ct_src, tlb_ct6_src: budgets of new flows, fixed (a power of two: ct_src_budget masks) */
	CT_PROVEN_SOURCES = 65536,      /* tlb_ct_proven: sources with a budget of their own, fixed */
	DEFAULT_MAX_AFFINITY = 65536,
	DEFAULT_MAX_IFACES = 4096,
	DEFAULT_MAX_SRC_RANGES = 65536,
	DEFAULT_MAX_FRAGS = 8192,       /* tlb_frags, fragmented datagrams in flight (frag.h) */
	WEIGHTED_SLOTS = 512,
	STAT_SLOTS = 64,
};

/* Conntrack lifetimes in seconds, by state (docs/datapath.md has the
 * references), and how stale an expiry may get before a packet refreshes
 * it. TCP_ESTABLISHED is the lifetime of an assured flow (CT_F_ASSURED);
 * a TCP flow with a reply but no assurance yet keeps TCP_SYN.
 * SNAT_UNREPLIED is the lifetime of a source-NATed flow before the backend
 * answers: it holds a port of a small range, so a client that never gets
 * (or never wanted) an answer gives it back within seconds. 10 s covers
 * the gaps between a SYN's first four retransmissions (1, 2, 4, 8 s); a
 * later one finds the port free and usually claims it again.
 * SNAT_UNASSURED is the lifetime of a source-NATed flow the backend
 * answered but whose client has not answered back yet (TCP: the
 * handshake's last ACK; UDP: a datagram after the reply): a spoofed
 * source never does, and its flow must give the port back soon, not after
 * TCP_SYN or UDP. A real client answers within a round trip; 5 s also
 * covers a lost ACK's retransmission. Such a flow may also be evicted
 * when a new flow finds no free port (nat.h, snat_claim). */
enum ct_timeout {
	CT_TIMEOUT_TCP_SYN = 60,
	CT_TIMEOUT_TCP_ESTABLISHED = 86400,
	CT_TIMEOUT_TCP_CLOSING = 10,
	CT_TIMEOUT_UDP = 60,
	CT_TIMEOUT_SNAT_UNREPLIED = 10,
	CT_TIMEOUT_SNAT_UNASSURED = 5,
	CT_REFRESH_INTERVAL = 1,
	/* How long a source stays proven (tlb_ct_proven) after its last
	 * completed handshake: a client that opens connections now and then
	 * keeps its own budget between them. */
	CT_TIMEOUT_PROVEN = 300,
	/* How long the L4 tuple of a datagram's first fragment is remembered
	 * for the later ones (frag.h): reordering takes milliseconds; the
	 * kernel's reassembly waits up to 30 s (net.ipv4.ipfrag_time), but a
	 * datagram that late is rare, and a short life keeps a reused IP id
	 * from meeting a stale tuple. */
	FRAG_TIMEOUT = 10,
};

/* How far from the sequence number a direction of a TCP flow has reached
 * (ct_value.tcp_next) one of its segments may start, either way, and
 * still count (conntrack.h, ct_tcp_in_window): 256 KiB, data lost on the
 * way here or retransmitted, and a reset answering the peer's
 * acknowledgement of data in flight. A blind sender of a random sequence
 * number is inside with probability 2^-13. */
enum ct_tcp_limit {
	CT_TCP_WINDOW = 262144,
};

/* Counters of tlb_stats, one per-CPU slot each. Append only: a pinned
 * tlb_stats keeps its meaning across agent versions. Each member's metric
 * name is derived from its name here (maps/stats.go: without STAT_, lower
 * case, CT/FRAG/SRC/... spelled out); a new one needs a Go constant there
 * and a row in docs/datapath.md's Counters table (TestStatNames). */
enum stat_reason {
	STAT_DROP_NO_BACKEND = 0,   /* frontend with no active backend */
	STAT_DROP_MAP_FULL = 1,     /* conntrack insert failed */
	STAT_DROP_PARSE_ERROR = 2,  /* malformed IPv4/TCP/UDP header */
	STAT_DROP_REWRITE = 3,      /* a tc rewrite helper failed (should not happen) */
	STAT_REVERSE_NAT = 4,       /* replies rewritten back to the service address */
	STAT_FRAGMENT = 5,          /* fragments passed untranslated (both families): not to a Service, or a later fragment without its first (frag.h) */
	STAT_CT_CREATED = 6,        /* flows created (each is two conntrack entries) */
	STAT_CT_REPLACED = 7,       /* conntrack entries a new flow replaced: deleted or overwritten (expired, stale, reopened, an expired SNAT port taken over) */
	STAT_CT_EXPIRED = 8,        /* packets whose flow had expired: balanced as new */
	STAT_CT_STALE_BACKEND = 9,  /* packets whose backend is gone: re-balanced */
	STAT_CT_SYN_REOPEN = 10,    /* SYNs to a closing flow, or to an unanswered handshake's draining backend: new flow */
	STAT_TCP_MIDFLOW_MISS = 11, /* TCP without SYN to a frontend, no flow: silently re-balanced */
	STAT_AFFINITY_HIT = 12,     /* new flows sent to the client's remembered backend */
	STAT_AFFINITY_NEW = 13,     /* new flows of affinity frontends that chose afresh */
	STAT_REJECT = 14,           /* new flows refused on a reject frontend: a reset or port unreachable sent, or the socket call failed */
	STAT_CT_SWEPT = 15,         /* conntrack entries the agent's sweeps deleted (written by user space) */
	STAT_REJECT_LIMITED = 16,   /* rejects over the rate limit (enum reject_limit): dropped instead */
	STAT_ICMP_XLATE = 17,       /* ICMP and ICMPv6 errors about a translated flow, translated back */
	STAT_SOCK_XLATE = 18,       /* host-process connects and sends translated to a backend (socket hooks) */
	STAT_SOCK_REVNAT = 19,      /* host-process peer addresses shown as the frontend (recvmsg, getpeername) */
	/* Forwarding (bpf/fwd.h). The path of each direction of a flow is
	 * counted once, when the flow is created (per-packet counting would
	 * cost a map lookup on the hit path); a packet that leaves its
	 * flow's path is counted as it does. */
	STAT_FWD_PEER = 20,          /* flow directions delivered into a local pod (bpf_redirect_peer) */
	STAT_FWD_NEIGH = 21,         /* flow directions sent out of an interface whose next hop the kernel resolves (bpf_redirect_neigh) */
	STAT_FWD_L2 = 22,            /* flow directions sent out of an uplink with cached MACs (XDP_TX, XDP_REDIRECT, bpf_redirect) */
	STAT_FWD_STACK = 23,         /* flow directions handed to the host stack (no route, an interface topolb does not own) */
	STAT_FWD_FALLBACK_MTU = 24,  /* packets larger than the egress MTU: up the stack, which answers "fragmentation needed" */
	STAT_FWD_FALLBACK_TTL = 25,  /* packets whose TTL would expire: up the stack, which answers "time exceeded" */
	STAT_FWD_FALLBACK_META = 26, /* XDP packets for a pod that could not carry metadata to tc_uplink: up the stack */
	STAT_SNAT_FLOWS = 27,        /* new flows whose source was translated (external frontend, backend on another node) */
	STAT_SNAT_COLLISION = 28,    /* SNAT ports tried and found taken */
	STAT_DROP_SNAT_EXHAUSTED = 29, /* no free SNAT port in SNAT_RETRIES tries: new flow dropped */
	STAT_DROP_SNAT_NO_ROUTE = 30,  /* no route, or no source address, towards a remote backend: new flow dropped */
	STAT_DROP_SNAT_FALLBACK = 31,  /* a source-NATed packet that could not be forwarded (MTU, TTL): dropped, the stack would take it for a martian */
	/* The two conntrack tables (docs/datapath.md, "Conntrack"). */
	STAT_CT_PROMOTED = 32,          /* flows moved into tlb_conntrack: TCP whose client answered the reply, UDP with a reply */
	STAT_CT_PROMOTE_FULL = 33,      /* promotions refused, tlb_conntrack full: the flow goes on from tlb_ct_new (tried again once a second) */
	STAT_DROP_CT_SOURCE_LIMIT = 34, /* new flows over their source's budget (tlb_ct_src): dropped */
	STAT_CT_DEMOTED = 35,           /* closing flows moved from tlb_conntrack back to tlb_ct_new */
	STAT_CT_ORPHAN = 36,            /* forward entries whose reply entry was gone (evicted): deleted, the packet balanced as new */
	STAT_SNAT_RECLAIMED = 37,       /* SNAT ports taken over from an expired flow */
	STAT_SOCK_REVNAT_CLOBBER = 38, /* a socket's record of the frontend behind a backend rewritten to another frontend: one UDP socket sending to two Services that share a backend (sock_lb.c) */
	STAT_DROP_SRC_RANGE = 39,     /* new flows to a load-balancer IP from outside its loadBalancerSourceRanges: dropped (srcrange.h) */
	STAT_FRAG_FIRST = 40,         /* first fragments of a datagram translated, their L4 tuple remembered (frag.h) */
	STAT_FRAG_FOLLOWED = 41,      /* later fragments translated as their first was */
	STAT_CT_TCP_IGNORED = 42,     /* TCP RSTs and FINs out of their flow's window, SYNs to an open flow: translated, the flow's state left as it was (conntrack.h) */
	STAT_DROP_LOOPBACK = 43,      /* frames from a pod to or from a loopback address (127.0.0.0/8, ::1): dropped (tc_lb.c) */
	STAT_DROP_UNPARSED = 44,      /* packets to a frontend whose L4 header lies beyond what the parser walks (an IPv6 extension chain longer than IP6_MAX_EXT headers or IP6_MAX_EXT_LEN bytes): dropped, never passed on untranslated (lb.h) */
	STAT_DROP_REPLY_IFACE = 45,   /* replies, and ICMP errors about a flow, that arrived on another interface than the flow's packets of that direction come in on (a pod's veth where the backend is elsewhere, or another pod's): forged, dropped (conntrack.h, ct_iif_plausible) */
	STAT_CT_SRC_PROVEN = 46,      /* new flows taken from a proven source's own budget (tlb_ct_proven), not its shared cell's (conntrack.h) */
	STAT_SNAT_EVICTED = 47,       /* source-NATed flows the backend answered but their client did not (spoofed, most likely), evicted from their port for a new flow that found no free one (nat.h, snat_claim) */
	STAT_MAX = 48,
};

/* How many rejects (TCP resets, ICMP port unreachables) each hook may send
 * per CPU: REJECT_RATE a second, in bursts of up to REJECT_BURST — the
 * kernel's own ICMP budget (net.ipv4.icmp_msgs_per_sec 1000,
 * icmp_msgs_burst 50), per CPU instead of per host. Over it, new flows to
 * the frontend are dropped and counted (STAT_REJECT_LIMITED). Refusals at
 * the socket (connect, sendmsg) send nothing and are not limited. */
enum reject_limit {
	REJECT_RATE = 1000,
	REJECT_BURST = 50,
};

/* Bits of backend_value.flags and registry_value.flags. Informational for
 * the datapath. */
enum backend_flag {
	BACKEND_F_NODE_LOCAL = 1,
	BACKEND_F_ZONE_LOCAL = 2,
};

/* registry_value.state. A registry entry counts only while its gen equals
 * its id's tlb_backend_stats gen: releasing an id bumps that gen, which
 * retires the entry without writing it. */
enum backend_state {
	BACKEND_FREE = 0,     /* id never assigned (zero value) */
	BACKEND_ACTIVE = 1,   /* in its frontend's slot table */
	BACKEND_DRAINING = 2, /* not in the slot table; its flows keep it */
};

/* Bits of svc_value.flags. */
enum svc_flag {
	SVC_F_AFFINITY = 1, /* ClientIP session affinity, svc_value.affinity_timeout */
	SVC_F_REJECT = 2,   /* no active backend: reject new flows (reject.h) instead of dropping them */
	SVC_F_SRC_RANGES = 4, /* loadBalancerSourceRanges: new flows only from tlb_src_ranges' prefixes of the frontend (srcrange.h) */
	SVC_F_SRC_NODE = 8,   /* with SVC_F_SRC_RANGES: a range holds the node's address, so the node's own processes pass */
};

/* svc_key.scope: which hooks see a frontend. */
enum scope {
	SCOPE_INTERNAL = 0, /* from pods (tc) and host processes (socket hooks) */
	SCOPE_EXTERNAL = 1, /* arriving on an uplink (XDP) */
};

/* ct_value.dir */
enum ct_dir {
	CT_FORWARD = 1, /* client -> frontend: rewrite destination to backend */
	CT_REVERSE = 2, /* backend -> client: rewrite source to frontend */
};

/* ct_value.state */
enum ct_state {
	CT_TCP_SYN_SENT = 1,    /* TCP, no reply seen yet */
	CT_TCP_ESTABLISHED = 2, /* TCP, a reply seen */
	CT_TCP_CLOSING = 3,     /* TCP, FIN or RST seen in either direction */
	CT_UDP = 4,
};

/* Bits of ct_value.flags. Both entries of a flow carry the same bits but
 * nothing else differs by direction. */
enum ct_flag {
	CT_F_SNAT = 1,    /* nat_addr/nat_port hold the second pair (source-NATed flow) */
	CT_F_REPLIED = 2, /* a packet of the reply direction was seen */
	CT_F_ASSURED = 4, /* promoted (TCP: the client answered the reply; UDP: a reply): in tlb_conntrack, else in tlb_ct_new */
	CT_F_FULL = 8,    /* a promotion found tlb_conntrack full: tried again at the next refresh, not per packet */
	CT_F_STALE = 16,  /* forward entry only, set by the agent with expires 0 when it released the backend's id
			   * (maps/stale.go): the next packet re-balances the flow (STAT_CT_STALE_BACKEND) */
};

/* Per-source budget of new flows (tlb_ct_src's cells, a generic cell
 * rate algorithm): a source may start cfg_ct_src_rate flows a second that are
 * not established yet, in bursts of as many; each flow that gets
 * promoted (a TCP client answered the reply, a UDP flow got one) gives
 * its share back, so
 * clients whose handshakes complete are never limited, and one source
 * flooding SYNs or one-way datagrams cannot churn everyone's unreplied
 * flows out of tlb_ct_new. 0 disables the limit.
 * The cells are charged before a source proves anything: a flood spoofing
 * a client's address (or addresses of its IPv6 /64) spends the client's
 * cell. A source that completed a TCP handshake (tlb_ct_proven) is
 * charged against a budget of its own instead, CT_PROVEN_SHARE times the
 * cell's rate and burst: a flood spoofing it must outrun that, and
 * unproven sources (spoofers, UDP-only clients) keep sharing cells. */
enum ct_src_limit {
	CT_SRC_RATE_DEFAULT = 10000,
	CT_PROVEN_SHARE = 8,
};

/* ct_value.redirect: where the translated packets of one direction of a
 * flow go (bpf/fwd.h resolves it from the FIB when the flow is created,
 * and again at most once a second while the flow is active). */
enum ct_redirect {
	CT_REDIRECT_STACK = 0, /* up the host stack */
	CT_REDIRECT_PEER = 1,  /* into the pod behind host veth ifindex: tc bpf_redirect_peer; XDP hands over to tc_uplink */
	CT_REDIRECT_NEIGH = 2, /* resolve again; meanwhile out of ifindex with the kernel resolving the next hop
				* (tc bpf_redirect_neigh; XDP hands over to tc_uplink), or up the stack when ifindex is 0 */
	CT_REDIRECT_XDP = 3,   /* out of uplink ifindex with the stored MACs: XDP_TX / XDP_REDIRECT, tc bpf_redirect */
};

/* iface_value.kind */
enum iface_kind {
	IFACE_POD = 1,    /* host side of a pod veth (tc) */
	IFACE_UPLINK = 2, /* an uplink (XDP) */
};

/* Source NAT of external flows to backends on other nodes (bpf/nat.h).
 * The port range is set at load time (cfg_snat_port_min/max). netfilter's
 * masquerade walks 1024 to 65535 for sources above 1023, but it sees the
 * node's own connections and keeps clear of them; this datapath does not,
 * so the default leaves out what the node uses itself: Linux's default
 * ephemeral range (ip_local_port_range 32768 to 60999), where a host
 * process connecting to the same backend could pick the same 5-tuple,
 * and the NodePort range (30000 to 32767), so a stray reply is never
 * taken for a packet to a NodePort. 1024 to 29999 is the larger of the
 * two pieces left: 28,976 ports per (address, backend), 6.4 times the
 * 61000 to 65535 used before. Ports of expired flows are taken over on
 * collision, and when all ports tried are taken, one of an unassured flow
 * is evicted (snat_claim). */
enum snat_config {
	SNAT_PORT_MIN_DEFAULT = 1024,
	SNAT_PORT_MAX_DEFAULT = 29999,
	SNAT_RETRIES = 16, /* ports tried per new flow before it is dropped */
};

/* Verdicts of the shared core (lb.h); each hook maps them to its own. */
enum lb_verdict {
	LB_PASS = 0,
	LB_DROP = 1,
	LB_REWRITE = 2,
	LB_ICMP = 3,   /* an ICMP message: icmp.h decides */
	LB_REJECT = 4, /* a new flow to an empty reject frontend: answer it (reject.h) */
};

/* "Keep going" sentinel for helpers that otherwise return a verdict. */
#define LB_CONTINUE -1

#endif
