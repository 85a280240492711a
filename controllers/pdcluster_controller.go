// Package controllers holds the PDCluster reconciler. A reconcile observes once (snapshot.go:
// the nodes' domains, the children, the pods, the pods' last reports from PodReports), decides
// in pure functions (decide: render.Prepare, revisionsOf, decideScale, planRollout, render,
// keepSet, unused), acts (apply what differs with server-side apply, step the older KV
// revisions, prune by inventory, connector-health restarts, deletion costs), computes the
// status in one pure function and writes it once, events after.
package controllers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"
	"unique"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/conversion"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// PDClusterReconciler reconciles PDCluster objects.
type PDClusterReconciler struct {
	client.Client
	Scheme   *runtime.Scheme
	Recorder events.EventRecorder
	Options  render.Options
	// Clock times connector health; nil is the wall clock. Tests inject a fake one.
	Clock clock.PassiveClock
	// GateReader reads the completion gate's counts from the engine pods' sidecars for
	// status; nil leaves them out.
	GateReader GateReader
	// CanaryReader reads each router's newest canary (verification mode Canary); nil leaves
	// it out.
	CanaryReader CanaryReader
	// PairsReader reads each router's pair counts (spec.scheduling.pairing); nil leaves them
	// out.
	PairsReader PairsReader
	// RoutingReader reads each router's routing counts (spec.router.routing PrefixAware or
	// KVEvents); nil leaves them out.
	RoutingReader RoutingReader
	// Reports, when set, is the runnable behind the four readers above (each of them set to
	// it): SetupWithManager starts it with the manager and enqueues the PDClusters its
	// events name, so Reconcile reads only its last answers and never waits on a pod.
	Reports *PodReports
	// APIReader reads past the cache: a restart round first checks that the cached PDCluster
	// (and the restart record in its status) is current. nil skips the check.
	APIReader client.Reader
	// MaxConcurrentReconciles is how many PDClusters are reconciled at once (0: one).
	// Reconciles of different PDClusters share nothing but the API server.
	MaxConcurrentReconciles int

	// kv keeps each PDCluster's engine samples between reconciles, for KV verification.
	kv kvHistories
	// childrenIndexed: the client's cache has childIndex (SetupWithManager adds it); without
	// it (a client that reads the API server) the snapshot lists by label.
	childrenIndexed bool
	// groupSets and podGroups are what the reconciler knows of the kinds the cluster may not
	// serve: LeaderWorkerSet (replicas across pods) and PodGroup (their gangs).
	groupSets, podGroups optionalKind
}

