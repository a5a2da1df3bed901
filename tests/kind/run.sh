#!/usr/bin/env bash
# tests/kind/run.sh: topolb end to end on a 3-node kind cluster.
#
# Creates a kind cluster (one node per zone), builds the topolb image and
# loads it, installs deploy/, runs a backend Deployment spread over the
# zones, a Service with trafficDistribution: PreferClose and a client in
# zone-a, and asserts where the client's requests land: with hints on, with
# topolb's own policy switched off by annotation (which only topolb obeys,
# so it proves topolb is the one balancing), with hints off, and with
# topolb.io/topology-keys. With KUBE_PROXY=none the cluster has no
# kube-proxy at all (kind's kubeProxyMode: none) and topolb replaces it:
# the same scenarios, plus the node's own processes (host network) through
# the socket hooks, a NodePort from outside the cluster, and a Service
# without endpoints refused at once. Exits non-zero on the first mismatch.
#
# Needs kind, docker (a running engine), kubectl, jq and curl. See
# README.md here for the expected output. Environment:
#   CLUSTER     kind cluster name (default topolb)
#   IMAGE       image tag to build and load (default topolb:kind)
#   REQUESTS    requests per scenario (default 60)
#   KUBE_PROXY  iptables (default: kube-proxy stays, topolb beside it) or
#               none (no kube-proxy: topolb replaces it)
#   KEEP=1      keep the cluster afterwards (default: delete it)
#   REUSE=1     use an existing cluster named $CLUSTER instead of creating one
#   SUITE=1     afterwards, run the end-to-end suite of tests/cluster (the
#               one `make test-cluster` runs on the local cluster) on this
#               cluster, with its test backend image loaded (needs go)
set -euo pipefail

CLUSTER=${CLUSTER:-topolb}
IMAGE=${IMAGE:-topolb:kind}
REQUESTS=${REQUESTS:-60}
KUBE_PROXY=${KUBE_PROXY:-iptables}
KEEP=${KEEP:-0}
REUSE=${REUSE:-0}
SUITE=${SUITE:-0}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WORK=$ROOT/tests/kind/.work
ZONES=(zone-a zone-b zone-c)
BACKEND_IMAGE=registry.k8s.io/e2e-test-images/agnhost:2.53
CLIENT_IMAGE=busybox:1.36
TIMEOUT=180

log() { printf '[kind %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() {
	printf 'FAIL: %s\n' "$*" >&2
	exit 1
}

for tool in kind docker kubectl jq curl; do
	command -v "$tool" >/dev/null || die "needs $tool on PATH"
done
[[ $KUBE_PROXY == iptables || $KUBE_PROXY == none ]] || die "KUBE_PROXY=$KUBE_PROXY: want iptables or none"
docker info >/dev/null 2>&1 || die "needs a running Docker engine (docker info failed)"

mkdir -p "$WORK"
export KUBECONFIG=$WORK/kubeconfig

cleanup() {
	local rc=$?
	if [[ $rc -ne 0 ]]; then
		log "failed; agent logs:"
		kubectl -n topolb-system logs -l app.kubernetes.io/name=topolb-agent --tail=20 --prefix 2>/dev/null || true
	fi
	if [[ $KEEP != 1 && $REUSE != 1 ]]; then
		kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
	else
		log "cluster $CLUSTER kept; KUBECONFIG=$KUBECONFIG"
	fi
	exit "$rc"
}
trap cleanup EXIT

# wait_for DESCRIPTION COMMAND...: retry COMMAND every 2 s for $TIMEOUT s.
wait_for() {
	local what=$1 deadline=$((SECONDS + TIMEOUT))
	shift
	until "$@" >/dev/null 2>&1; do
		((SECONDS < deadline)) || die "timed out after ${TIMEOUT}s waiting for $what"
		sleep 2
	done
}

