package v1alpha1

// Condition types of a PDCluster.
const (
	// ConditionReady is True when prefill, decode and router are all ready.
	ConditionReady = "Ready"
	// ConditionPrefillReady, ConditionDecodeReady and ConditionRouterReady report each pool.
	ConditionPrefillReady = "PrefillReady"
	ConditionDecodeReady  = "DecodeReady"
	ConditionRouterReady  = "RouterReady"
	// ConditionConnectorHealthy is False while a connector sidecar is unready.
	ConditionConnectorHealthy = "ConnectorHealthy"
	// ConditionCompletionGated is True when the engines run the completion-gated connector.
	ConditionCompletionGated = "CompletionGated"
	// ConditionKVTransferVerified says whether decode receives its prompts' KV from prefill,
	// from what the engines counted over the verification window.
	ConditionKVTransferVerified = "KVTransferVerified"
	// ConditionProgressing is True while the engine pods do not all serve the spec's KV
	// revision (status.updateRevision).
	ConditionProgressing = "Progressing"
	// ConditionRatioConstrained is True while a pool runs another count than its scaler asked,
	// brought within spec.scaling's bounds or P:D ratio. Set only when spec.scaling bounds
	// something (a pool in External mode, or a ratio).
	ConditionRatioConstrained = "RatioConstrained"
	// ConditionGangScheduling says whether each replica across pods is scheduled as one gang
	// (spec.scheduling.gang Auto). Set only for a PDCluster with such a pool.
	ConditionGangScheduling = "GangScheduling"
)

// Reasons of GangScheduling.
const (
	// ReasonGangsApplied (True): each replica across pods has its PodGroup, and the scheduler
	// has reported none unschedulable.
	ReasonGangsApplied = "GangsApplied"
	// ReasonGangUnschedulable (False): the scheduler cannot place a replica's pods all at once;
	// the message quotes it. None of that replica's pods is bound.
	ReasonGangUnschedulable = "GangUnschedulable"
	// ReasonPodGroupsUnavailable (False): the cluster serves no PodGroups
	// (scheduling.k8s.io/v1beta1, feature GenericWorkload): the pods are scheduled one by one.
	ReasonPodGroupsUnavailable = "PodGroupsUnavailable"
	// ReasonGangDisabled (False): spec.scheduling.gang is None.
	ReasonGangDisabled = "GangDisabled"
)

// Reasons of RatioConstrained.
const (
	// ReasonAsRequested (False): each pool runs what its scaler asked.
	ReasonAsRequested = "AsRequested"
	// ReasonReplicaBounds (True): a request outside minReplicas/maxReplicas was brought inside.
	ReasonReplicaBounds = "ReplicaBounds"
	// ReasonRatioBounds (True): a pool was raised into the ratio (or lowered, past the other
	// pool's maxReplicas).
	ReasonRatioBounds = "RatioBounds"
	// ReasonRatioUnsatisfiable (True): no counts within both pools' bounds meet the ratio; the
	// pools run their requests within the bounds.
	ReasonRatioUnsatisfiable = "RatioUnsatisfiable"
)

// Reasons of Progressing.
const (
	// ReasonKVRevisionRollingOut (True): engine pods of an older KV revision still run beside
	// pods of status.updateRevision; the message counts them per pool.
	ReasonKVRevisionRollingOut = "KVRevisionRollingOut"
	// ReasonRolloutComplete (False): every engine pod of both pools serves
	// status.updateRevision and the pools are ready.
	ReasonRolloutComplete = "RolloutComplete"
	// ReasonMultiNodeUnavailable (Ready False): a pool's replicas span pods
	// (spec.<pool>.parallelism.nodes > 1), which needs LeaderWorkerSet; nothing is rendered
	// until it can be.
	ReasonMultiNodeUnavailable = "MultiNodeUnavailable"
)

