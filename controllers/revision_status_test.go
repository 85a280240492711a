package controllers

import (
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

func TestRevisionStatus(t *testing.T) {
	pod := func(name string, role v1alpha1.Role, rev string) *wrappers.PodWrapper {
		w := wrappers.MakeEnginePod("ns", name, "c", role, start)
		if rev != "" {
			w.KVRevision(rev)
		}
		return w
	}
	rendered := func(rev string) []render.Object {
		dep := &appsv1.Deployment{}
		dep.Spec.Template.Labels = map[string]string{v1alpha1.LabelKVRevision: rev}
		return []render.Object{&corev1.ConfigMap{}, dep}
	}
	progressing := func(s metav1.ConditionStatus, reason string) *metav1.Condition {
		return &metav1.Condition{Type: v1alpha1.ConditionProgressing, Status: s, Reason: reason}
	}
	type revs struct{ Update, Current string }
	cases := []struct {
		name       string
		before     revs
		wasRolling *metav1.Condition
		applied    []render.Object
		pods       []*wrappers.PodWrapper
		podsErr    error
		ready      bool
		want       revs
		wantCond   *metav1.Condition
		wantMsg    string
		wantEvents []string
	}{
		{
			name: "first rollout, pods not ready", applied: rendered("new"),
			pods:     []*wrappers.PodWrapper{pod("p-0", v1alpha1.RolePrefill, "new"), pod("d-0", v1alpha1.RoleDecode, "new")},
			want:     revs{Update: "new"},
			wantCond: progressing(metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut), wantMsg: "waiting for the engine pods of KV revision new to be ready",
			// A PDCluster's first pods: Created and Ready tell of them.
		},
		{
			name: "first rollout complete", applied: rendered("new"), before: revs{Update: "new"},
			wasRolling: progressing(metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut),
			pods:       []*wrappers.PodWrapper{pod("p-0", v1alpha1.RolePrefill, "new"), pod("d-0", v1alpha1.RoleDecode, "new")}, ready: true,
			want:     revs{"new", "new"},
			wantCond: progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete), wantMsg: "every engine pod serves KV revision new",
		},
		{
			name: "a rollout from old completes", applied: rendered("new"), before: revs{"new", "old"},
			wasRolling: progressing(metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut),
			pods:       []*wrappers.PodWrapper{pod("p-0", v1alpha1.RolePrefill, "new"), pod("d-0", v1alpha1.RoleDecode, "new")}, ready: true,
			want:     revs{"new", "new"},
			wantCond: progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete), wantMsg: "every engine pod serves KV revision new",
			wantEvents: []string{v1alpha1.ReasonRolloutComplete},
		},
		{
			name: "a pod of the current revision not ready: a pool problem, not a rollout", applied: rendered("new"), before: revs{"new", "new"},
			wasRolling: progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete),
			pods:       []*wrappers.PodWrapper{pod("p-0", v1alpha1.RolePrefill, "new")},
			want:       revs{"new", "new"},
			wantCond:   progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete),
		},
		{
			name: "complete and unchanged: no event", applied: rendered("new"), before: revs{"new", "new"},
			wasRolling: progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete),
			pods:       []*wrappers.PodWrapper{pod("p-0", v1alpha1.RolePrefill, "new"), pod("d-0", v1alpha1.RoleDecode, "new")}, ready: true,
			want:     revs{"new", "new"},
			wantCond: progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete), wantMsg: "every engine pod serves KV revision new",
		},
		{
			name: "a new revision beside the old one, the pools ready", applied: rendered("new"), before: revs{"old", "old"},
			wasRolling: progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete),
			pods: []*wrappers.PodWrapper{
				pod("p-0", v1alpha1.RolePrefill, "old"), pod("p-1", v1alpha1.RolePrefill, "new"),
				pod("d-0", v1alpha1.RoleDecode, "old"), pod("d-1", v1alpha1.RoleDecode, "old"),
				pod("d-2", v1alpha1.RoleDecode, "new").Deleting(start), // gone: not counted
				pod("r-0", v1alpha1.RoleRouter, ""),                    // not an engine
			},
			ready:      true,
			want:       revs{"new", "old"},
			wantCond:   progressing(metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut),
			wantMsg:    "rolling out KV revision new (engine pods by revision: old: 1 prefill, 2 decode; new: 1 prefill, 0 decode)",
			wantEvents: []string{v1alpha1.ReasonKVRevisionRollingOut},
		},
		{
			name: "still rolling: no second event", applied: rendered("new"), before: revs{"new", "old"},
			wasRolling: progressing(metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut),
			pods:       []*wrappers.PodWrapper{pod("p-0", v1alpha1.RolePrefill, "old"), pod("d-0", v1alpha1.RoleDecode, "new")}, ready: true,
			want:     revs{"new", "old"},
			wantCond: progressing(metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut),
			wantMsg:  "rolling out KV revision new (engine pods by revision: old: 1 prefill, 0 decode; new: 0 prefill, 1 decode)",
		},
		{
			name: "a newer revision mid-rollout: a new event", applied: rendered("newer"), before: revs{"new", "old"},
			wasRolling: progressing(metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut),
			pods:       []*wrappers.PodWrapper{pod("p-0", v1alpha1.RolePrefill, "old"), pod("d-0", v1alpha1.RoleDecode, "new")}, ready: true,
			want:       revs{"newer", "old"},
			wantCond:   progressing(metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut),
			wantMsg:    "rolling out KV revision newer (engine pods by revision: new: 0 prefill, 1 decode; old: 1 prefill, 0 decode; newer: 0 prefill, 0 decode)",
			wantEvents: []string{v1alpha1.ReasonKVRevisionRollingOut},
		},
		{
			name: "pods from before KV revisions count as another revision", applied: rendered("new"), before: revs{},
			wasRolling: progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete),
			pods:       []*wrappers.PodWrapper{pod("p-0", v1alpha1.RolePrefill, ""), pod("d-0", v1alpha1.RoleDecode, "new")},
			ready:      true, want: revs{Update: "new"},
			wantCond:   progressing(metav1.ConditionTrue, v1alpha1.ReasonKVRevisionRollingOut),
			wantMsg:    "rolling out KV revision new (engine pods by revision: unlabelled: 1 prefill, 0 decode; new: 0 prefill, 1 decode)",
			wantEvents: []string{v1alpha1.ReasonKVRevisionRollingOut},
		},
		{
			name: "pods unknown: kept", applied: rendered("new"), before: revs{"old", "old"},
			wasRolling: progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete), podsErr: errors.New("list pods: boom"), ready: true,
			want: revs{"old", "old"}, wantCond: progressing(metav1.ConditionFalse, v1alpha1.ReasonRolloutComplete),
		},
		{
			name: "nothing rendered: kept", before: revs{"old", "old"}, ready: true,
			want: revs{"old", "old"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc()
			p.Status.UpdateRevision, p.Status.CurrentRevision = tc.before.Update, tc.before.Current
			if tc.wasRolling != nil {
				p.Status.Conditions = []metav1.Condition{*tc.wasRolling}
			}
			status := p.Status.DeepCopy()
			in := statusInputs{pdc: p, applied: tc.applied, obs: observed{podsErr: tc.podsErr}}
			for _, w := range tc.pods {
				in.obs.pods = append(in.obs.pods, *w.Obj())
			}
			events := revisionStatus(status, in, tc.ready)
			if d := cmp.Diff(tc.want, revs{status.UpdateRevision, status.CurrentRevision}); d != "" {
				t.Errorf("revisions (-want +got):\n%s", d)
			}
			got := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionProgressing)
			if tc.wantCond == nil {
				if got != nil {
					t.Errorf("Progressing = %+v, want none", got)
				}
			} else if got == nil || got.Status != tc.wantCond.Status || got.Reason != tc.wantCond.Reason || (tc.wantMsg != "" && got.Message != tc.wantMsg) {
				t.Errorf("Progressing = %+v, want %s/%s %q", got, tc.wantCond.Status, tc.wantCond.Reason, tc.wantMsg)
			}
			var reasons []string
			for _, e := range events {
				reasons = append(reasons, e.reason)
			}
			if d := cmp.Diff(tc.wantEvents, reasons); d != "" {
				t.Errorf("events (-want +got):\n%s", d)
			}
		})
	}
}

