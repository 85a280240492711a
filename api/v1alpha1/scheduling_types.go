package v1alpha1

// SchedulingSpec places the engine pods.
type SchedulingSpec struct {
	// pairing keeps a request's prefill and decode in one topology domain (a rack, an NVLink
	// domain, an RDMA fabric), where the KV crosses the fastest links.
	// +optional
	Pairing *PairingSpec `json:"pairing,omitempty"`

	// gang schedules each replica that spans pods (spec.<pool>.parallelism.nodes > 1) all at
	// once. Auto (the default): each such replica is one gang of its pods on Kubernetes' own
	// gang scheduling (a PodGroup with minCount its pods, scheduling.k8s.io/v1beta1, feature
	// GenericWorkload), so the scheduler binds all of them or none, never holding the GPUs of
	// a half-placed replica; where the cluster does not serve PodGroups the GangScheduled
	// condition says so and the pods are scheduled one by one. None: one by one. A replica of
	// one pod, and the prefill and decode pools together, are never a gang.
	// +kubebuilder:default=Auto
	// +optional
	Gang GangMode `json:"gang,omitempty"`
}

// GangMode is spec.scheduling.gang.
// +kubebuilder:validation:Enum=Auto;None
type GangMode string

const (
	// GangAuto makes each replica across pods one gang where the cluster serves PodGroups.
	GangAuto GangMode = "Auto"
	// GangNone schedules a replica's pods one by one.
	GangNone GangMode = "None"
)

// PairingMode is how strictly the router keeps a request's pair in one domain.
// +kubebuilder:validation:Enum=Preferred;Required
type PairingMode string

const (
	// PairingPreferred pairs within a domain where the prefill's domain has a decode engine,
	// and across domains otherwise.
	PairingPreferred PairingMode = "Preferred"
	// PairingRequired pairs only within a domain: a request waits for no one, it is sent to a
	// domain with both pools or answered 503.
	PairingRequired PairingMode = "Required"
)

// PairingSpec is spec.scheduling.pairing.
type PairingSpec struct {
	// topologyKey is the node label whose value names a node's domain, e.g.
	// topology.kubernetes.io/zone or a rack label. The operator labels each engine pod with its
	// node's value (serving.pdcluster.dev/domain) and gives each pool of each domain a headless
	// Service the router reads; a pod on a node without the label is in no domain. The pools'
	// pods also prefer (pod affinity) nodes of the domains where the other pool runs.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=317
	TopologyKey string `json:"topologyKey"`

	// mode: Preferred (default) pairs within a domain when it can and across domains
	// otherwise; Required never pairs across domains.
	// +kubebuilder:default=Preferred
	// +optional
	Mode PairingMode `json:"mode,omitempty"`
}
