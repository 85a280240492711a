// Package render turns a PDCluster into the Kubernetes objects that run it. It is pure: the
// same PDCluster and Options always give the same objects, with no cluster access, so the
// reconciler only diffs and applies, and `pdctl render` prints exactly what the operator creates.
//
// The builders read a defaulted PDCluster (as the API server stores it, or after
// (*PDCluster).SetDefaults, the one place defaults are applied in Go): they read values, never
// fall back to a default at the point of use. Each exported builder defaults its own copy first
// (defaulted), so a caller may pass a PDCluster as written.
package render

import (
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/rollout"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/internal/scaling"
)

// Options are the operator-wide settings that are not part of a PDCluster.
type Options struct {
	// RouterImage runs cmd/router.
	RouterImage string
	// ConnectorImage runs cmd/connector, unless a PDCluster names its own.
	ConnectorImage string
	// OperatorNamespace is where the operator runs: its pods read the connector sidecars'
	// /gate, which the NetworkPolicies admit from there only. Empty: from nowhere.
	OperatorNamespace string
}

// DefaultOptions are used by pdctl and by the manager unless flags override them.
func DefaultOptions() Options {
	return Options{RouterImage: "ghcr.io/pdcluster/router:v0.1.0", ConnectorImage: "ghcr.io/pdcluster/connector:v0.1.0", OperatorNamespace: "pdcluster-system"}
}

// Render returns every object the operator creates for pdc, in a stable order, with nothing
// running yet (what pdctl prints): RenderServing with the zero Serving.
func Render(pdc *v1alpha1.PDCluster, opts Options) ([]Object, error) {
	return RenderServing(pdc, opts, Serving{})
}

// Serving is what runs now that the rendered objects depend on; the reconciler reads it from
// the cluster and logs it with each plan (at --zap-log-level=debug), so that `pdctl render
// --serving` renders what a reconcile applied.
type Serving struct {
	// Suffixed puts the update revision's Deployments and Services under
	// <pdc>-<pool>-<revision> (EngineObjectName): an older revision still holds the base names.
	Suffixed bool `json:"suffixed,omitempty"`
	// Old are the older KV revisions still running, oldest first, each with its Services:
	// router.json lists them beside the update revision, and a request goes to one revision's
	// prefill and decode.
	Old []routerconfig.RevisionHosts `json:"old,omitempty"`
	// Domains are the values of spec.scheduling.pairing.topologyKey on the cluster's nodes,
	// sorted: each pool of each running revision gets a Service per domain.
	Domains []string `json:"domains,omitempty"`
	// PodGroups says the cluster serves PodGroups (scheduling.k8s.io/v1beta1): with
	// spec.scheduling.gang Auto, each replica across pods is one (Gangs).
	PodGroups bool `json:"podGroups,omitempty"`
	// Step, when set, is the replicas of the update revision's engine Deployments in a rollout
	// between KV revisions (the reconciler's rollout step, which steps the revisions in
	// lockstep); unset, each pool runs its replicas from the spec and its scaling.
	Step *rollout.Counts `json:"step,omitempty"`
}

// RenderServing returns every object the operator creates for pdc while serving runs, in a
// stable order. The engine objects are the update revision's; an older revision's Deployments
// are the reconciler's to scale down and delete, not render's.
func RenderServing(pdc *v1alpha1.PDCluster, opts Options, serving Serving) ([]Object, error) {
	p, err := Prepare(pdc)
	if err != nil {
		return nil, err
	}
	router, err := p.Router(opts, serving)
	if err != nil {
		return nil, err
	}
	return p.Objects(opts, serving, router)
}

// Prepared is a PDCluster made ready to render, once for every builder of one render (the
// reconciler's, or pdctl's): defaulted, checked, its KV revision computed.
type Prepared struct {
	pdc *v1alpha1.PDCluster
	rev string
}

// SpecError is a PDCluster that fails the checks the CRD cannot make
// ((*PDCluster).Validate), each naming its field.
type SpecError struct{ Err error }

func (e *SpecError) Error() string { return e.Err.Error() }
func (e *SpecError) Unwrap() error { return e.Err }

// MultiNodePools names the pools of pdc whose replicas span pods ("spec.<pool>.parallelism.nodes
// is N", one per such pool): they run as LeaderWorkerSets, which the cluster must serve.
func MultiNodePools(pdc *v1alpha1.PDCluster) []string {
	var out []string
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		if multiNode(pdc, role) {
			out = append(out, fmt.Sprintf("spec.%s.parallelism.nodes is %d", role, *pool(pdc, role).Parallelism.Nodes))
		}
	}
	return out
}

