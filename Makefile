# topolb — build, test and benchmark entry points.
# `make demo` and `make test` are the two commands in the README; each installs
# what it needs (Debian packages via tools/install-deps.sh, Go modules via the
# module proxy, the kube-apiserver/etcd build cached under ~/.cache/topolb/).

SHELL      := /bin/bash
GO         ?= go
ARCH       := $(shell uname -m)
BIN        := $(CURDIR)/bin
KUBE_VERSION ?= v1.37.2
# The kube-apiserver/etcd/kube-proxy/kubectl build is cached per user, outside
# the clone, so a second run on the same machine (CI's fresh clone included)
# reuses it; internal/kubetest looks in the same place by default.
XDG_CACHE_HOME ?= $(HOME)/.cache
KUBE_BINS  := $(XDG_CACHE_HOME)/topolb/kube-bins-$(KUBE_VERSION)
CONTAINERD_VERSION ?= v2.4.2
CONTAINERD_BINS := $(XDG_CACHE_HOME)/topolb/containerd-$(CONTAINERD_VERSION)
# helm, for the chart's tests only (tests/deploy: lint, template); built
# from the module proxy like the kube binaries, never linked into topolb.
HELM_VERSION ?= v4.3.1
HELM_BINS  := $(XDG_CACHE_HOME)/topolb/helm-$(HELM_VERSION)
GOTEST_FLAGS ?= -count=1

export TOPOLB_KUBE_BINS := $(KUBE_BINS)
export TOPOLB_CONTAINERD_BINS := $(CONTAINERD_BINS)
export TOPOLB_HELM_BINS := $(HELM_BINS)

.PHONY: all deps build generate check-generate test unit demo bench bench-datapath bench-agent bench-e2e bench-scale kube-bins vet clean image test-northsouth-plain \
	cluster-deps containerd-bins cluster cluster-down test-cluster readme-flags helm-bin test-kernels

all: build

deps:
	bash tools/install-deps.sh

build:
	$(GO) build -o $(BIN)/ ./cmd/...

# Regenerate the BPF objects and their Go bindings with pinned flags.
generate:
	$(GO) generate ./maps/...

# CI: the committed generated output must match what `make generate` produces.
check-generate: generate
	@git diff --exit-code --stat -- maps/ || { echo "generated BPF output is stale: run 'make generate' and commit"; exit 1; }

vet:
	$(GO) vet ./...

# Rewrite the README's flag tables from the commands (their TestREADMEFlags
# fail while the README disagrees).
readme-flags:
	$(GO) test -p 1 -count=1 -run '^TestREADMEFlags$$' ./cmd/topolb-agent ./cmd/topolbctl ./cmd/topolb-demo -args -update-readme

kube-bins:
	bash tools/kube-bins.sh $(KUBE_BINS) $(KUBE_VERSION)

helm-bin:
	bash tools/helm-bin.sh $(HELM_BINS) $(HELM_VERSION)

# The local cluster's runtime: containerd built from the module proxy
# (cached like kube-bins), runc and the CNI plugins from Debian.
containerd-bins:
	bash tools/containerd-bins.sh $(CONTAINERD_BINS) $(CONTAINERD_VERSION)

cluster-deps: deps kube-bins containerd-bins
	bash tools/install-deps.sh cluster

# A local cluster of real Kubernetes components, topolb deployed from
# deploy/ (README, "A real cluster on one machine"). TLBC_KUBE_PROXY=1 runs
# kube-proxy beside topolb.
cluster: cluster-deps build
	bash tools/cluster/up.sh

cluster-down:
	bash tools/cluster/down.sh

# The end-to-end suite on a fresh local cluster, torn down afterwards, also
# on failure.
test-cluster: cluster-deps build
	bash tools/cluster/test.sh

