package v1alpha1

import (
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

// Defaults. The CRD carries the same values in its +kubebuilder:default markers, and the API
// server applies them; SetDefaults is their Go image, for the readers of a PDCluster that did
// not pass an API server (pdctl, tests) or passed one with an older CRD (an upgrade applies the
// operator before its CRD). A test defaults the same manifests both ways and requires equal
// results, so the two cannot drift.
const (
	DefaultBlockSize        int32 = 16
	DefaultReplicas         int32 = 1
	DefaultMinReplicas      int32 = 1
	DefaultParallelism      int32 = 1
	DefaultRDMAResourceName       = "rdma/hca"
	DefaultRDMACount        int32 = 1
	DefaultTokenSecretKey         = "token"

	DefaultHealthPeriodSeconds    int32 = 10
	DefaultHealthFailureThreshold int32 = 3
	DefaultInitialBackoffSeconds  int32 = 30
	DefaultMaxBackoffSeconds      int32 = 600
	DefaultRestartBudget          int32 = 5
	DefaultBudgetWindowSeconds    int32 = 3600
	DefaultDecodeCascadeBudget    int32 = 2

	DefaultRouterRetries             int32 = 2
	DefaultRouterRetryBudgetPercent  int32 = 20
	DefaultRouterEjectSeconds        int32 = 10
	DefaultRouterConsecutiveFailures int32 = 3
	// DefaultRouterLoadSlack is spec.router.routing.prefixAware.loadSlack's default.
	DefaultRouterLoadSlack int32 = 2

	DefaultVerificationWindowSeconds int32 = 300
	DefaultMinExternalSharePercent   int32 = 90
	DefaultCanaryIntervalSeconds     int32 = 60

	DefaultDrainTimeoutSeconds int32 = 120

	// DefaultRouterMemoryLimit is the router container's memory limit when spec.router.resources
	// is unset (render's default resources): its heap, body budget and KV index are sized from it.
	DefaultRouterMemoryLimit = "1Gi"

	// A Deployment's own defaults.
	DefaultMaxSurge       = "25%"
	DefaultMaxUnavailable = "25%"
)

// SetDefaults fills every unset field that has a default, as the API server would. It is the
// one place defaults are applied in Go: render and the reconciler call it once on their copy
// and then read plain values, never a fallback at the point of use.
func (in *PDCluster) SetDefaults() {
	s := &in.Spec
	if hf := s.Model.HuggingFace; hf != nil && hf.TokenSecret != nil {
		setString(&hf.TokenSecret.Key, DefaultTokenSecretKey)
	}
	setPtr(&s.Engine.BlockSize, DefaultBlockSize)
	setPtr(&s.Engine.EnablePrefixCaching, true)

	kv := &s.KVTransfer
	setString(&kv.Connector, ConnectorMooncake)
	setString(&kv.Protocol, ProtocolRDMA)
	setString(&kv.BufferDevice, BufferDeviceCUDA)
	setString(&kv.LoadFailurePolicy, LoadFailurePolicyFail)
	setString(&kv.CompletionGate, CompletionGateEnabled)
	setString(&kv.Verification.Mode, KVVerificationPassive)
	setPtr(&kv.Verification.WindowSeconds, DefaultVerificationWindowSeconds)
	setPtr(&kv.Verification.MinExternalSharePercent, DefaultMinExternalSharePercent)
	setPtr(&kv.Verification.CanaryIntervalSeconds, DefaultCanaryIntervalSeconds)

	for _, p := range []*PoolScalingSpec{&s.Scaling.Prefill, &s.Scaling.Decode} {
		setString(&p.Mode, ScalingStatic)
		setPtr(&p.MinReplicas, DefaultMinReplicas)
	}
	// The pools' replicas have no default (scaling.SpecReplicas reads unset as 1): with
	// spec.scaling.<pool>.mode External a value written in Git is warned of, which a default
	// would hide.
	for _, p := range []*PoolSpec{&s.Prefill, &s.Decode} {
		setPtr(&p.Parallelism.Tensor, DefaultParallelism)
		setPtr(&p.Parallelism.Data, DefaultParallelism)
		setPtr(&p.Parallelism.Pipeline, DefaultParallelism)
		setPtr(&p.Parallelism.Nodes, DefaultParallelism)
		setString(&p.RDMA.ResourceName, DefaultRDMAResourceName)
		setPtr(&p.RDMA.Count, DefaultRDMACount)
		setPtr(&p.Drain.TimeoutSeconds, DefaultDrainTimeoutSeconds)
	}

	setString(&s.Scheduling.Gang, GangAuto)
	if pr := s.Scheduling.Pairing; pr != nil {
		setString(&pr.Mode, PairingPreferred)
	}
	setPtr(&s.Rollout.MaxSurge, intstr.FromString(DefaultMaxSurge))
	setPtr(&s.Rollout.MaxUnavailable, intstr.FromString(DefaultMaxUnavailable))

	setPtr(&s.Router.Replicas, DefaultReplicas)
	setString(&s.Router.Balance, RouterBalanceLeastInFlight)
	setString(&s.Router.Routing.Strategy, RoutingLeastInFlight)
	fp := &s.Router.FailurePolicy
	setPtr(&fp.Retries, DefaultRouterRetries)
	setPtr(&fp.RetryBudgetPercent, DefaultRouterRetryBudgetPercent)
	setPtr(&fp.EjectSeconds, DefaultRouterEjectSeconds)
	setPtr(&fp.ConsecutiveFailures, DefaultRouterConsecutiveFailures)
	setString(&fp.OnPrefillFailure, OnPrefillFailureRetry)

	h := &s.Connector.Health
	setPtr(&h.PeriodSeconds, DefaultHealthPeriodSeconds)
	setPtr(&h.FailureThreshold, DefaultHealthFailureThreshold)
	setPtr(&h.InitialBackoffSeconds, DefaultInitialBackoffSeconds)
	setPtr(&h.MaxBackoffSeconds, DefaultMaxBackoffSeconds)
	setPtr(&h.RestartBudget, DefaultRestartBudget)
	setPtr(&h.BudgetWindowSeconds, DefaultBudgetWindowSeconds)
	setPtr(&h.RestartDecodeWithPrefill, true)
	setPtr(&h.DecodeCascadeBudget, DefaultDecodeCascadeBudget)

	setPtr(&s.NetworkPolicy.Enabled, true)
	setPtr(&s.NetworkPolicy.Egress.Enabled, true)
	setPtr(&s.NetworkPolicy.Egress.PublicHTTPS, true)
}

func setPtr[T any](p **T, def T) {
	if *p == nil {
		*p = ptr.To(def)
	}
}

func setString[T ~string](p *T, def T) {
	if *p == "" {
		*p = def
	}
}
