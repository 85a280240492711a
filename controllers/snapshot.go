package controllers

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// snapshot is what one reconcile reads of the cluster, read once and first, before anything is
// decided: the nodes' domains, the PDCluster's children of every kind it manages, its pods, and
// what the pods last reported. Every later step decides from it; only act writes, and act
// keeps the snapshot's Deployments current with what it wrote (observed).
//
// A child is the PDCluster's when the PDCluster controls it (its controller reference): one
// rule for every kind. Children are listed by the PDCluster's label, as the manager's cache
// holds them.
type snapshot struct {
	pdc  *v1alpha1.PDCluster
	topo topology

	deployments []*appsv1.Deployment
	// groupSets are the LeaderWorkerSets of the pools whose replicas span pods (listed when
	// the cluster serves the kind).
	groupSets  []*lwsv1.LeaderWorkerSet
	services   []*corev1.Service
	configMaps []*corev1.ConfigMap
	budgets    []*policyv1.PodDisruptionBudget
	policies   []*networkingv1.NetworkPolicy
	poolScales []*v1alpha1.PoolScale

	// pods are the PDCluster's pods, every role (they belong to ReplicaSets: by label);
	// podsErr says why they are unknown, which leaves the children's reconcile going.
	pods    []corev1.Pod
	podsErr error
	// gates are the completion gate states the engine pods' sidecars answered; gatesRead says
	// whether they were asked at all (a reader is set, the gate or KV verification is on, the
	// pods are known).
	gates     []gateRead
	gatesRead bool
	// canary is the newest canary the routers reported (verification mode Canary), or nil.
	canary *v1alpha1.CanaryResult
	// pairs are the routers' pair counts summed (pairing), or nil.
	pairs *routerconfig.PairCounts
	// routing are the routers' routing counts summed (PrefixAware, KVEvents), or nil.
	routing *routerconfig.RoutingCounts
	// servesGroupSets says whether the cluster serves LeaderWorkerSet (looked up for a
	// PDCluster with a pool whose replicas span pods, unless the manager watches the kind).
	servesGroupSets availability
	// podGroups are the PodGroups of the replicas across pods (listed when the cluster serves
	// the kind, servesPodGroups: looked up for a PDCluster that wants gangs).
	podGroups       []*schedulingv1beta1.PodGroup
	servesPodGroups availability
}

// observeSnapshot reads the snapshot. An error in any read but the pods' stops the reconcile
// before it decides anything.
func (r *PDClusterReconciler) observeSnapshot(ctx context.Context, pdc *v1alpha1.PDCluster, now time.Time) (*snapshot, error) {
	s := &snapshot{pdc: pdc}
	var err error
	if s.topo, err = r.observeTopology(ctx, pdc); err != nil {
		return s, err
	}
	s.servesGroupSets = r.groupSets.observe(r.RESTMapper, leaderWorkerSetKind, len(render.MultiNodePools(pdc)) > 0)
	s.servesPodGroups = r.podGroups.observe(r.RESTMapper, podGroupKind, wantsGangs(pdc))
	mine := []client.ListOption{client.InNamespace(pdc.Namespace), client.MatchingLabels{v1alpha1.LabelCluster: pdc.Name}}
	if r.childrenIndexed {
		// The same objects from the cache's index: a reconcile reads its own children, not
		// every one of the namespace (which, with many PDClusters in one namespace, made each
		// reconcile's lists grow with the fleet).
		mine = []client.ListOption{client.InNamespace(pdc.Namespace), client.MatchingFields{childIndex: pdc.Name}}
	}
	var (
		deps     appsv1.DeploymentList
		svcs     corev1.ServiceList
		cms      corev1.ConfigMapList
		pdbs     policyv1.PodDisruptionBudgetList
		nps      networkingv1.NetworkPolicyList
		scales   v1alpha1.PoolScaleList
		podsList corev1.PodList
	)
	for _, l := range []struct {
		kind string
		list client.ObjectList
	}{{"deployments", &deps}, {"services", &svcs}, {"configmaps", &cms}, {"poddisruptionbudgets", &pdbs}, {"networkpolicies", &nps}, {"poolscales", &scales}} {
		if err := r.List(ctx, l.list, mine...); err != nil {
			return s, fmt.Errorf("list %s: %w", l.kind, err)
		}
	}
	s.deployments = controlled(pdc, deps.Items)
	s.services = controlled(pdc, svcs.Items)
	s.configMaps = controlled(pdc, cms.Items)
	s.budgets = controlled(pdc, pdbs.Items)
	s.policies = controlled(pdc, nps.Items)
	s.poolScales = controlled(pdc, scales.Items)
	// Uninstalled since it was found: none to keep (and a multi-node pool is refused again).
	var groups lwsv1.LeaderWorkerSetList
	if err := r.listOptional(ctx, pdc, &r.groupSets, leaderWorkerSetKind, &s.servesGroupSets, &groups, mine); err != nil {
		return s, err
	}
	s.groupSets = controlled(pdc, groups.Items)
	var gangs schedulingv1beta1.PodGroupList
	if err := r.listOptional(ctx, pdc, &r.podGroups, podGroupKind, &s.servesPodGroups, &gangs, mine); err != nil {
		return s, err
	}
	s.podGroups = controlled(pdc, gangs.Items)
	if err := r.List(ctx, &podsList, mine...); err != nil {
		s.podsErr = fmt.Errorf("list pods: %w", err)
		return s, nil
	}
	s.pods = podsList.Items
	// The sidecars answer the gate's state and their engine's KV counts: asked when either is
	// wanted.
	if r.GateReader != nil && (render.GateEnabled(pdc.Spec.KVTransfer) || verificationOn(pdc)) {
		s.gates, s.gatesRead = r.readGates(ctx, s.pods, now), true
	}
	if r.CanaryReader != nil && pdc.Spec.KVTransfer.Verification.Mode == v1alpha1.KVVerificationCanary {
		s.canary = r.readCanary(ctx, s.pods)
	}
	if r.PairsReader != nil && pdc.Spec.Scheduling.Pairing != nil {
		s.pairs = r.readPairs(ctx, s.pods)
	}
	if r.RoutingReader != nil && render.RoutesByHold(pdc) {
		s.routing = r.readRouting(ctx, s.pods)
	}
	return s, nil
}

