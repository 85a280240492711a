package controllers

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/rollout"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/internal/scaling"
)

// engineRevision is one KV revision's engine pod sets (Deployments, or LeaderWorkerSets for a
// pool whose replicas span pods), as observed.
type engineRevision struct {
	revision string
	// pinned: the sets run this revision's pods only (podSet.pinned). Deployments made before
	// revisions had Deployments of their own select every revision's pods, so they can only be
	// rolled away from, even to the revision their pods carry.
	pinned  bool
	prefill *podSet
	decode  *podSet
}

func (e *engineRevision) set(role v1alpha1.Role) *podSet {
	if role == v1alpha1.RolePrefill {
		return e.prefill
	}
	return e.decode
}

func (e *engineRevision) sets() []*podSet {
	var out []*podSet
	for _, d := range []*podSet{e.prefill, e.decode} {
		if d != nil {
			out = append(out, d)
		}
	}
	return out
}

// base: the revision's Services hold the pools' base names (<pdc>-<pool>).
func (e *engineRevision) base(pdc string) bool {
	return slices.ContainsFunc(e.sets(), func(d *podSet) bool {
		return d.service() == render.ObjectName(pdc, d.role())
	})
}

// counts are what the revision's sets ask and have ready. Ready is available: ready for the
// Deployment's minReadySeconds (render.EngineMinReadySeconds), long enough for every router to
// have found the pod, so an older revision's pod goes only once the routers can send its
// clients elsewhere.
func (e *engineRevision) counts() rollout.Revision {
	rev := rollout.Revision{Name: e.revision}
	if d := e.prefill; d != nil {
		rev.Replicas.Prefill, rev.Ready.Prefill = d.wants(), d.counts().available
	}
	if d := e.decode; d != nil {
		rev.Replicas.Decode, rev.Ready.Decode = d.wants(), d.counts().available
	}
	return rev
}

// drained: the revision's sets ask for no pod and run none. Pods still terminating finish
// their drain after their set goes: deleting an owner does not shorten a terminating pod's
// grace period.
func (e *engineRevision) drained() bool {
	for _, d := range e.sets() {
		if c := d.counts(); c.wants != 0 || c.replicas != 0 || !c.current {
			return false
		}
	}
	return true
}

// hosts are the revision's Services for router.json.
func (e *engineRevision) hosts(namespace string) routerconfig.RevisionHosts {
	h := routerconfig.RevisionHosts{Revision: cmp.Or(e.revision, render.UnlabelledRevision)}
	if e.prefill != nil {
		h.PrefillHost = render.ServiceHost(namespace, e.prefill.service())
		h.PrefillDataParallel = e.prefill.dataParallel()
	}
	if e.decode != nil {
		h.DecodeHost = render.ServiceHost(namespace, e.decode.service())
	}
	return h
}

// engineRevisions are the PDCluster's engine pod sets by KV revision: the update revision's
// (nil when it has none yet) and the older ones, oldest first.
type engineRevisions struct {
	update *engineRevision
	old    []*engineRevision
	// router is the router's Deployment, from the same list (nil when it has none yet).
	router *appsv1.Deployment
}

// running is what role's set of the newest revision asks (the update revision's, else the
// newest older one's); nil when role has none.
func (e engineRevisions) running(role v1alpha1.Role) *int32 {
	if e.update != nil && e.update.set(role) != nil {
		return ptr.To(e.update.set(role).wants())
	}
	for _, rev := range slices.Backward(e.old) {
		if d := rev.set(role); d != nil {
			return ptr.To(d.wants())
		}
	}
	return nil
}

// revisionsOf groups the snapshot's engine pod sets (the PDCluster's, oldest first) by KV
// revision, and finds the router's Deployment among deps; update is the revision render gives
// the engines now. The groups point at the snapshot's objects: what act writes to them, the
// snapshot sees.
func revisionsOf(pdc *v1alpha1.PDCluster, deps []*appsv1.Deployment, groups []*lwsv1.LeaderWorkerSet, update string) engineRevisions {
	var all []*engineRevision
	var router *appsv1.Deployment
	for _, d := range deps {
		if role := v1alpha1.Role(d.Labels[v1alpha1.LabelRole]); role == v1alpha1.RoleRouter && d.Name == render.ObjectName(pdc.Name, role) {
			router = d
		}
	}
	for _, d := range enginePodSets(deps, groups) {
		role, rev, pinned := d.role(), d.revision(), d.pinned()
		i := slices.IndexFunc(all, func(e *engineRevision) bool { return e.revision == rev && e.pinned == pinned && e.set(role) == nil })
		if i < 0 {
			all = append(all, &engineRevision{revision: rev, pinned: pinned})
			i = len(all) - 1
		}
		if role == v1alpha1.RolePrefill {
			all[i].prefill = d
		} else {
			all[i].decode = d
		}
	}
	out := engineRevisions{router: router}
	for _, e := range all {
		if e.pinned && e.revision == update && out.update == nil {
			out.update = e
		} else {
			out.old = append(out.old, e)
		}
	}
	return out
}

// serving is what render needs of the running revisions: where the update revision's objects
// go and the older revisions' Services, for router.json. Drained older revisions are left out:
// they are deleted in this reconcile.
func (e engineRevisions) serving(pdc *v1alpha1.PDCluster) render.Serving {
	var s render.Serving
	if e.update != nil {
		s.Suffixed = !e.update.base(pdc.Name)
	} else {
		s.Suffixed = slices.ContainsFunc(e.old, func(o *engineRevision) bool { return o.base(pdc.Name) })
	}
	for _, o := range e.old {
		if !o.drained() {
			s.Old = append(s.Old, o.hosts(pdc.Namespace))
		}
	}
	return s
}

