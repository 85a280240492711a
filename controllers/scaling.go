package controllers

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"
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
	// scales are the External pools' PoolScales, as read or created.
	scales map[v1alpha1.Role]*v1alpha1.PoolScale
}

func (d scaleDecision) runs(role v1alpha1.Role) int32 {
	if role == v1alpha1.RoleDecode {
		return d.effective.Decode
	}
	return d.effective.Prefill
}

// decideScale reads what each pool's scaler asks (spec.<pool>.replicas, or the PoolScale of an
// External pool, created seeded when missing; a Static pool's is deleted) and decides what the
// pools run within spec.scaling.
func (r *PDClusterReconciler) decideScale(ctx context.Context, pdc *v1alpha1.PDCluster, revs engineRevisions) (scaleDecision, []event, error) {
	d := scaleDecision{requested: map[v1alpha1.Role]int32{}, scales: map[v1alpha1.Role]*v1alpha1.PoolScale{}}
	var events []event
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		name := render.ObjectName(pdc.Name, role)
		if !scaling.External(pdc, role) {
			d.requested[role] = scaling.SpecReplicas(pdc, role)
			e, err := r.deleteUnused(ctx, pdc, &v1alpha1.PoolScale{ObjectMeta: metav1.ObjectMeta{Namespace: pdc.Namespace, Name: name}},
				"PoolScale", fmt.Sprintf("spec.scaling.%s.mode is Static", role))
			if e != nil {
				events = append(events, *e)
			}
			if err != nil {
				return d, events, err
			}
			continue
		}
		ps, created, err := r.poolScale(ctx, pdc, role, revs.running(role))
		if err != nil {
			return d, events, err
		}
		if created {
			events = append(events, event{corev1.EventTypeNormal, "Created", "Create",
				fmt.Sprintf("created PoolScale %s at %d replicas: spec.scaling.%s.mode is External, so its scaler sets the count", name, ps.Spec.Replicas, role)})
		}
		d.scales[role] = ps
		d.requested[role] = ps.Spec.Replicas
	}
	eff, err := scaling.ForSpec(pdc, d.requested[v1alpha1.RolePrefill], d.requested[v1alpha1.RoleDecode])
	if err != nil {
		return d, events, permanentError{&readyError{v1alpha1.ReasonInvalidSpec, "Validate", err.Error(), err}}
	}
	d.effective = eff
	return d, events, nil
}

// poolScale reads role's PoolScale, creating it seeded when it is missing.
func (r *PDClusterReconciler) poolScale(ctx context.Context, pdc *v1alpha1.PDCluster, role v1alpha1.Role, running *int32) (*v1alpha1.PoolScale, bool, error) {
	key := client.ObjectKey{Namespace: pdc.Namespace, Name: render.ObjectName(pdc.Name, role)}
	ps := &v1alpha1.PoolScale{}
	err := r.Get(ctx, key, ps)
	switch {
	case err == nil:
		if !metav1.IsControlledBy(ps, pdc) {
			err := fmt.Errorf("PoolScale %s exists and is not this PDCluster's: delete it, or rename the PDCluster", key.Name)
			return nil, false, &readyError{v1alpha1.ReasonApplyFailed, "Create", err.Error(), err}
		}
		return ps, false, nil
	case !apierrors.IsNotFound(err):
		return nil, false, fmt.Errorf("get PoolScale %s: %w", key.Name, err)
	}
	// Seeded with what the pool runs now, so switching to External moves nothing.
	ps = render.PoolScale(pdc, role, scaling.Seed(pdc, role, running))
	if err := controllerutil.SetControllerReference(pdc, ps, r.Scheme); err != nil {
		return nil, false, fmt.Errorf("set owner of PoolScale %s: %w", key.Name, err)
	}
	if err := r.Create(ctx, ps); err != nil {
		return nil, false, fmt.Errorf("create PoolScale %s: %w", key.Name, err)
	}
	return ps, true, nil
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
