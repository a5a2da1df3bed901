#!/usr/bin/env bash
# guest.sh REPO OUT — runs inside each kernel of the matrix (tools/kernels/init
# starts it in the overlay of the host's root): the maps/ test binary and the
# e2e traffic subset that tools/kernels/run.sh built into OUT/bin, each with
# -test.v into OUT/results/RELEASE/, whose counts run.sh reads. With
# TOPOLB_KERNELS_HOST=1 it runs on the host itself (the machine's kernel,
# where /boot has no image to boot) and leaves the host's settings alone.
set -uo pipefail
REPO=$1 OUT=$2
rel=$(uname -r)
res=$OUT/results/$rel
mkdir -p "$res"
export PATH=$OUT/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
# shellcheck source=/dev/null
. "$OUT/bin/env"
if [ -z "${TOPOLB_KERNELS_HOST:-}" ]; then
	ip link set lo up
	hostname "topolb-kernel-${rel//[^a-z0-9.-]/-}"
	# What the tests load through the kernel's module autoloading, loaded
	# up front so a missing one shows here rather than as a test's odd
	# error.
	for m in veth sch_ingress cls_bpf nf_tables nft_chain_nat nf_conntrack iptable_nat dummy bridge 8021q ipv6; do
		modprobe "$m" 2>>"$res/modprobe.log" || true
	done
fi
run() { # name dir binary args...
	local name=$1 dir=$2 bin=$3
	shift 3
	echo "guest: $name on $rel"
	(cd "$dir" && "$bin" -test.v -test.count=1 "$@") >"$res/$name.log" 2>&1
	echo "$?" >"$res/$name.rc"
}
run maps "$REPO/maps" "$OUT/bin/maps.test" -test.timeout "${TOPOLB_KERNELS_MAPS_TIMEOUT:-10m}" ${TOPOLB_KERNELS_MAPS_RUN:+-test.run "$TOPOLB_KERNELS_MAPS_RUN"}
if [ -n "${TOPOLB_KERNELS_E2E_RUN:-}" ]; then
	run e2e "$REPO/tests/e2e" "$OUT/bin/e2e.test" -test.timeout "${TOPOLB_KERNELS_E2E_TIMEOUT:-6m}" -test.run "$TOPOLB_KERNELS_E2E_RUN"
fi
uname -a >"$res/uname"
if [ -z "${TOPOLB_KERNELS_HOST:-}" ]; then
	# The guest's clock, which run.sh compares with the host's.
	dmesg | grep -iE 'clocksource|tsc' >"$res/clock.log"
	cut -d' ' -f1 /proc/uptime >"$res/uptime"
fi
