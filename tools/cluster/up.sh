#!/usr/bin/env bash
# tools/cluster/up.sh: a local Kubernetes cluster of real components on this
# machine, with topolb deployed from deploy/ as a DaemonSet (`make cluster`).
#
# Control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler) in a fabric network namespace; four nodes in three zones,
# each a network namespace with its own kubelet, containerd (+ runc) and CNI
# (bridge + host-local), its uplink a veth into the fabric's bridge. Images
# are written locally (tools/cluster/image) and imported into every node's
# containerd: no registry, no container engine. The layout is in lib.sh.
#
# Needs (make cluster provides them): root, the kube binaries of
# tools/kube-bins.sh in $TOPOLB_KUBE_BINS, containerd from
# tools/containerd-bins.sh in $TOPOLB_CONTAINERD_BINS, runc and the CNI
# plugins (tools/install-deps.sh cluster), topolb's binaries in ./bin
# (make build). On any failure it tears down what it set up (down.sh).
#
# Environment:
#   TLBC_DIR        state directory (default /var/tmp/tlbc-cluster)
#   TLBC_API_PORT   the API server on the machine's 127.0.0.1 (default 16443)
#   TLBC_KUBE_PROXY 1: kube-proxy (iptables) runs on every node and topolb
#                   beside it; default 0: kube-proxy-free (topolb replaces it)
#   TLBC_EXAMPLE    0: skip the example workload (default 1)
#   TLBC_KEEP_FAILED 1: leave a failed bring-up up, to look at it
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=tools/cluster/lib.sh
source "$HERE/lib.sh"

KUBE_BINS=${TOPOLB_KUBE_BINS:?set TOPOLB_KUBE_BINS (make cluster does)}
CONTAINERD_BINS=${TOPOLB_CONTAINERD_BINS:?set TOPOLB_CONTAINERD_BINS (make cluster does)}
KUBE_PROXY=${TLBC_KUBE_PROXY:-0}
EXAMPLE=${TLBC_EXAMPLE:-1}
TIMEOUT=180

[[ $(id -u) == 0 ]] || tlbc_die "needs root"
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy; do
	[[ -x $KUBE_BINS/$b ]] || tlbc_die "$KUBE_BINS/$b missing: run make kube-bins"
done
for b in containerd containerd-shim-runc-v2 ctr; do
	[[ -x $CONTAINERD_BINS/$b ]] || tlbc_die "$CONTAINERD_BINS/$b missing: run make containerd-bins"
done
for b in topolb-agent topolbctl; do
	[[ -x $ROOT/bin/$b ]] || tlbc_die "$ROOT/bin/$b missing: run make build"
done
if ! command -v runc >/dev/null || [[ ! -x /usr/lib/cni/bridge || ! -x /usr/lib/cni/host-local || ! -x /usr/lib/cni/loopback ]]; then
	tlbc_die "needs runc and the CNI plugins: bash tools/install-deps.sh cluster"
fi
mountpoint -q /sys/fs/bpf || tlbc_die "needs a bpf filesystem at /sys/fs/bpf (mount -t bpf bpf /sys/fs/bpf)"
[[ -e $TLBC_DIR ]] && tlbc_die "$TLBC_DIR exists: a cluster is up or was not torn down (make cluster-down)"
ip netns list | grep -q '^tlbc-' && tlbc_die "tlbc-* network namespaces exist: make cluster-down"

KUBECTL=("$KUBE_BINS/kubectl" --kubeconfig "$TLBC_KUBECONFIG")
export PATH=$CONTAINERD_BINS:$KUBE_BINS:$PATH

mkdir -p "$TLBC_DIR"/{bin,pki,images,deploy} "$TLBC_LOGS" "$TLBC_PIDS"
started=$SECONDS
ok=0
on_exit() {
	local rc=$?
	if [[ $ok != 1 && ${TLBC_KEEP_FAILED:-0} == 1 ]]; then
		tlbc_log "bring-up failed (exit $rc); left up (TLBC_KEEP_FAILED=1): make cluster-down"
	elif [[ $ok != 1 ]]; then
		tlbc_log "bring-up failed (exit $rc); logs in $TLBC_LOGS (kept in /tmp/tlbc-cluster-logs); tearing down"
		rm -rf /tmp/tlbc-cluster-logs
		cp -r "$TLBC_LOGS" /tmp/tlbc-cluster-logs 2>/dev/null || true
		bash "$HERE/down.sh" || true
	fi
	exit "$rc"
}
trap on_exit EXIT

