package controllers

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers/connectorhealth"
)

// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch;delete

// healthOutcome is connector health's decision for this reconcile and what acting on it did.
type healthOutcome struct {
	// decided is false when the pods are unknown: nothing was judged.
	decided  bool
	policy   connectorhealth.Policy
	decision connectorhealth.Decision
	// restarted are the pods deleted for a restart (or already gone); err, the deletes refused.
	restarted []connectorhealth.Pod
	err       error
	// deferred: the cached restart record is behind the API server's, so the round waits.
	deferred bool
}

// requeueAfter is when connector health must look again although no pod changes; 0: never.
func (h healthOutcome) requeueAfter() time.Duration {
	if h.deferred {
		return time.Second
	}
	if !h.decided || h.err != nil {
		return 0
	}
	return h.decision.RequeueAfter
}

// decideConnectorHealth judges the observed engine pods' connectors (see
// controllers/connectorhealth for the rules) and restarts the pods whose connector has been
// unready too long. It writes no status: computeStatus records the round. desired is how many
// engine pods the pools run (what the scale decision set on the Deployments, not spec's
// replicas: an External pool's count is its PoolScale's).
func (r *PDClusterReconciler) decideConnectorHealth(ctx context.Context, pdc *v1alpha1.PDCluster, o observed, now time.Time, desired int) healthOutcome {
	if o.podsErr != nil {
		return healthOutcome{}
	}
	var pods []connectorhealth.Pod
	for i := range o.pods {
		if p, ok := connectorhealth.Observe(&o.pods[i]); ok {
			pods = append(pods, p)
		}
	}
	h := healthOutcome{decided: true, policy: connectorhealth.PolicyFrom(pdc.Spec.Connector.Health)}
	h.decision = connectorhealth.Decide(now, h.policy, pdc.Status.Connector, pods, desired)
	if len(h.decision.Restart) == 0 {
		return h
	}
	if r.APIReader != nil {
		// Backoff and budget were judged on the cached record; a round decided on a stale one
		// could restart twice or lose its count, so check it first.
		var live v1alpha1.PDCluster
		if err := r.APIReader.Get(ctx, client.ObjectKeyFromObject(pdc), &live); err != nil {
			h.err = fmt.Errorf("read current PDCluster before restarting pods: %w", err)
			return h
		}
		if live.ResourceVersion != pdc.ResourceVersion {
			log.FromContext(ctx).V(1).Info("cached PDCluster is behind; restart round waits for the current one")
			h.deferred = true
			return h
		}
	}
	h.restarted, h.err = r.restartPods(ctx, pdc, h.decision.Restart)
	for _, p := range h.restarted {
		connectorRestarts.WithLabelValues(pdc.Namespace, pdc.Name, string(p.Role)).Inc()
	}
	if len(h.restarted) > 0 {
		log.FromContext(ctx).Info("restarted pods for connector health", "pods", connectorhealth.Names(h.restarted))
	}
	return h
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
