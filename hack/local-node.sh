#!/usr/bin/env bash
# A real node for the local cluster: pods on it run for real, from the project's images.
#   hack/local-node.sh up KUBECONFIG   # registry, containerd, kubelet, kube-proxy, CoreDNS
#   hack/local-node.sh images          # builds the binaries and pushes the images to the registry
#   hack/local-node.sh netpol KUBECONFIG  # the NetworkPolicy implementation (after images)
#   hack/local-node.sh lws KUBECONFIG     # LeaderWorkerSet, by its own chart (after images)
#   hack/local-node.sh down
#
# kubelet and kube-proxy come from the same k8s.io/kubernetes module as the control plane,
# containerd 2.x, CoreDNS and the registry from hack/node (all built by hack/envtest-assets.sh);
# runc, the CNI plugins, iptables and conntrack from Debian. Needs root (it makes a bridge,
# iptables rules and mounts). The node advertises fake nvidia.com/gpu and rdma/hca capacity so
# GPU pods can land on it, and carries the label pdcluster.dev/real-node=true.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib.sh
source "${root}/hack/lib.sh"
bin="$("${root}/hack/envtest-assets.sh")"
cluster="${PDCLUSTER_CLUSTER_DIR:-${HOME}/.cache/pdcluster/cluster}"
dir="${cluster}/node"
certs="${cluster}/certs"
node="${PDCLUSTER_NODE_NAME:-pdc-node-0}"
registry="${PDCLUSTER_REGISTRY:-127.0.0.1:5000}"
# Pods get 10.244.0.0/24 on the bridge pdc0; the node's end of it, 10.244.0.1, is also where
# CoreDNS answers (it runs on the node, not in a pod).
bridge=pdc0 gateway=10.244.0.1 pod_cidr=10.244.0.0/24
runc_root=/run/containerd/runc/k8s.io
log() { echo "local-node: $*" >&2; }
export PATH="${bin}:${PATH}:/usr/local/sbin:/usr/sbin:/sbin"

