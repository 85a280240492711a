package chart

import (
	"testing"

	"pdcluster.dev/pdcluster-operator/internal/render"
)

// The engine pods' NetworkPolicies admit the sidecars' port from the manager's pods only, by
// render.ManagerPodLabels: the chart's manager pods carry them whatever the release is called
// (nameOverride renames objects, not these labels) and whatever podLabels add.
func TestManagerPodsCarryTheLabelsTheNetworkPoliciesAdmit(t *testing.T) {
	for _, set := range [][]string{nil, {"--set", "nameOverride=serving,fullnameOverride=ops-serving,podLabels.team=ml"}} {
		deps := objects(t, set...)["Deployment"]
		if len(deps) != 1 {
			t.Fatalf("%v: %d Deployments, want the manager's", set, len(deps))
		}
		spec, _ := deps[0]["spec"].(map[string]any)
		tmpl, _ := spec["template"].(map[string]any)
		meta, _ := tmpl["metadata"].(map[string]any)
		labels, _ := meta["labels"].(map[string]any)
		for k, v := range render.ManagerPodLabels() {
			if got, _ := labels[k].(string); got != v {
				t.Errorf("%v: manager pod label %s=%q, want %q", set, k, got, v)
			}
		}
	}
}