// +kubebuilder:rbac:groups=serving.pdcluster.dev,resources=pdclusters,verbs=get;list;watch
// +kubebuilder:rbac:groups=serving.pdcluster.dev,resources=pdclusters/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=leaderworkerset.x-k8s.io,resources=leaderworkersets,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=scheduling.k8s.io,resources=podgroups,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups="",resources=services;configmaps,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=networking.k8s.io,resources=networkpolicies,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile brings one PDCluster's children to the rendered state and updates its status.
func (r *PDClusterReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	logger := log.FromContext(ctx)
	var pdc v1alpha1.PDCluster
	if err := r.Get(ctx, req.NamespacedName, &pdc); err != nil {
		if apierrors.IsNotFound(err) {
			forgetStatus(req.Namespace, req.Name)
			r.kv.forget(req.NamespacedName)
		}
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !pdc.DeletionTimestamp.IsZero() {
		forgetStatus(req.Namespace, req.Name)
		r.kv.forget(req.NamespacedName)
		return ctrl.Result{}, nil // children go with the owner references
	}
	// The API server has defaulted what its CRD knows; this covers a CRD older than the
	// operator (an upgrade that applied the manager first). Only status is written back.
	pdc.SetDefaults()
	// Observe once, decide, act (apply, scale, prune), act on connector health, then compute
	// the whole status from what was learned and write it once; events go out after the write.
	in := statusInputs{pdc: &pdc, now: r.now()}
	snap, err := r.observeSnapshot(ctx, &pdc, in.now)
	in.topo = snap.topo
	var applied []render.Object
	var scale *scaleDecision
	var events []event
	if err == nil {
		applied, scale, events, err = r.reconcileChildren(ctx, &pdc, snap)
	}
	in.applied, in.scale, in.childrenErr = applied, scale, err
	reconcileErr := err // every step's error: observe, apply, restarts
	var requeueAfter time.Duration
	if err == nil {
		in.obs = snap.observed(applied)
		in.health = r.decideConnectorHealth(ctx, &pdc, in.obs, in.now, enginePods(&pdc, scale.effective))
		in.kv = r.verifyKV(&pdc, in.obs, in.now)
		costErr := r.setDeletionCosts(ctx, in.obs)
		domainErr := r.labelDomains(ctx, &pdc, in.obs.pods, snap.topo)
		reconcileErr = errors.Join(in.obs.err(), in.health.err, costErr, domainErr)
		requeueAfter = in.health.requeueAfter()
		if in.obs.gatesRead {
			requeueAfter = sooner(requeueAfter, countsRefresh(&pdc))
		}
	}
	status, statusEvents := computeStatus(in)
	events = append(events, statusEvents...)

	if !equality.Semantic.DeepEqual(&pdc.Status, &status) {
		pdc.Status = status
		// Update, not a patch: status carries the restart record, which a write computed from
		// a stale copy must not overwrite. A conflict only means the cache was behind; the
		// watch event of the newer write reconciles again.
		if err := r.Status().Update(ctx, &pdc); apierrors.IsConflict(err) {
			logger.V(1).Info("status changed since it was read; reconciling again", "error", err.Error())
			return ctrl.Result{RequeueAfter: conflictRetry}, nil
		} else if err != nil {
			return ctrl.Result{}, fmt.Errorf("update status of %s: %w", req.NamespacedName, err)
		}
	}
	recordStatus(&pdc)
	for _, e := range events {
		r.Recorder.Eventf(&pdc, nil, e.kind, e.reason, e.action, "%s", e.note)
	}
	if reconcileErr != nil {
		logger.Error(reconcileErr, "reconcile")
		if isPermanent(reconcileErr) {
			return ctrl.Result{}, nil // a spec error: wait for the user to change it
		}
		return ctrl.Result{}, reconcileErr
	}
	return ctrl.Result{RequeueAfter: requeueAfter}, nil
}

// sooner is the earlier of two requeue delays, where 0 means none.
func sooner(a, b time.Duration) time.Duration {
	if a == 0 || (b != 0 && b < a) {
		return b
	}
	return a
}

// conflictRetry is how soon a reconcile whose status write met a newer PDCluster runs again, in
// case no watch event of that newer write arrives.
const conflictRetry = time.Second

type permanentError struct{ error }

func (e permanentError) Unwrap() error { return e.error }

func isPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// plan is what a reconcile decides from the spec and the snapshot, without the client: the
// objects to apply (rendered with the scale and the rollout's step), the children to remove,
// the scale decision, the older revisions' step.
type plan struct {
	objs     []render.Object
	removals []removal
	scale    scaleDecision
	revs     engineRevisions
	step     rolloutStep
	// serving is what render took of the cluster (`pdctl render --serving` takes it too).
	serving render.Serving
}

// decide plans a reconcile: what the CRD cannot check, in the PDCluster's field names, before
// anything is applied; the scale and the rollout's step; render with them; the children the
// PDCluster no longer keeps.
func decide(pdc *v1alpha1.PDCluster, snap *snapshot, opts render.Options) (*plan, error) {
	prep, err := prepare(pdc, snap)
	if err != nil {
		return nil, err
	}
	p := &plan{revs: revisionsOf(pdc, snap.deployments, snap.groupSets, prep.Revision())}
	if p.scale, err = decideScale(pdc, snap, p.revs); err != nil {
		return nil, err
	}
	serving := p.revs.serving(pdc)
	serving.Domains = snap.topo.domains
	serving.PodGroups = snap.servesPodGroups.served
	scaled := prep.Scaled(p.scale.effective)
	renderErr := func(err error) error {
		return permanentError{&readyError{v1alpha1.ReasonInvalidSpec, "Render", err.Error(), fmt.Errorf("render: %w", err)}}
	}
	// A new KV revision steps in lockstep with the older ones, and the older ones shrink only
	// once every router pod runs the router this reconcile applies: render takes the step's
	// replicas for the update revision's Deployments; act scales the older ones after the apply.
	router, err := scaled.Router(opts, serving)
	if err != nil {
		return nil, renderErr(err)
	}
	p.step = planRollout(pdc, p.revs, p.scale.effective, p.revs.routerCurrent(router.Deployment))
	serving.Step = &p.step.update
	if p.objs, err = scaled.Objects(opts, serving, router); err != nil {
		return nil, renderErr(err)
	}
	p.serving = serving
	p.removals = unused(pdc, snap, keepSet(p.objs, p.revs, p.scale), p.revs)
	return p, nil
}

// reconcileChildren decides (decide) and acts: it creates the PoolScales the decision seeded,
// applies the objects that differ from the cluster, steps the older KV revisions and prunes.
// Nothing is written when everything already matches. It returns what it applied (as
// rendered, not as the server answered) and the scale decision, for the pool status, and the
// events of what it did.
func (r *PDClusterReconciler) reconcileChildren(ctx context.Context, pdc *v1alpha1.PDCluster, snap *snapshot) ([]render.Object, *scaleDecision, []event, error) {
	p, err := decide(pdc, snap, r.Options)
	if err != nil {
		return nil, nil, nil, err
	}
	if logger := log.FromContext(ctx).V(1); logger.Enabled() {
		// What render took of the cluster: `pdctl render --serving` renders the same objects.
		if b, err := json.Marshal(p.serving); err == nil {
			logger.Info("planned", "serving", string(b), "prefill", p.scale.effective.Prefill, "decode", p.scale.effective.Decode)
		}
	}
	events, err := r.createPoolScales(ctx, pdc, p.scale)
	if err != nil {
		return nil, nil, events, err
	}
	applyEvents, err := r.applyAll(ctx, pdc, snap, p.objs)
	events = append(events, applyEvents...)
	if err != nil {
		return nil, nil, events, err
	}
	stepped, err := r.stepOldRevisions(ctx, snap, p.revs, p.step)
	events = append(events, stepped...)
	if err != nil {
		return p.objs, &p.scale, events, err
	}
	pruned, err := r.prune(ctx, snap, p.removals)
	events = append(events, pruned...)
	if err != nil {
		return p.objs, &p.scale, events, err
	}
	return p.objs, &p.scale, events, r.writeScaleStatus(ctx, pdc, p.scale)
}

// applyAll applies each object that is missing or differs, keeping the snapshot's Deployments
// current with the API server's answers, and returns one event per action for all the children
// it touched: the events library merges events of one reason and action into a series that
// keeps only the first note, so one event per child named a single child (and cost a write
// each).
func (r *PDClusterReconciler) applyAll(ctx context.Context, pdc *v1alpha1.PDCluster, snap *snapshot, objs []render.Object) (events []event, err error) {
	var created, updated []string
	summarize := func() {
		for _, e := range []struct {
			reason, action string
			names          []string
		}{{"Created", "Create", created}, {"Updated", "Update", updated}} {
			if len(e.names) > 0 {
				events = append(events, event{corev1.EventTypeNormal, e.reason, e.action, strings.ToLower(e.reason) + " " + strings.Join(e.names, ", ")})
			}
		}
	}
	defer summarize()
	for _, obj := range objs {
		if err := controllerutil.SetControllerReference(pdc, obj, r.Scheme); err != nil {
			return events, fmt.Errorf("set owner of %s: %w", obj.GetName(), err)
		}
		action, answer, err := r.reconcileObject(ctx, obj)
		if err != nil {
			msg := fmt.Sprintf("apply %T %s: %v", obj, obj.GetName(), err)
			return events, &readyError{v1alpha1.ReasonApplyFailed, "Apply", msg, fmt.Errorf("apply %s: %w", obj.GetName(), err)}
		}
		snap.wrote(answer)
		name := obj.GetObjectKind().GroupVersionKind().Kind + " " + obj.GetName()
		switch action {
		case actionCreated:
			created = append(created, name)
		case actionUpdated:
			updated = append(updated, name)
		}
	}
	return events, nil
}

// deleteObserved deletes obj as it was observed (its UID: never a newer object of the same
// name); one already gone is not an error.
func (r *PDClusterReconciler) deleteObserved(ctx context.Context, obj client.Object) error {
	uid := obj.GetUID()
	return client.IgnoreNotFound(r.Delete(ctx, obj, client.Preconditions{UID: &uid}))
}

type applyAction int

const (
	actionNone applyAction = iota
	actionCreated
	actionUpdated
)

// reconcileObject applies obj when it is missing or differs; it returns what it did and the
// object as the cluster now has it (the API server's answer to the apply, or what was read).
// It reads obj again though the snapshot holds it: a read of the informer's cache, no API
// call, and the newest the cache has when the apply is decided, not when the reconcile began.
func (r *PDClusterReconciler) reconcileObject(ctx context.Context, desired client.Object) (applyAction, client.Object, error) {
	kind := desired.GetObjectKind().GroupVersionKind().Kind // render sets TypeMeta
	existing, ok := desired.DeepCopyObject().(client.Object)
	if !ok {
		return actionNone, nil, fmt.Errorf("%T is not a client.Object", desired)
	}
	err := r.Get(ctx, client.ObjectKeyFromObject(desired), existing)
	switch {
	case apierrors.IsNotFound(err):
		answer, err := r.apply(ctx, desired)
		if err != nil {
			appliesTotal.WithLabelValues(kind, "create", "error").Inc()
			return actionNone, nil, err
		}
		appliesTotal.WithLabelValues(kind, "create", "ok").Inc()
		return actionCreated, answer, nil
	case err != nil:
		return actionNone, nil, fmt.Errorf("get: %w", err)
	}
	if owner := metav1.GetControllerOf(existing); owner == nil || owner.UID != ownerUID(desired) {
		// Never taken over: another PDCluster's (or a user's) object of the same name.
		return actionNone, nil, fmt.Errorf("%s %s exists and is not this PDCluster's: delete or rename it", kind, desired.GetName())
	}
	if upToDate(desired, existing) {
		return actionNone, existing, nil
	}
	answer, err := r.apply(ctx, desired)
	if err != nil {
		appliesTotal.WithLabelValues(kind, "update", "error").Inc()
		return actionNone, nil, err
	}
	appliesTotal.WithLabelValues(kind, "update", "ok").Inc()
	return actionUpdated, answer, nil
}

// ownerUID is the UID of obj's controller.
func ownerUID(obj client.Object) types.UID {
	if o := metav1.GetControllerOf(obj); o != nil {
		return o.UID
	}
	return ""
}

// derivative is equality.Semantic, except that an unset (zero) desired metav1.Time matches any
// time: Semantic compares times by value, so the server-set creationTimestamps (of the object
// and of a pod template) would never match what render leaves unset.
var derivative = conversion.EqualitiesOrDie(
	func(a, b resource.Quantity) bool { return a.Cmp(b) == 0 },
	func(a, b metav1.MicroTime) bool { return a.Equal(&b) },
	func(a, b metav1.Time) bool { return a.IsZero() || a.Equal(&b) },
	func(a, b labels.Selector) bool { return a.String() == b.String() },
	func(a, b fields.Selector) bool { return a.String() == b.String() },
)

// upToDate reports whether every field the operator sets already has its value: fields the
// operator leaves unset (server defaults, other managers' additions) are not compared.
func upToDate(desired, existing client.Object) bool {
	d := desired.DeepCopyObject().(client.Object)
	d.GetObjectKind().SetGroupVersionKind(existing.GetObjectKind().GroupVersionKind())
	d.SetGeneration(existing.GetGeneration()) // server-set; DeepDerivative compares ints as values
	// Status is not the operator's to set.
	switch x := existing.(type) {
	case *appsv1.Deployment:
		d.(*appsv1.Deployment).Status = x.Status
	case *lwsv1.LeaderWorkerSet:
		d.(*lwsv1.LeaderWorkerSet).Status = x.Status
	case *corev1.Service:
		d.(*corev1.Service).Status = x.Status
	}
	return derivative.DeepDerivative(d, existing)
}

// apply applies obj with server-side apply and returns the API server's answer, of obj's type.
func (r *PDClusterReconciler) apply(ctx context.Context, obj client.Object) (client.Object, error) {
	m, err := render.ToUnstructured(obj)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: m}
	if err := r.Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(v1alpha1.OperatorName), client.ForceOwnership); err != nil {
		return nil, err
	}
	answer, ok := reflect.New(reflect.TypeOf(obj).Elem()).Interface().(client.Object)
	if !ok {
		return nil, fmt.Errorf("%T is not a client.Object", obj)
	}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, answer); err != nil {
		return nil, fmt.Errorf("read the answer to applying %s: %w", obj.GetName(), err)
	}
	return answer, nil
}

