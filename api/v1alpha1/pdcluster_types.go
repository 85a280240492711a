package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// Connector names a vLLM KV connector.
// +kubebuilder:validation:Enum=MooncakeConnector;NixlConnector
type Connector string

const (
	ConnectorMooncake Connector = "MooncakeConnector"
	ConnectorNixl     Connector = "NixlConnector"
)

// CompletionGate turns the operator's completion-gated connector plugin on or off.
// +kubebuilder:validation:Enum=Enabled;Disabled
type CompletionGate string

const (
	CompletionGateEnabled  CompletionGate = "Enabled"
	CompletionGateDisabled CompletionGate = "Disabled"
)

// TransferProtocol is the wire used between prefill and decode.
// +kubebuilder:validation:Enum=rdma;tcp
type TransferProtocol string

const (
	ProtocolRDMA TransferProtocol = "rdma"
	ProtocolTCP  TransferProtocol = "tcp"
)

// BufferDevice is where the connector stages KV blocks.
// +kubebuilder:validation:Enum=cuda;cpu
type BufferDevice string

const (
	BufferDeviceCUDA BufferDevice = "cuda"
	BufferDeviceCPU  BufferDevice = "cpu"
)

// LoadFailurePolicy says what the decode engine does with a request whose KV pull failed.
// +kubebuilder:validation:Enum=fail;recompute
type LoadFailurePolicy string

const (
	LoadFailurePolicyFail      LoadFailurePolicy = "fail"
	LoadFailurePolicyRecompute LoadFailurePolicy = "recompute"
)

// RouterBalance is how the router picks a prefill and a decode engine for each request.
// +kubebuilder:validation:Enum=least-in-flight;round-robin
type RouterBalance string

const (
	// RouterBalanceLeastInFlight picks, in each pool, the engine with the fewest of the
	// router's requests in flight, taking turns among equals: a slow or busy engine gets fewer.
	RouterBalanceLeastInFlight RouterBalance = "least-in-flight"
	// RouterBalanceRoundRobin takes turns whatever the engines' load.
	RouterBalanceRoundRobin RouterBalance = "round-robin"
)

// EngineArgs are extra `vllm serve` arguments, one token per item (e.g. "--max-model-len=8192"
// or "--max-model-len", "8192"). Flags the operator derives from typed fields
// (OperatorEngineFlags) are rejected, spelled with underscores, abbreviated or with a key
// after a dot alike. At most 64 (the API server's cost budget for that rule).
// +kubebuilder:validation:MaxItems=64
// +kubebuilder:validation:items:MaxLength=4096
// +kubebuilder:validation:XValidation:rule="self.all(a, !(a.split('=')[0].split('.')[0].replace('_', '-') in ['-tp', '-dp', '-pp'] || a.startsWith('--') && size(a.split('=')[0].split('.')[0]) > 2 && ['--kv-transfer-config', '--kv-events-config', '--block-size', '--tensor-parallel-size', '--pipeline-parallel-size', '--data-parallel-size', '--data-parallel-size-local', '--data-parallel-start-rank', '--data-parallel-address', '--data-parallel-rpc-port', '--data-parallel-hybrid-lb', '--enable-expert-parallel', '--enable-prefix-caching', '--no-enable-prefix-caching', '--served-model-name', '--port', '--host', '--nnodes', '--node-rank', '--master-addr', '--master-port', '--headless'].exists(f, f.startsWith(a.split('=')[0].split('.')[0].replace('_', '-')))))",messageExpression="'flag ' + self.filter(a, (a.split('=')[0].split('.')[0].replace('_', '-') in ['-tp', '-dp', '-pp'] || a.startsWith('--') && size(a.split('=')[0].split('.')[0]) > 2 && ['--kv-transfer-config', '--kv-events-config', '--block-size', '--tensor-parallel-size', '--pipeline-parallel-size', '--data-parallel-size', '--data-parallel-size-local', '--data-parallel-start-rank', '--data-parallel-address', '--data-parallel-rpc-port', '--data-parallel-hybrid-lb', '--enable-expert-parallel', '--enable-prefix-caching', '--no-enable-prefix-caching', '--served-model-name', '--port', '--host', '--nnodes', '--node-rank', '--master-addr', '--master-port', '--headless'].exists(f, f.startsWith(a.split('=')[0].split('.')[0].replace('_', '-')))))[0] + ' is set by the operator (or abbreviates one it sets: vLLM takes a unique prefix of a flag, and the keys of a JSON flag after a dot); use the typed field instead (model, engine.blockSize, engine.enablePrefixCaching, kvTransfer, parallelism, router.routing)'"
type EngineArgs []string

// ModelSpec names the model both pools serve and where its weights come from.
// +kubebuilder:validation:XValidation:rule="(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.huggingFace) ? 1 : 0) <= 1",message="set at most one of pvc, hostPath and huggingFace: they are where the weights come from"
// +kubebuilder:validation:XValidation:rule="!(has(self.pvc) || has(self.hostPath)) || !self.path.startsWith('/')",message="with pvc or hostPath, path is a directory inside that volume (e.g. Qwen3-32B or .), not an absolute path"
type ModelSpec struct {
	// path is the model passed to `vllm serve`: a Hugging Face id (huggingFace, or no source:
	// vLLM downloads it into the container), or a path inside the image. With pvc or hostPath it
	// is the directory inside that volume ("." for its root); the engine serves
	// /models/<path>.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=1024
	Path string `json:"path"`

	// servedModelName is the name clients use in the OpenAI `model` field.
	// Defaults to path.
	// +optional
	// +kubebuilder:validation:MaxLength=256
	ServedModelName string `json:"servedModelName,omitempty"`

	// revision names the weights at path. Without pvc or hostPath it is passed to vLLM as
	// --revision (a Hugging Face branch, tag or commit). With pvc or hostPath it is a label
	// only: change it whenever the weights at the same path change, so the KV revision
	// (status.updateRevision) changes with them, the engines restart and the rollout is
	// reported; KV computed from other weights reads as valid KV and gives plausible but wrong
	// output.
	// +optional
	// +kubebuilder:validation:MaxLength=256
	Revision string `json:"revision,omitempty"`

	// pvc holds the weights on a PersistentVolumeClaim, mounted read-only at /models in every
	// engine container.
	// +optional
	PVC *PVCModelSource `json:"pvc,omitempty"`

	// hostPath holds the weights in a directory of every GPU node, mounted read-only at
	// /models.
	// +optional
	HostPath *HostPathModelSource `json:"hostPath,omitempty"`

	// huggingFace downloads path from the Hugging Face Hub into a cache volume (HF_HOME), with
	// an optional token for gated models.
	// +optional
	HuggingFace *HuggingFaceModelSource `json:"huggingFace,omitempty"`
}

// PVCModelSource is a PersistentVolumeClaim holding model weights.
type PVCModelSource struct {
	// claimName is the PersistentVolumeClaim in the PDCluster's namespace.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')",message="claimName must be a PersistentVolumeClaim name: lowercase letters, digits, '-' and '.'"
	ClaimName string `json:"claimName"`

	// subPath mounts only this directory of the volume at /models.
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:XValidation:rule="!self.startsWith('/') && !self.split('/').exists(p, p == '..')",message="subPath must be relative and may not contain '..'"
	// +optional
	SubPath string `json:"subPath,omitempty"`
}

// HostPathModelSource is a directory on the node holding model weights.
type HostPathModelSource struct {
	// path is the absolute directory on the node.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=4096
	// +kubebuilder:validation:XValidation:rule="self.startsWith('/')",message="hostPath.path must be an absolute path on the node"
	Path string `json:"path"`
}

// HuggingFaceModelSource downloads the model from the Hugging Face Hub.
// +kubebuilder:validation:XValidation:rule="!(has(self.cacheClaimName) && has(self.cacheSizeLimit))",message="set cacheClaimName (a PVC that keeps downloads across restarts) or cacheSizeLimit (an emptyDir), not both"
type HuggingFaceModelSource struct {
	// cacheClaimName is a PersistentVolumeClaim for the download cache (HF_HOME), shared by
	// the engines and kept across restarts. Without it the cache is an emptyDir per pod.
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')",message="cacheClaimName must be a PersistentVolumeClaim name: lowercase letters, digits, '-' and '.'"
	// +optional
	CacheClaimName string `json:"cacheClaimName,omitempty"`

	// cacheSizeLimit bounds the emptyDir cache (e.g. 200Gi).
	// +optional
	CacheSizeLimit *resource.Quantity `json:"cacheSizeLimit,omitempty"`

	// tokenSecret is the Secret key holding a Hugging Face token, passed as HF_TOKEN (gated
	// models such as Llama need one).
	// +optional
	TokenSecret *SecretKey `json:"tokenSecret,omitempty"`
}

