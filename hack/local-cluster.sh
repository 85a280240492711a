#!/usr/bin/env bash
# Starts a local cluster from the binaries built by hack/envtest-assets.sh: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler (with Kubernetes' gang scheduling on) and kwok with fake
# GPU/RDMA nodes.
#   hack/local-cluster.sh up      # prints the kubeconfig path; processes keep running
#   hack/local-cluster.sh down
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib.sh
source "${root}/hack/lib.sh"
bin="$("${root}/hack/envtest-assets.sh")"
dir="${PDCLUSTER_CLUSTER_DIR:-${HOME}/.cache/pdcluster/cluster}"
nodes="${PDCLUSTER_GPU_NODES:-4}"
real_node="${PDCLUSTER_REAL_NODE:-1}"
kwok_cidr=10.244.128.0/20
port="${PDCLUSTER_APISERVER_PORT:-16443}"
etcd_port="${PDCLUSTER_ETCD_PORT:-12379}" # and the next port for etcd peers
# Kubernetes' own gang scheduling (PodGroups, the pods' schedulingGroup; beta, off by default in
# 1.37): a replica across pods is one gang (spec.scheduling.gang).
gates=GenericWorkload=true
log() { echo "local-cluster: $*" >&2; }

down() {
	local p pid
	"${root}/hack/local-node.sh" down
	ip route delete unreachable "${kwok_cidr}" 2>/dev/null || true
	# manager: the operator hack/run.sh starts against this cluster.
	for p in manager kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
		[[ -f "${dir}/${p}.pid" ]] || continue
		pid="$(cat "${dir}/${p}.pid")"
		kill "${pid}" 2>/dev/null || true
		for _ in $(seq 1 50); do kill -0 "${pid}" 2>/dev/null || break; sleep 0.2; done
		kill -9 "${pid}" 2>/dev/null || true # its ports must be free for the next up
		rm -f "${dir}/${p}.pid"
	done
}

start() { # name args...
	local name="$1"; shift
	"${bin}/${name}" "$@" >"${dir}/${name}.log" 2>&1 &
	echo $! >"${dir}/${name}.pid"
}

