package maps

// The BPF objects and their Go bindings are generated with pinned flags and
// committed; `make generate` rebuilds them and CI checks nothing changed.
// bpf/include holds arch-neutral asm/ shims so no host triplet leaks in.
// Every type and enum Go shares with C is generated from BTF (-type): none
// is copied by hand.
//
// The pinned flags, once: bpf2go below is this command (go generate's
// -command alias, for the rest of this file).

//go:generate -command bpf2go go tool bpf2go -target bpfel -cc clang -strip llvm-strip -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I../bpf/include"

//go:generate bpf2go -type tlb_addr -type svc_key -type svc_value -type backend_key -type backend_value -type registry_value -type backend_stats -type ct_key -type ct_value -type ct_src -type affinity_key -type affinity_value -type iface_value -type sock_revnat_key -type sock_revnat_value -type src_range_key -type meta -type map_size -type ct_timeout -type stat_reason -type backend_flag -type backend_state -type svc_flag -type scope -type ct_dir -type ct_state -type ct_flag -type ct_redirect -type iface_kind -type reject_limit -type snat_config -type ct_src_limit -type ct_tcp_limit -type fwd_meta_const -type fwd_meta_flag -type fwd_meta tc ../bpf/tc_lb.c
//go:generate bpf2go xdp ../bpf/xdp_lb.c
//go:generate bpf2go uplink ../bpf/tc_uplink.c
//go:generate bpf2go baseline ../bpf/baseline.c
//go:generate bpf2go floor ../bpf/floor.c
//go:generate bpf2go sock ../bpf/sock_lb.c
//go:generate bpf2go -type stale_id_gen -type stale_traffic ctstale ../bpf/ct_stale.c
