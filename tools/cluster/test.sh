#!/usr/bin/env bash
# tools/cluster/test.sh: `make test-cluster`. Brings up the local cluster
# (up.sh, without the example), runs the end-to-end suite (tests/cluster)
# against it and tears it down, also when the bring-up or a test fails.
# Extra `go test` flags: TEST_FLAGS (e.g. TEST_FLAGS='-run PreferSameZone -v').
# TLBC_KUBE_PROXY=1 runs the suite with kube-proxy beside topolb (up.sh).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=tools/cluster/lib.sh
source "$HERE/lib.sh"

start=$SECONDS
# up.sh tears down what it set up when it fails, and leaves a cluster it
# did not start alone.
TLBC_EXAMPLE=0 bash "$HERE/up.sh"
trap 'bash "$HERE/down.sh"' EXIT
up=$((SECONDS - start))
cd "$ROOT"
# shellcheck disable=SC2086 # TEST_FLAGS is a list of flags
TOPOLB_E2E_KUBECONFIG=$TLBC_KUBECONFIG TOPOLB_E2E_ECHO_IMAGE=$TLBC_IMAGE_ECHO \
	TOPOLB_E2E_OUTSIDE_NETNS=/run/netns/$TLBC_FABRIC \
	go test -count=1 -timeout 20m ${TEST_FLAGS:--v} ./tests/cluster/
tlbc_log "bring-up ${up}s, suite $((SECONDS - start - up))s"