// controlled are the items pdc controls, by pointer into items, sorted by creation, then name.
func controlled[T any, PT interface {
	*T
	client.Object
}](pdc *v1alpha1.PDCluster, items []T) []PT {
	var out []PT
	for i := range items {
		if o := PT(&items[i]); metav1.IsControlledBy(o, pdc) {
			out = append(out, o)
		}
	}
	slices.SortFunc(out, func(a, b PT) int {
		if c := a.GetCreationTimestamp().Compare(b.GetCreationTimestamp().Time); c != 0 {
			return c
		}
		return strings.Compare(a.GetName(), b.GetName())
	})
	return out
}

// children are the snapshot's children of every managed kind.
func (s *snapshot) children() []client.Object {
	var out []client.Object
	out = appendObjects(out, s.deployments)
	out = appendObjects(out, s.groupSets)
	out = appendObjects(out, s.podGroups)
	out = appendObjects(out, s.services)
	out = appendObjects(out, s.configMaps)
	out = appendObjects(out, s.budgets)
	out = appendObjects(out, s.policies)
	return appendObjects(out, s.poolScales)
}

func appendObjects[T client.Object](out []client.Object, items []T) []client.Object {
	for _, o := range items {
		out = append(out, o)
	}
	return out
}

// service is the snapshot's Service named name, or nil.
func (s *snapshot) service(name string) *corev1.Service {
	for _, svc := range s.services {
		if svc.Name == name {
			return svc
		}
	}
	return nil
}

// poolScale is the snapshot's PoolScale named name, or nil.
func (s *snapshot) poolScale(name string) *v1alpha1.PoolScale {
	for _, ps := range s.poolScales {
		if ps.Name == name {
			return ps
		}
	}
	return nil
}

// wrote keeps the snapshot's pod sets current with what act wrote: answer is an object as the
// API server answered an apply (only Deployments and LeaderWorkerSets are kept).
func (s *snapshot) wrote(answer client.Object) {
	switch x := answer.(type) {
	case *appsv1.Deployment:
		s.deployments = replaced(s.deployments, x)
	case *lwsv1.LeaderWorkerSet:
		s.groupSets = replaced(s.groupSets, x)
	}
}

// replaced is items with the one named like answer replaced by it, or answer added.
func replaced[T client.Object](items []T, answer T) []T {
	for i, d := range items {
		if d.GetName() == answer.GetName() {
			items[i] = answer
			return items
		}
	}
	return append(items, answer)
}

// deleted drops what act deleted from the snapshot's pod sets.
func (s *snapshot) deleted(obj client.Object) {
	named := func(o client.Object) bool { return o.GetName() == obj.GetName() }
	switch obj.(type) {
	case *appsv1.Deployment:
		s.deployments = slices.DeleteFunc(s.deployments, func(d *appsv1.Deployment) bool { return named(d) })
	case *lwsv1.LeaderWorkerSet:
		s.groupSets = slices.DeleteFunc(s.groupSets, func(d *lwsv1.LeaderWorkerSet) bool { return named(d) })
	}
}

// childIndex is the cache's index of the PDClusters' children and pods by the PDCluster their
// label names (v1alpha1.LabelCluster).
const childIndex = "serving.pdcluster.dev/cluster"

// indexedKinds are the kinds the snapshot lists.
func indexedKinds() []client.Object {
	return []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &corev1.ConfigMap{}, &policyv1.PodDisruptionBudget{},
		&networkingv1.NetworkPolicy{}, &v1alpha1.PoolScale{}, &corev1.Pod{}}
}

// indexChildren adds childIndex to the cache for every kind the snapshot lists (groupSets:
// LeaderWorkerSets too; podGroups: PodGroups too).
func indexChildren(ctx context.Context, indexer client.FieldIndexer, groupSets, podGroups bool) error {
	kinds := indexedKinds()
	if groupSets {
		kinds = append(kinds, &lwsv1.LeaderWorkerSet{})
	}
	if podGroups {
		kinds = append(kinds, &schedulingv1beta1.PodGroup{})
	}
	for _, obj := range kinds {
		err := indexer.IndexField(ctx, obj, childIndex, func(o client.Object) []string {
			if c := o.GetLabels()[v1alpha1.LabelCluster]; c != "" {
				return []string{c}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("index %T by PDCluster: %w", obj, err)
		}
	}
	return nil
}