// SecretKey selects a key of a Secret in the PDCluster's namespace.
type SecretKey struct {
	// name of the Secret.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')",message="name must be a Secret name: lowercase letters, digits, '-' and '.'"
	Name string `json:"name"`

	// key in the Secret.
	// +kubebuilder:default=token
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[-._a-zA-Z0-9]+$')",message="key may hold only letters, digits, '-', '_' and '.'"
	// +optional
	Key string `json:"key,omitempty"`
}

// EngineSpec configures the vLLM engine shared by both pools.
type EngineSpec struct {
	// image is the vLLM container image for prefill and decode.
	// +kubebuilder:validation:MinLength=1
	Image string `json:"image"`

	// blockSize is the number of tokens per KV-cache block; prefill and decode must agree.
	// +kubebuilder:default=16
	// +kubebuilder:validation:Enum=1;8;16;32;64;128;256
	// +optional
	BlockSize *int32 `json:"blockSize,omitempty"`

	// enablePrefixCaching turns on vLLM automatic prefix caching in both pools.
	// +kubebuilder:default=true
	// +optional
	EnablePrefixCaching *bool `json:"enablePrefixCaching,omitempty"`

	// args are extra `vllm serve` arguments passed to both pools, before each pool's own args.
	// +optional
	Args EngineArgs `json:"args,omitempty"`

	// pod holds settings of the prefill and decode pods the operator does not derive: extra
	// environment, pod labels and annotations (e.g. Multus networks for RDMA), priority class,
	// service account, image pull secrets, scheduler, grace period, /dev/shm size. A pool's own
	// pod settings win over these, field by field (env, labels and annotations key by key).
	// +optional
	Pod *PodSettings `json:"pod,omitempty"`
}

// KVTransferSpec configures the KV connector that moves the cache from prefill to decode.
// +kubebuilder:validation:XValidation:rule="!has(self.protocol) || self.protocol != 'rdma' || (has(self.rdmaDevices) && size(self.rdmaDevices) > 0)",message="rdmaDevices must list at least one RDMA device (e.g. mlx5_0) when protocol is rdma"
// +kubebuilder:validation:XValidation:rule="!has(self.rdmaDevices) || size(self.rdmaDevices) == 0 || !has(self.protocol) || self.protocol == 'rdma'",message="rdmaDevices is only used with protocol rdma; remove it, or set protocol: rdma"
type KVTransferSpec struct {
	// connector is the vLLM KV connector class.
	// +kubebuilder:default=MooncakeConnector
	// +optional
	Connector Connector `json:"connector,omitempty"`

	// protocol is the transfer wire: rdma (InfiniBand/RoCE) or tcp.
	// +kubebuilder:default=rdma
	// +optional
	Protocol TransferProtocol `json:"protocol,omitempty"`

	// bufferDevice is where KV blocks are staged for transfer (kv_buffer_device).
	// +kubebuilder:default=cuda
	// +optional
	BufferDevice BufferDevice `json:"bufferDevice,omitempty"`

	// loadFailurePolicy is what decode does when a KV pull fails: fail the request, or
	// recompute the missing blocks locally (kv_load_failure_policy).
	// +kubebuilder:default=fail
	// +optional
	LoadFailurePolicy LoadFailurePolicy `json:"loadFailurePolicy,omitempty"`

	// rdmaDevices are the RDMA NICs the connector uses (e.g. mlx5_0, or mlx5_0:1 with its
	// port). Mooncake gets them joined with commas as device_name; NIXL gets them as
	// UCX_NET_DEVICES (port 1 when none is given). Required when protocol is rdma, refused
	// with tcp.
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=64
	// +listType=set
	// +optional
	RDMADevices []string `json:"rdmaDevices,omitempty"`

	// completionGate runs the engines with the operator's gated connector (the pdgate vLLM
	// plugin: GatedMooncakeConnector or GatedNixlConnector), which never reports a pull with no
	// local blocks to vLLM's scheduler as finished. Disabled runs vLLM's stock connector, whose
	// reports of such pulls (early aborts, rejected requests, full prefix hits) kill the decode
	// engine on a scheduler assertion.
	// +kubebuilder:default=Enabled
	// +optional
	CompletionGate CompletionGate `json:"completionGate,omitempty"`

	// verification is how the operator checks that KV really moves from prefill to decode
	// (a cluster can be healthy and answer 200 while decode recomputes every prompt): it
	// reports the evidence in status.kvTransfer and the KVTransferVerified condition.
	// +kubebuilder:default={}
	// +optional
	Verification KVVerification `json:"verification,omitempty"`

	// extraConfig is merged into kv_connector_extra_config. Keys the operator derives from the
	// fields above (mooncake_protocol, device_name) may not be set here.
	// +kubebuilder:pruning:PreserveUnknownFields
	// +kubebuilder:validation:Type=object
	// +optional
	ExtraConfig *apiextensionsv1.JSON `json:"extraConfig,omitempty"`
}

// KVVerificationMode is how KV transfer is verified.
// +kubebuilder:validation:Enum=Passive;Canary;Disabled
type KVVerificationMode string

const (
	// KVVerificationPassive reads the engines' own counts: the decode engines' prompt tokens by
	// source (vllm:prompt_tokens_by_source_total, read by each sidecar from its engine) and the
	// completion gate's failed pulls.
	KVVerificationPassive KVVerificationMode = "Passive"
	// KVVerificationCanary is Passive plus a canary: every router sends a never-cached prompt
	// of a few blocks with max_tokens 1 through the P/D path at an interval and reads, from the
	// decode engine that answered, how many of its tokens came from prefill. An idle cluster is
	// judged too, and a single request's path is proven end to end.
	KVVerificationCanary KVVerificationMode = "Canary"
	// KVVerificationDisabled reads nothing and sets no KVTransferVerified condition.
	KVVerificationDisabled KVVerificationMode = "Disabled"
)

// KVVerification is how the operator checks that decode receives its prompts' KV from
// prefill instead of recomputing them.
type KVVerification struct {
	// mode is Passive (read the engines' own counts), Canary (Passive, and the routers send a
	// canary request at canaryIntervalSeconds) or Disabled.
	// +kubebuilder:default=Passive
	// +optional
	Mode KVVerificationMode `json:"mode,omitempty"`

	// canaryIntervalSeconds is how often each router sends its canary request (mode Canary).
	// +kubebuilder:default=60
	// +kubebuilder:validation:Minimum=5
	// +kubebuilder:validation:Maximum=3600
	// +optional
	CanaryIntervalSeconds *int32 `json:"canaryIntervalSeconds,omitempty"`

	// windowSeconds is how far back the evidence reaches: the change of the engines' counters
	// over this many seconds. The first verdict comes once a window has passed with traffic.
	// +kubebuilder:default=300
	// +kubebuilder:validation:Minimum=30
	// +kubebuilder:validation:Maximum=86400
	// +optional
	WindowSeconds *int32 `json:"windowSeconds,omitempty"`

	// minExternalSharePercent is the share of the prompt tokens decode did not find in its
	// own prefix cache that must have come from prefill (external KV). Not 100: a connector or
	// KV layout that moves whole blocks only leaves the partial last block to decode.
	// +kubebuilder:default=90
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +optional
	MinExternalSharePercent *int32 `json:"minExternalSharePercent,omitempty"`

	// minTransferMBps is the slowest KV transfer rate (MB/s: bytes moved over the engines'
	// transfer time, vllm:<connector>_bytes_transferred and _xfer_time_seconds, over the
	// window) that still counts as verified. Set it for protocol rdma well above what TCP
	// reaches on your network: an RDMA path that fell back to TCP then reads SlowTransport.
	// Unset: no floor.
	// +kubebuilder:validation:Minimum=1
	// +optional
	MinTransferMBps *int32 `json:"minTransferMBps,omitempty"`

	// requiredForReady makes Ready False while KVTransferVerified is False. By default a failed
	// verification is a condition and a Warning event only: the cluster still serves (slower).
	// +optional
	RequiredForReady bool `json:"requiredForReady,omitempty"`
}