# need checks for root and installs the Debian packages the node runs on when they are
# missing, so `make run` works on a fresh machine as `.ci/run` does.
need() {
	[[ "$(id -u)" == 0 ]] || { log "needs root (bridge, iptables, mounts)"; exit 1; }
	local missing=()
	for c in runc iptables conntrack; do command -v "${c}" >/dev/null || missing+=("${c}"); done
	command -v ip >/dev/null || missing+=(iproute2)
	[[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
	((${#missing[@]})) || return 0
	if ! command -v apt-get >/dev/null; then
		log "missing: ${missing[*]} (Debian packages; install them)"
		exit 1
	fi
	log "installing ${missing[*]}"
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
}

start() { # name args...
	local name="$1"; shift
	"$@" >"${dir}/${name}.log" 2>&1 &
	echo $! >"${dir}/${name}.pid"
}

stop() { # name
	local pid
	[[ -f "${dir}/$1.pid" ]] || return 0
	pid="$(cat "${dir}/$1.pid")"
	kill "${pid}" 2>/dev/null || true
	for _ in $(seq 1 50); do kill -0 "${pid}" 2>/dev/null || break; sleep 0.2; done
	kill -9 "${pid}" 2>/dev/null || true
	rm -f "${dir}/$1.pid"
}

down() {
	[[ -d "${dir}" ]] || return 0
	stop kubelet
	stop kube-proxy
	stop coredns
	# The pods' containers outlive kubelet and containerd: kill them and their shims.
	if command -v runc >/dev/null && [[ -d "${runc_root}" ]]; then
		for c in $(runc --root "${runc_root}" list -q 2>/dev/null); do
			runc --root "${runc_root}" kill "${c}" KILL 2>/dev/null || true
		done
		sleep 0.5
		for c in $(runc --root "${runc_root}" list -q 2>/dev/null); do
			runc --root "${runc_root}" delete --force "${c}" 2>/dev/null || true
		done
	fi
	pkill -f "containerd-shim-runc-v2 .*${dir}/containerd.sock" 2>/dev/null || true
	stop containerd
	stop registry
	netpol_rules_down
	# Mounts the kubelet and containerd made (volumes, rootfs, network namespaces), deepest first.
	awk -v d="${dir}/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do umount -l "${m}" 2>/dev/null || true; done
	for ns in $(ip netns list 2>/dev/null | awk '/^cni-/ {print $1}'); do ip netns delete "${ns}" 2>/dev/null || true; done
	ip link delete "${bridge}" 2>/dev/null || true
	if [[ -x "${bin}/kube-proxy" ]]; then "${bin}/kube-proxy" --cleanup >/dev/null 2>&1 || true; fi
	# The bridge plugin's masquerade rules of the pods that were never torn down.
	{ iptables -t nat -S POSTROUTING 2>/dev/null || true; } | { grep -F -- "CNI-" || true; } | sed 's/^-A/-D/' |
		while read -r r; do eval "iptables -t nat ${r}" 2>/dev/null || true; done
	rm -rf "${dir}/containerd/state" "${dir}/cni-state"
	# The images too (containerd's store, the registry's): the next up starts from an empty
	# directory (hack/local-cluster.sh), so kept they would only hold the disk, about 10 GB with a
	# vLLM engine image, that the next cluster needs (hack/e2e.sh's holds two such images).
	rm -rf "${dir}/containerd/root" "${dir}/registry"
}

write_configs() {
	mkdir -p "${dir}"/{containerd,cni,certs.d/"${registry}",kubelet,cni-state}
	cat >"${dir}/certs.d/${registry}/hosts.toml" <<EOF
server = "http://${registry}"
[host."http://${registry}"]
  capabilities = ["pull", "resolve"]
EOF
	# restrict_oom_score_adj: this host is itself a container, where runc may not lower a
	# process's oom_score_adj below its own (the pod sandbox asks for -998; runc then fails
	# with "can't get final child's PID from pipe: EOF").
	cat >"${dir}/containerd/config.toml" <<EOF
version = 3
root = "${dir}/containerd/root"
state = "${dir}/containerd/state"
[grpc]
  address = "${dir}/containerd.sock"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  # The compressed layers go once unpacked: vLLM's engine image is 3 GB of them.
  discard_unpacked_layers = true
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "${registry}/pdcluster/pause:$(app_version)"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "${dir}/certs.d"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "${dir}/cni"
EOF
	cat >"${dir}/cni/10-pdcluster.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "pdcluster", "plugins": [
  {"type": "bridge", "bridge": "${bridge}", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "${dir}/cni-state", "ranges": [[{"subnet": "${pod_cidr}", "gateway": "${gateway}"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
	# failCgroupV1: this host has cgroup v1, which kubelet 1.37 refuses unless told.
	cat >"${dir}/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
containerRuntimeEndpoint: unix://${dir}/containerd.sock
# Only the API server (its client certificate, from hack/local-cluster.sh) reaches the kubelet.
authentication: {anonymous: {enabled: false}, webhook: {enabled: false}, x509: {clientCAFile: "${certs}/kubelet-ca.crt"}}
authorization: {mode: AlwaysAllow}
address: 0.0.0.0
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
clusterDNS: ["${gateway}"]
clusterDomain: cluster.local
resolvConf: ""
failSwapOn: false
localStorageCapacityIsolation: false
imageGCHighThresholdPercent: 100
evictionHard: {}
serializeImagePulls: false
registerNode: true
nodeStatusReportFrequency: 10s
EOF
	cat >"${dir}/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: "${kubeconfig}"}
hostnameOverride: ${node}
clusterCIDR: ${pod_cidr}
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: [primary]
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
	cat >"${dir}/Corefile" <<EOF
cluster.local:53 in-addr.arpa:53 {
    bind ${gateway}
    errors
    kubernetes cluster.local in-addr.arpa {
        kubeconfig ${kubeconfig}
        pods insecure
    }
    cache 5
}
.:53 {
    bind ${gateway}
    template ANY ANY {
        rcode NXDOMAIN
    }
}
EOF
	cat >"${dir}/registry.yml" <<EOF
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: "${dir}/registry"}
http: {addr: "${registry}"}
EOF
}

wait_for() { # what command...
	local what="$1"; shift
	for _ in $(seq 1 120); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
	log "${what} did not come up"; return 1
}

registry_up() {
	mkdir -p "${dir}"
	[[ -f "${dir}/registry.yml" ]] || write_configs
	if ! curl -fsS "http://${registry}/v2/" >/dev/null 2>&1; then
		start registry "${bin}/registry" serve "${dir}/registry.yml"
		wait_for registry curl -fsS "http://${registry}/v2/"
	fi
}

# images builds every image the local cluster runs and pushes it, tagged with the chart's
# appVersion: the operator, the connector sidecar (the agent, and the vLLM plugin's files), the
# router, the engine standing in for vLLM, and the pod sandbox.
images() {
	registry_up
	(cd "${root}" && CGO_ENABLED=0 go build -trimpath -o bin/ ./cmd/... ./test/sim/cmd/... ./test/cluster/cmd/...)
	local plugin=() f
	for f in "${root}"/connector/vllm/pdgate/*.py; do plugin+=("${f}:/opt/pdgate/pdgate/$(basename "${f}")"); done
	local IFS=,
	(cd "${root}" && go run ./hack/imagebuild --registry "${registry}/pdcluster" --tag "$(app_version)" \
		pdcluster-operator=bin/manager:/manager \
		connector="bin/connector,${plugin[*]}" \
		router=bin/router \
		vllm-sim=bin/vllm@root \
		pause=bin/pause:/pause \
		netprobe=bin/netprobe \
		kube-network-policies="${bin}/kube-network-policies:/kube-network-policies@root" \
		lws="${bin}/lws:/manager") >&2
}

# lws installs LeaderWorkerSet (its CRDs, its controller and its webhooks, which inject the
# group's variables into its pods) by the Helm chart of the sigs.k8s.io/lws module the operator
# builds with, its controller from the image built here (hack/lws), on this node. Its webhook
# certificates are its own (internal cert management); the API server reaches its webhook
# Service through kube-proxy on this machine.
lws() {
	local kc=(--kubeconfig "$1") chart
	chart="$(cd "${root}" && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)/charts/lws"
	HELM_CACHE_HOME="${cluster}/helm/cache" HELM_CONFIG_HOME="${cluster}/helm/config" HELM_DATA_HOME="${cluster}/helm/data" \
		helm "${kc[@]}" upgrade --install lws "${chart}" --namespace lws-system --create-namespace \
		--set "image.manager.repository=${registry}/pdcluster/lws" --set "image.manager.tag=$(app_version)" \
		--set image.manager.pullPolicy=IfNotPresent \
		--set resources.requests.cpu=20m --set resources.requests.memory=64Mi \
		--set-string 'nodeSelector.pdcluster\.dev/real-node=true' \
		--wait --timeout 3m >&2
	log "lws: LeaderWorkerSet $(kubectl "${kc[@]}" get crd leaderworkersets.leaderworkerset.x-k8s.io -o jsonpath='{.spec.versions[0].name}') served, its controller running in lws-system"
}

# knp_chain holds the rules that hand new pod connections to kube-network-policies' NFQUEUE.
knp_chain=PDC-NETPOL knp_queue=100

netpol_rules_down() {
	iptables -t mangle -D POSTROUTING -j "${knp_chain}" 2>/dev/null || true
	iptables -t mangle -D INPUT -s "${pod_cidr}" -m conntrack --ctstate NEW -j NFQUEUE --queue-num "${knp_queue}" --queue-bypass 2>/dev/null || true
	iptables -t mangle -F "${knp_chain}" 2>/dev/null || true
	iptables -t mangle -X "${knp_chain}" 2>/dev/null || true
}

# netpol runs kube-network-policies on the node and feeds it the first packet of every new
# connection to or from a pod, which it accepts or drops by the NetworkPolicies it watches (its
# own nftables rules need the kernel's nft queue expression, which this kernel lacks, so these
# iptables rules do the same job). Connections the node's root processes open (the kubelet's
# probes, the tests) are not judged; --queue-bypass lets everything through while nothing
# listens on the queue, so a policy is enforced only while kube-network-policies runs.
netpol() {
	local kc=(--kubeconfig "$1")
	netpol_rules_down
	iptables -t mangle -N "${knp_chain}"
	iptables -t mangle -A "${knp_chain}" -m owner --uid-owner 0 -j RETURN
	iptables -t mangle -A "${knp_chain}" -m conntrack ! --ctstate NEW -j RETURN
	iptables -t mangle -A "${knp_chain}" -s "${pod_cidr}" -j NFQUEUE --queue-num "${knp_queue}" --queue-bypass
	iptables -t mangle -A "${knp_chain}" -d "${pod_cidr}" -j NFQUEUE --queue-num "${knp_queue}" --queue-bypass
	iptables -t mangle -A POSTROUTING -j "${knp_chain}"
	iptables -t mangle -A INPUT -s "${pod_cidr}" -m conntrack --ctstate NEW -j NFQUEUE --queue-num "${knp_queue}" --queue-bypass
	sed "s|image: IMAGE|image: ${registry}/pdcluster/kube-network-policies:$(app_version)|" "${root}/hack/netpol/install.yaml" |
		kubectl "${kc[@]}" apply -f - >&2
	kubectl "${kc[@]}" -n kube-system rollout status daemonset/kube-network-policies --timeout 120s >&2
	log "netpol: kube-network-policies enforces NetworkPolicies on ${node} (queue ${knp_queue})"
}

up() {
	kubeconfig="$1"
	need
	down
	write_configs
	registry_up
	echo 1 >/proc/sys/net/ipv4/ip_forward
	modprobe br_netfilter 2>/dev/null || true
	[[ -w /proc/sys/net/bridge/bridge-nf-call-iptables ]] && echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables
	# The bridge exists before the first pod, so CoreDNS can bind the node's end of it.
	ip link add "${bridge}" type bridge 2>/dev/null || true
	ip addr replace "${gateway}/24" dev "${bridge}"
	ip link set "${bridge}" up
	start containerd "${bin}/containerd" --config "${dir}/containerd/config.toml"
	wait_for containerd test -S "${dir}/containerd.sock"
	start coredns "${bin}/coredns" -conf "${dir}/Corefile"
	start kube-proxy "${bin}/kube-proxy" --config "${dir}/kube-proxy.yaml"
	local ip; ip="$(node_ip)"
	start kubelet "${bin}/kubelet" --config "${dir}/kubelet/config.yaml" --kubeconfig "${kubeconfig}" \
		--hostname-override "${node}" ${ip:+--node-ip "${ip}"} --root-dir "${dir}/kubelet/root" --cert-dir "${dir}/kubelet/pki" \
		--node-labels "pdcluster.dev/real-node=true"
	local kc=(--kubeconfig "${kubeconfig}")
	wait_for "node ${node}" kubectl "${kc[@]}" get node "${node}"
	kubectl "${kc[@]}" wait --for=condition=Ready "node/${node}" --timeout 120s >/dev/null
	# Fake accelerators, as a device plugin would advertise them: the scheduler counts them, the
	# engine image needs none.
	kubectl "${kc[@]}" patch node "${node}" --subresource=status --type=merge \
		-p '{"status":{"capacity":{"nvidia.com/gpu":"8","rdma/hca":"4"}}}' >/dev/null
	log "up: node ${node} (containerd, kubelet, kube-proxy, CoreDNS at ${gateway}); images from ${registry}"
}

case "${1:-}" in
up) up "${2:?usage: $0 up KUBECONFIG}" ;;
images) images ;;
netpol) netpol "${2:?usage: $0 netpol KUBECONFIG}" ;;
lws) lws "${2:?usage: $0 lws KUBECONFIG}" ;;
down) down ;;
*) echo "usage: $0 up KUBECONFIG | images | netpol KUBECONFIG | lws KUBECONFIG | down" >&2; exit 2 ;;
esac
