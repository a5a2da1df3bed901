# shellcheck shell=bash
# tools/build-cache.sh: the per-user build cache that tools/kube-bins.sh and
# tools/containerd-bins.sh share (sourced). A cache directory OUT holds the
# binaries and a stamp whose first line names what was built with which
# recipe; a build whose stamp matches is skipped, and concurrent builds of
# the same OUT wait on OUT.lock.

# cache_log NAME MESSAGE...
cache_log() {
	local name=$1
	shift
	printf '[%s %s] %s\n' "$name" "$(date +%H:%M:%S)" "$*"
}

# cache_is_built OUT STAMP_KEY BIN...: OUT has every BIN under STAMP_KEY.
cache_is_built() {
	local out=$1 key=$2 b
	shift 2
	[[ -f $out/.stamp ]] && [[ "$(head -n1 "$out/.stamp")" == "$key" ]] || return 1
	for b in "$@"; do [[ -x $out/$b ]] || return 1; done
}

# cache_begin NAME OUT STAMP_KEY BIN...: exits the script (0) when OUT is
# built already, also after waiting for another build of OUT; otherwise
# returns holding OUT.lock (file descriptor 9) for the caller to build, in
# CACHE_SRC (OUT-src), with the environment both builds use: static,
# trimmed binaries, modules from the proxy, no workspace. Sets CACHE_OUT to
# OUT's absolute path.
cache_begin() {
	local name=$1 out=$2 key=$3
	shift 3
	if cache_is_built "$out" "$key" "$@"; then
		cache_log "$name" "already built in $out"
		exit 0
	fi
	command -v go >/dev/null || { echo "$name: go is not on PATH" >&2; exit 1; }
	mkdir -p "$out"
	CACHE_OUT=$(cd "$out" && pwd)
	# One build at a time: a second run waits here and then finds the stamp.
	if command -v flock >/dev/null; then
		exec 9>"$CACHE_OUT.lock"
		if ! flock -n 9; then
			cache_log "$name" "another build holds $CACHE_OUT.lock; waiting"
			flock 9
		fi
		if cache_is_built "$CACHE_OUT" "$key" "$@"; then
			cache_log "$name" "already built in $CACHE_OUT"
			exit 0
		fi
	fi
	# shellcheck disable=SC2034 # for the caller
	CACHE_SRC="$CACHE_OUT-src"
	export GOFLAGS="-trimpath -mod=mod -buildvcs=false" CGO_ENABLED=0 GOWORK=off
}

# cache_publish FROM STAMP BIN...: moves each BIN from directory FROM into
# CACHE_OUT, then writes STAMP (its first line the stamp key) as the stamp.
cache_publish() {
	local from=$1 stamp=$2 b
	shift 2
	for b in "$@"; do
		[[ -x $from/$b ]] || { echo "$from/$b was not built" >&2; exit 1; }
	done
	for b in "$@"; do mv -f "$from/$b" "$CACHE_OUT/$b"; done
	printf '%s\n' "$stamp" >"$CACHE_OUT/.stamp.tmp"
	mv -f "$CACHE_OUT/.stamp.tmp" "$CACHE_OUT/.stamp"
}

# go_mod_file MODULE@VERSION: prints the path of that module's go.mod,
# downloaded from the module proxy outside any module (so the caller's
# go.mod is not involved).
go_mod_file() {
	(cd / && go mod download -json "$1") | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p'
}