// SetupWithManager registers the controller and its watches on owned children, and the pod
// reads (Reports) with their events.
func (r *PDClusterReconciler) SetupWithManager(mgr ctrl.Manager) error {
	// LeaderWorkerSets are watched when the cluster serves them now: a watch on a kind it does
	// not serve would keep the manager from starting.
	if err := r.groupSets.watch(mgr.GetRESTMapper(), leaderWorkerSetKind); err != nil {
		return err
	}
	if err := r.podGroups.watch(mgr.GetRESTMapper(), podGroupKind); err != nil {
		return err
	}
	if err := indexChildren(context.Background(), mgr.GetFieldIndexer(), r.groupSets.watched, r.podGroups.watched); err != nil {
		return err
	}
	r.childrenIndexed = true
	b := ctrl.NewControllerManagedBy(mgr)
	if r.groupSets.watched {
		b = b.Owns(&lwsv1.LeaderWorkerSet{})
	}
	if r.podGroups.watched {
		// The scheduler's verdict on a gang (its status) is status to report.
		b = b.Owns(&schedulingv1beta1.PodGroup{})
	}
	if r.Reports != nil {
		if err := mgr.Add(r.Reports); err != nil {
			return fmt.Errorf("add the pod reads: %w", err)
		}
		b = b.WatchesRawSource(source.Channel(r.Reports.Events(), &handler.EnqueueRequestForObject{}))
	}
	return b.
		For(&v1alpha1.PDCluster{}).
		Owns(&appsv1.Deployment{}).
		Owns(&corev1.Service{}).
		Owns(&corev1.ConfigMap{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Owns(&networkingv1.NetworkPolicy{}).
		// An autoscaler or `kubectl scale` writing an External pool's count.
		Owns(&v1alpha1.PoolScale{}).
		// Engine pods belong to ReplicaSets, not to the PDCluster: map them by label.
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(podToPDCluster), builder.WithPredicates(ignoreOwnDeletionCost)).
		WithOptions(controller.Options{MaxConcurrentReconciles: r.MaxConcurrentReconciles}).
		Named("pdcluster").
		Complete(r)
}

// podToPDCluster maps an engine pod to the PDCluster named in its labels.
func podToPDCluster(_ context.Context, obj client.Object) []reconcile.Request {
	name := obj.GetLabels()[v1alpha1.LabelCluster]
	if name == "" || obj.GetLabels()[v1alpha1.LabelManagedBy] != v1alpha1.OperatorName {
		return nil
	}
	return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: obj.GetNamespace(), Name: name}}}
}

