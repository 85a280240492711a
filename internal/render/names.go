// Names, labels and ports of the rendered objects.

package render

import (
	"crypto/sha256"
	"encoding/hex"
	"net"
	"strconv"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// Names and paths inside the rendered pods.
const (
	shmVolume = "dshm"
	// gateVolume is the completion-gate plugin, from its ConfigMap.
	gateVolume = "completion-gate"

	// connectorVolume holds the sidecar's pod-local socket, which the engine's gate heartbeats
	// to: on the pod's own volume, so only the engine of the same pod reaches it.
	connectorVolume = "connector-run"
	ConnectorDir    = "/var/run/pdcluster"
	// ConnectorSocket is the sidecar's pod-local API (the gate's heartbeat).
	ConnectorSocket = "unix://" + ConnectorDir + "/agent.sock"
	// connectorVolumeBytes bounds the volume: it holds one socket.
	connectorVolumeBytes = 1 << 20
	// controlVolume holds the sidecar's control socket, where its preStop hook asks for a
	// drain: mounted in the sidecar's container alone, since a drain makes the pod unready.
	controlVolume = v1alpha1.ControlVolumeName
	ControlDir    = "/var/run/pdcluster-ctl"
	// ControlSocket is the sidecar's --control-listen and its drain's --listen.
	ControlSocket = "unix://" + ControlDir + "/ctl.sock"
	// ConnectorPort is the sidecar's public port: /healthz, /readyz, /metrics and /gate. It is
	// not vLLM's bootstrap port (8998): the prefill engine binds that in the same network
	// namespace.
	ConnectorPort int32 = 8190
	// RouterPort is the router's: vLLM's API port, so a client of the router reaches it where it
	// would reach a single vLLM.
	RouterPort = vllm.APIPort
	// RouterMetricsPort is the router's for /metrics and the counts the operator reads (GET
	// /canary, /pairs, /routing): its own, so that the NetworkPolicy opens it to the operator
	// and monitoring and not to every client of the router.
	RouterMetricsPort int32 = 9090

	// Port names, shared by container ports and the Services that target them.
	portHTTP      = "http"
	portMetrics   = "metrics"
	portBootstrap = "bootstrap"
	portConnector = "connector"
	// portNixlPrefix + data-parallel rank names a NIXL side-channel port.
	portNixlPrefix = "nixl-"
	// portKVEventsPrefix and portKVReplayPrefix + data-parallel rank name an engine's KV
	// events publisher and replay ports (routing.strategy KVEvents).
	portKVEventsPrefix = "kv-events-"
	portKVReplayPrefix = "kv-replay-"

	// drainSeconds keeps a deleted engine pod's containers serving before they get SIGTERM:
	// routers resolve the pools every 5 s through DNS (cached up to 5 s more), so a pod gone at
	// once would still get requests and fail them ("no route to host") during every rollout.
	// The pool's drain.timeoutSeconds follows, for vLLM's own drain.
	drainSeconds = 15
	// routerDrainSeconds keeps a deleted router pod serving before it gets SIGTERM: its
	// Service's endpoints (kube-proxy, a gateway) drop it within that.
	routerDrainSeconds = 10
	// graceMarginSeconds is the default grace period's room past the drain, for the engine's
	// teardown after its last request (vLLM frees GPU memory and joins its workers).
	graceMarginSeconds = 15

	// ConnectorBinary is where the connector image keeps the sidecar's command: its preStop
	// hook runs `connector drain` there. An image set in spec.connector.image must keep it.
	ConnectorBinary = "/usr/local/bin/connector"
)

// ObjectName is the name of the child object of cluster for role.
func ObjectName(cluster string, role v1alpha1.Role) string { return cluster + "-" + string(role) }

// EngineObjectName is the name of the Deployment and the headless Service of role's engines of
// KV revision rev in cluster: <cluster>-<role> in the base slot, else <cluster>-<role>-<rev>.
// Where that passes 63 characters (a Service name is a DNS label; a PDCluster's name may take
// 55) its end is a hash of the whole name instead, which keeps two PDClusters' names apart.
func EngineObjectName(cluster string, role v1alpha1.Role, rev string, base bool) string {
	name := ObjectName(cluster, role)
	if base {
		return name
	}
	return fitLabel(name, name+"-"+rev)
}

// maxNameLength is a DNS label's.
const maxNameLength = 63

// fitLabel is full, the name prefix with a suffix, when it fits a DNS label; else prefix cut
// short and a hash of full, which keeps apart two names that share the kept part.
func fitLabel(prefix, full string) string { return fitName(prefix, full, maxNameLength) }

// fitName is fitLabel within max characters.
func fitName(prefix, full string, limit int) string {
	if len(full) <= limit {
		return full
	}
	sum := sha256.Sum256([]byte(full))
	h := hex.EncodeToString(sum[:])[:10]
	return prefix[:min(len(prefix), limit-len(h)-1)] + "-" + h
}

// Labels are the selector labels of role's pods in cluster.
func Labels(cluster string, role v1alpha1.Role) map[string]string {
	l := componentLabels(cluster, string(role))
	l[v1alpha1.LabelRole] = string(role)
	return l
}

// RevisionLabels are the selector labels of role's pods of KV revision rev in cluster: an
// engine Deployment's and its Service's.
func RevisionLabels(cluster string, role v1alpha1.Role, rev string) map[string]string {
	l := Labels(cluster, role)
	l[v1alpha1.LabelKVRevision] = rev
	return l
}

// componentLabels are the labels of every object of cluster; component names the part.
func componentLabels(cluster, component string) map[string]string {
	return map[string]string{
		v1alpha1.LabelName:      "pdcluster",
		v1alpha1.LabelInstance:  cluster,
		v1alpha1.LabelComponent: component,
		v1alpha1.LabelManagedBy: v1alpha1.OperatorName,
		v1alpha1.LabelCluster:   cluster,
	}
}

func objectMeta(pdc *v1alpha1.PDCluster, role v1alpha1.Role) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name:      ObjectName(pdc.Name, role),
		Namespace: pdc.Namespace,
		Labels:    Labels(pdc.Name, role),
	}
}

// EngineMetricsURL is where the sidecar reads its engine's /metrics: the engine's API port on
// the pod's loopback.
var EngineMetricsURL = "http://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(int(vllm.APIPort))) + "/metrics"