# TOPOLB_KUBE_REQUIRED makes tests that need the apiserver fail, not skip,
# when its build is missing. Then the north-south tests again with uplinks
# on the tc path, and the end-to-end suite on a local cluster
# (test-cluster: about 5 minutes with the builds cached; torn down also on
# failure), and the kernel matrix where KVM can boot it (it says why it
# skips).
test: cluster-deps helm-bin check-generate vet build
	TOPOLB_KUBE_REQUIRED=1 $(GO) test $(GOTEST_FLAGS) -timeout 40m ./...
	$(MAKE) test-northsouth-plain
	bash tools/cluster/test.sh
	if bash tools/kernels/run.sh --kvm; then $(MAKE) test-kernels; else echo "make test: kernel matrix skipped (no KVM that boots it); make test-kernels runs it under TCG"; fi

# The tests a user without root and without the kube/helm builds runs, in
# under a minute once built: nettest.RequireRoot skips under TOPOLB_UNIT
# even as root, and kube/helm binaries are looked up where none are (the
# tests that need them skip as they do on a machine without them).
unit:
	TOPOLB_UNIT=1 TOPOLB_KUBE_BINS=/nonexistent/kube-bins TOPOLB_HELM_BINS=/nonexistent/helm \
		$(GO) test $(GOTEST_FLAGS) ./...

# The maps/ tests and an e2e traffic subset inside Debian's 5.10, 6.1 and
# 6.12 kernels (and the machine's own, where /boot has it) booted in qemu;
# one line per kernel: KERNEL <release> <pass|fail> <passed>/<total>
# (tools/kernels/run.sh; the packages are cached in ~/.cache/topolb/kernels).
test-kernels: deps kube-bins
	bash tools/install-deps.sh kernels
	bash tools/kernels/run.sh

# The north-south e2e tests again on switch ports without XDP programs (a
# veth peer without NAPI, as a kind node's eth0): the uplinks take tc.
test-northsouth-plain: deps kube-bins
	TOPOLB_KUBE_REQUIRED=1 TOPOLB_E2E_SWITCH_PORTS=plain $(GO) test $(GOTEST_FLAGS) -timeout 15m \
		-run 'TestNorthSouth|TestNetfilterInvalidDrop|TestRejectEmptyService|TestOutsideClientThroughKubeProxy' ./tests/e2e/

demo: deps build
	$(BIN)/topolb-demo

bench: bench-datapath bench-agent

bench-datapath:
	$(GO) test -run '^$$' -bench . -benchtime 1x ./maps/ -args -bench-datapath

# 10,000 services, 100,000 endpoints, 2,000 single-endpoint changes through
# the agent's run loop into a real datapath, in three rows: an empty node,
# 250,000 live conntrack entries, and those with a metrics scrape every
# second. Exits non-zero when a goal is not met in any row.
bench-agent:
	$(GO) test -run '^$$' -bench BenchmarkAgentChurn -benchtime 1x ./agent/

# Cluster scale (issue 33): a real apiserver with 500, 1,000 and 5,000
# simulated Nodes, 10,000 Services, K=3 agents without a datapath
# (--datapath=none) beside one kube-proxy (nftables); prints BENCH scale
# lines and the goals' verdicts, and exits non-zero when one is not met at
# 5,000 Nodes. BENCH_SCALE_ARGS passes the test's flags, for example
# BENCH_SCALE_ARGS='-bench-scale-nodes 500 -bench-scale-phase 20s
# -bench-scale-agent-args=--node-watch=own' (BENCHMARKS.md, "Scale").
BENCH_SCALE_ARGS ?=
bench-scale: deps kube-bins
	$(GO) test -count=1 -run '^$$' -bench BenchmarkScale -benchtime 1x -timeout 120m ./tests/scale/ -args $(BENCH_SCALE_ARGS)

# topolb vs kube-proxy (nftables, iptables) on the testbed with a real
# apiserver, at 10, 1,000 and 10,000 services; prints BENCH e2e lines.
bench-e2e: deps kube-bins
	$(GO) test -count=1 -run '^$$' -bench BenchmarkE2E -benchtime 1x -timeout 60m ./tests/e2e/

# The container image: a thin wrapper around `make build` (see Dockerfile).
# Needs a Docker engine, which CI does not have; tests/kind/run.sh uses it.
IMAGE ?= topolb:dev
VERSION ?= dev
image:
	docker build --build-arg VERSION=$(VERSION) -t $(IMAGE) .

clean:
	rm -rf $(BIN)
