package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ScalingMode says who sets a pool's replica count.
// +kubebuilder:validation:Enum=Static;External
type ScalingMode string

const (
	// ScalingStatic: spec.<pool>.replicas sets the count.
	ScalingStatic ScalingMode = "Static"
	// ScalingExternal: the pool's PoolScale (<name>-<pool>) sets it; an autoscaler (HPA,
	// KEDA) or `kubectl scale` writes it through its /scale subresource.
	ScalingExternal ScalingMode = "External"
)

// ScalingSpec says who scales each pool and the bounds every count is brought within,
// whoever asked for it.
type ScalingSpec struct {
	// prefill scales the prefill pool.
	// +kubebuilder:default={}
	// +optional
	Prefill PoolScalingSpec `json:"prefill,omitempty"`

	// decode scales the decode pool.
	// +kubebuilder:default={}
	// +optional
	Decode PoolScalingSpec `json:"decode,omitempty"`

	// ratio bounds prefill replicas per decode replica. A count that leaves it is repaired
	// biased to scaling up: the short pool is raised first, the other lowered only when the
	// short one is at its maxReplicas; with a ratio, a pool at 0 beside a serving one is raised
	// to at least 1, and both at 0 is scale to zero. The condition RatioConstrained says when
	// the pools run other counts than asked.
	// +optional
	Ratio *ReplicaRatio `json:"ratio,omitempty"`
}

// PoolScalingSpec is who scales one pool, and within what bounds.
// +kubebuilder:validation:XValidation:rule="!has(self.maxReplicas) || !has(self.minReplicas) || self.minReplicas <= self.maxReplicas",message="minReplicas may not exceed maxReplicas"
type PoolScalingSpec struct {
	// mode: Static, the count is spec.<pool>.replicas; External, the count is spec.replicas of
	// the PoolScale <name>-<pool> the operator creates (seeded with the pool's running count,
	// else spec.<pool>.replicas) for an autoscaler or `kubectl scale` to write.
	// spec.<pool>.replicas is then ignored (kept in Git, it draws an admission warning only).
	// +kubebuilder:default=Static
	// +optional
	Mode ScalingMode `json:"mode,omitempty"`

	// minReplicas is the fewest replicas the pool runs whatever its scaler asks (External
	// only). 0 lets a scaler such as KEDA scale the pool to zero.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=0
	// +optional
	MinReplicas *int32 `json:"minReplicas,omitempty"`

	// maxReplicas is the most replicas the pool runs whatever its scaler asks (External only);
	// unset, no bound.
	// +kubebuilder:validation:Minimum=1
	// +optional
	MaxReplicas *int32 `json:"maxReplicas,omitempty"`
}

// ReplicaRatio bounds prefill replicas per decode replica, as decimals with at most two
// places (e.g. min "0.25" and max "1": one to four decode replicas per prefill replica).
// +kubebuilder:validation:XValidation:rule="!has(self.min) || !has(self.max) || double(self.min) <= double(self.max)",message="ratio.min may not exceed ratio.max"
type ReplicaRatio struct {
	// min is the fewest prefill replicas per decode replica.
	// +kubebuilder:validation:Pattern=`^[0-9]{1,4}(\.[0-9]{1,2})?$`
	// +kubebuilder:validation:XValidation:rule="double(self) > 0.0",message="ratio.min must be above 0"
	// +optional
	Min string `json:"min,omitempty"`

	// max is the most prefill replicas per decode replica.
	// +kubebuilder:validation:Pattern=`^[0-9]{1,4}(\.[0-9]{1,2})?$`
	// +kubebuilder:validation:XValidation:rule="double(self) > 0.0",message="ratio.max must be above 0"
	// +optional
	Max string `json:"max,omitempty"`
}

// PoolScaleSpec is what a pool's scaler asks.
type PoolScaleSpec struct {
	// replicas is the count the pool's scaler (HPA, KEDA, `kubectl scale`) asks for. The
	// operator sets it once, when it creates the PoolScale, and never again; the pool runs it
	// within the PDCluster's spec.scaling bounds and ratio (status.replicas).
	// +kubebuilder:validation:Minimum=0
	Replicas int32 `json:"replicas"`
}

// PoolScaleStatus is what the pool runs.
type PoolScaleStatus struct {
	// replicas is the count the pool runs: spec.replicas within the PDCluster's spec.scaling
	// minReplicas, maxReplicas and ratio.
	// +optional
	Replicas int32 `json:"replicas"`
	// selector selects the pool's engine pods (label selector text), for an autoscaler's pod
	// metrics.
	// +optional
	Selector string `json:"selector,omitempty"`
	// observedGeneration is the generation whose spec.replicas status.replicas answers.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
}

// PoolScale is the scale target of one pool of a PDCluster whose spec.scaling.<pool>.mode is
// External: point an HPA's or KEDA's scaleTargetRef at it, or `kubectl scale` it. The operator
// creates it (named <pdcluster>-<pool>), reads spec.replicas, runs the pool at that count within
// spec.scaling's bounds and P:D ratio, and deletes it when the pool goes back to Static.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.replicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:resource:shortName=pdscale
// +kubebuilder:printcolumn:name="Requested",type=integer,JSONPath=`.spec.replicas`,description="what the pool's scaler asks"
// +kubebuilder:printcolumn:name="Replicas",type=integer,JSONPath=`.status.replicas`,description="what the pool runs, within the PDCluster's bounds and ratio"
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PoolScale struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   PoolScaleSpec   `json:"spec"`
	Status PoolScaleStatus `json:"status,omitempty"`
}

// PoolScaleList is a list of PoolScales.
// +kubebuilder:object:root=true
type PoolScaleList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []PoolScale `json:"items"`
}
