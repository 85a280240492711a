package controllers

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"

	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// optionalKind is a kind of child the cluster may not serve (LeaderWorkerSet, PodGroup). The
// manager watches and indexes it when the cluster serves it at start (a watch on a kind it
// does not serve would keep the manager from starting); else a reconcile that needs it looks
// it up, and remembers it once found: a lookup of a kind the cluster does not serve costs a
// discovery request each time, so PDClusters that do not need the kind never look.
//
// One per kind on the reconciler, with the kind's name beside it (leaderWorkerSetKind,
// podGroupKind): a reconciler built as a literal, as tests build it, has its zero value.
type optionalKind struct {
	// watched: served when the manager started, and watched and indexed (SetupWithManager).
	watched bool
	// found: a lookup since the start found it served (kept: a PDCluster that no longer
	// needs the kind may still have objects of it to delete).
	found atomic.Bool
}

// availability is what a reconcile knows of an optionalKind: served, or why that is unknown.
type availability struct {
	served bool
	err    error
}

var (
	leaderWorkerSetKind = lwsv1.GroupVersion.WithKind("LeaderWorkerSet")
	podGroupKind        = schedulingv1beta1.SchemeGroupVersion.WithKind("PodGroup")
)

// watch, at manager start, records whether the cluster serves kind now.
func (k *optionalKind) watch(mapper meta.RESTMapper, kind schema.GroupVersionKind) error {
	_, err := mapper.RESTMapping(kind.GroupKind(), kind.Version)
	switch {
	case err == nil:
		k.watched = true
	case !meta.IsNoMatchError(err):
		return fmt.Errorf("look up %s: %w", kind.Kind, err)
	}
	return nil
}

// observe says whether the cluster serves kind: watched, or remembered once found, else looked
// up with mapper when the PDCluster wants the kind.
func (k *optionalKind) observe(mapper func() meta.RESTMapper, kind schema.GroupVersionKind, wanted bool) availability {
	if k.watched || k.found.Load() {
		return availability{served: true}
	}
	if !wanted {
		return availability{}
	}
	_, err := mapper().RESTMapping(kind.GroupKind(), kind.Version)
	switch {
	case err == nil:
		k.found.Store(true)
		return availability{served: true}
	case meta.IsNoMatchError(err):
		return availability{}
	}
	return availability{err: fmt.Errorf("look up %s: %w", kind.Kind, err)}
}

// listOptional lists pdc's children of an optional kind into list when a says it is served: from the cache's
// index (indexed) when k is watched, by label when it was found later (an informer started
// on first use has no index). A kind uninstalled since is forgotten, and a says so.
func (r *PDClusterReconciler) listOptional(ctx context.Context, pdc *v1alpha1.PDCluster, k *optionalKind, kind schema.GroupVersionKind, a *availability, list client.ObjectList, indexed []client.ListOption) error {
	if !a.served {
		return nil
	}
	opts := indexed
	if !k.watched {
		opts = []client.ListOption{client.InNamespace(pdc.Namespace), client.MatchingLabels{v1alpha1.LabelCluster: pdc.Name}}
	}
	switch err := r.List(ctx, list, opts...); {
	case meta.IsNoMatchError(err):
		k.found.Store(false)
		a.served = false
	case err != nil:
		return fmt.Errorf("list %ss: %w", strings.ToLower(kind.Kind), err)
	}
	return nil
}