up() {
	down
	rm -rf "${dir}"; mkdir -p "${dir}/certs"
	local token; token="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
	echo "${token},admin,admin,system:masters" >"${dir}/tokens.csv"
	openssl genrsa -out "${dir}/certs/sa.key" 2048 2>/dev/null
	openssl rsa -in "${dir}/certs/sa.key" -pubout -out "${dir}/certs/sa.pub" 2>/dev/null
	# The API server's client certificate for kubelets (logs, exec), signed by a CA the real
	# node's kubelet trusts.
	openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=pdcluster-kubelet-ca" \
		-keyout "${dir}/certs/kubelet-ca.key" -out "${dir}/certs/kubelet-ca.crt" 2>/dev/null
	openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" \
		-keyout "${dir}/certs/kubelet-client.key" -out "${dir}/certs/kubelet-client.csr" 2>/dev/null
	openssl x509 -req -in "${dir}/certs/kubelet-client.csr" -CA "${dir}/certs/kubelet-ca.crt" -CAkey "${dir}/certs/kubelet-ca.key" \
		-CAcreateserial -days 30 -out "${dir}/certs/kubelet-client.crt" 2>/dev/null
	cat >"${dir}/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: "https://127.0.0.1:${port}", insecure-skip-tls-verify: true}
users:
- name: admin
  user: {token: "${token}"}
contexts:
- name: local
  context: {cluster: local, user: admin}
current-context: local
KC
	# With the real node, pods reach the API server (the operator runs as a pod): it listens on
	# every address and advertises the node's, which the kubernetes Service points at; pods
	# trust its self-signed certificate through kube-root-ca.crt (--root-ca-file).
	local listen=(--bind-address 127.0.0.1) root_ca=()
	if [[ "${real_node}" == 1 ]]; then
		local node_ip; node_ip="$(node_ip)"
		[[ -n "${node_ip}" ]] || { log "no IPv4 address with a route to find the node's address"; exit 1; }
		listen=(--bind-address 0.0.0.0 --advertise-address "${node_ip}")
		root_ca=(--root-ca-file "${dir}/certs/apiserver.crt")
	fi
	local etcd="http://127.0.0.1:${etcd_port}" peer="http://127.0.0.1:$((etcd_port + 1))"
	start etcd --data-dir "${dir}/etcd" --listen-client-urls "${etcd}" --advertise-client-urls "${etcd}" \
		--listen-peer-urls "${peer}" --initial-advertise-peer-urls "${peer}" --initial-cluster "default=${peer}" \
		--listen-metrics-urls ""
	start kube-apiserver --etcd-servers "${etcd}" --secure-port "${port}" "${listen[@]}" \
		--cert-dir "${dir}/certs" --token-auth-file "${dir}/tokens.csv" --authorization-mode RBAC \
		--service-account-key-file "${dir}/certs/sa.pub" --service-account-signing-key-file "${dir}/certs/sa.key" \
		--service-account-issuer https://kubernetes.default.svc --service-cluster-ip-range 10.96.0.0/16 \
		--kubelet-client-certificate "${dir}/certs/kubelet-client.crt" --kubelet-client-key "${dir}/certs/kubelet-client.key" \
		--kubelet-preferred-address-types InternalIP \
		--feature-gates "${gates}" --runtime-config scheduling.k8s.io/v1beta1=true
	local kc=("--kubeconfig" "${dir}/kubeconfig")
	for _ in $(seq 1 120); do "${bin}/kubectl" "${kc[@]}" get --raw /readyz >/dev/null 2>&1 && break; sleep 0.5; done
	"${bin}/kubectl" "${kc[@]}" get --raw /readyz >/dev/null
	start kube-controller-manager "${kc[@]}" --service-account-private-key-file "${dir}/certs/sa.key" "${root_ca[@]}" \
		--use-service-account-credentials=false --controllers '*' --leader-elect=false --secure-port 0 --feature-gates "${gates}"
	start kube-scheduler "${kc[@]}" --leader-elect=false --secure-port 0 --feature-gates "${gates}"
	# kwok ships its node and pod lifecycle Stages in its module, which installing it downloaded.
	local stages; stages="$(go env GOMODCACHE)/sigs.k8s.io/kwok@${KWOK_VERSION:-v0.8.0}/kustomize/stage"
	: >"${dir}/kwok.yaml"
	for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
		pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
		{ echo "---"; cat "${stages}/${f}"; } >>"${dir}/kwok.yaml"
	done
	# kwok makes up its pods' IPs from kwok_cidr; with the real node up that range is
	# unreachable (a route that refuses at once, also for the real node's pods), so what reads
	# pods by IP (the operator's gate-status reader) never sends traffic off this machine and
	# never waits for a timeout.
	start kwok "${kc[@]}" --config "${dir}/kwok.yaml" --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
		--node-lease-duration-seconds 40 --cidr "${kwok_cidr}"
	for i in $(seq 0 $((nodes - 1))); do
		cat <<NODE | "${bin}/kubectl" "${kc[@]}" apply -f - >/dev/null
apiVersion: v1
kind: Node
metadata:
  name: gpu-node-${i}
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels: {kubernetes.io/hostname: gpu-node-${i}, type: kwok, pdcluster.dev/gpu-pool: "true"}
spec:
  taints:
  - {key: nvidia.com/gpu, value: present, effect: NoSchedule}
status:
  allocatable: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "8", rdma/hca: "4"}
  capacity: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "8", rdma/hca: "4"}
NODE
	done
	if [[ "${real_node}" == 1 ]]; then
		# The real node is also the CPU node: what asks for no GPU (the router) runs there.
		"${root}/hack/local-node.sh" up "${dir}/kubeconfig"
		ip route replace unreachable "${kwok_cidr}"
		log "up: ${nodes} fake GPU nodes and a real node; export KUBECONFIG=${dir}/kubeconfig"
		echo "${dir}/kubeconfig"
		return
	fi
	# An untainted CPU node for what asks for no GPU: the router, the manager.
	cat <<NODE | "${bin}/kubectl" "${kc[@]}" apply -f - >/dev/null
apiVersion: v1
kind: Node
metadata:
  name: cpu-node-0
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels: {kubernetes.io/hostname: cpu-node-0, type: kwok}
status:
  allocatable: {cpu: "32", memory: 128Gi, pods: "110"}
  capacity: {cpu: "32", memory: 128Gi, pods: "110"}
NODE
	log "up: ${nodes} fake GPU nodes and a CPU node; export KUBECONFIG=${dir}/kubeconfig"
	echo "${dir}/kubeconfig"
}

case "${1:-up}" in
up) up ;;
down) down ;;
*) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
