#!/usr/bin/env bash
# tools/cluster/down.sh: tears the local cluster down (`make cluster-down`)
# and leaves the machine as up.sh found it, also after a failed or partial
# bring-up, and when run twice: every process of the cluster (its cgroups),
# the mounts under $TLBC_DIR, the network namespaces, the cgroups, the
# machine-wide sysctls the kubelet changed, the paths the kubelet and
# containerd created, the agents' pins, and $TLBC_DIR itself.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tools/cluster/lib.sh
source "$HERE/lib.sh"
[[ $(id -u) == 0 ]] || tlbc_die "needs root"

failed=0
fail() {
	printf 'cluster-down: %s\n' "$*" >&2
	failed=1
}

# pids_of CGROUP...: every process in these pids cgroups and below.
pids_of() {
	local cg
	for cg in "$@"; do
		[[ -d /sys/fs/cgroup/pids/$cg ]] || continue
		find "/sys/fs/cgroup/pids/$cg" -name cgroup.procs -exec cat {} + 2>/dev/null
	done
}

# The kubelets and kube-proxies first, so nothing restarts containers, then
# the rest gracefully, then whatever is left (containers, shims) killed.
for f in "$TLBC_PIDS"/*-kubelet.pid "$TLBC_PIDS"/*-kube-proxy.pid; do
	[[ -f $f ]] && kill -TERM "$(cat "$f")" 2>/dev/null
done
sleep 1
groups=("$TLBC_CGROUP" "${TLBC_NODES[@]}")
mapfile -t pids < <(pids_of "${groups[@]}")
((${#pids[@]})) && kill -TERM "${pids[@]}" 2>/dev/null
for _ in $(seq 1 20); do
	mapfile -t pids < <(pids_of "${groups[@]}")
	((${#pids[@]})) || break
	sleep 0.5
done
for _ in $(seq 1 20); do
	mapfile -t pids < <(pids_of "${groups[@]}")
	((${#pids[@]})) || break
	kill -KILL "${pids[@]}" 2>/dev/null
	sleep 0.5
done
mapfile -t pids < <(pids_of "${groups[@]}")
((${#pids[@]})) && fail "processes still running: ${pids[*]}"

# Mounts: the kubelets' volumes, containerd's snapshots and pod network
# namespaces, deepest first.
mapfile -t mounts < <(findmnt -rn -o TARGET | awk -v d="$TLBC_DIR/" 'index($0, d) == 1' | sort -r)
for m in "${mounts[@]}"; do
	umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || fail "could not unmount $m"
done

for ns in $(ip netns list | awk '$1 ~ /^tlbc-/ { print $1 }'); do
	ip netns delete "$ns" || fail "could not delete network namespace $ns"
done

# Cgroups, deepest first (a cgroup is removed with rmdir once empty).
for h in "${TLBC_CGROUP_HIERARCHIES[@]}"; do
	for cg in "${groups[@]}"; do
		d=/sys/fs/cgroup/$h/$cg
		[[ -d $d ]] || continue
		find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
		[[ -d $d ]] && fail "could not remove cgroup $d"
	done
done

if [[ -f $TLBC_DIR/sysctls ]]; then
	while IFS= read -r kv; do sysctl -qw "$kv" || fail "could not restore $kv"; done <"$TLBC_DIR/sysctls"
fi

# The agents' pins (--bpffs=/sys/fs/bpf/topolb/NODE) and the paths the
# kubelets and containerds created: container log links, shim sockets.
for n in "${TLBC_NODES[@]}"; do
	rm -rf "/sys/fs/bpf/topolb/$n"
done
if [[ -d /var/log/containers ]]; then
	find /var/log/containers -maxdepth 1 -type l -lname "$TLBC_DIR/*" -delete
fi
if [[ -f $TLBC_DIR/preexisting-paths ]]; then
	for p in "${TLBC_GLOBAL_PATHS[@]}"; do
		grep -qxF "$p" "$TLBC_DIR/preexisting-paths" && continue
		[[ -e $p ]] || continue
		# Only if nothing else put anything there meanwhile.
		find "$p" -depth -type d -empty -delete 2>/dev/null
		[[ -e $p ]] && fail "$p was created by the cluster and is not empty; left in place"
	done
fi

if ((failed)); then
	fail "$TLBC_DIR kept for a look"
	exit 1
fi
rm -rf "$TLBC_DIR"
tlbc_log "cluster down"
