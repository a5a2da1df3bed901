/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Puts the shared enums that no map key or value names into BTF, so
 * bpf2go can export them to Go (-type). clang emits BTF only for types
 * that something emitted refers to; btf_anchor's parameter does. No
 * program calls it, so the loader never links it into one. */
#ifndef TOPOLB_ANCHORS_H
#define TOPOLB_ANCHORS_H

#include "consts.h"
#include "fwd.h"

struct btf_anchors {
	enum map_size map_size;
	enum ct_timeout ct_timeout;
	enum stat_reason stat_reason;
	enum backend_flag backend_flag;
	enum backend_state backend_state;
	enum svc_flag svc_flag;
	enum scope scope;
	enum ct_dir ct_dir;
	enum ct_state ct_state;
	enum ct_flag ct_flag;
	enum ct_redirect ct_redirect;
	enum iface_kind iface_kind;
	enum reject_limit reject_limit;
	enum snat_config snat_config;
	enum ct_src_limit ct_src_limit;
	enum ct_tcp_limit ct_tcp_limit;
	enum fwd_meta_const fwd_meta_const;
	enum fwd_meta_flag fwd_meta_flag;
	struct fwd_meta fwd_meta;
};

__attribute__((noinline)) int btf_anchor(struct btf_anchors *a)
{
	return a != 0;
}

#endif
