package controllers

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"sigs.k8s.io/controller-runtime/pkg/client"
	crevent "sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// podDeletionCost is the annotation a ReplicaSet reads when it scales down: it deletes the
// pods of lowest cost first.
const podDeletionCost = "controller.kubernetes.io/pod-deletion-cost"

// +kubebuilder:rbac:groups="",resources=pods,verbs=patch

// setDeletionCosts gives each prefill pod a deletion cost of the KV sends its engine holds (as
// its sidecar last heard from the gate), so a scale-down deletes idle prefill pods first and
// not one whose KV decode has still to pull. A pod whose count is unknown is left as it is;
// a pod whose annotation already says the count is not written.
func (r *PDClusterReconciler) setDeletionCosts(ctx context.Context, o observed) error {
	var errs []error
	for _, g := range o.gates {
		if g.role != v1alpha1.RolePrefill || !g.st.Loaded || g.st.Report == nil || g.st.Report.HeldSends == nil {
			continue
		}
		want := strconv.FormatInt(min(max(*g.st.Report.HeldSends, 0), math.MaxInt32), 10)
		if g.pod.Annotations[podDeletionCost] == want {
			continue
		}
		pod := g.pod.DeepCopy()
		patch := client.MergeFrom(g.pod)
		if pod.Annotations == nil {
			pod.Annotations = map[string]string{}
		}
		pod.Annotations[podDeletionCost] = want
		if err := r.Patch(ctx, pod, patch); client.IgnoreNotFound(err) != nil {
			errs = append(errs, fmt.Errorf("set %s of pod %s: %w", podDeletionCost, pod.Name, err))
		}
	}
	return errors.Join(errs...)
}

// ignoreOwnDeletionCost drops the pod updates that change nothing but the deletion cost: the
// operator's own write must not reconcile again (and read every sidecar again, and write the
// next count, in a loop as fast as the API server answers).
var ignoreOwnDeletionCost = predicate.Funcs{UpdateFunc: func(e crevent.UpdateEvent) bool {
	old, okOld := e.ObjectOld.(*corev1.Pod)
	cur, okCur := e.ObjectNew.(*corev1.Pod)
	if !okOld || !okCur || old.Annotations[podDeletionCost] == cur.Annotations[podDeletionCost] {
		return true
	}
	o, c := old.DeepCopy(), cur.DeepCopy()
	for _, p := range []*corev1.Pod{o, c} {
		delete(p.Annotations, podDeletionCost)
		if len(p.Annotations) == 0 {
			p.Annotations = nil
		}
		p.ResourceVersion, p.ManagedFields = "", nil
	}
	return !equality.Semantic.DeepEqual(o, c)
}}
