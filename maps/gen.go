package maps

// The BPF objects and their Go bindings are generated with pinned flags and
// committed; `make generate` rebuilds them and CI checks nothing changed.
// bpf/include holds arch-neutral asm/ shims so no host triplet leaks in.

//go:generate go tool bpf2go -target bpfel -cc clang -strip llvm-strip -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I../bpf/include" -type svc_key -type svc_value -type backend_key -type backend_value -type registry_value -type ct_key -type ct_value -type traffic -type meta -type stat_reason tc ../bpf/tc_lb.c
//go:generate go tool bpf2go -target bpfel -cc clang -strip llvm-strip -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I../bpf/include" xdp ../bpf/xdp_lb.c
//go:generate go tool bpf2go -target bpfel -cc clang -strip llvm-strip -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I../bpf/include" baseline ../bpf/baseline.c
