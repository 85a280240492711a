package controllers

// The PDCluster's status is computed here: pool counts and conditions, Ready, and the events of
// its transitions. Connector health adds its condition and record in connector_health.go; the
// reconciler writes the result once per reconcile.

import (
	"context"
	"fmt"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// reconcilePoolStatus copies each Deployment's replica counts and sets the per-component
// conditions and Ready. applied is what this reconcile applied (nil: nothing to compare with).
func (r *PDClusterReconciler) reconcilePoolStatus(ctx context.Context, pdc *v1alpha1.PDCluster, status *v1alpha1.PDClusterStatus, applied []render.Object) error {
	components := []struct {
		role      v1alpha1.Role
		condition string
		out       *v1alpha1.PoolStatus
	}{
		{v1alpha1.RolePrefill, v1alpha1.ConditionPrefillReady, &status.Prefill},
		{v1alpha1.RoleDecode, v1alpha1.ConditionDecodeReady, &status.Decode},
		{v1alpha1.RoleRouter, v1alpha1.ConditionRouterReady, &status.Router},
	}
	var notReady []string
	var problem struct{ reason, msg string } // the first pool's pod problem, for Ready
	// A cached Deployment that differs from what this reconcile applied is the cache not having
	// caught up with the write yet, and its counts describe the previous spec (a pool just
	// scaled from 2 to 3 would read "2/2", ready).
	desired := map[string]client.Object{}
	for _, o := range applied {
		if _, ok := o.(*appsv1.Deployment); ok {
			desired[o.GetName()] = o
		}
	}
	for _, c := range components {
		var dep appsv1.Deployment
		err := r.Get(ctx, client.ObjectKey{Namespace: pdc.Namespace, Name: render.ObjectName(pdc.Name, c.role)}, &dep)
		if apierrors.IsNotFound(err) {
			*c.out = v1alpha1.PoolStatus{ConnectorRestarts: c.out.ConnectorRestarts}
			setCondition(status, pdc, c.condition, metav1.ConditionFalse, v1alpha1.ReasonDeploymentAbsent, fmt.Sprintf("Deployment %s not found", render.ObjectName(pdc.Name, c.role)))
			notReady = append(notReady, string(c.role))
			continue
		}
		if err != nil {
			return fmt.Errorf("get %s deployment: %w", c.role, err)
		}
		ps, condStatus, reason, msg := poolStatus(&dep)
		if want, ok := desired[dep.Name]; ok && !upToDate(want, &dep) {
			condStatus, reason, msg = metav1.ConditionFalse, v1alpha1.ReasonRollingOut, "applying the new spec"
		}
		ps.ConnectorRestarts = c.out.ConnectorRestarts
		*c.out = ps
		if condStatus != metav1.ConditionTrue {
			// Replica counts say that pods are missing; the pods say why.
			var pods corev1.PodList
			if err := r.List(ctx, &pods, client.InNamespace(pdc.Namespace), client.MatchingLabels(render.Labels(pdc.Name, c.role))); err != nil {
				return fmt.Errorf("list %s pods: %w", c.role, err)
			}
			if why, detail := podProblem(pods.Items); why != "" {
				reason, msg = why, detail
				if problem.reason == "" {
					problem.reason, problem.msg = why, fmt.Sprintf("%s: %s", c.role, detail)
				}
			}
			notReady = append(notReady, string(c.role))
		}
		setCondition(status, pdc, c.condition, condStatus, reason, msg)
	}
	switch {
	case len(notReady) == 0:
		setCondition(status, pdc, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAllReady, "prefill, decode and router are ready")
	case problem.reason != "":
		setCondition(status, pdc, v1alpha1.ConditionReady, metav1.ConditionFalse, problem.reason, problem.msg)
	default:
		setCondition(status, pdc, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonNotReady, fmt.Sprintf("not ready: %v", notReady))
	}
	return nil
}

// poolProblemEvents are Warning events for pool conditions that turned to a pod problem
// (Unschedulable, ImagePullFailed, CrashLoopBackOff, ContainerFailed), once per change of reason.
func poolProblemEvents(before []metav1.Condition, after *v1alpha1.PDClusterStatus) []event {
	var out []event
	for _, typ := range []string{v1alpha1.ConditionPrefillReady, v1alpha1.ConditionDecodeReady, v1alpha1.ConditionRouterReady} {
		cur := meta.FindStatusCondition(after.Conditions, typ)
		if cur == nil || cur.Status == metav1.ConditionTrue || !slices.Contains(problemReasons, cur.Reason) {
			continue
		}
		if old := meta.FindStatusCondition(before, typ); old != nil && old.Reason == cur.Reason {
			continue
		}
		out = append(out, event{corev1.EventTypeWarning, cur.Reason, "Reconcile", cur.Message})
	}
	return out
}

// poolStatus summarises a Deployment: ready only when every desired replica is ready and runs
// the current template.
func poolStatus(dep *appsv1.Deployment) (v1alpha1.PoolStatus, metav1.ConditionStatus, string, string) {
	desired := ptr.Deref(dep.Spec.Replicas, 1)
	ps := v1alpha1.PoolStatus{
		Replicas:        desired,
		ReadyReplicas:   dep.Status.ReadyReplicas,
		UpdatedReplicas: dep.Status.UpdatedReplicas,
		Ready:           fmt.Sprintf("%d/%d", dep.Status.ReadyReplicas, desired),
	}
	switch {
	case desired == 0:
		return ps, metav1.ConditionTrue, v1alpha1.ReasonScaledToZero, "scaled to zero replicas"
	case dep.Status.ObservedGeneration < dep.Generation || dep.Status.UpdatedReplicas < desired:
		return ps, metav1.ConditionFalse, v1alpha1.ReasonRollingOut, fmt.Sprintf("%d/%d replicas updated", dep.Status.UpdatedReplicas, desired)
	case dep.Status.Replicas > dep.Status.UpdatedReplicas:
		// readyReplicas counts the old pods too: until they are gone, a new pod that is not
		// ready yet hides behind an old one that is.
		return ps, metav1.ConditionFalse, v1alpha1.ReasonRollingOut, fmt.Sprintf("%d old replicas still running", dep.Status.Replicas-dep.Status.UpdatedReplicas)
	case dep.Status.ReadyReplicas < desired:
		return ps, metav1.ConditionFalse, v1alpha1.ReasonReplicasNotReady, fmt.Sprintf("%d/%d replicas ready", dep.Status.ReadyReplicas, desired)
	}
	return ps, metav1.ConditionTrue, v1alpha1.ReasonReplicasReady, fmt.Sprintf("%d/%d replicas ready", dep.Status.ReadyReplicas, desired)
}

func setCondition(status *v1alpha1.PDClusterStatus, pdc *v1alpha1.PDCluster, typ string, s metav1.ConditionStatus, reason, msg string) {
	meta.SetStatusCondition(&status.Conditions, metav1.Condition{
		Type: typ, Status: s, Reason: reason, Message: msg, ObservedGeneration: pdc.Generation,
	})
}

// readinessEvents are the Degraded and Recovered events of a Ready transition.
func readinessEvents(before []metav1.Condition, after *v1alpha1.PDClusterStatus) []event {
	old := meta.FindStatusCondition(before, v1alpha1.ConditionReady)
	cur := meta.FindStatusCondition(after.Conditions, v1alpha1.ConditionReady)
	if cur == nil || (old != nil && old.Status == cur.Status) {
		return nil
	}
	switch {
	case cur.Status == metav1.ConditionTrue:
		return []event{{corev1.EventTypeNormal, "Ready", "Reconcile", cur.Message}}
	case old != nil && old.Status == metav1.ConditionTrue:
		return []event{{corev1.EventTypeWarning, "Degraded", "Reconcile", cur.Message}}
	}
	return nil
}

// reconcileGateCondition reports whether the engines run the completion-gated connector; a
// user who turns it off is told, once, what that risks, and pods whose connector is unready
// because their gate is silent are named.
func reconcileGateCondition(pdc *v1alpha1.PDCluster, status *v1alpha1.PDClusterStatus, silent []string, pending *[]event) {
	before := meta.FindStatusCondition(pdc.Status.Conditions, v1alpha1.ConditionCompletionGated)
	if render.GateEnabled(pdc.Spec.KVTransfer) && len(silent) > 0 {
		msg := fmt.Sprintf("the completion gate of %s has not reported, so its connector is unready and the pod is restarted: "+
			"is vLLM loading the pdgate plugin (kv_connector_module_path, PYTHONPATH)? see the engine log for an UnsupportedVLLM or import error",
			strings.Join(silent, ", "))
		setCondition(status, pdc, v1alpha1.ConditionCompletionGated, metav1.ConditionFalse, v1alpha1.ReasonGateSilent, msg)
		if before == nil || before.Reason != v1alpha1.ReasonGateSilent {
			*pending = append(*pending, event{corev1.EventTypeWarning, v1alpha1.ReasonGateSilent, "Observe", msg})
		}
		return
	}
	if render.GateEnabled(pdc.Spec.KVTransfer) {
		setCondition(status, pdc, v1alpha1.ConditionCompletionGated, metav1.ConditionTrue, v1alpha1.ReasonGateEnabled,
			"engines load the pdgate plugin: pulls with no local KV block are never reported to vLLM's scheduler as finished")
		switch {
		case before != nil && before.Reason == v1alpha1.ReasonGateDisabled:
			*pending = append(*pending, event{corev1.EventTypeNormal, v1alpha1.ReasonGateEnabled, "Render", "completion gate enabled; engines roll to load it"})
		case before != nil && before.Reason == v1alpha1.ReasonGateSilent:
			*pending = append(*pending, event{corev1.EventTypeNormal, v1alpha1.ReasonGateEnabled, "Observe", "every engine's completion gate reports again"})
		}
		return
	}
	msg := "kvTransfer.completionGate is Disabled: engines run vLLM's stock connector, which reports pulls with no local KV block (early aborts, rejected requests, full prefix hits) as finished and can kill the decode engine"
	setCondition(status, pdc, v1alpha1.ConditionCompletionGated, metav1.ConditionFalse, v1alpha1.ReasonGateDisabled, msg)
	if before == nil || before.Status != metav1.ConditionFalse {
		*pending = append(*pending, event{corev1.EventTypeWarning, v1alpha1.ReasonGateDisabled, "Render", msg})
	}
}
