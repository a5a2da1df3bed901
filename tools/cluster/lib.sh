# shellcheck shell=bash disable=SC2034 # sourced: the variables are used by its callers
# tools/cluster/lib.sh: the local cluster's layout, sourced by up.sh, down.sh
# and (through `env.sh`) the tests. Every name, address and path of the
# cluster is defined here once.
#
# Layout: one network namespace per node (tlbc-n1..4), each with an uplink
# eth0, a veth whose peer is a port of the bridge br0 in the fabric
# namespace (tlbc-fabric), where the control plane runs (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler). Nothing gets an
# address, a link or a route in the machine's own namespace: tools/cluster/fwd
# forwards 127.0.0.1:$TLBC_API_PORT to the API server.

TLBC_DIR=${TLBC_DIR:-/var/tmp/tlbc-cluster}
TLBC_API_PORT=${TLBC_API_PORT:-16443}
TLBC_FABRIC=tlbc-fabric
TLBC_NODES=(tlbc-n1 tlbc-n2 tlbc-n3 tlbc-n4)
# Zone and reserved CPU per node (same order). Every node sees the machine's
# CPUs, so the nodes of zone-a each reserve half: every zone then has the
# same share of the cluster's allocatable CPU, which the EndpointSlice
# controller's topology hints are computed from.
TLBC_ZONES=(zone-a zone-a zone-b zone-c)
TLBC_CPU_RESERVED=(1000m 1000m 0 0)
TLBC_FABRIC_IP=10.213.0.1 # br0 in the fabric namespace: the API server
TLBC_NODE_NET=10.213.0     # node i (from 1) is $TLBC_NODE_NET.$((10+i))/24
TLBC_POD_NET=10.214        # node i's pods are $TLBC_POD_NET.i.0/24
TLBC_SERVICE_CIDR=10.215.0.0/16
TLBC_APISERVER_SVC_IP=10.215.0.1
TLBC_EXAMPLE_IP=10.215.0.80 # the example Service web

TLBC_KUBECONFIG=$TLBC_DIR/kubeconfig
TLBC_LOGS=$TLBC_DIR/logs
TLBC_PIDS=$TLBC_DIR/pids
# Every process the cluster starts is in this cgroup (pids hierarchy) or,
# for the pods, below a node's cgroup root, so down.sh finds them all.
TLBC_CGROUP=tlbc-cluster
TLBC_CGROUP_HIERARCHIES=(cpu cpuacct cpuset memory devices freezer blkio pids systemd unified)

# Images imported into every node's containerd.
TLBC_IMAGE_TOPOLB=localhost/topolb:dev
TLBC_IMAGE_ECHO=localhost/topolb-echo:dev
TLBC_IMAGE_PAUSE=localhost/pause:dev

# Machine-wide sysctls the kubelet sets when it starts (container manager's
# kernel tunables); up.sh saves them before the first kubelet and restores
# them, down.sh restores them again.
TLBC_KUBELET_SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
# Machine-wide paths the kubelet or containerd create when missing: down.sh
# removes those that up.sh did not find.
TLBC_GLOBAL_PATHS=(/var/log/containers /run/containerd /sys/fs/bpf/topolb /opt/containerd /etc/cdi /var/run/cdi)

tlbc_node_ip() { echo "$TLBC_NODE_NET.$((10 + $1))"; }
tlbc_pod_cidr() { echo "$TLBC_POD_NET.$1.0/24"; }
tlbc_node_dir() { echo "$TLBC_DIR/nodes/${TLBC_NODES[$1 - 1]}"; }
tlbc_log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
tlbc_die() {
	printf 'cluster: %s\n' "$*" >&2
	exit 1
}