// Prepare defaults a copy of pdc, checks it (a *SpecError) and computes
// its KV revision.
func Prepare(pdc *v1alpha1.PDCluster) (*Prepared, error) {
	pdc = defaulted(pdc)
	// The checks the CRD cannot make, each naming the PDCluster field (the API server would
	// otherwise refuse the Deployment in its own words).
	if err := pdc.Validate().ToAggregate(); err != nil {
		return nil, &SpecError{err}
	}
	rev, err := kvRevision(pdc)
	if err != nil {
		return nil, err
	}
	return &Prepared{pdc: pdc, rev: rev}, nil
}

// Revision is the KV revision the engines render with: the update revision.
func (p *Prepared) Revision() string { return p.rev }

// RouterObjects are the router's ConfigMap (router.json) and Deployment.
type RouterObjects struct {
	Config     *corev1.ConfigMap
	Deployment *appsv1.Deployment
}

// Router renders the router's ConfigMap and Deployment. They do not depend on serving.Step:
// the reconciler plans a rollout's step on whether every router pod runs this Deployment,
// then renders the rest with that step (Objects).
func (p *Prepared) Router(opts Options, serving Serving) (RouterObjects, error) {
	cm, err := routerConfigMap(p.pdc, serving, p.rev)
	if err != nil {
		return RouterObjects{}, fmt.Errorf("render router config: %w", err)
	}
	dep, err := routerDeployment(p.pdc, opts, cm)
	if err != nil {
		return RouterObjects{}, fmt.Errorf("render router: %w", err)
	}
	return RouterObjects{cm, dep}, nil
}

// Objects are every object the operator creates while serving runs, in a stable order, with
// the router as Router rendered it for the same serving.
func (p *Prepared) Objects(opts Options, serving Serving, router RouterObjects) ([]Object, error) {
	pdc, rev := p.pdc, p.rev
	var objs []Object
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		name := EngineObjectName(pdc.Name, role, rev, !serving.Suffixed)
		replicas := scaling.SpecReplicas(pdc, role)
		if serving.Step != nil {
			replicas = serving.Step.Decode
			if role == v1alpha1.RolePrefill {
				replicas = serving.Step.Prefill
			}
		}
		var engines []Object
		if multiNode(pdc, role) {
			lws, err := engineGroupSet(pdc, opts, role, rev, name, replicas)
			if err != nil {
				return nil, fmt.Errorf("render %s pool: %w", role, err)
			}
			engines = append(engines, lws)
			if Gangs(pdc, role, serving.PodGroups) {
				joinGang(lws)
				engines = append(engines, gangs(pdc, lws)...)
			}
			if networkPoliciesEnabled(pdc) {
				engines = append(engines, groupPolicies(pdc, role, lws)...)
			}
		} else {
			dep, err := engineDeployment(pdc, opts, role, rev)
			if err != nil {
				return nil, fmt.Errorf("render %s pool: %w", role, err)
			}
			dep.Name, dep.Spec.Replicas = name, &replicas
			engines = append(engines, dep)
		}
		objs = append(objs, engines[0], engineService(pdc, role, rev, name))
		objs = append(objs, engines[1:]...)
		if pdb := disruptionBudget(pdc, role); pdb != nil {
			objs = append(objs, pdb)
		}
	}
	objs = append(objs, domainServices(pdc, pairedRevisions(pdc, rev, serving), serving.Domains)...)
	if GateEnabled(pdc.Spec.KVTransfer) {
		objs = append(objs, gateConfigMap(pdc))
	}
	objs = append(objs, router.Config, router.Deployment, routerService(pdc))
	for _, np := range networkPolicies(pdc, opts) {
		objs = append(objs, np)
	}
	return objs, nil
}

// Scaled is p with each pool's replicas set to what it runs (the reconciler's scale
// decision); the KV revision does not depend on them.
func (p *Prepared) Scaled(e scaling.Effective) *Prepared {
	return &Prepared{pdc: scaling.Scaled(p.pdc, e), rev: p.rev}
}

// Object is a rendered Kubernetes object. It is controller-runtime's client.Object, declared
// here so that pdctl, which renders without a cluster, does not link the client and its
// dependencies (client-go's typed clients and scheme: a third of pdctl's start-up time).
type Object interface {
	metav1.Object
	runtime.Object
}