// Parallelism is how one engine replica spreads over GPUs; each replica asks for
// tensor*data*pipeline GPUs, over nodes pods.
// +kubebuilder:validation:XValidation:rule="!has(self.nodes) || self.nodes == 1 || !has(self.data) || self.data == 1 || self.data % self.nodes == 0",message="data must be a multiple of nodes: each pod of a replica runs data/nodes of its data-parallel ranks",fieldPath=".nodes"
// +kubebuilder:validation:XValidation:rule="!has(self.nodes) || self.nodes == 1 || (has(self.data) && self.data > 1) || ((has(self.tensor) ? self.tensor : 1) * (has(self.pipeline) ? self.pipeline : 1)) % self.nodes == 0",message="with data 1 the model is sharded across the replica's pods: tensor x pipeline must be a multiple of nodes",fieldPath=".nodes"
// +kubebuilder:validation:XValidation:rule="!has(self.nodes) || self.nodes == 1 || !has(self.data) || self.data == 1 || self.data / self.nodes >= 2 || (has(self.expert) && self.expert)",message="with data-parallel ranks across pods each pod runs at least 2 (data >= 2 x nodes), or set expert: with one rank per pod vLLM's hybrid load balancing becomes external load balancing, which only MoE models support",fieldPath=".nodes"
type Parallelism struct {
	// tensor is the tensor-parallel size.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=64
	// +optional
	Tensor *int32 `json:"tensor,omitempty"`

	// data is the data-parallel size inside one replica.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=64
	// +optional
	Data *int32 `json:"data,omitempty"`

	// pipeline is the pipeline-parallel size.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=64
	// +optional
	Pipeline *int32 `json:"pipeline,omitempty"`

	// expert enables expert parallelism for MoE models (--enable-expert-parallel).
	// +optional
	Expert bool `json:"expert,omitempty"`

	// nodes is how many pods (one per node) one engine replica spans: with data > 1 each pod
	// runs data/nodes data-parallel ranks and serves them (vLLM's hybrid load balancing);
	// with data 1 the model is sharded across the pods (tensor x pipeline), the first pod
	// serving. A replica across pods runs as a LeaderWorkerSet group.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=64
	// +optional
	Nodes *int32 `json:"nodes,omitempty"`
}

// RDMASpec is the RDMA device-plugin resource each engine pod requests.
type RDMASpec struct {
	// resourceName is the extended resource advertised by the RDMA device plugin.
	// +kubebuilder:default="rdma/hca"
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$') && !self.startsWith('kubernetes.io/') && !self.startsWith('requests.')",message="resourceName must be an extended resource name such as rdma/hca or nvidia.com/hostdev: a domain, '/', and a name"
	// +optional
	ResourceName string `json:"resourceName,omitempty"`

	// count is how many units of resourceName each pod requests.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +optional
	Count *int32 `json:"count,omitempty"`
}

// PoolSpec configures the prefill or the decode pool.
// +kubebuilder:validation:XValidation:rule="!has(self.resources) || !has(self.resources.limits) || !('nvidia.com/gpu' in self.resources.limits)",message="resources.limits may not set nvidia.com/gpu: the operator requests parallelism.tensor*data*pipeline GPUs"
// +kubebuilder:validation:XValidation:rule="!has(self.resources) || !has(self.resources.requests) || !('nvidia.com/gpu' in self.resources.requests)",message="resources.requests may not set nvidia.com/gpu: the operator requests parallelism.tensor*data*pipeline GPUs"
type PoolSpec struct {
	// replicas is the number of engine replicas in the pool (unset: 1) while
	// spec.scaling.<pool>.mode is Static. With External it is ignored, the pool's PoolScale
	// sets the count, and a value still written here draws an admission warning (it has no
	// default, so a value in Git can be told from none).
	// +kubebuilder:validation:Minimum=0
	// +optional
	Replicas *int32 `json:"replicas,omitempty"`

	// image overrides engine.image for this pool only, e.g. to roll a new vLLM build out to
	// decode first.
	// +optional
	Image string `json:"image,omitempty"`

	// parallelism is how each replica is split over GPUs.
	// +kubebuilder:default={}
	// +optional
	Parallelism Parallelism `json:"parallelism,omitempty"`

	// args are extra `vllm serve` arguments for this pool only, after engine.args.
	// +optional
	Args EngineArgs `json:"args,omitempty"`

	// resources of the engine container (CPU, memory, ...). GPUs are added by the operator.
	// +optional
	Resources corev1.ResourceRequirements `json:"resources,omitempty"`

	// nodeSelector constrains the pool to matching nodes.
	// +optional
	NodeSelector NodeSelector `json:"nodeSelector,omitempty"`

	// tolerations let the pool schedule onto tainted (e.g. GPU) nodes.
	// +optional
	// +listType=atomic
	Tolerations []corev1.Toleration `json:"tolerations,omitempty"`

	// rdma is the RDMA resource each pod requests; used only when kvTransfer.protocol is rdma.
	// +kubebuilder:default={}
	// +optional
	RDMA RDMASpec `json:"rdma,omitempty"`

	// pod holds this pool's pod settings; they win over engine.pod.
	// +optional
	Pod *PodSettings `json:"pod,omitempty"`

	// disruptionBudget, when set, gives the pool a PodDisruptionBudget: how many of its pods
	// voluntary disruptions (node drains, cluster upgrades) may take down at once. Unset: none
	// (and one the operator made before is deleted).
	// +optional
	DisruptionBudget *DisruptionBudget `json:"disruptionBudget,omitempty"`

	// drain is how a pod of this pool that is deleted (scale-down, rollout, eviction) finishes
	// what it holds before it stops: prefill the KV blocks decode has not pulled yet, decode
	// the requests it is answering.
	// +kubebuilder:default={}
	// +optional
	Drain DrainSpec `json:"drain,omitempty"`
}

// DrainSpec bounds a deleted engine pod's drain.
type DrainSpec struct {
	// timeoutSeconds is how long a deleted pod's engine may keep working after the router
	// stopped sending it requests: vLLM's --shutdown-timeout, for which it finishes running
	// requests and keeps a prefill's KV blocks until decode pulled them. The sidecar's preStop
	// waits as long for the held KV sends to reach 0, and the pod's grace period covers it.
	// 0 stops the engine at once (vLLM aborts what it holds: decode's pulls of it fail).
	// +kubebuilder:default=120
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=3600
	// +optional
	TimeoutSeconds *int32 `json:"timeoutSeconds,omitempty"`
}

// DisruptionBudget is a pool's PodDisruptionBudget: exactly one of maxUnavailable and
// minAvailable, each a number of pods or a percentage such as "25%".
// +kubebuilder:validation:XValidation:rule="has(self.maxUnavailable) != has(self.minAvailable)",message="set exactly one of maxUnavailable and minAvailable"
type DisruptionBudget struct {
	// maxUnavailable is how many of the pool's pods may be down at once.
	// +optional
	MaxUnavailable *intstr.IntOrString `json:"maxUnavailable,omitempty"`

	// minAvailable is how many of the pool's pods must stay up.
	// +optional
	MinAvailable *intstr.IntOrString `json:"minAvailable,omitempty"`
}

