package controllers

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/scaling"
)

// +kubebuilder:rbac:groups=serving.pdcluster.dev,resources=poolscales,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=serving.pdcluster.dev,resources=poolscales/status,verbs=get;update

// scaleDecision is what each pool's scaler asked and what the pools run.
type scaleDecision struct {
	requested map[v1alpha1.Role]int32
	effective scaling.Effective
	// scales are the External pools' PoolScales, as read or to be created.
	scales map[v1alpha1.Role]*v1alpha1.PoolScale
	// create are the PoolScales of External pools that have none yet, seeded.
	create []*v1alpha1.PoolScale
}

func (d scaleDecision) runs(role v1alpha1.Role) int32 {
	if role == v1alpha1.RoleDecode {
		return d.effective.Decode
	}
	return d.effective.Prefill
}

// decideScale decides what the pools run within spec.scaling from what each pool's scaler asks:
// spec.<pool>.replicas, or the PoolScale of an External pool, seeded with what the pool runs
// when it has none yet (act creates it: scaleDecision.create). A Static pool's PoolScale is
// not kept (prune deletes it).
func decideScale(pdc *v1alpha1.PDCluster, s *snapshot, revs engineRevisions) (scaleDecision, error) {
	d := scaleDecision{requested: map[v1alpha1.Role]int32{}, scales: map[v1alpha1.Role]*v1alpha1.PoolScale{}}
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		if !scaling.External(pdc, role) {
			d.requested[role] = scaling.SpecReplicas(pdc, role)
			continue
		}
		ps := s.poolScale(render.ObjectName(pdc.Name, role))
		if ps == nil {
			// Seeded with what the pool runs now, so switching to External moves nothing.
			ps = render.PoolScale(pdc, role, scaling.Seed(pdc, role, revs.running(role)))
			d.create = append(d.create, ps)
		}
		d.scales[role] = ps
		d.requested[role] = ps.Spec.Replicas
	}
	eff, err := scaling.ForSpec(pdc, d.requested[v1alpha1.RolePrefill], d.requested[v1alpha1.RoleDecode])
	if err != nil {
		return d, permanentError{&readyError{v1alpha1.ReasonInvalidSpec, "Validate", err.Error(), err}}
	}
	d.effective = eff
	return d, nil
}

// createPoolScales creates the PoolScales the decision seeded, and returns the events saying so.
func (r *PDClusterReconciler) createPoolScales(ctx context.Context, pdc *v1alpha1.PDCluster, d scaleDecision) ([]event, error) {
	var events []event
	for _, ps := range d.create {
		if err := controllerutil.SetControllerReference(pdc, ps, r.Scheme); err != nil {
			return events, fmt.Errorf("set owner of PoolScale %s: %w", ps.Name, err)
		}
		role := v1alpha1.Role(ps.Labels[v1alpha1.LabelRole])
		switch err := r.Create(ctx, ps); {
		case apierrors.IsAlreadyExists(err):
			// The snapshot holds the PDCluster's own: this one is someone else's.
			err := fmt.Errorf("PoolScale %s exists and is not this PDCluster's: delete it, or rename the PDCluster", ps.Name)
			return events, &readyError{v1alpha1.ReasonApplyFailed, "Create", err.Error(), err}
		case err != nil:
			return events, fmt.Errorf("create PoolScale %s: %w", ps.Name, err)
		}
		events = append(events, event{corev1.EventTypeNormal, "Created", "Create",
			fmt.Sprintf("created PoolScale %s at %d replicas: spec.scaling.%s.mode is External, so its scaler sets the count", ps.Name, ps.Spec.Replicas, role)})
	}
	return events, nil
}

// writeScaleStatus tells each External pool's scaler what the pool runs, and its pods'
// selector, when that changed.
func (r *PDClusterReconciler) writeScaleStatus(ctx context.Context, pdc *v1alpha1.PDCluster, d scaleDecision) error {
	for role, ps := range d.scales {
		want := v1alpha1.PoolScaleStatus{
			Replicas:           d.runs(role),
			Selector:           labels.SelectorFromSet(render.Labels(pdc.Name, role)).String(),
			ObservedGeneration: ps.Generation,
		}
		if ps.Status == want {
			continue
		}
		ps = ps.DeepCopy()
		ps.Status = want
		if err := r.Status().Update(ctx, ps); err != nil {
			return fmt.Errorf("update status of PoolScale %s: %w", ps.Name, err)
		}
	}
	return nil
}

// ratioStatus writes the RatioConstrained condition: whether the scale decision ran what the
// pools' scalers asked (poolStatuses writes what they asked).
func ratioStatus(status *v1alpha1.PDClusterStatus, pdc *v1alpha1.PDCluster, d *scaleDecision) []event {
	if d == nil {
		return nil
	}
	if !scaling.Bounded(pdc) {
		meta.RemoveStatusCondition(&status.Conditions, v1alpha1.ConditionRatioConstrained)
		return nil
	}
	e := d.effective
	p, dec := d.requested[v1alpha1.RolePrefill], d.requested[v1alpha1.RoleDecode]
	counts := fmt.Sprintf("prefill runs %d (asked %d), decode runs %d (asked %d)", e.Prefill, p, e.Decode, dec)
	var msg string
	switch e.Why {
	case scaling.AsRequested:
		setCondition(status, pdc, v1alpha1.ConditionRatioConstrained, metav1.ConditionFalse, string(e.Why), fmt.Sprintf("each pool runs what its scaler asked: prefill %d, decode %d", p, dec))
		return nil
	case scaling.ReplicaBounds:
		msg = counts + ": brought within spec.scaling minReplicas and maxReplicas"
	case scaling.RatioBounds:
		msg = counts + ": brought within spec.scaling.ratio" + ratioText(pdc)
	case scaling.RatioUnsatisfiable:
		msg = counts + ": no counts within the pools' minReplicas and maxReplicas meet spec.scaling.ratio" + ratioText(pdc)
	}
	before := meta.FindStatusCondition(pdc.Status.Conditions, v1alpha1.ConditionRatioConstrained)
	setCondition(status, pdc, v1alpha1.ConditionRatioConstrained, metav1.ConditionTrue, string(e.Why), msg)
	if before == nil || before.Reason != string(e.Why) {
		kind := corev1.EventTypeNormal
		if e.Why == scaling.RatioUnsatisfiable {
			kind = corev1.EventTypeWarning
		}
		return []event{{kind, string(e.Why), "Scale", msg}}
	}
	return nil
}

func ratioText(pdc *v1alpha1.PDCluster) string {
	r := pdc.Spec.Scaling.Ratio
	if r == nil {
		return ""
	}
	return fmt.Sprintf(" (prefill per decode: min %s, max %s)", orNone(r.Min), orNone(r.Max))
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

func ptrTo(n int32) *int32 { return &n }
