#!/usr/bin/env bash
# containerd-bins.sh OUT VERSION
#
# Builds containerd, containerd-shim-runc-v2 and ctr for containerd VERSION
# (e.g. v2.4.2) from the Go module proxy into OUT, for the local cluster
# (tools/cluster). Static (CGO_ENABLED=0, no btrfs snapshotter), the way
# containerd's own Makefile builds its static release. runc and the CNI
# plugins come from Debian packages (tools/install-deps.sh cluster).
#
# Cached and idempotent like tools/kube-bins.sh (tools/build-cache.sh): OUT/.stamp
# names the version and recipe; concurrent runs wait on OUT.lock. Cold: a few minutes on 2 cores.
set -euo pipefail

# Bump when the build recipe changes, so existing caches are rebuilt.
RECIPE=1

usage() { echo "usage: $0 OUT VERSION   (e.g. $0 ~/.cache/topolb/containerd-v2.4.2 v2.4.2)" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
OUT=${1%/}
VERSION=$2
[[ -n $OUT ]] || usage
[[ $VERSION =~ ^v2\.[0-9]+\.[0-9]+$ ]] || { echo "containerd-bins: VERSION must look like v2.4.2, got '$VERSION'" >&2; exit 2; }
BINS=(containerd containerd-shim-runc-v2 ctr)
STAMP_KEY="containerd $VERSION recipe $RECIPE"
MOD=github.com/containerd/containerd/v2

# shellcheck source=tools/build-cache.sh
source "$(dirname "${BASH_SOURCE[0]}")/build-cache.sh"
log() { cache_log containerd-bins "$@"; }

cache_begin containerd-bins "$OUT" "$STAMP_KEY" "${BINS[@]}"
OUT=$CACHE_OUT SRC=$CACHE_SRC start=$SECONDS

cache_module containerd-bins "$MOD" "$VERSION"

ldflags="-s -w -X $MOD/version.Version=$VERSION -X $MOD/version.Package=$MOD"
tags="urfave_cli_no_docs no_btrfs osusergo netgo static_build"
log "building containerd and ctr $VERSION"
(cd "$SRC" && go build -p 2 -tags "$tags" -ldflags "$ldflags" -o bin/ "$MOD/cmd/containerd" "$MOD/cmd/ctr")
log "building containerd-shim-runc-v2"
(cd "$SRC" && go build -p 2 -tags "$tags no_grpc" -ldflags "$ldflags" -o bin/ "$MOD/cmd/containerd-shim-runc-v2")

"$SRC/bin/containerd" --version
cache_publish "$SRC/bin" "$STAMP_KEY
$(go version)
built in $((SECONDS - start))s" "${BINS[@]}"
rm -rf "$SRC"
log "done in $((SECONDS - start))s: ${BINS[*]} in $OUT"