# What was there before: down.sh restores it.
for p in "${TLBC_GLOBAL_PATHS[@]}"; do
	[[ -e $p ]] && echo "$p"
done >"$TLBC_DIR/preexisting-paths"
for s in "${TLBC_KUBELET_SYSCTLS[@]}"; do
	echo "$s=$(sysctl -n "$s")"
done >"$TLBC_DIR/sysctls"

# wait_for WHAT CMD...: retry CMD every second for $TIMEOUT s.
wait_for() {
	local what=$1 deadline=$((SECONDS + TIMEOUT))
	shift
	until "$@" >/dev/null 2>&1; do
		((SECONDS < deadline)) || tlbc_die "timed out after ${TIMEOUT}s waiting for $what"
		sleep 1
	done
}

# start NAME NETNS CMD...: run CMD in the background in network namespace
# NETNS ("" for the machine's) and in the cluster's cgroup, logging to
# $TLBC_LOGS/NAME.log. Not `ip netns exec`, which remounts /sys and hides
# the cgroup and bpf filesystems from the kubelet.
start() {
	local name=$1 ns=$2
	shift 2
	local pre=()
	[[ -n $ns ]] && pre=(nsenter "--net=/run/netns/$ns")
	# shellcheck disable=SC2016 # expanded by the inner bash
	setsid bash -c 'echo $$ >"$0" && exec "$@"' "/sys/fs/cgroup/pids/$TLBC_CGROUP/cgroup.procs" \
		"${pre[@]}" "$@" </dev/null >"$TLBC_LOGS/$name.log" 2>&1 &
	echo $! >"$TLBC_PIDS/$name.pid"
}

in_ns() {
	local ns=$1
	shift
	nsenter "--net=/run/netns/$ns" "$@"
}

# --- binaries and images ---------------------------------------------------
tlbc_log "building the cluster's helpers and images"
(cd "$ROOT" && CGO_ENABLED=0 go build -trimpath -o "$TLBC_DIR/bin/" ./tools/cluster/echo ./tools/cluster/pause ./tools/cluster/fwd ./tools/cluster/image)
img() { "$TLBC_DIR/bin/image" "$@"; }
# topolb's binaries as the Dockerfile's build stage makes them (its ENV:
# static, trimmed), into a context of their own.
CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" make -s -C "$ROOT" build BIN="$TLBC_DIR/image-context/bin"
img -o "$TLBC_DIR/images/topolb.tar" -name "$TLBC_IMAGE_TOPOLB" -dockerfile "$ROOT/Dockerfile" -context "$TLBC_DIR/image-context"
img -o "$TLBC_DIR/images/echo.tar" -name "$TLBC_IMAGE_ECHO" -file "$TLBC_DIR/bin/echo:/echo" -entrypoint /echo -user 65532:65532
img -o "$TLBC_DIR/images/pause.tar" -name "$TLBC_IMAGE_PAUSE" -file "$TLBC_DIR/bin/pause:/pause" -entrypoint /pause -user 65535:65535

# --- certificates, tokens, kubeconfigs -------------------------------------
tlbc_log "certificates and kubeconfigs"
pki=$TLBC_DIR/pki
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$pki/ca.key" -out "$pki/ca.crt" -days 30 -subj /CN=tlbc-ca \
	-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout "$pki/apiserver.key" -out "$pki/apiserver.csr" -subj /CN=kube-apiserver 2>/dev/null
printf 'subjectAltName=IP:%s,IP:127.0.0.1,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n' \
	"$TLBC_FABRIC_IP" "$TLBC_APISERVER_SVC_IP" >"$pki/apiserver.ext"
openssl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
	-out "$pki/apiserver.crt" -days 30 -extfile "$pki/apiserver.ext" 2>/dev/null
openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null