// Reasons of KVTransferVerified.
const (
	// ReasonExternalKVObserved (True): decode received at least the minimum share from prefill.
	ReasonExternalKVObserved = "ExternalKVObserved"
	// ReasonDecodeRecomputing (False): decode pods computed their prompts themselves, with no
	// failed pull to explain it (a router that drops kv_transfer_params, a connector that does
	// not pull); the pods are named.
	ReasonDecodeRecomputing = "DecodeRecomputing"
	// ReasonTransferFailing (False): decode recomputed and pulls failed in the window.
	ReasonTransferFailing = "TransferFailing"
	// ReasonSlowTransport (False): KV moved, slower than verification.minTransferMBps (an
	// RDMA path that fell back to TCP).
	ReasonSlowTransport = "SlowTransport"
	// ReasonConnectorNotLoaded (False): decode recomputed and its completion gate never
	// reported, so vLLM runs without the operator's connector.
	ReasonConnectorNotLoaded = "ConnectorNotLoaded"
	// ReasonNoTraffic (Unknown): decode saw no prompt tokens in the window.
	ReasonNoTraffic = "NoTraffic"
	// ReasonMetricsUnavailable (Unknown): no decode engine's counts could be read (the
	// sidecars did not answer, or the engines export no vllm:prompt_tokens_by_source_total).
	ReasonMetricsUnavailable = "MetricsUnavailable"
)

// Reasons of CompletionGated.
const (
	ReasonGateEnabled  = "GateEnabled"
	ReasonGateDisabled = "GateDisabled"
	// ReasonGateSilent: an engine pod's connector is unready because its engine's completion
	// gate has not reported (the plugin did not load, or the engine stopped heartbeating).
	ReasonGateSilent = "GateSilent"
)

// Reasons of Ready and of the pool conditions.
const (
	ReasonInvalidSpec      = "InvalidSpec"
	ReasonApplyFailed      = "ApplyFailed"
	ReasonReplicasReady    = "ReplicasReady"
	ReasonReplicasNotReady = "ReplicasNotReady"
	ReasonRollingOut       = "RollingOut"
	ReasonScaledToZero     = "ScaledToZero"
	ReasonDeploymentAbsent = "DeploymentNotFound"
	ReasonAllReady         = "AllComponentsReady"
	ReasonNotReady         = "ComponentsNotReady"

	// What keeps a pool's pods from running, read off the pods; Ready takes the first pool's.
	// ReasonUnschedulable carries the scheduler's message (e.g. "0/5 nodes are available: 4
	// Insufficient nvidia.com/gpu").
	ReasonUnschedulable = "Unschedulable"
	// ReasonCrashLoopBackOff: a container keeps exiting; the message has its last exit (code,
	// reason such as OOMKilled, and message).
	ReasonCrashLoopBackOff = "CrashLoopBackOff"
	// ReasonImagePullFailed: an image cannot be pulled (ErrImagePull, ImagePullBackOff, ...).
	ReasonImagePullFailed = "ImagePullFailed"
	// ReasonContainerFailed: a container cannot be created or started (e.g.
	// CreateContainerConfigError for a missing Secret).
	ReasonContainerFailed = "ContainerFailed"
)

// Reasons of ConnectorHealthy.
const (
	ReasonConnectorsReady        = "ConnectorsReady"
	ReasonConnectorNotReady      = "ConnectorNotReady"
	ReasonConnectorRestarted     = "ConnectorRestarted"
	ReasonRestartBackoff         = "RestartBackoff"
	ReasonRestartBudgetExhausted = "RestartBudgetExhausted"
	ReasonRestartFailed          = "RestartFailed"
)

// ReasonsNeedingSomeone are the reasons of Ready and ConnectorHealthy that waiting does not
// end: someone must fix the spec or an image, make room for the pods, install LeaderWorkerSet,
// or look at the pods and the operator's permissions. GitOps health checks show them Degraded
// (config/gitops/argocd/pdcluster-health.lua, which test/gitops holds to this list); every
// other reason of those conditions passes by waiting.
var ReasonsNeedingSomeone = []string{
	ReasonUnschedulable, ReasonCrashLoopBackOff, ReasonImagePullFailed, ReasonContainerFailed,
	ReasonInvalidSpec, ReasonApplyFailed, ReasonMultiNodeUnavailable,
	ReasonRestartBudgetExhausted, ReasonRestartFailed,
}
