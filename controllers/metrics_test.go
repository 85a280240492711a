package controllers

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// A KV-revision rollout is exported while it runs, with each revision's traffic; the series go
// with the rollout and with the PDCluster.
func TestRolloutMetrics(t *testing.T) {
	p := pdc()
	p.Status.Conditions = []metav1.Condition{{Type: v1alpha1.ConditionProgressing, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonKVRevisionRollingOut}}
	p.Status.Revisions = []v1alpha1.RevisionStatus{{Revision: "old", TrafficPercent: 60}, {Revision: "new", TrafficPercent: 40}}
	recordStatus(p)
	if v := testutil.ToFloat64(rolloutInProgress.WithLabelValues("ns", "c")); v != 1 {
		t.Errorf("pdcluster_rollout_in_progress = %v mid-rollout, want 1", v)
	}
	if v := testutil.ToFloat64(revisionTraffic.WithLabelValues("ns", "c", "old")); v != 60 {
		t.Errorf("pdcluster_revision_traffic_percent{old} = %v, want 60", v)
	}
	p.Status.Conditions[0] = metav1.Condition{Type: v1alpha1.ConditionProgressing, Status: metav1.ConditionFalse, Reason: v1alpha1.ReasonRolloutComplete}
	p.Status.Revisions = []v1alpha1.RevisionStatus{{Revision: "new", TrafficPercent: 100}}
	recordStatus(p)
	if v := testutil.ToFloat64(rolloutInProgress.WithLabelValues("ns", "c")); v != 0 {
		t.Errorf("pdcluster_rollout_in_progress = %v after the rollout, want 0", v)
	}
	if n := testutil.CollectAndCount(revisionTraffic); n != 1 {
		t.Errorf("%d revision traffic series after the rollout, want the new revision's", n)
	}
	forgetStatus("ns", "c")
	if n := testutil.CollectAndCount(revisionTraffic) + testutil.CollectAndCount(rolloutInProgress); n != 0 {
		t.Errorf("%d rollout series left after the PDCluster went", n)
	}
}
