package controllers

import (
	"strings"
	"testing"

	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

func TestGangStatus(t *testing.T) {
	unschedulable := &schedulingv1beta1.PodGroup{ObjectMeta: metav1.ObjectMeta{Name: "c-prefill-lws-1"}}
	unschedulable.Status.Conditions = []metav1.Condition{{Type: schedulingv1beta1.PodGroupInitiallyScheduled, Status: metav1.ConditionFalse,
		Reason: schedulingv1beta1.PodGroupReasonUnschedulable, Message: "0/5 nodes are available: 5 Insufficient nvidia.com/gpu."}}
	scheduled := &schedulingv1beta1.PodGroup{ObjectMeta: metav1.ObjectMeta{Name: "c-prefill-lws-0"}}
	scheduled.Status.Conditions = []metav1.Condition{{Type: schedulingv1beta1.PodGroupInitiallyScheduled, Status: metav1.ConditionTrue, Reason: "Scheduled"}}
	for _, tc := range []struct {
		name       string
		nodes      int32
		gang       v1alpha1.GangMode
		obs        observed
		wantReason string // "": no condition
		wantIn     string
		wantEvent  bool
	}{
		{name: "no pool across pods: no condition", nodes: 1, obs: observed{servesPodGroups: availability{served: true}}},
		{name: "gangs applied", nodes: 2, obs: observed{servesPodGroups: availability{served: true}, podGroups: []*schedulingv1beta1.PodGroup{scheduled}},
			wantReason: v1alpha1.ReasonGangsApplied, wantIn: "spec.prefill.parallelism.nodes is 2"},
		{name: "the scheduler's words for a gang it cannot place", nodes: 2,
			obs:        observed{servesPodGroups: availability{served: true}, podGroups: []*schedulingv1beta1.PodGroup{scheduled, unschedulable}},
			wantReason: v1alpha1.ReasonGangUnschedulable, wantIn: "c-prefill-lws-1: 0/5 nodes are available: 5 Insufficient nvidia.com/gpu.", wantEvent: true},
		{name: "not served: a warning, pods one by one", nodes: 2, obs: observed{},
			wantReason: v1alpha1.ReasonPodGroupsUnavailable, wantIn: "scheduled one by one"},
		{name: "gang None", nodes: 2, gang: v1alpha1.GangNone, obs: observed{servesPodGroups: availability{served: true}},
			wantReason: v1alpha1.ReasonGangDisabled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc()
			p.Spec.Prefill.Parallelism.Nodes = ptr.To(tc.nodes)
			p.Spec.Scheduling.Gang = tc.gang
			p.Status.Conditions = []metav1.Condition{{Type: v1alpha1.ConditionGangScheduling, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonGangsApplied}}
			status := *p.Status.DeepCopy()
			gangStatus(&status, p, tc.obs)
			c := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionGangScheduling)
			switch {
			case tc.wantReason == "" && c != nil:
				t.Errorf("condition %+v, want none", c)
			case tc.wantReason != "" && (c == nil || c.Reason != tc.wantReason || !strings.Contains(c.Message, tc.wantIn)):
				t.Errorf("condition %+v, want reason %s with %q", c, tc.wantReason, tc.wantIn)
			}
			if got := len(gangEvents(p.Status.Conditions, &status)) > 0; got != tc.wantEvent {
				t.Errorf("event %v, want %v", got, tc.wantEvent)
			}
		})
	}
}
