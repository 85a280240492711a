#!/usr/bin/env bash
# Builds the envtest / local-cluster binaries from source (no prebuilt download is reachable)
# and caches them outside the repo. Prints the asset directory on stdout, so callers can do
#   export KUBEBUILDER_ASSETS="$(hack/envtest-assets.sh)"
# A build is redone only when the pinned module files change (a stamp holds their hash).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${PDCLUSTER_BIN:-${HOME}/.cache/pdcluster/bin}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
HELM_MODULE="${HELM_MODULE:-helm.sh/helm/v3/cmd/helm@v3.21.4}"
mkdir -p "${bin}"

log() { echo "envtest-assets: $*" >&2; }

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

build_module() { # dir stampname pkg...
	local dir="$1" name="$2"; shift 2
	local want have
	want="$(stamp_of "${root}/hack/${dir}/go.mod" "${root}/hack/${dir}/go.sum")"
	have="$(cat "${bin}/.${name}.stamp" 2>/dev/null || true)"
	local missing=0
	for p in "$@"; do
		# A main package at the module root, or in its cmd directory, is named after the module.
		local b; b="$(basename "${p}")"; [[ "${b}" == . || "${b}" == cmd ]] && b="${name}"
		[[ -x "${bin}/${b}" ]] || missing=1
	done
	if [[ "${want}" == "${have}" && "${missing}" == 0 ]]; then
		log "${name}: cached in ${bin}"
		return
	fi
	log "${name}: building $* (kube-apiserver takes ~8 min cold on 2 cores)"
	(cd "${root}/hack/${dir}" && GOBIN="${bin}" CGO_ENABLED=0 go install -trimpath -ldflags='-s -w' ${BUILD_TAGS:+-tags "${BUILD_TAGS}"} "$@")
	if [[ -x "${bin}/cmd" ]]; then mv "${bin}/cmd" "${bin}/${name}"; fi
	echo "${want}" > "${bin}/.${name}.stamp"
}

build_module envtest kubernetes \
	k8s.io/kubernetes/cmd/kube-apiserver \
	k8s.io/kubernetes/cmd/kube-controller-manager \
	k8s.io/kubernetes/cmd/kube-scheduler \
	k8s.io/kubernetes/cmd/kubectl \
	k8s.io/kubernetes/cmd/kubelet \
	k8s.io/kubernetes/cmd/kube-proxy
build_module etcd etcd .
# go install names the etcd main after its module directory.
[[ -x "${bin}/etcd" ]] || { log "etcd binary missing after build"; exit 1; }

# The real node's runtime and the image registry (hack/local-node.sh). containerd without the
# snapshotters that need cgo or host tools.
BUILD_TAGS=no_btrfs,no_devmapper,no_zfs build_module node node \
	github.com/containerd/containerd/v2/cmd/containerd \
	github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
	github.com/coredns/coredns \
	github.com/distribution/distribution/v3/cmd/registry

# The real node's NetworkPolicy implementation (hack/netpol/install.yaml).
build_module netpol kube-network-policies sigs.k8s.io/kube-network-policies/cmd
# LeaderWorkerSet's controller, for the real node (hack/local-node.sh lws).
build_module lws lws sigs.k8s.io/lws/cmd

install_tool() { # binary module@version
	local name="$1" mod="$2"
	if [[ -x "${bin}/${name}" && "$(cat "${bin}/.${name}.stamp" 2>/dev/null)" == "${mod}" ]]; then
		log "${name}: cached"
		return
	fi
	if [[ "${PDCLUSTER_SKIP_CLUSTER_TOOLS:-}" == 1 ]]; then return; fi
	log "${name}: installing ${mod}"
	GOBIN="${bin}" CGO_ENABLED=0 go install -trimpath -ldflags='-s -w' "${mod}"
	echo "${mod}" > "${bin}/.${name}.stamp"
}
install_tool kwok "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}"
install_tool helm "${HELM_MODULE}"

echo "${bin}"
