package controllers

import (
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers/kvverify"
)

// kvHistories keeps each PDCluster's engine samples between reconciles: the evidence is the
// counters' change over a window, which one read cannot show. In memory only: after an
// operator restart the verdict waits for a second read.
type kvHistories struct {
	mu sync.Mutex
	m  map[types.NamespacedName]kvHistory
}

type kvHistory struct {
	uid types.UID // a PDCluster deleted and created again under its name starts afresh
	h   *kvverify.History
}

func (k *kvHistories) of(pdc *v1alpha1.PDCluster) *kvverify.History {
	k.mu.Lock()
	defer k.mu.Unlock()
	key := types.NamespacedName{Namespace: pdc.Namespace, Name: pdc.Name}
	if e, ok := k.m[key]; ok && e.uid == pdc.UID {
		return e.h
	}
	if k.m == nil {
		k.m = map[types.NamespacedName]kvHistory{}
	}
	e := kvHistory{uid: pdc.UID, h: &kvverify.History{}}
	k.m[key] = e
	return e.h
}

func (k *kvHistories) forget(key types.NamespacedName) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.m, key)
}

// verificationOn reports whether the PDCluster's KV transfer is verified.
func verificationOn(pdc *v1alpha1.PDCluster) bool {
	return pdc.Spec.KVTransfer.Verification.Mode != v1alpha1.KVVerificationDisabled
}

// countsRefresh is how often the sidecars' counts are read again: every gateRefresh, and while
// KV transfer is verified often enough that a window holds four reads (10 s at most often).
func countsRefresh(pdc *v1alpha1.PDCluster) time.Duration {
	if !verificationOn(pdc) {
		return gateRefresh
	}
	return max(10*time.Second, min(gateRefresh, kvverify.PolicyOf(pdc).Window/4))
}

// verifyKV records the engine counts this reconcile read and judges the window. It returns
// nil when verification is disabled or the sidecars were not asked (pods unknown).
func (r *PDClusterReconciler) verifyKV(pdc *v1alpha1.PDCluster, o observed, now time.Time) *kvverify.Verdict {
	if !verificationOn(pdc) || !o.gatesRead {
		return nil
	}
	policy := kvverify.PolicyOf(pdc)
	h := r.kv.of(pdc)
	read := map[types.UID]gateRead{}
	for _, g := range o.gates {
		read[g.pod.UID] = g
	}
	live := map[types.UID]bool{}
	var pods []kvverify.Pod
	for i := range o.pods {
		pod := &o.pods[i]
		role := v1alpha1.Role(pod.Labels[v1alpha1.LabelRole])
		if (role != v1alpha1.RolePrefill && role != v1alpha1.RoleDecode) || pod.Status.Phase != corev1.PodRunning || pod.DeletionTimestamp != nil {
			continue
		}
		live[pod.UID] = true
		g, answered := read[pod.UID]
		st := g.st
		if answered && st.Engine != nil {
			// The sidecar had read its engine AgeSeconds before it answered.
			at := g.at.Add(-time.Duration(st.Engine.AgeSeconds * float64(time.Second)))
			if s, ok := kvverify.SampleOf(at, st); ok {
				h.Add(pod.UID, engineRestarts(pod), s, policy.Window)
			}
		}
		// A sidecar that did not answer says nothing of the gate: only one that answered
		// without a report counts as a gate that never reported.
		pods = append(pods, kvverify.Pod{Name: pod.Name, Role: role, GateReported: !answered || st.Report != nil, Samples: h.Samples(pod.UID)})
	}
	h.Keep(live)
	v := kvverify.Evaluate(pods, policy, kvverify.CanaryOf(o.canary, policy, now))
	return &v
}

// engineRestarts is how often the pod's engine container restarted: a restart starts its
// counters at 0.
func engineRestarts(pod *corev1.Pod) int32 {
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == v1alpha1.EngineContainerName {
			return cs.RestartCount
		}
	}
	return 0
}

// kvStatus writes status.kvTransfer and KVTransferVerified from the verdict: a Warning event
// on each change to False (or of its reason), a Normal one when verified again. With
// verification disabled both are removed; without a verdict (pods unknown) both are kept. It
// returns the condition as it now stands, for Ready (kvBlocksReady).
func kvStatus(status *v1alpha1.PDClusterStatus, pdc *v1alpha1.PDCluster, v *kvverify.Verdict) ([]event, *metav1.Condition) {
	if !verificationOn(pdc) {
		status.KVTransfer = nil
		meta.RemoveStatusCondition(&status.Conditions, v1alpha1.ConditionKVTransferVerified)
		return nil, nil
	}
	if v == nil {
		return nil, meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionKVTransferVerified)
	}
	kv := v.KV
	status.KVTransfer = &kv
	before := meta.FindStatusCondition(pdc.Status.Conditions, v1alpha1.ConditionKVTransferVerified)
	setCondition(status, pdc, v1alpha1.ConditionKVTransferVerified, v.Status, v.Reason, v.Message)
	now := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionKVTransferVerified)
	switch {
	case v.Status == metav1.ConditionFalse && (before == nil || before.Status != metav1.ConditionFalse || before.Reason != v.Reason):
		return []event{{corev1.EventTypeWarning, v.Reason, "VerifyKVTransfer", v.Message}}, now
	case v.Status == metav1.ConditionTrue && before != nil && before.Status == metav1.ConditionFalse:
		return []event{{corev1.EventTypeNormal, v.Reason, "VerifyKVTransfer", v.Message}}, now
	}
	return nil, now
}

// kvBlocksReady is the reason and message Ready takes from a False KVTransferVerified (c, as
// kvStatus left it) when verification.requiredForReady is set; "" otherwise.
func kvBlocksReady(pdc *v1alpha1.PDCluster, c *metav1.Condition) (string, string) {
	if !pdc.Spec.KVTransfer.Verification.RequiredForReady {
		return "", ""
	}
	if c == nil || c.Status != metav1.ConditionFalse {
		return "", ""
	}
	return c.Reason, fmt.Sprintf("KV transfer not verified (kvTransfer.verification.requiredForReady): %s", c.Message)
}