// rolloutStep is what a reconcile does to the revisions: the update revision's replicas (set
// on its rendered Deployments) and the older revisions' (patched on theirs).
type rolloutStep struct {
	update rollout.Counts
	old    []rollout.Counts
}

// planRollout steps the update revision up and the older ones down, in lockstep within
// spec.rollout. With no older revision the update revision runs target.
func planRollout(pdc *v1alpha1.PDCluster, revs engineRevisions, target scaling.Effective, routerCurrent bool) rolloutStep {
	t := rollout.Counts{Prefill: target.Prefill, Decode: target.Decode}
	if len(revs.old) == 0 {
		return rolloutStep{update: t}
	}
	in := rollout.Input{Target: t}
	// Resolved against each pool's target as a Deployment resolves them (spec.Validate has
	// checked their form): surge rounded up, unavailable down.
	bounds := func(n int32) (surge, unavailable int32) {
		s, _ := intstr.GetScaledValueFromIntOrPercent(pdc.Spec.Rollout.MaxSurge, int(n), true)
		u, _ := intstr.GetScaledValueFromIntOrPercent(pdc.Spec.Rollout.MaxUnavailable, int(n), false)
		return int32(s), int32(u)
	}
	in.MaxSurge.Prefill, in.MaxUnavailable.Prefill = bounds(t.Prefill)
	in.MaxSurge.Decode, in.MaxUnavailable.Decode = bounds(t.Decode)
	if revs.update != nil {
		in.Update = revs.update.counts()
	}
	for _, o := range revs.old {
		in.Old = append(in.Old, o.counts())
	}
	plan := rollout.Plan(in)
	step := rolloutStep{update: plan.Update, old: plan.Old}
	if !routerCurrent {
		// The router still runs a router.json without the update revision: no older revision
		// shrinks yet (the router would find none of the new pods to send to).
		for i, o := range in.Old {
			step.old[i] = o.Replicas
		}
	}
	return step
}

// routerCurrent reports whether every router pod runs the rendered router Deployment (and so
// its router.json): none is older, and all are available.
func (e engineRevisions) routerCurrent(rendered *appsv1.Deployment) bool {
	observed := e.router
	if observed == nil || rendered.Name != observed.Name || !upToDate(rendered, observed) {
		return false
	}
	want := ptr.Deref(observed.Spec.Replicas, 1)
	st := observed.Status
	return st.ObservedGeneration >= observed.Generation && st.UpdatedReplicas == want && st.Replicas == want && st.AvailableReplicas == want
}

// stepOldRevisions scales the older revisions' pod sets to the step and pins a Service that
// still selects every revision to its own; the drained revisions are prune's. It returns the
// events of what it did.
func (r *PDClusterReconciler) stepOldRevisions(ctx context.Context, s *snapshot, revs engineRevisions, step rolloutStep) ([]event, error) {
	var events []event
	for i, o := range revs.old {
		if o.drained() {
			continue
		}
		name := cmp.Or(o.revision, render.UnlabelledRevision)
		var moved []string
		for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
			d := o.set(role)
			if d == nil {
				continue
			}
			if err := r.pinService(ctx, s.service(d.service()), o.revision); err != nil {
				return events, err
			}
			want := step.old[i].Prefill
			if role == v1alpha1.RoleDecode {
				want = step.old[i].Decode
			}
			have := d.wants()
			if have == want {
				continue
			}
			patch := client.MergeFrom(d.DeepCopyObject().(client.Object))
			d.setWants(want)
			if err := r.Patch(ctx, d.Object, patch); err != nil {
				return events, &readyError{v1alpha1.ReasonApplyFailed, "Scale", fmt.Sprintf("scale %s %s to %d: %v", kindOf(d.Object), d.GetName(), want, err), fmt.Errorf("scale %s: %w", d.GetName(), err)}
			}
			moved = append(moved, fmt.Sprintf("%s %s %d -> %d", role, d.GetName(), have, want))
		}
		if len(moved) > 0 {
			events = append(events, event{corev1.EventTypeNormal, v1alpha1.ReasonKVRevisionRollingOut, "Scale",
				fmt.Sprintf("KV revision %s: scaled %s", name, strings.Join(moved, ", "))})
		}
	}
	return events, nil
}

// pinService narrows an older revision's Service (svc, the snapshot's; nil when it has none)
// that selects every revision's pods (one made before revisions had Services of their own) to
// that revision's: the router reads it as that revision's pool and must not find the update
// revision's pods behind it.
func (r *PDClusterReconciler) pinService(ctx context.Context, svc *corev1.Service, rev string) error {
	if rev == "" {
		return nil // pods without the label cannot be told apart
	}
	if svc == nil || svc.Spec.Selector[v1alpha1.LabelKVRevision] == rev {
		return nil
	}
	patch := client.MergeFrom(svc.DeepCopy())
	svc.Spec.Selector[v1alpha1.LabelKVRevision] = rev
	if err := r.Patch(ctx, svc, patch); err != nil {
		return fmt.Errorf("pin Service %s to KV revision %s: %w", svc.Name, rev, err)
	}
	return nil
}
