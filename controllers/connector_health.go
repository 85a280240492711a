package controllers

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers/connectorhealth"
)

// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch;delete

// reconcileConnectorHealth restarts the pods whose connector has been unready too long (see
// controllers/connectorhealth for the rules), records the round in status and sets
// ConnectorHealthy. It returns when to look again although no pod changed.
func (r *PDClusterReconciler) reconcileConnectorHealth(ctx context.Context, pdc *v1alpha1.PDCluster, status *v1alpha1.PDClusterStatus, pending *[]event) (time.Duration, error) {
	now := r.now()
	var list corev1.PodList
	if err := r.List(ctx, &list, client.InNamespace(pdc.Namespace), client.MatchingLabels{v1alpha1.LabelCluster: pdc.Name}); err != nil {
		return 0, fmt.Errorf("list pods: %w", err)
	}
	var pods []connectorhealth.Pod
	for i := range list.Items {
		if p, ok := connectorhealth.Observe(&list.Items[i]); ok {
			pods = append(pods, p)
		}
	}
	policy := connectorhealth.PolicyFrom(pdc.Spec.Connector.Health)
	desired := int(ptr.Deref(pdc.Spec.Prefill.Replicas, v1alpha1.DefaultReplicas) + ptr.Deref(pdc.Spec.Decode.Replicas, v1alpha1.DefaultReplicas))
	d := connectorhealth.Decide(now, policy, status.Connector, pods, desired)
	status.Connector = d.Status
	before := meta.FindStatusCondition(pdc.Status.Conditions, v1alpha1.ConditionConnectorHealthy)

	if len(d.Restart) > 0 && r.APIReader != nil {
		// Backoff and budget were judged on the cached record; a round decided on a stale one
		// could restart twice or lose its count, so check it first.
		var live v1alpha1.PDCluster
		if err := r.APIReader.Get(ctx, client.ObjectKeyFromObject(pdc), &live); err != nil {
			return 0, fmt.Errorf("read current PDCluster before restarting pods: %w", err)
		}
		if live.ResourceVersion != pdc.ResourceVersion {
			log.FromContext(ctx).V(1).Info("cached PDCluster is behind; restart round waits for the current one")
			return time.Second, nil
		}
	}
	restarted, err := r.restartPods(ctx, pdc, d.Restart)
	connectorhealth.RecordRound(&status.Connector, now, len(restarted))
	for _, p := range restarted {
		if p.Role == v1alpha1.RolePrefill {
			status.Prefill.ConnectorRestarts++
		} else {
			status.Decode.ConnectorRestarts++
		}
		connectorRestarts.WithLabelValues(pdc.Namespace, pdc.Name, string(p.Role)).Inc()
	}

	msg := connectorhealth.Describe(policy, d)
	switch {
	case err != nil:
		msg = fmt.Sprintf("restart pods with an unready connector: %v", err)
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionFalse, v1alpha1.ReasonRestartFailed, msg)
		*pending = append(*pending, event{corev1.EventTypeWarning, v1alpha1.ReasonRestartFailed, "RestartPod", msg})
	case len(d.Unhealthy) == 0:
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionTrue, v1alpha1.ReasonConnectorsReady, msg)
		if before != nil && before.Status != metav1.ConditionTrue {
			*pending = append(*pending, event{corev1.EventTypeNormal, v1alpha1.ReasonConnectorsReady, "Observe", msg})
		}
	case len(restarted) > 0:
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionFalse, v1alpha1.ReasonConnectorRestarted, msg)
		*pending = append(*pending, event{corev1.EventTypeWarning, v1alpha1.ReasonConnectorRestarted, "RestartPod",
			fmt.Sprintf("%s (round %d; %d of %d rounds in %s spent)", msg, status.Connector.ConsecutiveRounds, len(status.Connector.RecentRounds), policy.Budget, policy.Window)})
	case d.Blocked != "":
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionFalse, d.Blocked, msg)
		if d.Blocked == v1alpha1.ReasonRestartBudgetExhausted && (before == nil || before.Reason != d.Blocked) {
			*pending = append(*pending, event{corev1.EventTypeWarning, d.Blocked, "RestartPod", msg})
		}
	default:
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionFalse, v1alpha1.ReasonConnectorNotReady, msg)
		if before == nil || before.Status == metav1.ConditionTrue {
			*pending = append(*pending, event{corev1.EventTypeWarning, v1alpha1.ReasonConnectorNotReady, "Observe", msg})
		}
	}
	if err != nil {
		return 0, err
	}
	if len(restarted) > 0 {
		log.FromContext(ctx).Info("restarted pods for connector health", "pods", connectorhealth.Names(restarted), "round", status.Connector.ConsecutiveRounds)
	}
	return d.RequeueAfter, nil
}

// restartPods deletes pods so their Deployment recreates them. The UID precondition keeps a
// stale decision from deleting a replacement that took the same name; a pod already gone
// counts as restarted.
func (r *PDClusterReconciler) restartPods(ctx context.Context, pdc *v1alpha1.PDCluster, pods []connectorhealth.Pod) ([]connectorhealth.Pod, error) {
	var done []connectorhealth.Pod
	var errs []error
	for _, p := range pods {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: pdc.Namespace, Name: p.Name}}
		var opts []client.DeleteOption
		if p.UID != "" {
			opts = append(opts, client.Preconditions{UID: &p.UID})
		}
		if err := r.Delete(ctx, pod, opts...); err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("delete pod %s: %w", p.Name, err))
			continue
		}
		done = append(done, p)
	}
	return done, errors.Join(errs...)
}

func (r *PDClusterReconciler) now() time.Time {
	if r.Clock == nil {
		return time.Now()
	}
	return r.Clock.Now()
}

// podToPDCluster maps an engine pod to the PDCluster named in its labels.
func podToPDCluster(_ context.Context, obj client.Object) []reconcile.Request {
	name := obj.GetLabels()[v1alpha1.LabelCluster]
	if name == "" || obj.GetLabels()[v1alpha1.LabelManagedBy] != v1alpha1.OperatorName {
		return nil
	}
	return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: obj.GetNamespace(), Name: name}}}
}
