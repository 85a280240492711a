package v1alpha1

// OperatorName names the operator everywhere it signs its work: the managed-by label, the
// server-side apply field manager and the event reporter.
const OperatorName = "pdcluster-operator"

// Label and annotation keys on every object the operator renders.
const (
	LabelName      = "app.kubernetes.io/name"
	LabelInstance  = "app.kubernetes.io/instance"
	LabelComponent = "app.kubernetes.io/component"
	LabelManagedBy = "app.kubernetes.io/managed-by"
	// LabelCluster names the PDCluster an object belongs to.
	LabelCluster = "serving.pdcluster.dev/cluster"
	// LabelRole is the Role of the object's pods.
	LabelRole = "serving.pdcluster.dev/role"
	// LabelKVRevision on an engine pod is the KV revision it serves (status.updateRevision
	// when it was created): pods with different values must not exchange KV.
	LabelKVRevision = "serving.pdcluster.dev/kv-revision"
	// LabelDomain on an engine pod is its node's value of spec.scheduling.pairing.topologyKey,
	// which the operator copies there once the pod is bound; on a Service, the domain whose
	// pods it selects.
	LabelDomain = "serving.pdcluster.dev/domain"
	// LabelGang "true" on a pod of a replica across pods asks the operator's admission policy
	// (config/admission/gang-podgroups.yaml) to put it in its replica's PodGroup, named
	// <LeaderWorkerSet>-<group index> (render.GroupName).
	LabelGang = "serving.pdcluster.dev/gang"

	// AnnotationConfigHash on a pod template changes whenever the pod spec does, so a spec
	// change rolls exactly the pool whose pods it affects.
	AnnotationConfigHash = "serving.pdcluster.dev/config-hash"
	// AnnotationGateHash on an engine pod template is the content hash of the completion-gate
	// plugin it mounts: a new plugin rolls the engines, which import it once at start.
	AnnotationGateHash = "serving.pdcluster.dev/completion-gate-hash"
	// AnnotationService on a LeaderWorkerSet names the headless Service of its serving pods
	// (the router's pool). They cannot share a name: LeaderWorkerSet makes its own headless
	// Service, named after itself, for its pods' DNS names.
	AnnotationService = "serving.pdcluster.dev/service"
)

// Container names in the pods the operator renders.
const (
	// EngineContainerName runs `vllm serve`.
	EngineContainerName = "engine"
	// ConnectorContainerName is the completion-gated connector sidecar beside each engine.
	ConnectorContainerName = "connector"
	// RouterContainerName is the P/D proxy.
	RouterContainerName = "router"
)

// GPUResourceName is the extended resource an engine asks for, one per GPU.
const GPUResourceName = "nvidia.com/gpu"
