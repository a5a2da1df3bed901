#!/usr/bin/env bash
# Installs the Debian packages topolb's build, tests and demo need; with
# the argument "cluster" also those of the local cluster (tools/cluster):
# runc and the CNI plugins (containerd is built: tools/containerd-bins.sh);
# with "kernels" those of the kernel matrix (tools/kernels/run.sh): qemu,
# a static busybox for its initramfs, and what unpacks kernel packages.
# Idempotent: does nothing when everything is already present.
set -euo pipefail
need=()
if [ "${1:-}" = cluster ]; then
  command -v runc >/dev/null 2>&1 || need+=(runc)
  [ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
fi
if [ "${1:-}" = kernels ]; then
  for pair in qemu-system-x86_64:qemu-system-x86 cpio:cpio depmod:kmod xz:xz-utils zstd:zstd; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
  done
  # The initramfs needs busybox linked statically.
  case $(ldd "$(command -v busybox || echo /nonexistent)" 2>&1) in
    *"not a dynamic executable"*) ;;
    *) need+=(busybox-static) ;;
  esac
fi
for pair in clang:clang llc:llvm bpftool:bpftool ip:iproute2 nft:nftables iptables:iptables nsenter:util-linux ethtool:ethtool capsh:libcap2-bin shellcheck:shellcheck wrk:wrk nginx:nginx prometheus:prometheus promtool:prometheus; do
  cmd=${pair%%:*} pkg=${pair#*:}
  command -v "$cmd" >/dev/null 2>&1 || need+=("$pkg")
done
[ -e /usr/include/bpf/bpf_helpers.h ] || need+=(libbpf-dev)
if [ ${#need[@]} -gt 0 ]; then
  mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
  if [ "$(id -u)" != 0 ]; then
    echo "install-deps: missing packages ${need[*]}; run as root or install them" >&2
    exit 1
  fi
  echo "install-deps: installing ${need[*]}"
  apt-get update -qq
  # nginx is only a program for the end-to-end benchmark's backends, and
  # prometheus one for the dashboard's and alerts' tests (tests/monitoring):
  # keep the packages from starting services on the host while they install.
  policy=/usr/sbin/policy-rc.d
  added_policy=
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && added_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  if [ -n "$added_policy" ]; then rm -f "$policy"; fi
fi
# bpffs is needed for pinning.
if [ "$(id -u)" = 0 ] && ! mountpoint -q /sys/fs/bpf; then
  mount -t bpf bpf /sys/fs/bpf
fi