create_cluster() {
	if [[ $REUSE == 1 ]]; then
		kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG"
		return
	fi
	log "creating kind cluster $CLUSTER (3 nodes, kube-proxy: $KUBE_PROXY)"
	cat >"$WORK/kind.yaml" <<'YAML'
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
- role: control-plane
- role: worker
- role: worker
YAML
	if [[ $KUBE_PROXY == none ]]; then
		# No kube-proxy: nodes get Ready once topolb serves the
		# `kubernetes` Service to the CNI, so do not wait for them here.
		printf 'networking:\n  kubeProxyMode: none\n' >>"$WORK/kind.yaml"
		kind create cluster --name "$CLUSTER" --config "$WORK/kind.yaml" --kubeconfig "$KUBECONFIG"
		return
	fi
	kind create cluster --name "$CLUSTER" --config "$WORK/kind.yaml" --kubeconfig "$KUBECONFIG" --wait 120s
}

prepare_nodes() {
	local i=0 node
	NODES=()
	while read -r node; do NODES+=("$node"); done < <(kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' | sort)
	((${#NODES[@]} == 3)) || die "want 3 nodes, got ${#NODES[@]}: ${NODES[*]}"
	for node in "${NODES[@]}"; do
		kubectl label node "$node" "topology.kubernetes.io/zone=${ZONES[i]}" --overwrite >/dev/null
		i=$((i + 1))
		# The DaemonSet needs the node's bpf filesystem (systemd mounts it).
		docker exec "$node" sh -c 'mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf'
		if [[ $KUBE_PROXY != none ]]; then
			# kube-proxy stays, as in most clusters. Started with this
			# sysctl set, it does not install its rule that drops
			# packets conntrack marks INVALID, as a TCP reply that
			# topolb has already translated back to the service
			# address is.
			docker exec "$node" sysctl -qw net.netfilter.nf_conntrack_tcp_be_liberal=1
		fi
	done
	# Backends run in every zone, the control plane's included.
	kubectl taint nodes --all node-role.kubernetes.io/control-plane- >/dev/null 2>&1 || true
	CLIENT_NODE=${NODES[0]}
	log "zones: ${NODES[0]}=zone-a ${NODES[1]}=zone-b ${NODES[2]}=zone-c; client on $CLIENT_NODE"
	if [[ $KUBE_PROXY == none ]]; then
		if kubectl -n kube-system get ds kube-proxy >/dev/null 2>&1; then
			die "KUBE_PROXY=none, but the cluster runs kube-proxy"
		fi
		return
	fi
	# kube-proxy reads the sysctl when it starts.
	kubectl -n kube-system rollout restart ds/kube-proxy >/dev/null
	kubectl -n kube-system rollout status ds/kube-proxy --timeout="${TIMEOUT}s" >/dev/null
}

install_topolb() {
	log "building $IMAGE"
	make -C "$ROOT" image IMAGE="$IMAGE" >"$WORK/image.log" 2>&1 || die "make image failed: see $WORK/image.log"
	kind load docker-image "$IMAGE" --name "$CLUSTER" >/dev/null
	log "installing deploy/ with image $IMAGE"
	kubectl kustomize "$ROOT/deploy" >"$WORK/topolb.yaml"
	grep -q 'image: ghcr.io/topolb/topolb:dev' "$WORK/topolb.yaml" || die "deploy/daemonset.yaml image changed; update this script"
	sed -i "s#image: ghcr.io/topolb/topolb:dev#image: $IMAGE#" "$WORK/topolb.yaml"
	if [[ $KUBE_PROXY == none ]]; then
		# Nothing translates the `kubernetes` Service before the agent
		# runs: it talks to the API server at the control plane's own
		# address, which the API server's certificate names.
		local cp
		cp=$(kubectl get nodes -l node-role.kubernetes.io/control-plane \
			-o jsonpath='{.items[0].status.addresses[?(@.type=="InternalIP")].address}')
		[[ -n $cp ]] || die "no control plane address"
		grep -q 'TOPOLB_APISERVER: ""' "$WORK/topolb.yaml" || die "deploy/configmap.yaml TOPOLB_APISERVER changed; update this script"
		sed -i "s#TOPOLB_APISERVER: \"\"#TOPOLB_APISERVER: \"$cp:6443\"#" "$WORK/topolb.yaml"
		# kube-proxy's health port is free: serve it for load balancers.
		grep -q 'TOPOLB_HEALTHZ_BIND_ADDRESS: ""' "$WORK/topolb.yaml" || die "deploy/configmap.yaml TOPOLB_HEALTHZ_BIND_ADDRESS changed; update this script"
		sed -i 's#TOPOLB_HEALTHZ_BIND_ADDRESS: ""#TOPOLB_HEALTHZ_BIND_ADDRESS: "0.0.0.0:10256"#' "$WORK/topolb.yaml"
		log "no kube-proxy: the agents reach the API server at $cp:6443"
	fi
	kubectl apply -f "$WORK/topolb.yaml" >/dev/null
	kubectl -n topolb-system rollout status ds/topolb-agent --timeout="${TIMEOUT}s"
	if [[ $KUBE_PROXY == none ]]; then
		# The CNI reaches the API server through topolb now.
		kubectl wait --for=condition=Ready nodes --all --timeout="${TIMEOUT}s" >/dev/null
	fi
}

deploy_workload() {
	log "deploying 6 backends spread over the zones, the web Service and a client"
	kubectl apply -f - >/dev/null <<YAML
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: default}
spec:
  replicas: 6
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: DoNotSchedule, labelSelector: {matchLabels: {app: web}}}
      containers:
      - name: web
        image: $BACKEND_IMAGE
        args: [netexec, --http-port=8080]
        ports: [{containerPort: 8080}]
        readinessProbe: {httpGet: {path: /hostname, port: 8080}, periodSeconds: 2}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  selector: {app: web}
  trafficDistribution: PreferClose
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: default}
spec:
  nodeName: $CLIENT_NODE
  containers:
  - {name: client, image: $CLIENT_IMAGE, command: [sleep, "86400"]}
YAML
	kubectl rollout status deploy/web --timeout="${TIMEOUT}s" >/dev/null
	kubectl wait --for=condition=Ready pod/client --timeout="${TIMEOUT}s" >/dev/null
	VIP=$(kubectl get svc web -o jsonpath='{.spec.clusterIP}')
	FRONTEND="$VIP:80/TCP"
}

# backends CONDITION: sorted "ip:8080" of the web pods for which the jq
# CONDITION on their zone ($z) and node ($n) holds.
backends() {
	local cond=$1
	kubectl get nodes -o json >"$WORK/nodes.json"
	kubectl get pods -l app=web -o json |
		jq -r --slurpfile nodes "$WORK/nodes.json" --arg client "$CLIENT_NODE" '
			($nodes[0].items | map({(.metadata.name): .metadata.labels["topology.kubernetes.io/zone"]}) | add) as $zones
			| .items[] | .spec.nodeName as $n | $zones[$n] as $z
			| select('"$cond"') | .status.podIP + ":8080"' | sort
}

# programmed: the backends the client node's agent has in its maps for the
# web frontend (its /debug/state, read on the node).
programmed() {
	docker exec "$CLIENT_NODE" curl -sf http://127.0.0.1:9966/debug/state |
		jq -r --arg f "$FRONTEND" '.programmed[$f] // [] | .[]' | sort
}

programmed_is() { [[ "$(programmed)" == "$1" ]]; }

hinted() {
	kubectl get endpointslices -l kubernetes.io/service-name=web -o json |
		jq '[.items[].endpoints[] | select(.hints.forZones != null)] | length'
}

hints_are() { [[ "$(hinted)" == "$1" ]]; }

# land: REQUESTS requests from the client, one connection each; prints
# "zone count" lines, sorted.
land() {
	local pods
	pods=$(kubectl exec client -- sh -c "for i in \$(seq 1 $REQUESTS); do wget -qO- -T 2 http://$VIP/hostname; echo; done")
	zones_of "$pods"
}

# zones_of PODS: the "zone count" lines of the web pods named one a line.
zones_of() {
	local pods=$1
	kubectl get pods -l app=web -o json >"$WORK/pods.json"
	kubectl get nodes -o json >"$WORK/nodes.json"
	grep -v '^$' <<<"$pods" | while read -r pod; do
		jq -r --arg p "$pod" --slurpfile nodes "$WORK/nodes.json" '
			.items[] | select(.metadata.name == $p) | .spec.nodeName as $n
			| $nodes[0].items[] | select(.metadata.name == $n) | .metadata.labels["topology.kubernetes.io/zone"]' "$WORK/pods.json"
	done | sort | uniq -c | awk '{print $2, $1}'
}

# land_host: land, from a process of the client's node itself (host
# network), through topolb's socket hooks.
land_host() {
	local pods
	pods=$(docker exec "$CLIENT_NODE" sh -c "for i in \$(seq 1 $REQUESTS); do curl -s -m 2 http://$VIP/hostname; echo; done")
	zones_of "$pods"
}

# scenario NAME WANT_BACKENDS CHECK [LAND]: waits until the client node's
# agent has programmed WANT_BACKENDS, sends the requests with LAND (default
# land: from the client pod), and runs CHECK on the landing table.
scenario() {
	local name=$1 want=$2 check=$3 lander=${4:-land} table line
	wait_for "$name: the agent on $CLIENT_NODE to program $(wc -l <<<"$want") backends" programmed_is "$want"
	table=$("$lander")
	log "scenario $name: $REQUESTS requests from zone-a landed in"
	while read -r line; do printf '    %s\n' "$line"; done <<<"$table"
	"$check" "$table" || die "$name: unexpected landing zones"
	printf 'PASS %s\n' "$name"
}

only_zone_a() { [[ "$(cut -d' ' -f1 <<<"$1")" == "zone-a" && "$(awk '{s += $2} END {print s}' <<<"$1")" == "$REQUESTS" ]]; }
all_zones() { [[ "$(cut -d' ' -f1 <<<"$1" | tr '\n' ' ')" == "zone-a zone-b zone-c " && "$(awk '{s += $2} END {print s}' <<<"$1")" == "$REQUESTS" ]]; }

# refused NAME COMMAND...: COMMAND (a request to a Service without
# endpoints) must fail with "refused" within 2 s: topolb answers it (a reset
# from tc, ECONNREFUSED from the socket hooks) instead of leaving it to time
# out. 2 s covers kubectl exec and docker exec; the testbed's e2e tests hold
# the answer itself to 100 ms.
refused() {
	local name=$1 out start took
	shift
	start=$(date +%s%N)
	out=$("$@" 2>&1) && die "$name: a Service without endpoints answered: $out"
	took=$((($(date +%s%N) - start) / 1000000))
	grep -qi refused <<<"$out" || die "$name: not refused: $out"
	((took < 2000)) || die "$name: refused only after ${took} ms"
	printf 'PASS %s (refused after %d ms)\n' "$name" "$took"
}

# without_kube_proxy: what only a kube-proxy replacement serves.
without_kube_proxy() {
	local zone_a=$1 empty_vip node_ip node_port i ok=0
	scenario host-network-client "$zone_a" only_zone_a land_host

	kubectl apply -f - >/dev/null <<'YAML'
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: default}
spec:
  selector: {app: nothing-selects-this}
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: web-np, namespace: default}
spec:
  type: NodePort
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
YAML
	empty_vip=$(kubectl get svc empty -o jsonpath='{.spec.clusterIP}')
	wait_for "the agent on $CLIENT_NODE to program the empty Service" programmed_has "$empty_vip:80/TCP"
	refused empty-from-pod kubectl exec client -- wget -qO- -T 5 "http://$empty_vip/"
	refused empty-from-host docker exec "$CLIENT_NODE" curl -sS -m 5 "http://$empty_vip/"

	node_ip=$(kubectl get node "$CLIENT_NODE" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')
	node_port=$(kubectl get svc web-np -o jsonpath='{.spec.ports[0].nodePort}')
	wait_for "the agent on $CLIENT_NODE to program the NodePort" programmed_has "$node_ip:$node_port/TCP/external"
	for ((i = 0; i < REQUESTS; i++)); do
		curl -sf -m 2 "http://$node_ip:$node_port/hostname" >/dev/null && ok=$((ok + 1))
	done
	((ok == REQUESTS)) || die "nodeport-from-outside: $ok of $REQUESTS requests answered"
	printf 'PASS nodeport-from-outside (%d requests from this machine to %s:%s)\n' "$REQUESTS" "$node_ip" "$node_port"
}

