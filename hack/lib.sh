# Shared by the hack/ scripts: source it after setting root to the repository's top.

# app_version is the chart's appVersion, which tags the images built here.
app_version() { awk '/^appVersion:/ {gsub(/"/, "", $2); print $2}' "${root}/charts/pdcluster-operator/Chart.yaml"; }

# node_ip is this machine's address on its default route: the real node's InternalIP, which the
# API server advertises too. Nothing is sent; the kernel only looks the route up.
node_ip() { ip -4 route get 1.1.1.1 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") print $(i + 1)}'; }

# vllm_release prints the vLLM release of the engine image hack/vllm-image.sh builds, if the
# PDCluster file given runs it (its image is .../pdcluster/vllm-cpu:RELEASE), else nothing.
vllm_release() {
	sed -n 's|^ *image: .*/pdcluster/vllm-cpu:\([0-9][0-9.]*\) *$|\1|p' "$1" | head -1
}

# vllm_control_release is the vLLM release whose stock decode engine dies of a pull with no
# local block (0.32.0 checks it itself): test/e2e TestRealVLLMPods rolls its sample onto this
# release's engine image, gated and then stock, to show what the gate prevents.
vllm_control_release=0.30.0

# need_disk fails unless the filesystem holding DIR has GB gigabytes free, naming what it is for
# and what this machine's caches take: a pull that runs out of space half way fails in
# containerd's words, minutes later, as an image that cannot be unpacked.
need_disk() { # DIR GB WHAT
	local d="$1"
	while [[ ! -d "${d}" ]]; do d="$(dirname "${d}")"; done
	local free; free="$(df -P -B1G "${d}" | awk 'NR == 2 {print $4}')"
	((free >= $2)) && return 0
	echo "$3 needs ${2} GB free on the filesystem of ${1}; it has ${free} GB. What the caches here take:" >&2
	du -sh "${HOME}"/.cache/pdcluster/* "${HOME}/.cache/go-build" >&2 2>/dev/null || true
	return 1
}
