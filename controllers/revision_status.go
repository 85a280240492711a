package controllers

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// revisionStatus writes status.updateRevision, status.currentRevision and Progressing from the
// KV revision render put on the engine pod templates and the revisions the engine pods carry.
// A rollout completes when every engine pod serves the update revision and both pools are
// ready (poolsReady, poolStatuses' verdict).
func revisionStatus(status *v1alpha1.PDClusterStatus, in statusInputs, poolsReady bool) []event {
	pdc := in.pdc
	update := appliedRevision(in.applied)
	if update == "" || in.obs.podsErr != nil {
		return nil // nothing rendered, or the pods unknown: keep what was known
	}
	status.UpdateRevision = update
	// Engine pods per revision and pool; a pod being deleted no longer serves.
	byRev := map[string]*v1alpha1.RevisionStatus{}
	// poolOf is role's counts of revision rev.
	poolOf := func(rev string, role v1alpha1.Role) *v1alpha1.RevisionPods {
		rs := byRev[rev]
		if rs == nil {
			rs = &v1alpha1.RevisionStatus{Revision: rev}
			byRev[rev] = rs
		}
		if role == v1alpha1.RoleDecode {
			return &rs.Decode
		}
		return &rs.Prefill
	}
	for _, p := range in.obs.pods {
		role := v1alpha1.Role(p.Labels[v1alpha1.LabelRole])
		if (role != v1alpha1.RolePrefill && role != v1alpha1.RoleDecode) || p.DeletionTimestamp != nil || podFinished(&p) {
			continue
		}
		pods := poolOf(p.Labels[v1alpha1.LabelKVRevision], role)
		pods.Pods++
		if podReady(&p) {
			pods.Ready++
		}
	}
	// The pods each revision's sets ask (one that has no pod yet is listed too).
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		for _, d := range in.obs.engineSets(role) {
			poolOf(d.revision(), role).Desired += d.wants() * d.podsPerReplica()
		}
	}
	old := slices.DeleteFunc(slices.Sorted(maps.Keys(byRev)), func(r string) bool { return r == update })
	status.Revisions = nil
	for _, rev := range append(slices.Clone(old), update) {
		if rs := byRev[rev]; rs != nil { // the update revision has none before its first pod
			status.Revisions = append(status.Revisions, *rs)
		}
	}
	// Traffic follows the router: among the revisions with a ready pod in both pools, by
	// their ready pods.
	var serving int32
	for _, rs := range status.Revisions {
		if rs.Prefill.Ready > 0 && rs.Decode.Ready > 0 {
			serving += rs.Prefill.Ready + rs.Decode.Ready
		}
	}
	for i := range status.Revisions {
		if rs := &status.Revisions[i]; serving > 0 && rs.Prefill.Ready > 0 && rs.Decode.Ready > 0 {
			rs.TrafficPercent = (rs.Prefill.Ready + rs.Decode.Ready) * 100 / serving
		}
	}
	if len(status.Revisions) > 16 {
		status.Revisions = status.Revisions[len(status.Revisions)-16:] // the newest, with updateRevision
	}
	before := meta.FindStatusCondition(pdc.Status.Conditions, v1alpha1.ConditionProgressing)
	wasRolling := before != nil && before.Status == metav1.ConditionTrue
	// Once a revision has rolled out, a pod of it that is not ready is a pool problem
	// (PrefillReady, DecodeReady), not a rollout.
	if len(old) == 0 && (poolsReady || pdc.Status.CurrentRevision == update) {
		status.CurrentRevision = update
		msg := fmt.Sprintf("every engine pod serves KV revision %s", update)
		setCondition(status, pdc, v1alpha1.ConditionProgressing, metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete, msg)
		// The events tell of a change of revision, not of a PDCluster's first pods (Created
		// and Ready do).
		if wasRolling && pdc.Status.CurrentRevision != "" {
			return []event{{corev1.EventTypeNormal, v1alpha1.ReasonRolloutComplete, "Observe", msg}}
		}
		return nil
	}
	var parts []string
	for _, rev := range append(old, update) {
		name := rev
		if name == "" {
			name = "unlabelled"
		}
		rs := byRev[rev]
		if rs == nil {
			rs = &v1alpha1.RevisionStatus{} // the update revision before its first pod
		}
		parts = append(parts, fmt.Sprintf("%s: %d prefill, %d decode", name, rs.Prefill.Pods, rs.Decode.Pods))
	}
	msg := fmt.Sprintf("rolling out KV revision %s (engine pods by revision: %s)", update, strings.Join(parts, "; "))
	if len(old) == 0 {
		msg = fmt.Sprintf("waiting for the engine pods of KV revision %s to be ready", update)
	}
	setCondition(status, pdc, v1alpha1.ConditionProgressing, metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut, msg)
	if len(old) > 0 && (!wasRolling || pdc.Status.UpdateRevision != update) {
		return []event{{corev1.EventTypeNormal, v1alpha1.ReasonKVRevisionRollingOut, "Render", msg}}
	}
	return nil
}

// appliedRevision is the KV revision on the engine pod templates render produced.
func appliedRevision(applied []render.Object) string {
	for _, o := range applied {
		if set, ok := asPodSet(o); ok {
			if rev := set.revision(); rev != "" {
				return rev
			}
		}
	}
	return ""
}

// podFinished: a pod that succeeded or failed runs no engine.
func podFinished(p *corev1.Pod) bool {
	return p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
}

// podReady reports the pod's Ready condition.
func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
