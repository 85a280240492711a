package controllers

import (
	"errors"
	"fmt"
	"strings"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// prepare makes the PDCluster ready to render (render.Prepare: defaults, the checks the CRD
// cannot make, the KV revision), once per reconcile, and says in Ready's words why it cannot
// be. A PDCluster whose replicas span pods (spec.<pool>.parallelism.nodes > 1) runs them as
// LeaderWorkerSet groups, which the cluster must serve: without, nothing of it is applied (not
// half-way), and Ready says which field and what is missing.
func prepare(pdc *v1alpha1.PDCluster, s *snapshot) (*render.Prepared, error) {
	p, err := render.Prepare(pdc)
	var invalid *render.SpecError
	switch {
	case errors.As(err, &invalid):
		return nil, permanentError{&readyError{v1alpha1.ReasonInvalidSpec, "Validate", err.Error(), fmt.Errorf("validate: %w", err)}}
	case err != nil:
		return nil, fmt.Errorf("KV revision: %w", err)
	}
	if pools := render.MultiNodePools(pdc); len(pools) > 0 && !s.servesGroupSets.served {
		return nil, multiNodeUnavailable(pools, s)
	}
	return p, nil
}

// multiNodeUnavailable says why pools (render.MultiNodePools) cannot run: the cluster does
// not serve LeaderWorkerSet, or whether it does is unknown.
func multiNodeUnavailable(pools []string, s *snapshot) error {
	if err := s.servesGroupSets.err; err != nil {
		return err
	}
	msg := fmt.Sprintf("%s: a replica across pods runs as a LeaderWorkerSet group, and the cluster does not serve LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): install it; nothing is applied until then (set nodes to 1 to run one pod per replica)", strings.Join(pools, ", "))
	return &readyError{v1alpha1.ReasonMultiNodeUnavailable, "Render", msg, errors.New(msg)}
}
