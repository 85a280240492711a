package v1alpha1

// Defaults. The CRD carries the same values in its +kubebuilder:default markers; a test
// checks that the two agree, so render can treat an unset field as its default.
const (
	DefaultBlockSize        int32 = 16
	DefaultReplicas         int32 = 1
	DefaultParallelism      int32 = 1
	DefaultRDMAResourceName       = "rdma/hca"
	DefaultRDMACount        int32 = 1

	DefaultHealthPeriodSeconds    int32 = 10
	DefaultHealthFailureThreshold int32 = 3
	DefaultInitialBackoffSeconds  int32 = 30
	DefaultMaxBackoffSeconds      int32 = 600
	DefaultRestartBudget          int32 = 5
	DefaultBudgetWindowSeconds    int32 = 3600
)
