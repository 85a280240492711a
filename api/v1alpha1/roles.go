package v1alpha1

// Role is the part a workload plays in a PDCluster; it names the child objects
// (<cluster>-<role>) and is the value of LabelRole.
type Role string

const (
	// RolePrefill runs the engines that compute the prompt's KV cache (kv_producer).
	RolePrefill Role = "prefill"
	// RoleDecode runs the engines that pull that KV cache and generate (kv_consumer).
	RoleDecode Role = "decode"
	// RoleRouter is the P/D proxy in front of both pools.
	RoleRouter Role = "router"
)