// PodSettings are settings of the engine pods the operator does not derive from the spec.
// Fields the operator owns (its environment variables, labels, annotations, volume names and
// mount paths) are refused at admission. The formats of env and volume names are checked when
// the operator renders the pods (status InvalidSpec names the field): a CEL rule on the names
// of core/v1 types, which carry no length limit, is past the API server's cost budget.
// +kubebuilder:validation:XValidation:rule="!has(self.env) || self.env.all(e, !(e.name in ['POD_IP', 'VLLM_HOST_IP', 'PDCLUSTER_CONNECTOR_URL', 'PYTHONPATH', 'VLLM_MOONCAKE_BOOTSTRAP_PORT', 'VLLM_NIXL_SIDE_CHANNEL_HOST', 'VLLM_NIXL_SIDE_CHANNEL_PORT', 'UCX_NET_DEVICES', 'HF_HOME', 'HF_TOKEN']))",message="env may not set POD_IP, VLLM_HOST_IP, PDCLUSTER_CONNECTOR_URL, PYTHONPATH, VLLM_MOONCAKE_BOOTSTRAP_PORT, VLLM_NIXL_SIDE_CHANNEL_HOST, VLLM_NIXL_SIDE_CHANNEL_PORT, UCX_NET_DEVICES, HF_HOME or HF_TOKEN: the operator sets them from the pod, model, kvTransfer and the connector"
// +kubebuilder:validation:XValidation:rule="!has(self.volumes) || self.volumes.all(v, !(v.name in ['dshm', 'connector-run', 'connector-ctl', 'completion-gate', 'model', 'hf-cache']))",message="volumes may not be named dshm, connector-run, connector-ctl, completion-gate, model or hf-cache: the operator's volumes have those names"
// +kubebuilder:validation:XValidation:rule="!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in ['/dev/shm', '/var/run/pdcluster', '/opt/pdgate/pdgate', '/models', '/var/cache/huggingface', '/dev/shm/', '/var/run/pdcluster/', '/opt/pdgate/pdgate/', '/models/', '/var/cache/huggingface/']))",message="volumeMounts may not use /dev/shm, /var/run/pdcluster, /opt/pdgate/pdgate, /models or /var/cache/huggingface: the operator mounts its volumes there"
// +kubebuilder:validation:XValidation:rule="!has(self.volumeMounts) || self.volumeMounts.all(m, m.name != 'connector-ctl')",message="volumeMounts may not mount connector-ctl: it holds the connector sidecar's control socket, which drains the pod"
// +kubebuilder:validation:XValidation:rule="!has(self.labels) || self.labels.all(k, !k.startsWith('app.kubernetes.io/') && !k.startsWith('serving.pdcluster.dev/'))",message="labels under app.kubernetes.io/ and serving.pdcluster.dev/ are the operator's: they select the pods"
// +kubebuilder:validation:XValidation:rule="!has(self.annotations) || self.annotations.all(k, !k.startsWith('serving.pdcluster.dev/'))",message="annotations under serving.pdcluster.dev/ are the operator's (the config and gate hashes that roll the pods)"
type PodSettings struct {
	// env is added to the engine container's environment (e.g. NCCL_DEBUG, VLLM_LOGGING_LEVEL).
	// +kubebuilder:validation:MaxItems=128
	// +listType=map
	// +listMapKey=name
	// +optional
	Env []corev1.EnvVar `json:"env,omitempty"`

	// envFrom adds every key of ConfigMaps or Secrets to the engine container's environment.
	// +kubebuilder:validation:MaxItems=16
	// +listType=atomic
	// +optional
	EnvFrom []corev1.EnvFromSource `json:"envFrom,omitempty"`

	// labels are added to the pods (not to their selector).
	// +kubebuilder:validation:MaxProperties=64
	// +optional
	Labels NodeSelector `json:"labels,omitempty"`

	// annotations are added to the pods, e.g. k8s.v1.cni.cncf.io/networks for an RDMA network.
	// +kubebuilder:validation:MaxProperties=64
	// +optional
	Annotations map[string]string `json:"annotations,omitempty"`

	// priorityClassName of the pods.
	// +kubebuilder:validation:MaxLength=253
	// +optional
	PriorityClassName string `json:"priorityClassName,omitempty"`

	// serviceAccountName the pods run as.
	// +kubebuilder:validation:MaxLength=253
	// +optional
	ServiceAccountName string `json:"serviceAccountName,omitempty"`

	// imagePullSecrets for the engine (and connector) images.
	// +kubebuilder:validation:MaxItems=16
	// +listType=atomic
	// +optional
	ImagePullSecrets []corev1.LocalObjectReference `json:"imagePullSecrets,omitempty"`

	// schedulerName schedules the pods (e.g. a gang scheduler).
	// +kubebuilder:validation:MaxLength=253
	// +optional
	SchedulerName string `json:"schedulerName,omitempty"`

	// volumes are added to the pods, for volumeMounts to use.
	// +kubebuilder:validation:MaxItems=32
	// +listType=map
	// +listMapKey=name
	// +optional
	Volumes []corev1.Volume `json:"volumes,omitempty"`

	// volumeMounts are added to the engine container.
	// +kubebuilder:validation:MaxItems=32
	// +listType=map
	// +listMapKey=mountPath
	// +optional
	VolumeMounts []corev1.VolumeMount `json:"volumeMounts,omitempty"`

	// affinity of the pods (e.g. spread decode replicas over racks, keep prefill near decode).
	// +optional
	Affinity *corev1.Affinity `json:"affinity,omitempty"`

	// topologySpreadConstraints of the pods; their label selectors may use the operator's pod
	// labels (serving.pdcluster.dev/cluster, serving.pdcluster.dev/role).
	// +kubebuilder:validation:MaxItems=8
	// +listType=atomic
	// +optional
	TopologySpreadConstraints []corev1.TopologySpreadConstraint `json:"topologySpreadConstraints,omitempty"`

	// terminationGracePeriodSeconds of the pods; at least the 15 s the router takes to stop
	// sending to a deleted pod. Unset: that, plus the pool's drain.timeoutSeconds and a margin.
	// A value set here wins, and a drain longer than it is cut short.
	// +kubebuilder:validation:Minimum=15
	// +kubebuilder:validation:Maximum=86400
	// +optional
	TerminationGracePeriodSeconds *int64 `json:"terminationGracePeriodSeconds,omitempty"`

	// shmSize bounds the memory-backed /dev/shm NCCL and vLLM's workers share (unset: no bound).
	// +optional
	ShmSize *resource.Quantity `json:"shmSize,omitempty"`
}

// NodeSelector selects nodes by label: label keys to label values.
// +kubebuilder:validation:MaxProperties=64
// +kubebuilder:validation:XValidation:rule="self.all(k, size(k) <= 317 && k.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$'))",message="nodeSelector keys must be label keys: an optional DNS prefix and '/', then up to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
type NodeSelector map[string]LabelValue

// LabelValue is a Kubernetes label value, as node selectors match them.
// +kubebuilder:validation:MaxLength=63
// +kubebuilder:validation:XValidation:rule="self.matches('^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$')",message="must be a label value: up to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
type LabelValue string

