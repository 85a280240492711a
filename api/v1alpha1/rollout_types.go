package v1alpha1

import "k8s.io/apimachinery/pkg/util/intstr"

// RolloutSpec paces a rollout. A change of the KV revision (see status.updateRevision) gets
// its own prefill and decode Deployments, stepped in lockstep: the new revision's pods come up
// before the old revision's go, and the router sends each request to one revision's prefill
// and decode, never one of each. A change outside the KV revision rolls each pool's pods in
// place. Both kinds step within these bounds, resolved per pool against its replica count.
type RolloutSpec struct {
	// maxSurge is how many pods per pool may run above its replica count during a rollout: a
	// number, or a percentage of the count rounded up. Surge pods need free accelerators.
	// +kubebuilder:default="25%"
	// +optional
	MaxSurge *intstr.IntOrString `json:"maxSurge,omitempty"`

	// maxUnavailable is how many pods per pool may be unready below its replica count during a
	// rollout: a number, or a percentage rounded down. With both at 0 nothing could move, so
	// that is refused; where no accelerator is free, set maxSurge 0 and maxUnavailable 1.
	// +kubebuilder:default="25%"
	// +optional
	MaxUnavailable *intstr.IntOrString `json:"maxUnavailable,omitempty"`
}