// CacheOptions shape the manager's cache. Pods, Deployments, Services, ConfigMaps and
// PodDisruptionBudgets: only the ones the operator manages, by their managed-by label
// (LeaderWorkerSets are cached whole: a kind named here must be served when the cache starts,
// and the cluster may not serve it; there are few of them; caching
// every one of a large cluster would cost memory for nothing; a child whose label a user
// removed is found missing and applied again, label and all). Every object: no managedFields
// (the reconciler compares fields, never their managers; they were a third of each cached
// child). ConfigMaps: large values are kept once however many ConfigMaps hold them (the
// completion gate's plugin files, the same in every PDCluster's ConfigMap, were half the
// operator's memory per PDCluster), with the standard library's unique, which also lets a
// value go once no ConfigMap holds it.
//
// watchNamespaces, when given, confine every watch to them (the chart's namespace-scoped
// install, whose Roles grant nothing elsewhere: a cluster-wide watch would be refused and the
// cache would never sync).
func CacheOptions(watchNamespaces ...string) cache.Options {
	strip := cache.TransformStripManagedFields()
	managed := labels.SelectorFromSet(labels.Set{v1alpha1.LabelManagedBy: v1alpha1.OperatorName})
	var namespaces map[string]cache.Config
	for _, ns := range watchNamespaces {
		if namespaces == nil {
			namespaces = map[string]cache.Config{}
		}
		namespaces[ns] = cache.Config{}
	}
	return cache.Options{
		DefaultNamespaces: namespaces,
		DefaultTransform:  strip,
		ByObject: map[client.Object]cache.ByObject{
			&corev1.Pod{}:                   {Label: managed},
			&appsv1.Deployment{}:            {Label: managed},
			&corev1.Service{}:               {Label: managed},
			&policyv1.PodDisruptionBudget{}: {Label: managed},
			&networkingv1.NetworkPolicy{}:   {Label: managed},
			&corev1.ConfigMap{}: {Label: managed, Transform: func(obj any) (any, error) {
				if cm, ok := obj.(*corev1.ConfigMap); ok {
					for k, v := range cm.Data {
						if len(v) >= internMinBytes {
							cm.Data[k] = unique.Make(v).Value()
						}
					}
				}
				return strip(obj)
			}},
		},
	}
}

// internMinBytes is the size from which ConfigMap values are shared: small ones are not
// worth the lookup.
const internMinBytes = 4 << 10
