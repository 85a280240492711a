package v1alpha1

// Defaults. The CRD carries the same values in its +kubebuilder:default markers; a test
// checks that the two agree, so render can treat an unset field as its default.
const (
	DefaultBlockSize        int32 = 16
	DefaultReplicas         int32 = 1
	DefaultParallelism      int32 = 1
	DefaultRDMAResourceName       = "rdma/hca"
	DefaultRDMACount        int32 = 1
	DefaultEnginePort       int32 = 8000
	// DefaultBootstrapPort is vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT: the prefill engine itself
	// serves Mooncake's bootstrap server there, so no other container of the pod may bind it.
	DefaultBootstrapPort int32 = 8998
	// DefaultNixlSideChannelPort is vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT: each engine listens for
	// NIXL handshakes on it plus its data-parallel rank.
	DefaultNixlSideChannelPort int32 = 5600

	DefaultHealthPeriodSeconds    int32 = 10
	DefaultHealthFailureThreshold int32 = 3
	DefaultInitialBackoffSeconds  int32 = 30
	DefaultMaxBackoffSeconds      int32 = 600
	DefaultRestartBudget          int32 = 5
	DefaultBudgetWindowSeconds    int32 = 3600
)
