/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The load-balancing core both hooks call: conntrack, backend choice and
 * the NAT decision. It never touches the packet; the hook applies the
 * rewrite with the checksum method that fits it. */
#ifndef TOPOLB_LB_H
#define TOPOLB_LB_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "consts.h"
#include "structs.h"
#include "maps.h"
#include "parse.h"

#ifndef LB_DNAT_DEFAULT
#error "entry file must define LB_DNAT_DEFAULT before including lb.h"
#endif

/* Node configuration, fixed at load time (the verifier prunes dead
 * branches). */

/* cfg_dnat enables service DNAT on this hook. tc: on. XDP on uplinks: off
 * until NodePort lands; XDP only reverse-NATs replies there. */
volatile const __u8 cfg_dnat = LB_DNAT_DEFAULT;
/* cfg_hash_seed seeds the flow hash; must match on every program of a node
 * so both hooks would pick the same slot. */
volatile const __u32 cfg_hash_seed = 0x746c6221;

/* A rewrite of one address and one port, both network byte order. */
struct nat {
	__be32 old_addr;
	__be32 new_addr;
	__be16 old_port;
	__be16 new_port;
	__u8 dst; /* 1: rewrite destination (DNAT), 0: source (reverse NAT) */
	__u8 pad[3];
};

static __always_inline void stat_inc(enum stat_reason reason)
{
	__u32 key = reason;
	__u64 *v = bpf_map_lookup_elem(&tlb_stats, &key);

	if (v)
		*v += 1;
}

static __always_inline void count_forward(__u32 svc_id, __u32 backend_id, __u32 bytes)
{
	struct traffic *t = bpf_map_lookup_elem(&tlb_svc_stats, &svc_id);
	__u64 *p;

	if (t) {
		t->packets += 1;
		t->bytes += bytes;
	}
	p = bpf_map_lookup_elem(&tlb_be_stats, &backend_id);
	if (p)
		*p += 1;
}

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

/* ct_lookup returns LB_REWRITE with nat filled in when pkt is a reply of a
 * tracked flow, or belongs to one whose backend is still permitted;
 * LB_CONTINUE otherwise. */
static __always_inline int ct_lookup(const struct packet *pkt, struct nat *nat)
{
	struct ct_key key = {
		.saddr = pkt->saddr,
		.daddr = pkt->daddr,
		.sport = pkt->sport,
		.dport = pkt->dport,
		.proto = pkt->proto,
	};
	struct registry_value *reg;
	struct ct_value *ct;

	ct = bpf_map_lookup_elem(&tlb_conntrack, &key);
	if (!ct)
		return LB_CONTINUE;

	if (ct->dir == CT_REVERSE) {
		/* Replies are always translated back, even after the backend
		 * lost its permission: the client must only ever see the
		 * service address. */
		nat->dst = 0;
		nat->old_addr = pkt->saddr;
		nat->old_port = pkt->sport;
		nat->new_addr = ct->addr;
		nat->new_port = ct->port;
		stat_inc(STAT_REVERSE_NAT);
		return LB_REWRITE;
	}
	if (!cfg_dnat || ct->dir != CT_FORWARD)
		return LB_CONTINUE;

	/* The flow keeps its backend only while the registry still lists
	 * that exact (service, backend) pair under the id. */
	reg = bpf_map_lookup_elem(&tlb_registry, &ct->backend_id);
	if (!reg || reg->svc_id != ct->svc_id || reg->addr != ct->addr ||
	    reg->port != ct->port)
		return LB_CONTINUE;

	nat->dst = 1;
	nat->old_addr = pkt->daddr;
	nat->old_port = pkt->dport;
	nat->new_addr = ct->addr;
	nat->new_port = ct->port;
	count_forward(ct->svc_id, ct->backend_id, pkt->l3_len);
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

/* ct_create records both directions of a new flow. */
static __always_inline int ct_create(const struct packet *pkt, __u32 svc_id,
				     const struct backend_value *be)
{
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
		.svc_id = svc_id,
		.backend_id = be->id,
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
		.svc_id = svc_id,
		.backend_id = be->id,
	};

	/* Reverse first: a reply can never race ahead of an entry that is
	 * not there yet, but a forward entry without its reverse would
	 * leak backend addresses to the client. */
	if (bpf_map_update_elem(&tlb_conntrack, &rev_key, &rev, BPF_ANY))
		return -1;
	if (bpf_map_update_elem(&tlb_conntrack, &fwd_key, &fwd, BPF_ANY))
		return -1;
	return 0;
}

/* lb_new_flow load-balances the first packet of a flow to a frontend.
 * Returns LB_PASS when pkt is not addressed to a frontend. */
static __always_inline int lb_new_flow(const struct packet *pkt, struct nat *nat)
{
	struct svc_key key = {
		.vip = pkt->daddr,
		.port = pkt->dport,
		.proto = pkt->proto,
	};
	struct backend_value be;
	struct svc_value svc, *v;
	__u32 hash;

	v = bpf_map_lookup_elem(&tlb_services, &key);
	if (!v)
		return LB_PASS;
	svc = *v;
	if (svc.count == 0) {
		stat_inc(STAT_DROP_NO_BACKEND);
		return LB_DROP;
	}

	hash = flow_hash(pkt);
	if (pick_backend(&svc, hash, &be)) {
		/* The buffer we read may have been retired between the two
		 * lookups; the service entry then points at the new one. */
		v = bpf_map_lookup_elem(&tlb_services, &key);
		if (!v || v->count == 0) {
			stat_inc(STAT_DROP_NO_BACKEND);
			return LB_DROP;
		}
		svc = *v;
		if (pick_backend(&svc, hash, &be)) {
			stat_inc(STAT_DROP_NO_BACKEND);
			return LB_DROP;
		}
	}

	if (ct_create(pkt, svc.id, &be)) {
		stat_inc(STAT_DROP_MAP_FULL);
		return LB_DROP;
	}

	nat->dst = 1;
	nat->old_addr = pkt->daddr;
	nat->old_port = pkt->dport;
	nat->new_addr = be.addr;
	nat->new_port = be.port;
	count_forward(svc.id, be.id, pkt->l3_len);
	return LB_REWRITE;
}

/* lb_process decides what happens to a parsed TCP/UDP packet. */
static __always_inline int lb_process(const struct packet *pkt, struct nat *nat)
{
	int ret = ct_lookup(pkt, nat);

	if (ret != LB_CONTINUE)
		return ret;
	if (!cfg_dnat)
		return LB_PASS;
	return lb_new_flow(pkt, nat);
}

/* lb_classify runs the parser and the core; shared prologue of both hooks. */
static __always_inline int lb_classify(void *data, void *data_end, __u32 frame_len,
				       struct packet *pkt, struct nat *nat)
{
	switch (parse_packet(data, data_end, frame_len, pkt)) {
	case PARSE_OK:
		return lb_process(pkt, nat);
	case PARSE_FRAGMENT:
		stat_inc(STAT_FRAGMENT);
		return LB_PASS;
	case PARSE_ERROR:
		stat_inc(STAT_DROP_PARSE_ERROR);
		return LB_DROP;
	default:
		return LB_PASS;
	}
}

#endif
