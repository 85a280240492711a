package controllers

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime/schema"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// leaderWorkerSet is the kind a replica across pods runs as.
var leaderWorkerSet = schema.GroupKind{Group: "leaderworkerset.x-k8s.io", Kind: "LeaderWorkerSet"}

// multiNodeAvailable refuses, before anything is applied, a PDCluster whose replicas span pods
// (spec.<pool>.parallelism.nodes > 1): they run as LeaderWorkerSet groups, which the cluster
// must serve and this operator must render. Neither half-way: nothing of the PDCluster is
// applied, and Ready says which field and what is missing.
func (r *PDClusterReconciler) multiNodeAvailable(pdc *v1alpha1.PDCluster) error {
	var pools []string
	for _, p := range []struct {
		name string
		spec *v1alpha1.PoolSpec
	}{{"prefill", &pdc.Spec.Prefill}, {"decode", &pdc.Spec.Decode}} {
		if n := p.spec.Parallelism.Nodes; n != nil && *n > 1 {
			pools = append(pools, fmt.Sprintf("spec.%s.parallelism.nodes is %d", p.name, *n))
		}
	}
	if len(pools) == 0 {
		return nil
	}
	why := "this operator build does not render LeaderWorkerSets yet"
	if _, err := r.RESTMapper().RESTMapping(leaderWorkerSet, "v1"); meta.IsNoMatchError(err) {
		why = "the cluster does not serve LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): install it"
	} else if err != nil {
		return fmt.Errorf("look up LeaderWorkerSet: %w", err)
	}
	msg := fmt.Sprintf("%s: a replica across pods runs as a LeaderWorkerSet group, and %s; nothing is applied until then (set nodes to 1 to run one pod per replica)", strings.Join(pools, ", "), why)
	return &readyError{v1alpha1.ReasonMultiNodeUnavailable, "Render", msg, fmt.Errorf("%s", msg)}
}
