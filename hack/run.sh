#!/usr/bin/env bash
# The main job: a local cluster (hack/local-cluster.sh) with a real node, the operator installed
# by its Helm chart from the images built here (it runs as a pod on the real node), and the
# sample PDCluster on the real node, waited on until Ready and answering a chat completion
# through its router Service.
#   hack/run.sh up     # leaves the cluster and the operator running
#   hack/run.sh down
#
# The sample's engines are real vLLM (config/samples/local-node-vllm.yaml: vLLM's CPU build from
# the image hack/vllm-image.sh builds, a tiny model with random weights); once they answer,
# run.sh waits for KVTransferVerified, judged from real vLLM's metrics. PDCLUSTER_ENGINE=sim
# applies config/samples/local-node.yaml instead: the Go stand-in for vLLM, a faster start.
#
# With PDCLUSTER_REAL_NODE=0 there are only kwok nodes, which run no containers: the chart's
# manager Deployment gets zero replicas and the manager runs here as a process instead.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib.sh
source "${root}/hack/lib.sh"
bin="$("${root}/hack/envtest-assets.sh")"
dir="${PDCLUSTER_CLUSTER_DIR:-${HOME}/.cache/pdcluster/cluster}"
export PDCLUSTER_CLUSTER_DIR="${dir}"
release=pdcluster-operator
namespace=pdcluster-system
real_node="${PDCLUSTER_REAL_NODE:-1}"
registry="${PDCLUSTER_REGISTRY:-127.0.0.1:5000}"
engine="${PDCLUSTER_ENGINE:-vllm}"
if [[ "${real_node}" == 1 ]]; then
	case "${engine}" in
	vllm) sample="${PDCLUSTER_SAMPLE:-${root}/config/samples/local-node-vllm.yaml}" ;;
	sim) sample="${PDCLUSTER_SAMPLE:-${root}/config/samples/local-node.yaml}" ;;
	*) echo "run: PDCLUSTER_ENGINE is vllm (default) or sim, not ${engine}" >&2; exit 2 ;;
	esac
else
	sample="${PDCLUSTER_SAMPLE:-${root}/config/samples/serving_v1alpha1_pdcluster.yaml}"
fi
manager_metrics="${PDCLUSTER_MANAGER_METRICS:-127.0.0.1:18080}"
manager_probes="${PDCLUSTER_MANAGER_PROBES:-127.0.0.1:18081}"
kubectl=""
log() { echo "run: $*" >&2; }

# helm_install installs the chart (helm keeps its caches out of the user's home).
helm_install() {
	HELM_CACHE_HOME="${dir}/helm/cache" HELM_CONFIG_HOME="${dir}/helm/config" HELM_DATA_HOME="${dir}/helm/data" \
		"${bin}/helm" upgrade --install "${release}" "${root}/charts/pdcluster-operator" \
		--namespace "${namespace}" --create-namespace "$@" --wait --timeout 3m >&2
	log "chart installed: $("${kubectl}" get crd pdclusters.serving.pdcluster.dev -o name)"
}

# run_manager_process runs the manager here, for a cluster of kwok nodes only (they run no
# containers), with a token of the chart's ServiceAccount: exactly the RBAC a manager pod has.
# --read-pod-reports=false: kwok's pods run no sidecar and no router answers.
run_manager_process() {
	(cd "${root}" && go build -o bin/manager ./cmd/manager)
	local token; token="$("${kubectl}" create token "${release}" --namespace "${namespace}" --duration 24h)"
	local server; server="$("${kubectl}" config view --minify -o jsonpath='{.clusters[0].cluster.server}')"
	cat >"${dir}/operator.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: "${server}", insecure-skip-tls-verify: true}
users:
- name: ${release}
  user: {token: "${token}"}
contexts:
- name: operator
  context: {cluster: local, user: ${release}, namespace: ${namespace}}
current-context: operator
KC
	KUBECONFIG="${dir}/operator.kubeconfig" "${root}/bin/manager" \
		--metrics-bind-address "${manager_metrics}" --metrics-secure=false --health-probe-bind-address "${manager_probes}" \
		--read-pod-reports=false >"${dir}/manager.log" 2>&1 &
	echo $! >"${dir}/manager.pid"
	for _ in $(seq 1 60); do curl -fsS "http://${manager_probes}/readyz" >/dev/null 2>&1 && break; sleep 0.5; done
	curl -fsS "http://${manager_probes}/readyz" >/dev/null || { tail -20 "${dir}/manager.log" >&2; exit 1; }
	log "operator running as ServiceAccount ${namespace}/${release} (log: ${dir}/manager.log)"
}

