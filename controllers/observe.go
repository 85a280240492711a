package controllers

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	"sigs.k8s.io/controller-runtime/pkg/log"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// observed is what one reconcile reads of a PDCluster's children, once: every later step
// (connector health, restarts, status) works from it.
type observed struct {
	// pods are the PDCluster's pods, every role; podsErr says why they are unknown.
	pods    []corev1.Pod
	podsErr error
	// sets are the pools' pod sets by role (a missing one is absent): the router's Deployment,
	// and each engine pool's Deployment or LeaderWorkerSet of the update revision; olderSets
	// each engine pool's of older revisions. depsErr says why they are unknown.
	sets      map[v1alpha1.Role]*podSet
	olderSets map[v1alpha1.Role][]*podSet
	depsErr   error
	// gates are the completion gate states the engine pods' sidecars answered; gatesRead says
	// whether they were asked at all (a reader is set, the gate is enabled, the pods are known).
	gates     []gateRead
	gatesRead bool
	// canary is the newest canary the routers reported (verification mode Canary), or nil.
	canary *v1alpha1.CanaryResult
	// pairs are the routers' pair counts summed (pairing), or nil.
	pairs *routerconfig.PairCounts
	// routing are the routers' routing counts summed (PrefixAware, KVEvents), or nil.
	routing *routerconfig.RoutingCounts
	// podGroups are the PDCluster's PodGroups (one per replica across pods), where the
	// cluster serves them (servesPodGroups).
	podGroups       []*schedulingv1beta1.PodGroup
	servesPodGroups availability
}

// gateRead is one engine pod's answer to GET /gate, read at at.
type gateRead struct {
	role v1alpha1.Role
	pod  *corev1.Pod
	st   vllm.State
	at   time.Time
}

// timedGateReader is a GateReader that says when it read each answer (PodReports): a
// reader without it answers as the reconcile asks.
type timedGateReader interface {
	ReadGateAt(pod *corev1.Pod) (vllm.State, time.Time, error)
}

func (o observed) err() error { return errors.Join(o.podsErr, o.depsErr) }

// gateReads bounds the sidecars read at once.
const gateReads = 16

// observed is the snapshot as the reconcile's act left it (the pod sets it applied, as the
// API server answered, and without the ones it deleted), grouped for connector health, KV
// verification and status; applied are the objects it applied, as rendered.
func (s *snapshot) observed(applied []render.Object) observed {
	o := observed{pods: s.pods, podsErr: s.podsErr, gates: s.gates, gatesRead: s.gatesRead, canary: s.canary, pairs: s.pairs, routing: s.routing,
		podGroups: s.podGroups, servesPodGroups: s.servesPodGroups}
	o.sets = map[v1alpha1.Role]*podSet{}
	for _, d := range s.deployments {
		if d.Name == render.ObjectName(s.pdc.Name, v1alpha1.RoleRouter) {
			o.sets[v1alpha1.RoleRouter] = &podSet{d}
		}
	}
	engines := enginePodSets(s.deployments, s.groupSets)
	o.olderSets = map[v1alpha1.Role][]*podSet{}
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		update, old := poolSets(engines, role, applied)
		if update != nil {
			o.sets[role] = update
		}
		o.olderSets[role] = old
	}
	return o
}

// poolSets are role's pod sets (engines, oldest first): the update revision's (the one this
// reconcile applied; nil when it is not there yet) and the older revisions'.
func poolSets(engines []*podSet, role v1alpha1.Role, applied []render.Object) (update *podSet, old []*podSet) {
	var name string
	for _, o := range applied {
		if d, ok := asPodSet(o); ok && d.role() == role {
			name = d.GetName()
		}
	}
	var mine []*podSet
	for _, d := range engines {
		if d.role() == role {
			mine = append(mine, d)
		}
	}
	if name == "" && len(mine) > 0 {
		// Nothing applied (the reconcile failed before): the newest is the update revision's.
		name = mine[len(mine)-1].GetName()
	}
	for _, d := range mine {
		if d.GetName() == name {
			update = d
		} else {
			old = append(old, d)
		}
	}
	return update, old
}

// engineSets are role's pod sets of every revision.
func (o observed) engineSets(role v1alpha1.Role) []*podSet {
	out := slices.Clone(o.olderSets[role])
	if d := o.sets[role]; d != nil {
		out = append(out, d)
	}
	return out
}

// withOlder are the counts of a pool's update-revision set (nil before it exists: one asking
// for no pod) with the older revisions' replicas added: a pool in a lockstep rollout reads as
// rolling out until only the update revision's pods run.
func withOlder(update *podSet, old []*podSet) podCounts {
	c := podCounts{current: true}
	if update != nil {
		c = update.counts()
	}
	for _, d := range old {
		o := d.counts()
		c.wants += o.wants
		c.replicas += o.replicas
		c.ready += o.ready
		c.available += o.available
	}
	return c
}

// readGates asks the sidecars of the running engine pods for their gate's state, a few at a
// time; an answer is dated now unless the reader says when it read it. Sidecars that do not
// answer are left out.
func (r *PDClusterReconciler) readGates(ctx context.Context, pods []corev1.Pod, now time.Time) []gateRead {
	var (
		mu    sync.Mutex
		reads []gateRead
		wg    sync.WaitGroup
		slots = make(chan struct{}, gateReads)
	)
	for i := range pods {
		pod := &pods[i]
		role := v1alpha1.Role(pod.Labels[v1alpha1.LabelRole])
		if (role != v1alpha1.RolePrefill && role != v1alpha1.RoleDecode) || pod.Status.Phase != corev1.PodRunning || pod.DeletionTimestamp != nil {
			continue
		}
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer func() { <-slots; wg.Done() }()
			var (
				st  vllm.State
				at  = now
				err error
			)
			if timed, ok := r.GateReader.(timedGateReader); ok {
				st, at, err = timed.ReadGateAt(pod)
			} else {
				st, err = r.GateReader.ReadGate(ctx, pod)
			}
			if err != nil {
				log.FromContext(ctx).V(1).Info("gate counts not read", "pod", pod.Name, "error", err.Error())
				return
			}
			mu.Lock()
			reads = append(reads, gateRead{role, pod, st, at})
			mu.Unlock()
		}()
	}
	wg.Wait()
	return reads
}

// podsOf are the pods of one role.
func podsOf(pods []corev1.Pod, role v1alpha1.Role) []corev1.Pod {
	var out []corev1.Pod
	for _, p := range pods {
		if p.Labels[v1alpha1.LabelRole] == string(role) {
			out = append(out, p)
		}
	}
	return out
}
