#!/usr/bin/env bash
# Builds vLLM's CPU engine image without a Docker daemon and pushes it to a registry:
#   hack/vllm-image.sh 0.32.0    # -> ${PDCLUSTER_REGISTRY:-127.0.0.1:5000}/pdcluster/vllm-cpu:0.32.0
#   hack/vllm-image.sh --layers-only 0.32.0   # the layers only, into the cache (.ci/run, early)
#   hack/vllm-image.sh --paths 0.32.0         # the cached layers' paths it would use, one a line
# It prints the pushed reference with its digest. Four layers, each a zstd tarball cached by the
# content of what makes it (in ~/.cache/pdcluster/image), so a rebuild makes only what changed
# and pushes only what the registry lacks:
#   base   Debian bookworm minbase (mmdebstrap, from Debian's packages): python3, python3-venv,
#          libibverbs1 and libcurl4 (Mooncake's transfer engine links both even over TCP), libnuma1,
#          libgomp1, ca-certificates, and g++ with python3-dev: vLLM's CPU sampler compiles
#          itself with torch.compile at the first sampled request (temperature > 0), which needs
#          a C++ compiler and Python's headers (without them 0.30.0's engine dies of it)
#   vllm   /opt/vllm: vllm-cpu VERSION and Mooncake's transfer engine, installed by
#          hack/vllm-venv.sh (the same install workarounds as the tests' environments) run in a
#          chroot of base, so the environment's python is the image's
#   model  /opt/models/tiny-llama: test/realengine's tiny Llama config (random weights: serve it
#          with --load-format=dummy) and a tokenizer trained at build time with a chat template,
#          so text prompts and chat work with nothing downloaded
#   shim   test-only: test/realengine/testdata/shim (torch.accelerator on a machine without an
#          accelerator; vLLM's Mooncake worker asks for the current device index whatever the
#          device), loaded by a .pth file in the environment; a GPU image needs none of it
# Needs root (chroot, device nodes), mmdebstrap and zstd (Debian's packages) and network access to
# Debian's mirror and PyPI. See docs/vllm-image.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
push=1 paths=0
case "${1:-}" in
--layers-only) push=0; shift ;;
--paths) paths=1; shift ;;
esac
version="${1:?usage: hack/vllm-image.sh [--layers-only|--paths] VLLM_VERSION}"
cache="${PDCLUSTER_CACHE:-${HOME}/.cache/pdcluster}/image"
registry="${PDCLUSTER_REGISTRY:-127.0.0.1:5000}"
ref="${registry}/pdcluster/vllm-cpu:${version}"
suite=bookworm
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
packages=python3,python3-venv,python3-dev,g++,libibverbs1,libcurl4,libnuma1,libgomp1,ca-certificates
# Debian bookworm's python3 is 3.11: the environment's site-packages is under it.
site=opt/vllm/lib/python3.11/site-packages
log() { echo "vllm-image: $*" >&2; }
for tool in mmdebstrap zstd; do
	command -v "${tool}" >/dev/null || { log "${tool} is missing (Debian: apt-get install ${tool})"; exit 1; }
done
key() { sha256sum | cut -c1-16; }
# Each layer's key: the content of what makes it.
base_key=$(printf '%s\n' "${suite}" "${packages}" | key)
base="${cache}/base-${base_key}.tar.zst"
# The install script without its lock's lines (marked #lock): the lock changes no layer.
vllm_key=$( { echo "${base_key}" "${version}"; grep -v '#lock$' "${root}/hack/vllm-venv.sh"; } | key)
vllm="${cache}/vllm-cpu-${version}-${vllm_key}.tar.zst"
model_src="${root}/test/realengine/testdata"
model_key=$( { echo "${vllm_key}"; cat "${model_src}/tiny-llama/config.json" "${model_src}/train_tokenizer.py"; } | key)
model="${cache}/model-tiny-llama-${model_key}.tar.zst"
shim_key=$(cat "${model_src}/shim/sitecustomize.py" | key)
shim="${cache}/shim-${shim_key}.tar.zst"
if ((paths)); then
	printf '%s\n' "${base}" "${vllm}" "${model}" "${shim}"
	exit 0
fi
mkdir -p "${cache}"
work=$(mktemp -d "${cache}/work.XXXXXX")
cleanup() {
	local m
	for m in proc dev; do mountpoint -q "${work}/rootfs/${m}" && umount -l "${work}/rootfs/${m}"; done
	rm -rf "${work}"
}
trap cleanup EXIT
start=$(date +%s)

# pack DIR LAYER PATH...: the paths under DIR as a zstd tarball, owned by root, with fixed times.
pack() {
	local dir="$1" out="$2"; shift 2
	tar -C "${dir}" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - "$@" | zstd -q -T0 -3 -o "${out}.tmp"
	mv "${out}.tmp" "${out}"
	log "layer $(basename "${out}"): $(du -h "${out}" | cut -f1) compressed"
}

