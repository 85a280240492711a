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
)

// Reasons of CompletionGated.
const (
	ReasonGateEnabled  = "GateEnabled"
	ReasonGateDisabled = "GateDisabled"
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