# verify_kv waits for KVTransferVerified, which the operator judges from decode's own vLLM
# metrics: at least 256 prompt tokens in the sample's 30 s window, taken from prefill. A chat
# message is too short, so new prompts of a few hundred tokens go through the router meanwhile
# (new each time: decode would find a repeated one in its own prefix cache).
verify_kv() {
	local ns="$1" name="$2" ip="$3" model="$4" i status words
	for i in $(seq 1 36); do
		status="$("${kubectl}" get --namespace "${ns}" pdcluster "${name}" -o jsonpath='{.status.conditions[?(@.type=="KVTransferVerified")].status}')"
		if [[ "${status}" == True ]]; then
			log "KVTransferVerified: $("${kubectl}" get --namespace "${ns}" pdcluster "${name}" -o jsonpath='{.status.conditions[?(@.type=="KVTransferVerified")].message}')"
			return 0
		fi
		words="$(seq -f "run${i}w%g" 1 60 | tr '\n' ' ')"
		curl -fsS -m 60 -o /dev/null "http://${ip}/v1/completions" -H 'Content-Type: application/json' \
			-d "{\"model\":\"${model}\",\"prompt\":\"${words}\",\"max_tokens\":4}" || true
		sleep 5
	done
	log "KVTransferVerified is not True after 3 minutes of traffic:"
	"${kubectl}" get --namespace "${ns}" pdcluster "${name}" -o jsonpath='{.status.conditions[?(@.type=="KVTransferVerified")]}' >&2
	echo >&2
	return 1
}

up() {
	# A vLLM engine image: about 3 GB in the registry and 7 in containerd once unpacked (11 measured
	# in all). A cluster still up is taken down first (up would): its images do not count.
	if [[ "${real_node}" == 1 && -n "$(vllm_release "${sample}")" ]]; then
		"${root}/hack/local-cluster.sh" down
		need_disk "${dir}" 13 "make run (vLLM's engine image in the cluster's registry and containerd)"
	fi
	local kubeconfig; kubeconfig="$("${root}/hack/local-cluster.sh" up)"
	export KUBECONFIG="${kubeconfig}"
	kubectl="${bin}/kubectl"
	local version; version="$(app_version)"
	# The sample's vLLM release, when it runs the engine image built here (its tag).
	local vllm; vllm="$(vllm_release "${sample}")"
	if [[ "${real_node}" == 1 ]]; then
		# The operator runs as the chart's pod on the real node, from the image built here.
		"${root}/hack/local-node.sh" images
		# The sample's vLLM engine image, built here.
		[[ -z "${vllm}" ]] || PDCLUSTER_REGISTRY="${registry}" "${root}/hack/vllm-image.sh" "${vllm}" >/dev/null
		"${root}/hack/local-node.sh" netpol "${kubeconfig}"
		# Before the operator: it watches LeaderWorkerSets when the cluster serves them at start.
		"${root}/hack/local-node.sh" lws "${kubeconfig}"
		helm_install --set "image.repository=${registry}/pdcluster/pdcluster-operator" \
			--set "routerImage=${registry}/pdcluster/router:${version}" \
			--set "connectorImage=${registry}/pdcluster/connector:${version}"
		log "operator running as a pod: kubectl logs -n ${namespace} deploy/${release}"
	else
		helm_install --set replicaCount=0
		run_manager_process
	fi

	"${kubectl}" apply -f "${sample}" >&2
	local ns name
	ns="$("${kubectl}" get -f "${sample}" -o jsonpath='{.metadata.namespace}')"
	name="$("${kubectl}" get -f "${sample}" -o jsonpath='{.metadata.name}')"
	# Real vLLM pulls a 3 GB image and starts on a CPU: minutes, not seconds.
	local wait=300s
	[[ -z "${vllm}" ]] || wait=900s
	"${kubectl}" wait --namespace "${ns}" --for=condition=Ready "pdcluster/${name}" --timeout "${PDCLUSTER_WAIT:-${wait}}" >&2
	local kinds=pdcluster,deployments,pods
	# The real node's cluster runs LeaderWorkerSet: a pool with parallelism.nodes > 1 is one.
	[[ "${real_node}" == 1 ]] && kinds=pdcluster,deployments,leaderworkersets,pods
	"${kubectl}" get --namespace "${ns}" "${kinds}" -o wide >&2
	if [[ "${real_node}" == 1 ]]; then
		local ip model
		ip="$("${kubectl}" get --namespace "${ns}" service "${name}-router" -o jsonpath='{.spec.clusterIP}')"
		model="$("${kubectl}" get --namespace "${ns}" pdcluster "${name}" -o jsonpath='{.spec.model.servedModelName}')"
		log "a chat completion through the router Service ${ip}:80:"
		# The router resolves the pools every 5 s: retry while it has not seen the new pods yet.
		curl -fsS -m 60 --retry 15 --retry-delay 2 --retry-all-errors "http://${ip}/v1/chat/completions" -H 'Content-Type: application/json' \
			-d "{\"model\":\"${model}\",\"messages\":[{\"role\":\"user\",\"content\":\"Disaggregated serving moves the KV cache from prefill to decode\"}],\"max_tokens\":8}" >&2
		echo >&2
		if [[ -n "${vllm}" ]]; then
			verify_kv "${ns}" "${name}" "${ip}" "${model}"
		fi
	fi
	log "up. export KUBECONFIG=${kubeconfig}; stop with: hack/run.sh down"
}

case "${1:-up}" in
up) up ;;
down) "${root}/hack/local-cluster.sh" down ;;
*) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
