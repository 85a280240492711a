#!/usr/bin/env bash
# End-to-end tests: the README's main command (hack/run.sh up) on a cluster of its own (its own
# directory and ports, so a cluster left up by `make run` is untouched), then test/e2e against it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$("${root}/hack/envtest-assets.sh")"
export PDCLUSTER_CLUSTER_DIR="${PDCLUSTER_E2E_DIR:-$(mktemp -d -t pdcluster-e2e.XXXXXX)}"
export PDCLUSTER_APISERVER_PORT="${PDCLUSTER_E2E_APISERVER_PORT:-16543}"
export PDCLUSTER_ETCD_PORT="${PDCLUSTER_E2E_ETCD_PORT:-12479}"
export PDCLUSTER_MANAGER_METRICS=127.0.0.1:18180 PDCLUSTER_MANAGER_PROBES=127.0.0.1:18181

cleanup() {
	local rc=$?
	if [[ ${rc} -ne 0 ]]; then
		echo "e2e: failed; last lines of the operator log:" >&2
		tail -30 "${PDCLUSTER_CLUSTER_DIR}/manager.log" >&2 || true
	fi
	"${root}/hack/run.sh" down || true
	exit "${rc}"
}
trap cleanup EXIT

"${root}/hack/run.sh" up
cd "${root}"
PDCLUSTER_E2E_KUBECONFIG="${PDCLUSTER_CLUSTER_DIR}/kubeconfig" PDCLUSTER_E2E_BIN="${bin}" \
	go test ./test/e2e/ -count=1 -v -timeout 15m
