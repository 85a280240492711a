package controllers

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// childKey names a child: its kind and name.
type childKey struct{ kind, name string }

func keyOf(obj client.Object) childKey {
	return childKey{kindOf(obj), obj.GetName()}
}

// kindOf is obj's kind, from its type: objects read from the cache carry no TypeMeta.
func kindOf(obj client.Object) string {
	switch obj.(type) {
	case *appsv1.Deployment:
		return "Deployment"
	case *corev1.Service:
		return "Service"
	case *corev1.ConfigMap:
		return "ConfigMap"
	case *policyv1.PodDisruptionBudget:
		return "PodDisruptionBudget"
	case *networkingv1.NetworkPolicy:
		return "NetworkPolicy"
	case *v1alpha1.PoolScale:
		return "PoolScale"
	case *lwsv1.LeaderWorkerSet:
		return "LeaderWorkerSet"
	case *schedulingv1beta1.PodGroup:
		return "PodGroup"
	}
	return obj.GetObjectKind().GroupVersionKind().Kind
}

// keepSet is every child a reconcile keeps: what it rendered, each older KV revision's
// Deployments and their Services until the revision drains, and the External pools'
// PoolScales.
func keepSet(rendered []render.Object, revs engineRevisions, scale scaleDecision) map[childKey]bool {
	keep := map[childKey]bool{}
	for _, o := range rendered {
		keep[keyOf(o)] = true
	}
	for _, o := range revs.old {
		if o.drained() {
			continue
		}
		for _, d := range o.sets() {
			keep[keyOf(d.Object)] = true
			keep[childKey{"Service", d.service()}] = true
			if _, ok := d.Object.(*lwsv1.LeaderWorkerSet); ok {
				// Its groups' gangs (a pod of an older group recreated waits for its PodGroup)
				// and NetworkPolicies (its pods reach each other through them).
				for g := range d.wants() {
					keep[childKey{"PodGroup", render.GroupName(d.GetName(), g)}] = true
					keep[childKey{"NetworkPolicy", render.GroupName(d.GetName(), g)}] = true
				}
			}
		}
	}
	for _, ps := range scale.scales {
		keep[childKey{"PoolScale", ps.Name}] = true
	}
	return keep
}

// removal is children to delete and the event that reports them.
type removal struct {
	objs []client.Object
	e    event
}

// unused are the snapshot's children outside keep, grouped as they are reported: a drained
// KV revision's pod sets and Services in one event, the domain Services in one, each other
// child in its own, saying why the spec no longer asks for it.
func unused(pdc *v1alpha1.PDCluster, s *snapshot, keep map[childKey]bool, revs engineRevisions) []removal {
	// A child already being deleted (a finalizer holds it, as a PodGroup's does while pods name
	// it) is not deleted again: that would write on every reconcile until it goes.
	gone := func(o client.Object) bool { return !keep[keyOf(o)] && o.GetDeletionTimestamp() == nil }
	var out []removal
	claimed := map[childKey]bool{}
	for _, o := range revs.old {
		if !o.drained() {
			continue
		}
		var objs []client.Object
		var names []string
		for _, d := range o.sets() {
			objs = append(objs, d.Object)
			claimed[keyOf(d.Object)] = true
			if svc := s.service(d.service()); svc != nil && gone(svc) {
				objs = append(objs, svc)
				claimed[keyOf(svc)] = true
			}
		}
		// Each with its kind: a revision's pod sets are Deployments or LeaderWorkerSets.
		for _, obj := range objs {
			names = append(names, kindOf(obj)+" "+obj.GetName())
		}
		out = append(out, removal{objs, event{corev1.EventTypeNormal, v1alpha1.ReasonKVRevisionRollingOut, "Delete",
			fmt.Sprintf("KV revision %s has drained: deleted %s", cmp.Or(o.revision, render.UnlabelledRevision), strings.Join(names, ", "))}})
	}
	var domain removal
	var domainNames []string
	for _, svc := range s.services {
		if _, ok := svc.Labels[v1alpha1.LabelDomain]; ok && gone(svc) && !claimed[keyOf(svc)] {
			domain.objs = append(domain.objs, svc)
			domainNames = append(domainNames, svc.Name)
			claimed[keyOf(svc)] = true
		}
	}
	if len(domain.objs) > 0 {
		domain.e = event{corev1.EventTypeNormal, "Deleted", "Delete", fmt.Sprintf("deleted the domain Services %v: no pool of a running revision in those domains", domainNames)}
		out = append(out, domain)
	}
	for _, o := range s.children() {
		if !gone(o) || claimed[keyOf(o)] {
			continue
		}
		out = append(out, removal{[]client.Object{o}, event{corev1.EventTypeNormal, "Deleted", "Delete",
			fmt.Sprintf("deleted %s %s: %s", kindOf(o), o.GetName(), whyUnused(pdc, o))}})
	}
	return out
}

// whyUnused says which part of the spec no longer asks for obj.
func whyUnused(pdc *v1alpha1.PDCluster, obj client.Object) string {
	role := obj.GetLabels()[v1alpha1.LabelRole]
	switch obj.(type) {
	case *corev1.ConfigMap:
		if obj.GetName() == render.GateObjectName(pdc.Name) {
			return "the completion gate is disabled"
		}
	case *v1alpha1.PoolScale:
		return fmt.Sprintf("spec.scaling.%s.mode is Static", role)
	case *policyv1.PodDisruptionBudget:
		return fmt.Sprintf("spec.%s.disruptionBudget is unset", role)
	case *networkingv1.NetworkPolicy:
		return "spec.networkPolicy.enabled is false"
	}
	return "the PDCluster no longer renders it"
}

// prune deletes the removals' children as observed (a UID precondition: never a newer object
// of the same name) and returns the event of each removal done; it goes on past an error and
// returns them all.
func (r *PDClusterReconciler) prune(ctx context.Context, s *snapshot, removals []removal) ([]event, error) {
	var events []event
	var errs []error
	for _, rm := range removals {
		ok := true
		for _, o := range rm.objs {
			if err := r.deleteObserved(ctx, o); err != nil {
				errs = append(errs, fmt.Errorf("delete the unused %s %s: %w", kindOf(o), o.GetName(), err))
				ok = false
				continue
			}
			s.deleted(o)
		}
		if ok {
			events = append(events, rm.e)
		}
	}
	return events, errors.Join(errs...)
}
