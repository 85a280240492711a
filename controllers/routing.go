package controllers

import (
	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// routingStatus writes status.routing: the share of the prompts the picked engines held, by
// pool, from the routers' counts. Counts the routers did not answer keep what status said.
func routingStatus(status *v1alpha1.PDClusterStatus, in statusInputs) {
	if !render.RoutesByHold(in.pdc) {
		status.Routing = nil
		return
	}
	rc := in.obs.routing
	if rc == nil {
		if status.Routing == nil {
			status.Routing = &v1alpha1.RoutingStatus{}
		}
		return
	}
	status.Routing = &v1alpha1.RoutingStatus{
		Prefill: poolRoutingStatus(rc.Prefill, in.pdc),
		Decode:  poolRoutingStatus(rc.Decode, in.pdc),
	}
}

// poolRoutingStatus is one pool's counts and share held: of the blocks the engines' events
// reported with KVEvents (once it has routed any), else of the estimate's chunks.
func poolRoutingStatus(c routerconfig.PoolRoutingCounts, pdc *v1alpha1.PDCluster) v1alpha1.PoolRoutingStatus {
	s := v1alpha1.PoolRoutingStatus{PromptBlocks: c.PromptBlocks, HeldBlocks: c.HeldBlocks, PromptChunks: c.PromptChunks, HeldChunks: c.HeldChunks,
		IndexBlocks: c.IndexBlocks, EventsLagMilliseconds: c.EventsLagMilliseconds}
	switch {
	case pdc.Spec.Router.Routing.Strategy == v1alpha1.RoutingKVEvents && c.PromptBlocks > 0:
		s.HeldPercent = percentOf(c.HeldBlocks, c.PromptBlocks-c.HeldBlocks)
	case c.PromptChunks > 0:
		s.HeldPercent = percentOf(c.HeldChunks, c.PromptChunks-c.HeldChunks)
	}
	return s
}
