package controllers

import (
	"context"
	"time"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// observe is the snapshot and what status reads of it when act applied applied and wrote
// nothing else: the steps' tests observe without a reconcile.
func (r *PDClusterReconciler) observe(ctx context.Context, pdc *v1alpha1.PDCluster, applied []render.Object, now time.Time) observed {
	s, err := r.observeSnapshot(ctx, pdc, now)
	o := s.observed(applied)
	if err != nil {
		o.depsErr = err
	}
	return o
}