# programmed_has FRONTEND: the client node's agent has FRONTEND in its maps.
programmed_has() {
	docker exec "$CLIENT_NODE" curl -sf http://127.0.0.1:9966/debug/state |
		jq -e --arg f "$1" '.programmed | has($f)' >/dev/null
}

main() {
	create_cluster
	prepare_nodes
	install_topolb
	deploy_workload
	local zone_a all local_node
	# jq conditions: $z is the pod's zone, $n its node.
	# shellcheck disable=SC2016
	zone_a=$(backends '$z == "zone-a"')
	all=$(backends 'true')
	# shellcheck disable=SC2016
	local_node=$(backends '$n == $client')
	[[ $(wc -l <<<"$all") -eq 6 && $(wc -l <<<"$zone_a") -eq 2 ]] || die "backends not spread 2 per zone: $all"

	wait_for "the EndpointSlice controller to hint all 6 endpoints" hints_are 6
	scenario hints-on "$zone_a" only_zone_a
	if [[ $KUBE_PROXY == none ]]; then
		without_kube_proxy "$zone_a"
	fi

	# kube-proxy would still follow the hints here; only topolb obeys this.
	kubectl annotate svc web topolb.io/topology-aware=false >/dev/null
	scenario topolb-disabled "$all" all_zones
	kubectl annotate svc web topolb.io/topology-aware- >/dev/null

	kubectl patch svc web --type=json -p '[{"op": "remove", "path": "/spec/trafficDistribution"}]' >/dev/null
	wait_for "the EndpointSlice controller to remove the hints" hints_are 0
	scenario hints-off "$all" all_zones

	kubectl annotate svc web topolb.io/topology-keys=kubernetes.io/hostname >/dev/null
	scenario topology-keys-hostname "$local_node" only_zone_a

	log "all scenarios passed"
	if [[ $SUITE == 1 ]]; then
		run_suite
	fi
}

# run_suite: tests/cluster on this cluster. Its backend image is written
# as an OCI archive by tools/cluster/image, as for the local cluster.
run_suite() {
	local echo_image=localhost/topolb-echo:dev
	log "the end-to-end suite (tests/cluster)"
	(cd "$ROOT" && CGO_ENABLED=0 go build -o "$WORK/" ./tools/cluster/echo ./tools/cluster/image)
	"$WORK/image" -o "$WORK/echo.tar" -name "$echo_image" -file "$WORK/echo:/echo" -entrypoint /echo -user 65532:65532
	kind load image-archive "$WORK/echo.tar" --name "$CLUSTER" >/dev/null
	make -C "$ROOT" build >/dev/null
	(cd "$ROOT" && TOPOLB_E2E_KUBECONFIG=$KUBECONFIG TOPOLB_E2E_ECHO_IMAGE=$echo_image go test -count=1 -v ./tests/cluster/) ||
		die "the end-to-end suite failed"
}

main "$@"