// RouterSpec configures the P/D router in front of the pools.
// +kubebuilder:validation:XValidation:rule="!has(self.routing) || !has(self.routing.strategy) || self.routing.strategy == 'LeastInFlight' || !has(self.balance) || self.balance == 'least-in-flight'",message="routing.strategy PrefixAware or KVEvents bounds each engine's load by the router's requests in flight on it: it needs balance least-in-flight, not round-robin",fieldPath=".routing.strategy"
type RouterSpec struct {
	// replicas is the number of router replicas.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=0
	// +optional
	Replicas *int32 `json:"replicas,omitempty"`

	// resources of the router container. Default: requests of 100m CPU and 128Mi memory, a
	// limit of 1Gi memory. The router keeps its Go heap under 90% of its memory limit and holds
	// at most a quarter of it in request bodies (each counted four times, its copies; 503 with
	// Retry-After past it) and 3/16 of it in each pool's KVEvents index; without a limit, the
	// node's memory stands for it.
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`

	// maxRequestBody is the largest request body the router takes (413 past it). Default 8Mi:
	// a prompt of a million tokens sent as token ids, or several million as text; raise it for
	// images sent inline as base64. 1Ki to 1Gi.
	// +optional
	MaxRequestBody *resource.Quantity `json:"maxRequestBody,omitempty"`

	// nodeSelector constrains the router to matching nodes (it needs no GPU).
	// +optional
	NodeSelector NodeSelector `json:"nodeSelector,omitempty"`

	// tolerations let the router schedule onto tainted nodes.
	// +optional
	// +listType=atomic
	Tolerations []corev1.Toleration `json:"tolerations,omitempty"`

	// balance is how the router picks a prefill and a decode engine for each request:
	// least-in-flight (the engines with the fewest of its requests in flight, so a slow or
	// busy engine gets fewer) or round-robin (in turns).
	// +kubebuilder:default=least-in-flight
	// +optional
	Balance RouterBalance `json:"balance,omitempty"`

	// failurePolicy is what the router does when a leg fails: which failures are retried on
	// another endpoint, within which budgets, how long a failed endpoint is left out, and how
	// long a request may wait for its first token. docs/router-failure-policy.md has the
	// failure table.
	// +kubebuilder:default={}
	// +optional
	FailurePolicy RouterFailurePolicy `json:"failurePolicy,omitempty"`

	// routing is whether the router weighs what the engines hold of each request's prompt:
	// LeastInFlight (the default) picks by balance alone; PrefixAware sends a request, in each
	// pool, to the engine the router sent the longest start of its prompt before (its prefix
	// cache likely holds it: prefill skips computing it, decode pulls fewer blocks), within a
	// load bound; KVEvents does so from the engines' own KV cache events for prompts given as
	// token ids. docs/routing.md says when to pick which.
	// +kubebuilder:default={}
	// +optional
	Routing RouterRouting `json:"routing,omitempty"`
}

// RoutingStrategy is whether the router weighs what the engines hold of a prompt.
// +kubebuilder:validation:Enum=LeastInFlight;PrefixAware;KVEvents
type RoutingStrategy string

const (
	// RoutingLeastInFlight picks by spec.router.balance alone, whatever the engines hold.
	RoutingLeastInFlight RoutingStrategy = "LeastInFlight"
	// RoutingPrefixAware picks the engine that was sent the longest start of the prompt,
	// unless it is loadSlack requests past the least loaded engine.
	RoutingPrefixAware RoutingStrategy = "PrefixAware"
	// RoutingKVEvents picks the engine whose own KV cache events say it holds the longest
	// start of the prompt's token ids, as far as the router sent it that start, within the same
	// load bound; PrefixAware's estimate for text prompts and while an engine's events cannot
	// be trusted.
	RoutingKVEvents RoutingStrategy = "KVEvents"
)

// RouterRouting is how the router weighs what the engines hold of a prompt.
// +kubebuilder:validation:XValidation:rule="!has(self.prefixAware) || (has(self.strategy) && (self.strategy == 'PrefixAware' || self.strategy == 'KVEvents'))",message="prefixAware tunes strategies PrefixAware and KVEvents: set one of them, or remove prefixAware",fieldPath=".prefixAware"
// +kubebuilder:validation:XValidation:rule="!has(self.kvEvents) || (has(self.strategy) && self.strategy == 'KVEvents')",message="kvEvents tunes strategy KVEvents: set strategy: KVEvents, or remove kvEvents",fieldPath=".kvEvents"
type RouterRouting struct {
	// strategy: LeastInFlight picks by spec.router.balance alone. PrefixAware remembers, for
	// each engine, the starts of the prompts the router sent it, in chunks of the prompt's
	// bytes (no tokenizer; a chat's messages as the client wrote them), and sends a request to
	// the engine that holds the most leading chunks of its prompt, the less loaded of equals;
	// an engine with more than prefixAware.loadSlack of the router's requests in flight above
	// the least loaded one is passed over (pdcluster_router_prefix_load_bound_total counts
	// it). The share of prompt the picked engines held is
	// pdcluster_router_prefix_matched_chunks_total over pdcluster_router_prefix_prompt_chunks_total.
	// KVEvents has every engine publish its KV cache events (vLLM's --kv-events-config, a
	// ZeroMQ publisher that only the router's pods may reach) and keeps, per engine, the
	// blocks the engine says it holds, by their token ids: a completion whose prompt is token
	// ids goes to the engine holding the most leading blocks of it, within the same load
	// bound, an engine's claim counting only as far as this router sent it the prompt (by
	// PrefixAware's record: an engine's events are its own word;
	// pdcluster_router_kv_events_unvouched_blocks_total counts the rest); a text prompt or a chat (the router has no tokenizer), and a pool with an engine
	// whose events are not connected or were lost in the last minute, are routed as
	// PrefixAware routes them (pdcluster_router_kv_events_estimated_total counts why). Not
	// for pools whose replicas span pods.
	// +kubebuilder:default=LeastInFlight
	// +optional
	Strategy RoutingStrategy `json:"strategy,omitempty"`

	// prefixAware tunes PrefixAware, and KVEvents' estimate and load bound; each unset field
	// takes its default.
	// +optional
	PrefixAware *PrefixAwareRouting `json:"prefixAware,omitempty"`

	// kvEvents tunes KVEvents; each unset field takes its default.
	// +optional
	KVEvents *KVEventsRouting `json:"kvEvents,omitempty"`
}

// KVEventsRouting sizes KVEvents' index of what each engine holds.
type KVEventsRouting struct {
	// blocksPerEngine is how many KV blocks the router keeps per engine and data-parallel
	// rank (at most 160 bytes of router memory each); past it, entries are dropped at random:
	// 262144 by default, more than one GPU's KV cache holds in 16-token blocks. Each pool's
	// index holds at most 3/16 of the router's memory limit over all its engines (past it the
	// engine holding the most gives up a block, counted in
	// pdcluster_router_kv_events_index_evicted_blocks_total), and one engine's blocks must fit
	// in that: 1258291 blocks with the router's default 1Gi limit.
	// +kubebuilder:validation:Minimum=1024
	// +kubebuilder:validation:Maximum=16777216
	// +optional
	BlocksPerEngine *int32 `json:"blocksPerEngine,omitempty"`
}

// PrefixAwareRouting sizes PrefixAware's memory of what each engine was sent, and its load
// bound.
type PrefixAwareRouting struct {
	// chunkBytes is the bytes of prompt per chunk, the unit of a match (a last partial chunk
	// does not count): 64 by default, about 16 tokens of English text, one vLLM block.
	// +kubebuilder:validation:Minimum=16
	// +kubebuilder:validation:Maximum=4096
	// +optional
	ChunkBytes *int32 `json:"chunkBytes,omitempty"`

	// maxChunks is how many of a prompt's chunks count (its first maxChunks x chunkBytes
	// bytes), which bounds the router's work per request: 256 by default.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=4096
	// +optional
	MaxChunks *int32 `json:"maxChunks,omitempty"`

	// chunksPerEngine is how many chunks the router remembers per engine, the least recently
	// sent forgotten first (about 40 bytes of router memory each): 31250 by default.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=4000000
	// +optional
	ChunksPerEngine *int32 `json:"chunksPerEngine,omitempty"`

	// loadSlack is how many more of the router's requests in flight than the least loaded
	// engine an engine may have and still be picked for what it holds: 0 keeps the load even
	// and the cache hits fewer; 2 by default.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=10000
	// +optional
	LoadSlack *int32 `json:"loadSlack,omitempty"`
}

// OnPrefillFailure is what the router does once a request's prefill cannot be served.
// +kubebuilder:validation:Enum=Retry;Fail;DecodeOnly
type OnPrefillFailure string

const (
	// OnPrefillFailureRetry retries on another prefill endpoint within the budgets, then
	// fails the request.
	OnPrefillFailureRetry OnPrefillFailure = "Retry"
	// OnPrefillFailureFail fails the request at the first prefill failure.
	OnPrefillFailureFail OnPrefillFailure = "Fail"
	// OnPrefillFailureDecodeOnly retries as Retry does, then sends the request to decode
	// alone, which computes the prompt itself (counted in pdcluster_router_decode_only_total).
	OnPrefillFailureDecodeOnly OnPrefillFailure = "DecodeOnly"
)

// RouterFailurePolicy is how the router handles a failed leg. Only a failure that says the
// chosen endpoint is not there or not serving (connection refused or reset, the Mooncake
// bootstrap server unreachable or empty, an answer 503), seen before the client got a byte, is
// retried, on another endpoint of the same pool; an engine's own error answer (4xx, 500) is
// its verdict on the request and is never sent to the next engine.
type RouterFailurePolicy struct {
	// retries bounds the retries of one request, over both legs.
	// +kubebuilder:default=2
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=10
	// +optional
	Retries *int32 `json:"retries,omitempty"`

	// retryBudgetPercent bounds each router replica's retries to this share of its requests
	// over the last 10 seconds (with a floor of 3 retries), so that a sick pool's load is not
	// multiplied by retries. 0 turns retries off.
	// +kubebuilder:default=20
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	RetryBudgetPercent *int32 `json:"retryBudgetPercent,omitempty"`

	// ejectSeconds is how long an endpoint that failed that way is left out of the router's
	// picks, at once rather than at the next resolution of the pools. One that was not there
	// (refused, reset, bootstrap down) comes back as soon as its health check answers. The
	// last endpoint of a pool not left out already is never left out: it serves on.
	// +kubebuilder:default=10
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=3600
	// +optional
	EjectSeconds *int32 `json:"ejectSeconds,omitempty"`

	// consecutiveFailures is how many failures in a row leave an endpoint out for ejectSeconds:
	// answers that say it is not serving (503), connections broken mid-answer, and hangs past
	// firstTokenTimeoutSeconds; an answer in between starts the count again. An endpoint that
	// refuses connections, or whose bootstrap server does, is left out at the first: nothing
	// is there, and its health check brings it back as soon as something is.
	// +kubebuilder:default=3
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +optional
	ConsecutiveFailures *int32 `json:"consecutiveFailures,omitempty"`

	// firstTokenTimeoutSeconds fails a request whose first byte has not come from decode in
	// this long (for a request that does not stream, its whole answer) with a 504 of type
	// first_token_timeout naming the engine that hung, cancelling both legs; the hang counts
	// toward that engine's consecutiveFailures. Unset: streaming requests get 60 s plus a
	// second per 100 tokens of the engines' --max-model-len (a prefill of the longest prompt
	// at 100 tokens/s; 300 s without --max-model-len), at most 600; a request that does not
	// stream waits up to the router's own 10 minutes for its answer.
	// +kubebuilder:validation:Minimum=1
	// +optional
	FirstTokenTimeoutSeconds *int32 `json:"firstTokenTimeoutSeconds,omitempty"`

	// onPrefillFailure is what happens once prefill cannot serve a request: Retry (on another
	// prefill endpoint, then fail), Fail (at once), or DecodeOnly (retry, then send the
	// request to decode alone, which recomputes the prompt; needs
	// kvTransfer.loadFailurePolicy recompute, the same trade of compute for availability).
	// +kubebuilder:default=Retry
	// +optional
	OnPrefillFailure OnPrefillFailure `json:"onPrefillFailure,omitempty"`
}

// ConnectorSpec configures the connector sidecar the operator runs beside every prefill and
// decode engine. vLLM moves the KV itself (its Mooncake or NIXL transfer engine) and runs the
// completion gate in-process; the sidecar hears the gate's heartbeat on a socket on the pod's
// own volume, answers the readiness probe (unready while the gate is silent) and exports the
// gate's counts. It moves no KV and holds no KV memory.
type ConnectorSpec struct {
	// image of the connector sidecar. Defaults to the operator's --connector-image.
	// +optional
	Image string `json:"image,omitempty"`

	// resources of the connector container.
	// +optional
	Resources corev1.ResourceRequirements `json:"resources,omitempty"`

	// health says when the operator restarts a pod whose connector is unhealthy.
	// +kubebuilder:default={}
	// +optional
	Health ConnectorHealthPolicy `json:"health,omitempty"`
}

// ConnectorHealthPolicy: the kubelet probes the connector's /readyz every periodSeconds; a pod
// whose connector has not been ready for failureThreshold*periodSeconds is restarted (deleted
// and recreated by its Deployment). Restarts back off exponentially from initialBackoffSeconds
// to maxBackoffSeconds while connectors stay unhealthy, and at most restartBudget restart rounds
// happen in any budgetWindowSeconds.
// +kubebuilder:validation:XValidation:rule="!has(self.initialBackoffSeconds) || !has(self.maxBackoffSeconds) || self.maxBackoffSeconds >= self.initialBackoffSeconds",message="maxBackoffSeconds must be at least initialBackoffSeconds"
type ConnectorHealthPolicy struct {
	// periodSeconds between two readiness checks of the connector.
	// +kubebuilder:default=10
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=300
	// +optional
	PeriodSeconds *int32 `json:"periodSeconds,omitempty"`

	// failureThreshold is how many periods a connector may stay unready before its pod is restarted.
	// +kubebuilder:default=3
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +optional
	FailureThreshold *int32 `json:"failureThreshold,omitempty"`

	// initialBackoffSeconds is the wait after a restart round before the next one; it doubles
	// with each further round until connectors are healthy again.
	// +kubebuilder:default=30
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=86400
	// +optional
	InitialBackoffSeconds *int32 `json:"initialBackoffSeconds,omitempty"`

	// maxBackoffSeconds caps the backoff between restart rounds.
	// +kubebuilder:default=600
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=86400
	// +optional
	MaxBackoffSeconds *int32 `json:"maxBackoffSeconds,omitempty"`

	// gateStartupGraceSeconds is how long a connector stays ready after it starts without
	// hearing the engine's completion gate (vLLM loads the model first); after it, and whenever
	// the gate's heartbeat stops, the connector is unready, its pod is restarted as above, and
	// the CompletionGated condition names the pod. Unset: 900 (15 minutes). Only with
	// kvTransfer.completionGate Enabled.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=86400
	// +optional
	GateStartupGraceSeconds *int32 `json:"gateStartupGraceSeconds,omitempty"`

	// restartBudget is the most restart rounds in any budgetWindowSeconds; when it is spent the
	// operator stops restarting and reports RestartBudgetExhausted. 0 disables restarts.
	// +kubebuilder:default=5
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	RestartBudget *int32 `json:"restartBudget,omitempty"`

	// budgetWindowSeconds is the sliding window restartBudget counts over.
	// +kubebuilder:default=3600
	// +kubebuilder:validation:Minimum=60
	// +kubebuilder:validation:Maximum=604800
	// +optional
	BudgetWindowSeconds *int32 `json:"budgetWindowSeconds,omitempty"`

	// restartDecodeWithPrefill restarts the decode pods too when a prefill pod is restarted: the
	// router spreads requests over every prefill and decode pair, so every decode connector holds
	// transfers with every prefill pod.
	// +kubebuilder:default=true
	// +optional
	RestartDecodeWithPrefill *bool `json:"restartDecodeWithPrefill,omitempty"`

	// decodeCascadeBudget is the most restart rounds in any budgetWindowSeconds that take decode
	// pods along with a prefill pod (restartDecodeWithPrefill). Past it a prefill pod restarts
	// alone and the decode pods keep serving (their transfers with it fail and are retried), so
	// a prefill pod that keeps failing, or is made to, cannot restart the decode pool again and
	// again. status.connector.recentCascadeRounds counts it. 0: decode pods never restart with
	// a prefill pod.
	// +kubebuilder:default=2
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	DecodeCascadeBudget *int32 `json:"decodeCascadeBudget,omitempty"`
}

// PDClusterSpec is the desired state of a disaggregated prefill/decode deployment.
// +kubebuilder:validation:XValidation:rule="!has(self.router) || !has(self.router.routing) || !has(self.router.routing.strategy) || self.router.routing.strategy != 'KVEvents' || !has(self.engine.enablePrefixCaching) || self.engine.enablePrefixCaching",message="router.routing.strategy KVEvents routes by the blocks the engines' prefix caches hold: it needs engine.enablePrefixCaching true",fieldPath=".router.routing.strategy"
// +kubebuilder:validation:XValidation:rule="!has(self.router) || !has(self.router.routing) || !has(self.router.routing.strategy) || self.router.routing.strategy != 'KVEvents' || ((!has(self.prefill) || !has(self.prefill.parallelism) || !has(self.prefill.parallelism.nodes) || self.prefill.parallelism.nodes == 1) && (!has(self.decode) || !has(self.decode.parallelism) || !has(self.decode.parallelism.nodes) || self.decode.parallelism.nodes == 1))",message="router.routing.strategy KVEvents follows each pod's engines on ports numbered by data-parallel rank, which a replica across pods (parallelism.nodes above 1) numbers from its first pod: use PrefixAware for such pools",fieldPath=".router.routing.strategy"
// +kubebuilder:validation:XValidation:rule="!has(self.router) || !has(self.router.failurePolicy) || !has(self.router.failurePolicy.onPrefillFailure) || self.router.failurePolicy.onPrefillFailure != 'DecodeOnly' || (has(self.kvTransfer) && has(self.kvTransfer.loadFailurePolicy) && self.kvTransfer.loadFailurePolicy == 'recompute')",message="router.failurePolicy.onPrefillFailure DecodeOnly lets decode recompute prompts, which kvTransfer.loadFailurePolicy fail forbids: set loadFailurePolicy: recompute, or onPrefillFailure: Retry",fieldPath=".router.failurePolicy.onPrefillFailure"
type PDClusterSpec struct {
	// model is the model both pools serve.
	Model ModelSpec `json:"model"`

	// engine is the vLLM engine configuration shared by both pools.
	Engine EngineSpec `json:"engine"`

	// kvTransfer configures how the KV cache moves from prefill to decode.
	// +kubebuilder:default={}
	// +optional
	KVTransfer KVTransferSpec `json:"kvTransfer,omitempty"`

	// prefill is the kv_producer pool.
	// +kubebuilder:default={}
	// +optional
	Prefill PoolSpec `json:"prefill,omitempty"`

	// decode is the kv_consumer pool.
	// +kubebuilder:default={}
	// +optional
	Decode PoolSpec `json:"decode,omitempty"`

	// scaling says who sets each pool's replica count (spec.<pool>.replicas or an autoscaler)
	// and bounds the counts and their P:D ratio.
	// +kubebuilder:default={}
	// +optional
	Scaling ScalingSpec `json:"scaling,omitempty"`

	// scheduling places the engine pods: which domain pairs a request's prefill and decode,
	// and whether a replica across pods is scheduled all at once.
	// +kubebuilder:default={}
	// +optional
	Scheduling SchedulingSpec `json:"scheduling,omitempty"`

	// rollout paces the rollouts of both pools: a new KV revision in lockstep, other changes in
	// place.
	// +kubebuilder:default={}
	// +optional
	Rollout RolloutSpec `json:"rollout,omitempty"`

	// router is the P/D proxy in front of both pools.
	// +kubebuilder:default={}
	// +optional
	Router RouterSpec `json:"router,omitempty"`

	// connector is the completion-gated connector sidecar of every prefill and decode pod.
	// +kubebuilder:default={}
	// +optional
	Connector ConnectorSpec `json:"connector,omitempty"`

	// networkPolicy isolates this PDCluster's pods: only its router reaches the engines' API,
	// only its own pools reach each other's transfer ports, only the operator's manager pods
	// the connector sidecars; the engines connect only to the other pool, DNS and public HTTPS
	// (egress). The router stays open to every client unless narrowed here.
	// +kubebuilder:default={}
	// +optional
	NetworkPolicy NetworkPolicySpec `json:"networkPolicy,omitempty"`
}

// NetworkPolicySpec shapes the NetworkPolicies of a PDCluster (one per pool and one for the
// router, named like their Deployments). They admit traffic; they take effect where the
// cluster runs a NetworkPolicy implementation.
type NetworkPolicySpec struct {
	// enabled renders the NetworkPolicies; false deletes them and leaves the pods open to every
	// pod of the cluster network.
	// +kubebuilder:default=true
	// +optional
	Enabled *bool `json:"enabled,omitempty"`

	// routerClients may reach the router's port (8000). Empty: every pod and address (the
	// router is the PDCluster's front door). Its metrics port (9090: /metrics and the counts
	// the operator reads) admits only the operator and monitoring, never its clients.
	// +kubebuilder:validation:MaxItems=16
	// +optional
	RouterClients []networkingv1.NetworkPolicyPeer `json:"routerClients,omitempty"`

	// engineClients may reach the engines' OpenAI port directly, besides this PDCluster's
	// router (a benchmark harness, say). A client that sends kv_transfer_params there steers
	// the engines' KV transfers, so keep this to trusted pods.
	// +kubebuilder:validation:MaxItems=16
	// +optional
	EngineClients []networkingv1.NetworkPolicyPeer `json:"engineClients,omitempty"`

	// monitoring may reach the metrics ports: the engines' HTTP port (8000), the connector
	// sidecars' port (8190) and the router's metrics port (9090), e.g. a Prometheus namespace.
	// +kubebuilder:validation:MaxItems=16
	// +optional
	Monitoring []networkingv1.NetworkPolicyPeer `json:"monitoring,omitempty"`

	// egress limits where the prefill and decode pods may connect (with enabled). A decode
	// engine fetches whatever remote_bootstrap_addr a request carries, so a pod that can forge
	// one (a compromised prefill, a client of engineClients) could otherwise make it reach any
	// address the cluster network reaches: other namespaces' services, a cloud's metadata
	// server.
	// +kubebuilder:default={}
	// +optional
	Egress EngineEgressSpec `json:"egress,omitempty"`
}

// EngineEgressSpec is the egress half of the engine pods' NetworkPolicies. With enabled, an
// engine pod may connect to: every port of the other pool of this PDCluster (vLLM's transfer
// engines), port 53 anywhere (DNS), HTTPS to public addresses (publicHTTPS) and the rules of
// allow. The router's egress is not limited (it reaches only what its pools' Services name).
type EngineEgressSpec struct {
	// enabled renders the egress rules; false leaves the engine pods free to connect anywhere
	// (the NetworkPolicies still limit who reaches them).
	// +kubebuilder:default=true
	// +optional
	Enabled *bool `json:"enabled,omitempty"`

	// publicHTTPS lets the engine pods open HTTPS (port 443) to every address outside the
	// private, shared, loopback and link-local ranges (10/8, 172.16/12, 192.168/16, 100.64/10,
	// 127/8, 169.254/16; fc00::/7, fe80::/10, ::1): the Hugging Face Hub, which vLLM downloads
	// from when the weights are on no volume, and public object stores. The cluster's own pods
	// and Services (on private ranges in nearly every cluster) and a cloud's metadata server
	// stay closed. Set false when the weights are on a pvc or hostPath and nothing downloads.
	// +kubebuilder:default=true
	// +optional
	PublicHTTPS *bool `json:"publicHTTPS,omitempty"`

	// allow adds destinations the engine pods may reach, as NetworkPolicy egress rules: an
	// in-cluster S3 endpoint or registry mirror holding the weights (a podSelector with a
	// namespaceSelector, or an ipBlock, and its port), a tracing collector.
	// +kubebuilder:validation:MaxItems=16
	// +optional
	Allow []networkingv1.NetworkPolicyEgressRule `json:"allow,omitempty"`
}

// PoolStatus is the observed state of one pool.
type PoolStatus struct {
	// replicas is the number of replicas the pool runs (its Deployment's): requestedReplicas
	// within spec.scaling's bounds and ratio.
	// +optional
	Replicas int32 `json:"replicas"`
	// requestedReplicas is what the pool's scaler asks: spec.<pool>.replicas, or the PoolScale's
	// spec.replicas with spec.scaling.<pool>.mode External. Absent for the router.
	// +optional
	RequestedReplicas *int32 `json:"requestedReplicas,omitempty"`
	// readyReplicas is the number of replicas whose pods are ready.
	// +optional
	ReadyReplicas int32 `json:"readyReplicas"`
	// updatedReplicas is the number of replicas running the current pod template.
	// +optional
	UpdatedReplicas int32 `json:"updatedReplicas"`
	// ready is readyReplicas/replicas, for printing.
	// +optional
	Ready string `json:"ready,omitempty"`
	// connectorRestarts counts the pods of this pool the operator restarted for connector health.
	// +optional
	ConnectorRestarts int32 `json:"connectorRestarts,omitempty"`
	// gate sums what the completion gate of this pool's running engines reported to their
	// sidecars (refreshed about every minute). Absent while the gate is disabled or no
	// sidecar was read.
	// +optional
	Gate *PoolGateStatus `json:"gate,omitempty"`
}

// PoolGateStatus sums the completion-gate counts of a pool's engines, each since its engine
// started (a restarted engine starts again from zero).
type PoolGateStatus struct {
	// reportingPods are the pods whose gate heartbeats now.
	ReportingPods int32 `json:"reportingPods"`
	// silentPods are running pods whose sidecar answered but whose gate does not heartbeat
	// (not loaded yet, or stopped).
	// +optional
	SilentPods int32 `json:"silentPods,omitempty"`
	// gatedCompletions are finished-receiving reports of pulls with no local block that the
	// gate kept from vLLM's scheduler (each would have killed a decode engine).
	GatedCompletions int64 `json:"gatedCompletions"`
	// passedCompletions are finished-receiving reports the gate passed on.
	PassedCompletions int64 `json:"passedCompletions"`
	// failedPulls are failed pulls with local blocks the gate saw reported to vLLM's scheduler.
	// +optional
	FailedPulls int64 `json:"failedPulls,omitempty"`
}

// UnhealthyPod is an engine pod whose connector is not ready.
type UnhealthyPod struct {
	// name of the pod.
	Name string `json:"name"`
	// since is when the operator first saw the connector unready, or when the connector last
	// started if that is later.
	Since metav1.Time `json:"since"`
}

// ConnectorStatus is the operator's record of connector health and restarts.
type ConnectorStatus struct {
	// restarts counts every pod restarted for connector health (both pools).
	// +optional
	Restarts int32 `json:"restarts"`
	// containerRestarts sums the kubelet's restarts of the connector container (failed
	// liveness, crashes) over the current engine pods.
	// +optional
	ContainerRestarts int32 `json:"containerRestarts,omitempty"`
	// unhealthyPods are the pods whose connector is not ready now, with the time each restart
	// threshold counts from.
	// +optional
	// +listType=map
	// +listMapKey=name
	UnhealthyPods []UnhealthyPod `json:"unhealthyPods,omitempty"`
	// consecutiveRounds counts restart rounds since the connectors were last all healthy; it
	// sets the backoff before the next round.
	// +optional
	ConsecutiveRounds int32 `json:"consecutiveRounds,omitempty"`
	// lastRestartTime is when the last restart round happened.
	// +optional
	LastRestartTime *metav1.Time `json:"lastRestartTime,omitempty"`
	// recentRounds are the times of the restart rounds inside the budget window.
	// +optional
	// +listType=atomic
	RecentRounds []metav1.Time `json:"recentRounds,omitempty"`
	// decodeCascadeRestarts counts the decode pods restarted because a prefill pod of their KV
	// revision was (restartDecodeWithPrefill); restarts includes them.
	// +optional
	DecodeCascadeRestarts int32 `json:"decodeCascadeRestarts,omitempty"`
	// recentCascadeRounds are the times of the rounds inside the budget window that restarted
	// decode pods along with a prefill pod; spec.connector.health.decodeCascadeBudget bounds
	// them.
	// +optional
	// +listType=atomic
	RecentCascadeRounds []metav1.Time `json:"recentCascadeRounds,omitempty"`
}

// PDClusterStatus is the observed state of a PDCluster.
type PDClusterStatus struct {
	// observedGeneration is the spec generation the status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// conditions: Ready, PrefillReady, DecodeReady, RouterReady, ConnectorHealthy, CompletionGated,
	// KVTransferVerified, Progressing.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +patchStrategy=merge
	// +patchMergeKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty" patchStrategy:"merge" patchMergeKey:"type"`

	// prefill is the observed state of the prefill pool.
	// +optional
	Prefill PoolStatus `json:"prefill,omitempty"`

	// decode is the observed state of the decode pool.
	// +optional
	Decode PoolStatus `json:"decode,omitempty"`

	// router is the observed state of the router.
	// +optional
	Router PoolStatus `json:"router,omitempty"`

	// connector is the health and restart record of the connector sidecars.
	// +optional
	Connector ConnectorStatus `json:"connector,omitempty"`

	// kvTransfer is the evidence that KV moves from prefill to decode, over the last
	// kvTransfer.verification.windowSeconds; absent when verification is Disabled.
	// +optional
	KVTransfer *KVTransferStatus `json:"kvTransfer,omitempty"`

	// updateRevision is the KV revision of the current spec: a hash of only what decides
	// whether decode can read prefill's KV (both pools' images, the model, its path and
	// revision, block size, dtype and KV-cache dtype, the kvTransfer stanza, both pools'
	// tensor and pipeline parallelism, the completion gate plugin). The engine pods carry it
	// in the serving.pdcluster.dev/kv-revision label.
	// +optional
	UpdateRevision string `json:"updateRevision,omitempty"`

	// currentRevision is the KV revision every engine pod of both pools served when the last
	// rollout completed. While it differs from updateRevision (condition Progressing), pods of
	// both revisions run.
	// +optional
	CurrentRevision string `json:"currentRevision,omitempty"`

	// revisions are the KV revisions the engine pods run now, older first and updateRevision
	// last, with each pool's pods and ready pods: during a rollout, how far it has come.
	// +listType=map
	// +listMapKey=revision
	// +kubebuilder:validation:MaxItems=16
	// +optional
	Revisions []RevisionStatus `json:"revisions,omitempty"`

	// pairing is how the routers paired requests across topology domains
	// (spec.scheduling.pairing).
	// +optional
	Pairing *PairingStatus `json:"pairing,omitempty"`

	// routing is how much of the prompts the engines the routers picked already held
	// (spec.router.routing.strategy PrefixAware or KVEvents), by pool, since the routers
	// started.
	// +optional
	Routing *RoutingStatus `json:"routing,omitempty"`
}

