#!/usr/bin/env bash
# run.sh [RELEASE-PATTERN] — `make test-kernels`: the maps/ tests and an
# e2e traffic subset inside each kernel of the matrix, booted in qemu.
#
# The kernels are Debian's own packages, one per suite of sources.list
# (bullseye 5.10, bookworm 6.1, trixie 6.12): the linux-image-amd64 of each
# suite names the image package, which apt-get downloads with Dir settings
# of its own (the host's apt state is untouched) into
# ~/.cache/topolb/kernels, then unpacks there. The machine's own kernel
# joins the matrix, booted where /boot/vmlinuz-$(uname -r) and its modules
# exist, else with the same binaries run on the host itself.
#
# Each kernel boots in qemu (KVM where /dev/kvm can boot a stock kernel,
# else TCG, far slower: a PVM /dev/kvm boots only guests built for PVM) with a busybox initramfs (init beside this file) whose root is the
# host's root shared read-only over virtio-9p under a tmpfs overlay, so the
# guest has the host's tools, kube-bins and this checkout; the test
# binaries are built once here (go test -c). guest.sh runs them and writes
# -test.v logs, which this script counts into one line per kernel:
#
#   KERNEL <release> <pass|fail> <passed>/<total>
#
# total counts the top-level tests that passed or failed; skipped ones (a
# feature the kernel lacks, with the test's reason) are listed above the
# line. A test binary that exits non-zero without a FAIL line (a panic, a
# timeout, a guest that did not finish) counts as one failure. Exits 1 when
# any kernel fails.
#
# run.sh --kvm exits 0 where qemu can use KVM to boot the matrix, else
# says why not and exits 1 (make test runs the matrix only with KVM: under
# TCG it takes far longer than make test's budget).
#
# Environment: TOPOLB_KERNELS_MAPS_RUN / TOPOLB_KERNELS_E2E_RUN select tests
# (-test.run; E2E empty skips the e2e binary), TOPOLB_KERNELS_MEM (MiB,
# default 3072), TOPOLB_KERNELS_BOOT_TIMEOUT (per kernel, default 20m,
# 95m under TCG), TOPOLB_KERNELS_MAPS_TIMEOUT / TOPOLB_KERNELS_E2E_TIMEOUT
# (each test binary, default 10m and 6m, 60m and 30m under TCG),
# TOPOLB_AGENT_READY_TIMEOUT (how long the testbed waits for an agent to
# be ready, tools/testbed; default 1m, 10m under TCG).
set -euo pipefail

# choose_accel sets accel to qemu's accelerator flags and says why it is
# not KVM; returns 1 without KVM.
choose_accel() {
	accel=(-accel "tcg,thread=multi" -cpu max)
	if [[ ! -e /dev/kvm ]]; then
		echo "test-kernels: no /dev/kvm: TCG, far slower"
		return 1
	elif [[ -d /sys/module/kvm_pvm ]]; then
		# PVM runs only guests built for it (CONFIG_PVM_GUEST): Debian's
		# kernels stop at their first instruction it must emulate.
		echo "test-kernels: /dev/kvm is PVM (kvm_pvm), which boots no stock kernel: TCG, far slower"
		return 1
	elif [[ ! -r /dev/kvm || ! -w /dev/kvm ]]; then
		echo "test-kernels: /dev/kvm is not readable and writable: TCG, far slower"
		return 1
	fi
	accel=(-accel kvm -cpu host)
}