token() { openssl rand -hex 16; }
admin_token=$(token)
{
	echo "$admin_token,admin,admin,system:masters"
	for n in "${TLBC_NODES[@]}"; do
		t=$(token)
		echo "$t,system:node:$n,$n,system:nodes"
		echo "$t" >"$pki/$n.token"
	done
} >"$pki/tokens.csv"
chmod 600 "$pki"/*.key "$pki/tokens.csv" "$pki"/*.token

# kubeconfig FILE SERVER TOKEN
kubeconfig() {
	cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: tlbc
  cluster: {server: "$2", certificate-authority: "$pki/ca.crt"}
users:
- name: tlbc
  user: {token: "$3"}
contexts:
- name: tlbc
  context: {cluster: tlbc, user: tlbc}
current-context: tlbc
EOF
	chmod 600 "$1"
}
kubeconfig "$TLBC_KUBECONFIG" "https://127.0.0.1:$TLBC_API_PORT" "$admin_token"
kubeconfig "$TLBC_DIR/control-plane.kubeconfig" "https://$TLBC_FABRIC_IP:6443" "$admin_token"

# --- cgroups ---------------------------------------------------------------
# Every v1 hierarchy gets each node's cgroup root (the kubelet's
# cgroupRoot: it requires it in every mounted subsystem), cpuset's with the
# parent's CPUs and memory nodes; the pids hierarchy also the cgroup of
# every process started here.
tlbc_log "cgroups"
for h in "${TLBC_CGROUP_HIERARCHIES[@]}"; do
	base=/sys/fs/cgroup/$h
	[[ -d $base ]] || continue
	for n in "${TLBC_NODES[@]}"; do
		mkdir -p "$base/$n"
		if [[ $h == cpuset ]]; then
			cat "$base/cpuset.cpus" >"$base/$n/cpuset.cpus"
			cat "$base/cpuset.mems" >"$base/$n/cpuset.mems"
		fi
	done
done
mkdir -p "/sys/fs/cgroup/pids/$TLBC_CGROUP"

# --- network ---------------------------------------------------------------
tlbc_log "network namespaces"
ip netns add "$TLBC_FABRIC"
in_ns "$TLBC_FABRIC" sh -ec "
	ip link set lo up
	ip link add br0 type bridge
	ip addr add $TLBC_FABRIC_IP/24 dev br0
	ip link set br0 up"
for i in $(seq 1 ${#TLBC_NODES[@]}); do
	n=${TLBC_NODES[i - 1]}
	ip netns add "$n"
	ip -n "$TLBC_FABRIC" link add "$n" type veth peer name eth0 netns "$n"
	ip -n "$TLBC_FABRIC" link set "$n" master br0 up
	in_ns "$TLBC_FABRIC" ip route add "$(tlbc_pod_cidr "$i")" via "$(tlbc_node_ip "$i")"
	in_ns "$n" sh -ec "
		ip link set lo up
		ip addr add $(tlbc_node_ip "$i")/24 dev eth0
		ip link set eth0 up
		ip route add default via $TLBC_FABRIC_IP
		sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0"
	for j in $(seq 1 ${#TLBC_NODES[@]}); do
		((j == i)) || in_ns "$n" ip route add "$(tlbc_pod_cidr "$j")" via "$(tlbc_node_ip "$j")"
	done
done

# --- control plane ---------------------------------------------------------
tlbc_log "control plane"
start etcd "$TLBC_FABRIC" etcd --data-dir "$TLBC_DIR/etcd" --name tlbc \
	--listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
	--listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
	--initial-cluster tlbc=http://127.0.0.1:2380 --log-level warn
start kube-apiserver "$TLBC_FABRIC" kube-apiserver \
	--etcd-servers http://127.0.0.1:2379 \
	--bind-address 0.0.0.0 --secure-port 6443 --advertise-address "$TLBC_FABRIC_IP" \
	--tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
	--client-ca-file "$pki/ca.crt" --token-auth-file "$pki/tokens.csv" \
	--service-account-issuer https://kubernetes.default.svc --service-account-key-file "$pki/sa.pub" \
	--service-account-signing-key-file "$pki/sa.key" \
	--service-cluster-ip-range "$TLBC_SERVICE_CIDR" \
	--authorization-mode Node,RBAC --allow-privileged \
	--kubelet-preferred-address-types InternalIP,Hostname \
	--profiling=false --v=1
start fwd "" "$TLBC_DIR/bin/fwd" -listen "127.0.0.1:$TLBC_API_PORT" -netns "/run/netns/$TLBC_FABRIC" -to "$TLBC_FABRIC_IP:6443"
wait_for "the API server" "${KUBECTL[@]}" get --raw /readyz
start kube-controller-manager "$TLBC_FABRIC" kube-controller-manager \
	--kubeconfig "$TLBC_DIR/control-plane.kubeconfig" \
	--service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
	--use-service-account-credentials --service-cluster-ip-range "$TLBC_SERVICE_CIDR" \
	--leader-elect=false --secure-port 0 --v=1
start kube-scheduler "$TLBC_FABRIC" kube-scheduler \
	--kubeconfig "$TLBC_DIR/control-plane.kubeconfig" --leader-elect=false --secure-port 0 --v=1

# --- nodes -----------------------------------------------------------------
tlbc_log "nodes: containerd, images, CNI, kubelet"
for i in $(seq 1 ${#TLBC_NODES[@]}); do
	n=${TLBC_NODES[i - 1]}
	nd=$(tlbc_node_dir "$i")
	mkdir -p "$nd"/{containerd,cni/net.d,cni/ipam,kubelet,pod-logs,volume-plugins,cdi,runc,opt}
	sock=$nd/containerd/containerd.sock
	cat >"$nd/containerd.toml" <<EOF
version = 3
root = "$nd/containerd/root"
state = "$nd/containerd/state"
oom_score = 0
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "$sock"

[ttrpc]
  address = "$sock.ttrpc"

[plugins.'io.containerd.internal.v1.opt']
  path = "$nd/opt"

[plugins.'io.containerd.cri.v1.runtime']
  # No CAP_SYS_RESOURCE here: containers may not get a lower
  # oom_score_adj than containerd's own.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  cdi_spec_dirs = ["$nd/cdi"]
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        Root = "$nd/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$nd/cni/net.d"

[plugins.'io.containerd.cri.v1.images']
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$TLBC_IMAGE_PAUSE"

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
EOF
	cat >"$nd/cni/net.d/10-tlbc.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "tlbc",
  "plugins": [{
    "type": "bridge",
    "bridge": "cni0",
    "isGateway": true,
    "hairpinMode": true,
    "ipam": {
      "type": "host-local",
      "dataDir": "$nd/cni/ipam",
      "ranges": [[{"subnet": "$(tlbc_pod_cidr "$i")"}]],
      "routes": [{"dst": "0.0.0.0/0"}]
    }
  }]
}
EOF
	start "$n-containerd" "$n" containerd --config "$nd/containerd.toml"
done
for i in $(seq 1 ${#TLBC_NODES[@]}); do
	n=${TLBC_NODES[i - 1]}
	nd=$(tlbc_node_dir "$i")
	wait_for "$n's containerd" ctr --address "$nd/containerd/containerd.sock" version
	for f in "$TLBC_DIR"/images/*.tar; do
		ctr --address "$nd/containerd/containerd.sock" -n k8s.io images import --local "$f" >/dev/null
	done
	kubeconfig "$nd/kubeconfig" "https://$TLBC_FABRIC_IP:6443" "$(cat "$pki/$n.token")"
	cat >"$nd/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine has a cgroup v1 hybrid hierarchy.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$n
# No CAP_SYS_RESOURCE: the kubelet may not lower its own oom_score_adj.
oomScoreAdj: 0
containerRuntimeEndpoint: unix://$nd/containerd/containerd.sock
address: $(tlbc_node_ip "$i")
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
failSwapOn: false
podLogsDir: $nd/pod-logs
volumePluginDir: $nd/volume-plugins
systemReserved: {cpu: "${TLBC_CPU_RESERVED[i - 1]}"}
enforceNodeAllocatable: [pods]
# The nodes share the machine's disk: no eviction or image GC because of it.
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: ""
EOF
	start "$n-kubelet" "$n" kubelet --config "$nd/kubelet.yaml" --kubeconfig "$nd/kubeconfig" \
		--hostname-override "$n" --node-ip "$(tlbc_node_ip "$i")" \
		--node-labels "topology.kubernetes.io/zone=${TLBC_ZONES[i - 1]}" \
		--root-dir "$nd/kubelet" --v=1
done
for i in $(seq 1 ${#TLBC_NODES[@]}); do
	n=${TLBC_NODES[i - 1]}
	wait_for "node $n to register" "${KUBECTL[@]}" get node "$n"
	"${KUBECTL[@]}" patch node "$n" --type merge \
		-p "{\"spec\":{\"podCIDR\":\"$(tlbc_pod_cidr "$i")\",\"podCIDRs\":[\"$(tlbc_pod_cidr "$i")\"]}}" >/dev/null
done
wait_for "nodes Ready" "${KUBECTL[@]}" wait --for=condition=Ready nodes --all --timeout=5s
# The kubelets have set the machine-wide tunables by now: put them back.
while IFS= read -r kv; do sysctl -qw "$kv"; done <"$TLBC_DIR/sysctls"

if [[ $KUBE_PROXY == 1 ]]; then
	tlbc_log "kube-proxy (iptables) on every node"
	for i in $(seq 1 ${#TLBC_NODES[@]}); do
		n=${TLBC_NODES[i - 1]}
		nd=$(tlbc_node_dir "$i")
		cat >"$nd/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
hostnameOverride: $n
clientConnection: {kubeconfig: $TLBC_DIR/control-plane.kubeconfig}
clusterCIDR: $TLBC_POD_NET.0.0/16
# Machine-wide conntrack sysctls stay as they are; be liberal about TCP
# windows (deploy/README.md, "With kube-proxy").
conntrack: {maxPerCore: 0, min: 0, tcpBeLiberal: true, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
EOF
		start "$n-kube-proxy" "$n" kube-proxy --config "$nd/kube-proxy.yaml" --v=1
	done
fi

# --- topolb ----------------------------------------------------------------
# deploy/ as a user applies it, through an overlay: the local image, and
# per-node pin directories (every node here shares the machine's one bpf
# filesystem: the pod's /sys/fs/bpf is the node's /sys/fs/bpf/topolb, and
# each agent pins in its node's directory below it). Without kube-proxy, the API server's own address.
tlbc_log "topolb from deploy/ (kube-proxy: $([[ $KUBE_PROXY == 1 ]] && echo beside || echo none))"
apiserver=
[[ $KUBE_PROXY == 1 ]] || apiserver=$TLBC_FABRIC_IP:6443
cat >"$TLBC_DIR/deploy/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- $(realpath --relative-to "$TLBC_DIR/deploy" "$ROOT/deploy")
images:
- name: ghcr.io/topolb/topolb
  newName: ${TLBC_IMAGE_TOPOLB%:*}
  newTag: ${TLBC_IMAGE_TOPOLB##*:}
patches:
- target: {kind: DaemonSet, name: topolb-agent}
  patch: |
    - op: replace
      path: /spec/template/spec/containers/0/args/0
      value: --bpffs=/sys/fs/bpf/\$(NODE_NAME)
- target: {kind: ConfigMap, name: topolb-agent}
  patch: |
    - op: replace
      path: /data/TOPOLB_APISERVER
      value: "$apiserver"
EOF
# shellcheck disable=SC2016 # a literal $(NODE_NAME), expanded by the kubelet
"${KUBECTL[@]}" kustomize "$TLBC_DIR/deploy" | grep -q -- '--bpffs=/sys/fs/bpf/$(NODE_NAME)' ||
	tlbc_die "deploy/daemonset.yaml's first argument is no longer --bpffs: update the overlay in $0"
"${KUBECTL[@]}" apply -k "$TLBC_DIR/deploy" >/dev/null
"${KUBECTL[@]}" -n topolb-system rollout status ds/topolb-agent --timeout="${TIMEOUT}s" >/dev/null

if [[ $EXAMPLE == 1 ]]; then
	tlbc_log "example: Deployment web over the zones, Service web (PreferSameZone), a client per zone"
	fill() { sed -e "s#@ECHO_IMAGE@#$TLBC_IMAGE_ECHO#g" -e "s#@WEB_IP@#$TLBC_EXAMPLE_IP#g" "$@"; }
	fill "$HERE/example.yaml" >"$TLBC_DIR/example.yaml"
	for zone in $(printf '%s\n' "${TLBC_ZONES[@]}" | sort -u); do
		fill -e "s#@ZONE@#$zone#g" "$HERE/client.yaml"
	done >>"$TLBC_DIR/example.yaml"
	"${KUBECTL[@]}" apply -f "$TLBC_DIR/example.yaml" >/dev/null
	"${KUBECTL[@]}" rollout status deploy/web --timeout="${TIMEOUT}s" >/dev/null
	"${KUBECTL[@]}" wait --for=condition=Ready pod -l app=client --timeout="${TIMEOUT}s" >/dev/null
fi

ok=1
tlbc_log "up in $((SECONDS - started))s"
cat <<EOF

A local cluster: ${#TLBC_NODES[@]} nodes ($(for i in "${!TLBC_NODES[@]}"; do printf '%s=%s ' "${TLBC_NODES[i]}" "${TLBC_ZONES[i]}"; done)), topolb on each.
Use it:
  export KUBECONFIG=$TLBC_KUBECONFIG
  export PATH=$KUBE_BINS:\$PATH
  kubectl get nodes -L topology.kubernetes.io/zone
  kubectl exec client-zone-a -- /echo get -url http://$TLBC_EXAMPLE_IP/ -n 20   # lands in zone-a
  $ROOT/bin/topolbctl explain --node tlbc-n1 --service default/web
A node's network namespace: nsenter --net=/run/netns/tlbc-n1 ...
Tear down: make cluster-down
KUBECONFIG=$TLBC_KUBECONFIG
EOF