// RoutingStatus is what the routers' routing strategy found the picked engines holding.
type RoutingStatus struct {
	// prefill is the prefill pool's, decode the decode pool's.
	Prefill PoolRoutingStatus `json:"prefill"`
	Decode  PoolRoutingStatus `json:"decode"`
}

// PoolRoutingStatus is one pool's share of the prompts held by the engines picked.
type PoolRoutingStatus struct {
	// heldPercent is the share of the prompts routed that the picked engines held: of the
	// full KV blocks of token-id prompts, by the engines' own events, with KVEvents; else of
	// the prompt chunks the router had sent them (PrefixAware's estimate). Absent before the
	// first prompt long enough to count.
	// +optional
	HeldPercent *int32 `json:"heldPercent,omitempty"`
	// promptBlocks and heldBlocks are the full KV blocks of the token-id prompts routed by
	// the engines' events and those the picked engines held (KVEvents).
	// +optional
	PromptBlocks int64 `json:"promptBlocks,omitempty"`
	// +optional
	HeldBlocks int64 `json:"heldBlocks,omitempty"`
	// promptChunks and heldChunks are the prompt chunks routed by the estimate and those the
	// router had sent the picked engines before.
	// +optional
	PromptChunks int64 `json:"promptChunks,omitempty"`
	// +optional
	HeldChunks int64 `json:"heldChunks,omitempty"`
	// indexBlocks are the KV blocks the pool's engines' events say they hold, as the routers
	// index them (the largest router's index; KVEvents).
	// +optional
	IndexBlocks int64 `json:"indexBlocks,omitempty"`
	// eventsLagMilliseconds is the longest an engine's latest KV event batch took to reach a
	// router (KVEvents): the index is that far behind the engines' caches.
	// +optional
	EventsLagMilliseconds int64 `json:"eventsLagMilliseconds,omitempty"`
}

