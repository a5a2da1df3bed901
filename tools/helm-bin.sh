#!/usr/bin/env bash
# helm-bin.sh OUT VERSION
#
# Builds the helm command of Helm VERSION (e.g. v4.3.1) from the Go module
# proxy into OUT, for the chart's tests (tests/chart: `helm lint`, `helm
# template`). A tool of the tests only: helm is not a dependency of the
# agent's module, and nothing of it is linked into topolb's binaries.
#
# Cached and idempotent like tools/kube-bins.sh (tools/build-cache.sh):
# OUT/.stamp names the version and recipe; concurrent runs wait on OUT.lock.
# Cold: a few minutes on 2 idle cores (most of its modules, client-go and
# k8s.io/api, are shared with topolb's own module cache).
set -euo pipefail

# Bump when the build recipe changes, so existing caches are rebuilt.
RECIPE=1

usage() { echo "usage: $0 OUT VERSION   (e.g. $0 ~/.cache/topolb/helm-v4.3.1 v4.3.1)" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
OUT=${1%/}
VERSION=$2
[[ -n $OUT ]] || usage
[[ $VERSION =~ ^v([34])\.[0-9]+\.[0-9]+$ ]] || { echo "helm-bin: VERSION must look like v4.3.1, got '$VERSION'" >&2; exit 2; }
MOD=helm.sh/helm/v${BASH_REMATCH[1]}
BINS=(helm)
STAMP_KEY="helm $VERSION recipe $RECIPE"

# shellcheck source=tools/build-cache.sh
source "$(dirname "${BASH_SOURCE[0]}")/build-cache.sh"
log() { cache_log helm-bin "$@"; }

cache_begin helm-bin "$OUT" "$STAMP_KEY" "${BINS[@]}"
OUT=$CACHE_OUT SRC=$CACHE_SRC start=$SECONDS

cache_module helm-bin "$MOD" "$VERSION"

# The variable Helm's own Makefile sets, so `helm version` names the release.
ldflags="-s -w -X $MOD/internal/version.version=$VERSION"
log "building helm $VERSION"
(cd "$SRC" && go build -p 2 -ldflags "$ldflags" -o bin/ "$MOD/cmd/helm")

"$SRC/bin/helm" version
cache_publish "$SRC/bin" "$STAMP_KEY
$(go version)
built in $((SECONDS - start))s" "${BINS[@]}"
rm -rf "$SRC"
log "done in $((SECONDS - start))s: ${BINS[*]} in $OUT"