main() {

	ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
	HERE=$ROOT/tools/kernels
	CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/topolb/kernels
	WORK=$CACHE/work
	: "${TOPOLB_KERNELS_MAPS_RUN:=}"
	: "${TOPOLB_KERNELS_E2E_RUN=TestFlowsKeepTheirBackend|TestAgentRestartUnderLoad|TestNorthSouth}"
	: "${TOPOLB_KERNELS_MEM:=3072}"
	# Under TCG everything takes many times longer: an agent minutes to
	# probe the kernel and verify its programs, which the testbed waits
	# for (TOPOLB_AGENT_READY_TIMEOUT), the maps binary most of an hour.
	if choose_accel >/dev/null; then
		: "${TOPOLB_KERNELS_MAPS_TIMEOUT:=10m}" "${TOPOLB_KERNELS_E2E_TIMEOUT:=6m}" "${TOPOLB_KERNELS_BOOT_TIMEOUT:=20m}"
		ready_timeout=${TOPOLB_AGENT_READY_TIMEOUT:-}
	else
		: "${TOPOLB_KERNELS_MAPS_TIMEOUT:=60m}" "${TOPOLB_KERNELS_E2E_TIMEOUT:=30m}" "${TOPOLB_KERNELS_BOOT_TIMEOUT:=95m}"
		ready_timeout=${TOPOLB_AGENT_READY_TIMEOUT:-10m}
	fi

	for cmd in qemu-system-x86_64 busybox cpio apt-get dpkg-deb depmod xz zstd go; do
		command -v "$cmd" >/dev/null || { echo "test-kernels: $cmd missing (tools/install-deps.sh kernels)" >&2; exit 1; }
	done
	[[ $(ldd "$(command -v busybox)" 2>&1) == *"not a dynamic executable"* ]] ||
		{ echo "test-kernels: busybox must be static (busybox-static)" >&2; exit 1; }

	mkdir -p "$CACHE/apt/lists/partial" "$CACHE/apt/archives/partial" "$CACHE/debs" "$WORK/bin" "$WORK/results"
	touch "$CACHE/apt/status"
	APT=(-o Dir::Etc::SourceList="$HERE/sources.list" -o Dir::Etc::SourceParts=/dev/null
		-o Dir::State::Lists="$CACHE/apt/lists" -o Dir::State::Status="$CACHE/apt/status"
		-o Dir::Cache="$CACHE/apt/cache" -o Dir::Cache::archives="$CACHE/apt/archives"
		-o Debug::NoLocking=1 -o APT::Sandbox::User=root -o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
		-o Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false -o Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false)

	# kernels: lines "release vmlinuz modules-dir" to boot.
	kernels=()
	echo "test-kernels: reading the kernel packages of $(grep -c '^deb ' "$HERE/sources.list") suites"
	# The lists are read again once a day.
	if [[ -z $(find "$CACHE/apt/lists" -maxdepth 1 -name '*_Packages*' -mmin -1440 -print -quit) ]]; then
		apt-get "${APT[@]}" -qq update </dev/null
	fi
	while read -r suite; do
		ver=$(apt-cache "${APT[@]}" madison linux-image-amd64 | awk -v s="$suite/main" '$0 ~ " "s" " {print $3; exit}')
		[[ -n $ver ]] || { echo "test-kernels: no linux-image-amd64 in $suite" >&2; exit 1; }
		pkg=$(apt-cache "${APT[@]}" show "linux-image-amd64=$ver" | sed -n 's/^Depends: \(linux-image-[^ ,]*\).*/\1/p' | head -1)
		rel=${pkg#linux-image-}
		dir=$CACHE/$pkg
		if [[ ! -e $dir/.unpacked ]]; then
			(cd "$CACHE/debs" && apt-get "${APT[@]}" -qq download "$pkg")
			deb=$(find "$CACHE/debs" -name "${pkg}_*.deb" | sort -V | tail -1)
			rm -rf "$dir" && mkdir -p "$dir"
			dpkg-deb -x "$deb" "$dir"
			# trixie's package has its modules under usr/ (merged /usr).
			[[ -e $dir/lib ]] || ln -s usr/lib "$dir/lib"
			# The package leaves modules.dep to its postinst.
			depmod -b "$dir" "$rel"
			touch "$dir/.unpacked"
		fi
		kernels+=("$rel $dir/boot/vmlinuz-$rel $dir/lib/modules")
	done < <(awk '/^deb /{print $(NF-1)}' "$HERE/sources.list")
	host_rel=$(uname -r)
	if [[ -r /boot/vmlinuz-$host_rel && -d /lib/modules/$host_rel ]]; then
		kernels+=("$host_rel /boot/vmlinuz-$host_rel /lib/modules")
	else
		# Nothing to boot: the same binaries run on the host itself.
		echo "test-kernels: the machine's kernel $host_rel has no /boot/vmlinuz-$host_rel with modules to boot: its tests run on the host, not in qemu"
		kernels+=("$host_rel host -")
	fi

	echo "test-kernels: building the test binaries"
	(cd "$ROOT" && go test -c -o "$WORK/bin/maps.test" ./maps/ &&
		go test -c -o "$WORK/bin/e2e.test" ./tests/e2e/ &&
		go build -o "$WORK/bin/" ./cmd/topolb-agent ./cmd/topolbctl)
	{
		printf 'export TOPOLB_AGENT_BINARY=%q\n' "$WORK/bin/topolb-agent"
		printf 'export TOPOLB_KUBE_BINS=%q\n' "${TOPOLB_KUBE_BINS:-${XDG_CACHE_HOME:-$HOME/.cache}/topolb/kube-bins-v1.37.2}"
		printf 'export TOPOLB_KERNELS_MAPS_RUN=%q TOPOLB_KERNELS_E2E_RUN=%q\n' "$TOPOLB_KERNELS_MAPS_RUN" "$TOPOLB_KERNELS_E2E_RUN"
		printf 'export TOPOLB_KERNELS_MAPS_TIMEOUT=%q TOPOLB_KERNELS_E2E_TIMEOUT=%q\n' "$TOPOLB_KERNELS_MAPS_TIMEOUT" "$TOPOLB_KERNELS_E2E_TIMEOUT"
		[[ -z $ready_timeout ]] || printf 'export TOPOLB_AGENT_READY_TIMEOUT=%q\n' "$ready_timeout"
	} >"$WORK/bin/env"

	# initramfs RELEASE MODDIR OUT: busybox, init, and the modules the 9p
	# root and the overlay need, with their dependencies, uncompressed, in
	# load order.
	initramfs() {
		local rel=$1 moddir=$2/$1 out=$3 tmp
		tmp=$(mktemp -d)
		mkdir -p "$tmp"/{bin,mods,proc,sys,dev}
		cp "$(command -v busybox)" "$tmp/bin/busybox"
		cp "$HERE/init" "$tmp/init"
		local -A seen=()
		add() {
			local m=$1 line path d
			[[ -n ${seen[$m]:-} ]] && return
			seen[$m]=1
			grep -qE "/$m\.ko(\.[a-z]+)?$" "$moddir/modules.builtin" 2>/dev/null && return
			line=$(grep -E "(^|/)$m\.ko(\.[a-z]+)?:" "$moddir/modules.dep" | head -1) || true
			[[ -n $line ]] || return 0
			path=${line%%:*}
			for d in ${line#*:}; do
				d=${d##*/}
				add "${d%%.ko*}"
			done
			case $path in
			*.xz) xz -dc "$moddir/$path" >"$tmp/mods/$m.ko" ;;
			*.zst) zstd -qdc "$moddir/$path" >"$tmp/mods/$m.ko" ;;
			*) cp "$moddir/$path" "$tmp/mods/$m.ko" ;;
			esac
			echo "$m.ko" >>"$tmp/mods/order"
		}
		touch "$tmp/mods/order"
		for m in virtio_pci 9pnet_virtio 9p overlay; do add "$m"; done
		(cd "$tmp" && find . | cpio -o -H newc --quiet | gzip -1) >"$out"
		rm -rf "$tmp"
	}

	# count LOG RC: "passed failed skipped" of the top-level tests of a -test.v
	# log; a non-zero exit without a FAIL line is one failure.
	count() {
		local log=$1 rc=$2 p f s
		p=$(grep -c '^--- PASS' "$log" || true)
		f=$(grep -c '^--- FAIL' "$log" || true)
		s=$(grep -c '^--- SKIP' "$log" || true)
		if [[ $rc != 0 && $f == 0 ]]; then f=1; fi
		echo "$p $f $s"
	}

	# boot RELEASE VMLINUZ MODULES RESULTS: one run of guest.sh in the
	# kernel, under qemu.
	boot() {
		local rel=$1 vmlinuz=$2 mods=$3 res=$4
		initramfs "$rel" "$mods" "$WORK/initrd-$rel.gz"
		echo "test-kernels: booting $rel (${accel[1]})"
		timeout --foreground "$TOPOLB_KERNELS_BOOT_TIMEOUT" qemu-system-x86_64 "${accel[@]}" -smp 2 -m "$TOPOLB_KERNELS_MEM" \
			-kernel "$vmlinuz" -initrd "$WORK/initrd-$rel.gz" \
			-append "console=ttyS0 quiet panic=-1 topolb.repo=$ROOT" \
			-virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
			-virtfs "local,path=$mods,mount_tag=kmods,security_model=none,readonly=on" \
			-virtfs "local,path=$WORK,mount_tag=out,security_model=none" \
			-nic none -display none -serial "file:$res/console.log" -monitor none -no-reboot || true
	}

	status=0
	lines=()
	choose_accel || true
	for k in "${kernels[@]}"; do
		read -r rel vmlinuz mods <<<"$k"
		[[ -z $PATTERN || $rel == *$PATTERN* ]] || continue
		res=$WORK/results/$rel
		rm -rf "$res" && mkdir -p "$res"
		start=$SECONDS
		if [[ $vmlinuz == host ]]; then
			echo "test-kernels: $rel on the host"
			TOPOLB_KERNELS_HOST=1 timeout "$TOPOLB_KERNELS_BOOT_TIMEOUT" bash "$HERE/guest.sh" "$ROOT" "$WORK" || true
		else
			boot "$rel" "$vmlinuz" "$mods" "$res"
		fi
		secs=$((SECONDS - start))
		passed=0 total=0 skipped=0
		for t in maps e2e; do
			[[ $t == e2e && -z $TOPOLB_KERNELS_E2E_RUN ]] && continue
			if [[ -e $res/$t.rc ]]; then
				read -r p f s < <(count "$res/$t.log" "$(cat "$res/$t.rc")")
			else
				p=0 f=1 s=0
				echo "  $rel: $t did not finish (console: $res/console.log)"
			fi
			passed=$((passed + p)) total=$((total + p + f)) skipped=$((skipped + s))
			grep -E '^--- (FAIL|SKIP)' "$res/$t.log" 2>/dev/null | sed "s/^/  $rel $t: /" || true
		done
		echo "  $rel: ${secs}s, $skipped skipped (logs: $res)"
		# A guest clock that runs fast shortens every timeout in it.
		if [[ -e $res/uptime ]]; then
			echo "  $rel: the guest's clock counted $(cut -d. -f1 "$res/uptime")s from boot to the end ($(grep -o 'Switched to clocksource.*' "$res/clock.log" | tail -1))"
		fi
		verdict=pass
		if [[ $passed != "$total" || $total == 0 ]]; then verdict=fail status=1; fi
		lines+=("KERNEL $rel $verdict $passed/$total")
		echo "${lines[-1]}"
	done
	echo "test-kernels: summary"
	printf '%s\n' "${lines[@]}"
	return $status
}

if [[ ${1:-} == --kvm ]]; then
	choose_accel
	exit
fi
PATTERN=${1:-}
main