// PairingStatus counts the routers' pairs by locality since they started.
type PairingStatus struct {
	// domains are the values of the topology key on the cluster's nodes.
	Domains int32 `json:"domains"`
	// sameDomainPairs and crossDomainPairs are the prefill-decode pairs the running routers
	// made within one domain and across two.
	SameDomainPairs  int64 `json:"sameDomainPairs"`
	CrossDomainPairs int64 `json:"crossDomainPairs"`
	// sameDomainPercent is the share of pairs within one domain; absent before the first.
	// +optional
	SameDomainPercent *int32 `json:"sameDomainPercent,omitempty"`
}

// RevisionStatus is one KV revision's engine pods.
type RevisionStatus struct {
	// revision is the KV revision (the pods' serving.pdcluster.dev/kv-revision label; empty for
	// pods made before the label existed).
	Revision string `json:"revision"`
	// prefill and decode count the pool's pods of this revision.
	Prefill RevisionPods `json:"prefill"`
	Decode  RevisionPods `json:"decode"`
	// trafficPercent is the share of new requests the routers send to this revision: its
	// ready pods' share of the ready pods of the revisions that have one in both pools
	// (a revision missing a pool serves nothing).
	TrafficPercent int32 `json:"trafficPercent"`
}

// RevisionPods counts one pool's pods of a revision.
type RevisionPods struct {
	// desired is what the revision's Deployment of the pool asks now (a rollout steps it).
	Desired int32 `json:"desired"`
	// pods are the running pods (not being deleted); ready those that are ready.
	Pods  int32 `json:"pods"`
	Ready int32 `json:"ready"`
}