// TestRevisionNotReadyPoolsKeepRolling: every pod at the new revision is not enough; the
// rollout completes when both pools are ready.
func TestRevisionNotReadyPoolsKeepRolling(t *testing.T) {
	p := pdc()
	p.Status.UpdateRevision, p.Status.CurrentRevision = "new", "old"
	status := p.Status.DeepCopy()
	dep := &appsv1.Deployment{}
	dep.Spec.Template.Labels = map[string]string{v1alpha1.LabelKVRevision: "new"}
	in := statusInputs{pdc: p, applied: []render.Object{dep}}
	in.obs.pods = []corev1.Pod{*wrappers.MakeEnginePod("ns", "d-0", "c", v1alpha1.RoleDecode, start).KVRevision("new").Obj()}
	revisionStatus(status, in, false) // decode not ready
	if status.CurrentRevision != "old" || !meta.IsStatusConditionTrue(status.Conditions, v1alpha1.ConditionProgressing) {
		t.Errorf("current %q, Progressing %+v: want old and True", status.CurrentRevision, meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionProgressing))
	}
}

// status.revisions lists the revisions the engine pods run, older first and the update
// revision last, with each pool's pods and ready pods; pods being deleted or finished are left
// out.
func TestRevisionsInStatus(t *testing.T) {
	p := pdc()
	status := p.Status.DeepCopy()
	dep := &appsv1.Deployment{}
	dep.Spec.Template.Labels = map[string]string{v1alpha1.LabelKVRevision: "b-new"}
	pod := func(name string, role v1alpha1.Role, rev string) *wrappers.PodWrapper {
		return wrappers.MakeEnginePod("ns", name, "c", role, start).KVRevision(rev)
	}
	in := statusInputs{pdc: p, applied: []render.Object{dep}}
	for _, w := range []*wrappers.PodWrapper{
		pod("p-0", v1alpha1.RolePrefill, "c-old").Ready(), pod("p-1", v1alpha1.RolePrefill, "c-old").Ready(), pod("d-0", v1alpha1.RoleDecode, "c-old").Ready(),
		pod("d-1", v1alpha1.RoleDecode, "c-old").Deleting(start),
		pod("p-2", v1alpha1.RolePrefill, "b-new").Ready(), pod("d-2", v1alpha1.RoleDecode, "b-new"),
		pod("d-3", v1alpha1.RoleDecode, "b-new").Phase(corev1.PodFailed),
	} {
		in.obs.pods = append(in.obs.pods, *w.Obj())
	}
	engineDep := func(rev string, replicas int32) *appsv1.Deployment {
		d := &appsv1.Deployment{}
		d.Spec.Replicas = ptr.To(replicas)
		d.Spec.Template.Labels = map[string]string{v1alpha1.LabelKVRevision: rev}
		return d
	}
	in.obs.sets = map[v1alpha1.Role]*podSet{v1alpha1.RolePrefill: {engineDep("b-new", 1)}, v1alpha1.RoleDecode: {engineDep("b-new", 2)}}
	in.obs.olderSets = map[v1alpha1.Role][]*podSet{
		v1alpha1.RolePrefill: {{engineDep("c-old", 2)}}, v1alpha1.RoleDecode: {{engineDep("c-old", 1)}},
	}
	revisionStatus(status, in, false)
	want := []v1alpha1.RevisionStatus{
		{Revision: "c-old", Prefill: v1alpha1.RevisionPods{Desired: 2, Pods: 2, Ready: 2}, Decode: v1alpha1.RevisionPods{Desired: 1, Pods: 1, Ready: 1}, TrafficPercent: 100},
		// No ready decode: the router sends it nothing.
		{Revision: "b-new", Prefill: v1alpha1.RevisionPods{Desired: 1, Pods: 1, Ready: 1}, Decode: v1alpha1.RevisionPods{Desired: 2, Pods: 1, Ready: 0}},
	}
	if d := cmp.Diff(want, status.Revisions); d != "" {
		t.Errorf("status.revisions (-want +got):\n%s", d)
	}
	// Its decode ready: traffic by ready pods, 3 to 2.
	in.obs.pods[5] = *pod("d-2", v1alpha1.RoleDecode, "b-new").Ready().Obj()
	revisionStatus(status, in, false)
	want[0].TrafficPercent, want[1].Decode.Ready, want[1].TrafficPercent = 60, 1, 40
	if d := cmp.Diff(want, status.Revisions); d != "" {
		t.Errorf("status.revisions with both serving (-want +got):\n%s", d)
	}
}