# rootfs extracts base (and the vllm layer, when asked) into the work directory once.
rootfs_has=""
rootfs() {
	local want="$1"
	if [[ -z "${rootfs_has}" ]]; then
		mkdir -p "${work}/rootfs"
		zstd -q -dc "${base}" | tar -C "${work}/rootfs" -xf -
		rootfs_has=base
	fi
	if [[ "${want}" == vllm && "${rootfs_has}" != vllm ]]; then
		zstd -q -dc "${vllm}" | tar -C "${work}/rootfs" -xf -
		rootfs_has=vllm
	fi
}

if [[ ! -f "${base}" ]]; then
	log "base: Debian ${suite} minbase with ${packages} (cold: about 2 minutes)"
	mkdir -p "${work}/rootfs"
	mmdebstrap --quiet --variant=minbase --include="${packages}" "${suite}" "${work}/rootfs" "${mirror}" >&2
	# Kubernetes mounts the pod's own resolver configuration.
	: >"${work}/rootfs/etc/resolv.conf"
	pack "${work}/rootfs" "${base}" .
	rootfs_has=base
fi

if [[ ! -f "${vllm}" ]]; then
	log "vllm: vllm-cpu ${version} into /opt/vllm, in a chroot of base (cold: about 6 minutes, mostly download)"
	rootfs base
	r="${work}/rootfs"
	cp /etc/resolv.conf "${r}/etc/resolv.conf"
	# The host's certificate authorities: PyPI may be reached through this machine's proxy.
	cp /etc/ssl/certs/ca-certificates.crt "${r}/tmp/host-ca.crt"
	cp "${root}/hack/vllm-venv.sh" "${r}/tmp/vllm-venv.sh"
	mount -t proc proc "${r}/proc"
	mount --rbind /dev "${r}/dev"
	chroot "${r}" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PIP_CERT=/tmp/host-ca.crt \
		PIP_NO_CACHE_DIR=1 PIP_DEFAULT_TIMEOUT=180 VLLM_VENV=/opt/vllm PYTHON=/usr/bin/python3 \
		bash /tmp/vllm-venv.sh --cpu "${version}" >&2
	umount -l "${r}/proc" "${r}/dev"
	[[ -d "${r}/${site}" ]] || { log "no ${site} in the environment: is base's python3 still 3.11?"; exit 1; }
	: >"${r}/etc/resolv.conf"
	rm -f "${r}/tmp/host-ca.crt" "${r}/tmp/vllm-venv.sh"
	pack "${r}" "${vllm}" opt/vllm
	rootfs_has=vllm
fi

# This release's vllm layers and the bases under other keys are stale (an older
# hack/vllm-venv.sh's, an older package list's): 3 GB a vllm layer, which the e2e's disk check
# counts against the space it needs. Another release's layers are left alone.
for stale in "${cache}"/vllm-cpu-"${version}"-*.tar.zst "${cache}"/base-*.tar.zst; do
	if [[ -f "${stale}" && "${stale}" != "${vllm}" && "${stale}" != "${base}" ]]; then
		log "removing the stale layer $(basename "${stale}") ($(du -h "${stale}" | cut -f1))"
		rm -f "${stale}"
	fi
done

if [[ ! -f "${model}" ]]; then
	log "model: tiny Llama config and a tokenizer trained with the image's own vLLM environment"
	rootfs vllm
	r="${work}/rootfs"
	mkdir -p "${work}/model/opt/models/tiny-llama" "${r}/tmp/model"
	cp "${model_src}/tiny-llama/config.json" "${model_src}/train_tokenizer.py" "${r}/tmp/model/"
	chroot "${r}" /usr/bin/env -i PATH=/opt/vllm/bin:/usr/bin:/bin HOME=/root HF_HUB_OFFLINE=1 \
		/opt/vllm/bin/python /tmp/model/train_tokenizer.py /tmp/model >&2
	rm "${r}/tmp/model/train_tokenizer.py"
	cp -r "${r}/tmp/model/." "${work}/model/opt/models/tiny-llama/"
	pack "${work}/model" "${model}" opt
fi

if [[ ! -f "${shim}" ]]; then
	mkdir -p "${work}/shim/${site}"
	cp "${model_src}/shim/sitecustomize.py" "${work}/shim/${site}/pdcluster_cpu_shim.py"
	# A .pth line that imports runs at every interpreter start, as sitecustomize would; the pod's
	# PYTHONPATH (the plugin's mount) is left to the operator.
	echo "import pdcluster_cpu_shim" >"${work}/shim/${site}/pdcluster_cpu_shim.pth"
	pack "${work}/shim" "${shim}" opt
fi

if ((!push)); then
	log "layers of ${ref} cached in $(($(date +%s) - start)) s"
	exit 0
fi
log "pushing ${ref}"
(cd "${root}" && go run ./hack/imagebuild layers --ref "${ref}" --entrypoint /opt/vllm/bin/vllm \
	--env PATH=/opt/vllm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
	--env HOME=/root \
	--env HF_HUB_OFFLINE=1 \
	"${base}" "${vllm}" "${model}" "${shim}")
log "${ref} in $(($(date +%s) - start)) s; layers: $(du -ch "${base}" "${vllm}" "${model}" "${shim}" | tail -1 | cut -f1) compressed"