// KVTransferStatus is what the decode engines counted over the verification window.
type KVTransferStatus struct {
	// externalSharePercent is the share of the prompt tokens decode computed or received that
	// it received from prefill; absent without traffic in the window.
	// +optional
	ExternalSharePercent *int32 `json:"externalSharePercent,omitempty"`

	// externalTokens are the prompt tokens decode received from prefill in the window.
	// +optional
	ExternalTokens int64 `json:"externalTokens,omitempty"`

	// localComputeTokens are the prompt tokens decode computed itself in the window.
	// +optional
	LocalComputeTokens int64 `json:"localComputeTokens,omitempty"`

	// failedPulls are the KV pulls that failed in the window: the completion gate's failed
	// pulls with local blocks, or the connector's failed transfers when the gate is disabled.
	// +optional
	FailedPulls int64 `json:"failedPulls,omitempty"`

	// expiredRequests are prefill requests whose held KV expired before decode pulled it
	// (vLLM's abort timeout), in the window.
	// +optional
	ExpiredRequests int64 `json:"expiredRequests,omitempty"`

	// transferMBps is the KV transfer rate the engines measured in the window: bytes moved
	// over their transfer time, in MB/s; absent when no transfer was timed.
	// +optional
	TransferMBps *int64 `json:"transferMBps,omitempty"`

	// lastCanary is the newest canary request a router reported (mode Canary).
	// +optional
	LastCanary *CanaryResult `json:"lastCanary,omitempty"`

	// recomputingPods are the decode pods whose own share was below the minimum.
	// +listType=set
	// +kubebuilder:validation:MaxItems=64
	// +optional
	RecomputingPods []string `json:"recomputingPods,omitempty"`
}

// CanaryResult is one canary request a router sent through the P/D path.
type CanaryResult struct {
	// time is when the canary's answer came.
	Time metav1.Time `json:"time"`

	// router is the router pod that sent it.
	Router string `json:"router"`

	// result is External (decode received the prompt's KV from prefill), Recomputed (decode
	// computed it) or Failed (the request did not succeed, or decode's counts could not be read).
	// +kubebuilder:validation:Enum=External;Recomputed;Failed
	Result CanaryOutcome `json:"result"`

	// promptTokens and externalTokens are the canary's prompt tokens and how many of them the
	// decode engine counted as received from prefill while it answered.
	// +optional
	PromptTokens int64 `json:"promptTokens,omitempty"`
	// +optional
	ExternalTokens int64 `json:"externalTokens,omitempty"`

	// message says what happened (the error of a failed canary).
	// +optional
	Message string `json:"message,omitempty"`
}

// CanaryOutcome is a canary request's result.
type CanaryOutcome string

const (
	CanaryExternal   CanaryOutcome = "External"
	CanaryRecomputed CanaryOutcome = "Recomputed"
	CanaryFailed     CanaryOutcome = "Failed"
)

// PDCluster runs one model as disaggregated prefill and decode pools with a P/D router
// and a completion-gated KV connector.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=pdc,categories=all
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 55",message="metadata.name must be at most 55 characters: it prefixes the objects <name>-prefill, <name>-decode and <name>-router"
// +kubebuilder:validation:XValidation:rule="self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",message="metadata.name must start with a lowercase letter and hold only lowercase letters, digits and '-' (it names Services)"
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Prefill",type=string,JSONPath=`.status.prefill.ready`
// +kubebuilder:printcolumn:name="Decode",type=string,JSONPath=`.status.decode.ready`
// +kubebuilder:printcolumn:name="Connector",type=string,JSONPath=`.status.conditions[?(@.type=="ConnectorHealthy")].status`
// +kubebuilder:printcolumn:name="Restarts",type=integer,JSONPath=`.status.connector.restarts`
// +kubebuilder:printcolumn:name="KV",type=string,JSONPath=`.status.conditions[?(@.type=="KVTransferVerified")].status`,description="whether decode receives its prompts' KV from prefill (KVTransferVerified)"
// +kubebuilder:printcolumn:name="External",type=integer,JSONPath=`.status.kvTransfer.externalSharePercent`,priority=1,description="percent of decode's prompt tokens received from prefill over the verification window"
// +kubebuilder:printcolumn:name="Gated",type=integer,JSONPath=`.status.decode.gate.gatedCompletions`,priority=1,description="empty pulls the decode engines' completion gate kept from the scheduler"
// +kubebuilder:printcolumn:name="Held",type=integer,JSONPath=`.status.routing.prefill.heldPercent`,priority=1,description="percent of the prompts the prefill engines the routers picked already held (routing PrefixAware or KVEvents)"
// +kubebuilder:printcolumn:name="Revision",type=string,JSONPath=`.status.currentRevision`,priority=1,description="the KV revision every engine pod served when the last rollout completed"
// +kubebuilder:printcolumn:name="Rollout",type=string,JSONPath=`.status.conditions[?(@.type=="Progressing")].reason`,priority=1,description="RollingOut while engine pods of two KV revisions run (Progressing)"
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PDCluster struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired state.
	Spec PDClusterSpec `json:"spec"`
	// status is the observed state, written by the operator.
	// +optional
	Status PDClusterStatus `json:"status,omitempty"`
}

// PDClusterList is a list of PDClusters.
// +kubebuilder:object:root=true
type PDClusterList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []PDCluster `json:"items"`
}
