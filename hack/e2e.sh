#!/usr/bin/env bash
# End-to-end tests: the README's main command (hack/run.sh up) on a cluster of its own (its own
# directory and ports), then test/e2e against it: the kwok GPU nodes, and the real node's pods.
# The real node is one per machine (bridge, registry and kubelet ports): a `make run` cluster is
# taken down first. PDCLUSTER_E2E_RUN selects tests (go test -run); PDCLUSTER_E2E_KEEP=1 leaves
# the cluster up afterwards, to look at.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib.sh
source "${root}/hack/lib.sh"
bin="$("${root}/hack/envtest-assets.sh")"
export PDCLUSTER_CLUSTER_DIR="${PDCLUSTER_E2E_DIR:-$(mktemp -d -t pdcluster-e2e.XXXXXX)}"
# A directory of our own goes when the cluster does: its registry and containerd hold about 24 GB
# with the two vLLM engine images.
made_dir=""; [[ -n "${PDCLUSTER_E2E_DIR:-}" ]] || made_dir="${PDCLUSTER_CLUSTER_DIR}"
export PDCLUSTER_APISERVER_PORT="${PDCLUSTER_E2E_APISERVER_PORT:-16543}"
export PDCLUSTER_ETCD_PORT="${PDCLUSTER_E2E_ETCD_PORT:-12479}"
export PDCLUSTER_MANAGER_METRICS=127.0.0.1:18180 PDCLUSTER_MANAGER_PROBES=127.0.0.1:18181

cleanup() {
	local rc=$?
	if [[ ${rc} -ne 0 ]]; then
		echo "e2e: failed; last lines of the operator log:" >&2
		if [[ "${PDCLUSTER_REAL_NODE:-1}" == 1 ]]; then
			"${bin}/kubectl" --kubeconfig "${PDCLUSTER_CLUSTER_DIR}/kubeconfig" logs -n pdcluster-system deploy/pdcluster-operator --tail 30 >&2 || true
		else
			tail -30 "${PDCLUSTER_CLUSTER_DIR}/manager.log" >&2 || true
		fi
	fi
	if [[ -n "${PDCLUSTER_E2E_KEEP:-}" ]]; then
		echo "e2e: the cluster stays up (PDCLUSTER_E2E_KEEP): KUBECONFIG=${PDCLUSTER_CLUSTER_DIR}/kubeconfig; hack/run.sh down with PDCLUSTER_CLUSTER_DIR set to take it down" >&2
		exit "${rc}"
	fi
	"${root}/hack/run.sh" down || true
	# run.sh down unmounted everything under it.
	[[ -z "${made_dir}" ]] || rm -rf "${made_dir}"
	exit "${rc}"
}
trap cleanup EXIT
if [[ "${PDCLUSTER_REAL_NODE:-1}" == 1 ]]; then
	PDCLUSTER_CLUSTER_DIR="${HOME}/.cache/pdcluster/cluster" "${root}/hack/local-cluster.sh" down
	need_disk "${PDCLUSTER_CLUSTER_DIR}" 26 "The e2e cluster (its registry and containerd with two vLLM engine images)"
fi

# The stand-in engine for the tests of the tiny sample (make run's default is real vLLM: its
# sample runs in test/e2e TestRealVLLMPods, beside it).
PDCLUSTER_ENGINE=sim "${root}/hack/run.sh" up
cd "${root}"
real=()
if [[ "${PDCLUSTER_REAL_NODE:-1}" == 1 ]]; then
	# run.sh put the small sample on the real node; the GPU-sized sample goes on the kwok nodes.
	"${bin}/kubectl" --kubeconfig "${PDCLUSTER_CLUSTER_DIR}/kubeconfig" apply -f config/samples/serving_v1alpha1_pdcluster.yaml
	# The operator runs as a pod there: its metrics are on the pod's address.
	manager_ip="$("${bin}/kubectl" --kubeconfig "${PDCLUSTER_CLUSTER_DIR}/kubeconfig" get pods -n pdcluster-system \
		-l app.kubernetes.io/instance=pdcluster-operator,app.kubernetes.io/component=manager -o jsonpath='{.items[0].status.podIP}')"
	# The chart's manager serves /metrics to authorized scrapers only: one bound to its
	# metrics-reader ClusterRole, as a Prometheus would be.
	k=("${bin}/kubectl" --kubeconfig "${PDCLUSTER_CLUSTER_DIR}/kubeconfig")
	"${k[@]}" create serviceaccount metrics-scraper -n pdcluster-system >&2
	"${k[@]}" create clusterrolebinding metrics-scraper --clusterrole pdcluster-operator-metrics-reader \
		--serviceaccount pdcluster-system:metrics-scraper >&2
	# vLLM's CPU engine images in this cluster's registry: the release make run's sample runs,
	# and the stock-crash control's (hack/lib.sh).
	vllm_image="$(PDCLUSTER_REGISTRY="${PDCLUSTER_REGISTRY:-127.0.0.1:5000}" hack/vllm-image.sh "$(vllm_release config/samples/local-node-vllm.yaml)")"
	control_image="$(PDCLUSTER_REGISTRY="${PDCLUSTER_REGISTRY:-127.0.0.1:5000}" hack/vllm-image.sh "${vllm_control_release}")"
	real=(PDCLUSTER_E2E_VLLM_IMAGE="${vllm_image%@*}" PDCLUSTER_E2E_VLLM_CONTROL_IMAGE="${control_image%@*}" PDCLUSTER_E2E_REAL_NODE="${PDCLUSTER_NODE_NAME:-pdc-node-0}" PDCLUSTER_E2E_REGISTRY="${PDCLUSTER_REGISTRY:-127.0.0.1:5000}"
		PDCLUSTER_MANAGER_METRICS="${manager_ip}:8080"
		PDCLUSTER_MANAGER_METRICS_TOKEN="$("${k[@]}" create token metrics-scraper -n pdcluster-system --duration 2h)")
fi
env "${real[@]}" PDCLUSTER_E2E_KUBECONFIG="${PDCLUSTER_CLUSTER_DIR}/kubeconfig" PDCLUSTER_E2E_BIN="${bin}" \
	go test ./test/e2e/ -count=1 -v -timeout 50m ${PDCLUSTER_E2E_RUN:+-run "${PDCLUSTER_E2E_RUN}"}
