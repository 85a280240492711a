package controllers

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/controllers/connectorhealth"
	"pdcluster.dev/pdcluster-operator/controllers/kvverify"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/scaling"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// poolStatusOf observes p's children through r and computes its status with applied as this
// reconcile's apply.
func poolStatusOf(t *testing.T, r *PDClusterReconciler, p *v1alpha1.PDCluster, applied []render.Object) *v1alpha1.PDClusterStatus {
	t.Helper()
	in := statusInputs{pdc: p, applied: applied, obs: r.observe(context.Background(), p, applied, r.now())}
	if err := in.obs.err(); err != nil {
		t.Fatal(err)
	}
	st, _ := computeStatus(in)
	return &st
}

func TestGateStatusSumsEachPool(t *testing.T) {
	pods := []client.Object{
		wrappers.MakeEnginePod("ns", "p-0", "c", v1alpha1.RolePrefill, start).Obj(),
		wrappers.MakeEnginePod("ns", "d-0", "c", v1alpha1.RoleDecode, start).Obj(),
		wrappers.MakeEnginePod("ns", "d-1", "c", v1alpha1.RoleDecode, start).Obj(),
		wrappers.MakeEnginePod("ns", "d-2", "c", v1alpha1.RoleDecode, start).Obj(),                          // sidecar answers, gate silent
		wrappers.MakeEnginePod("ns", "d-3", "c", v1alpha1.RoleDecode, start).Obj(),                          // sidecar unreachable
		wrappers.MakeEnginePod("ns", "d-5", "c", v1alpha1.RoleDecode, start).ConnectorUnready(start).Obj(),  // gate silent: the connector is unready for it
		wrappers.MakeEnginePod("ns", "d-6", "c", v1alpha1.RoleDecode, start).ConnectorUnready(start).Obj(),  // unready, gate reporting: not the gate
		wrappers.MakeEnginePod("ns", "d-4", "c", v1alpha1.RoleDecode, start).Phase(corev1.PodPending).Obj(), // not read
		wrappers.MakeEnginePod("ns", "r-0", "c", v1alpha1.RoleRouter, start).Obj(),                          // not an engine
	}
	gates := fakeGates{
		"p-0": loaded(0, 0, 0),
		"d-0": loaded(2, 10, 1),
		"d-1": loaded(3, 5, 0),
		"d-2": {Report: &vllm.Report{Connector: "GatedMooncakeConnector", Counts: vllm.Counts{Gated: 99}}},
		"d-5": {},
		"d-6": loaded(0, 0, 0),
		"d-4": loaded(100, 100, 100),
		"r-0": loaded(100, 100, 100),
	}
	cases := []struct {
		name        string
		gate        v1alpha1.CompletionGate
		reader      GateReader
		wantPrefill *v1alpha1.PoolGateStatus
		wantDecode  *v1alpha1.PoolGateStatus
		wantSilent  []string
		wantAfter   time.Duration
		noVerify    bool
	}{
		{
			name: "counts of the reporting pods, silent and unreachable ones apart", reader: gates,
			wantPrefill: &v1alpha1.PoolGateStatus{ReportingPods: 1},
			wantDecode:  &v1alpha1.PoolGateStatus{ReportingPods: 3, SilentPods: 2, GatedCompletions: 5, PassedCompletions: 15, FailedPulls: 1},
			wantSilent:  []string{"d-5"},
			wantAfter:   gateRefresh,
		},
		{name: "no reader: no counts", reader: nil},
		{name: "gate disabled: no gate counts, still read for KV verification", reader: gates, gate: v1alpha1.CompletionGateDisabled, wantAfter: gateRefresh},
		{name: "gate and KV verification disabled: not read", reader: gates, gate: v1alpha1.CompletionGateDisabled, noVerify: true},
		{name: "nothing answers: no counts, read again later", reader: fakeGates{}, wantAfter: gateRefresh},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newFakeClient(t).WithObjects(pods...).Build()
			r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), GateReader: tc.reader}
			p := pdc()
			p.Spec.KVTransfer.CompletionGate = tc.gate
			if tc.noVerify {
				p.Spec.KVTransfer.Verification.Mode = v1alpha1.KVVerificationDisabled
			}
			// A stale value from an earlier read must not survive a reconcile that reads nothing.
			p.Status.Decode.Gate = &v1alpha1.PoolGateStatus{GatedCompletions: 1234}
			in := statusInputs{pdc: p, obs: r.observe(context.Background(), p, nil, r.now())}
			if err := in.obs.err(); err != nil {
				t.Fatal(err)
			}
			status, _ := computeStatus(in)
			silent := gateSummary(gateAnswers(p, in.obs), nil).silent
			var after time.Duration
			if in.obs.gatesRead {
				after = gateRefresh
			}
			if d := cmp.Diff(tc.wantSilent, silent); d != "" {
				t.Errorf("pods unready for a silent gate (-want +got):\n%s", d)
			}
			// The status names them: CompletionGated False/GateSilent.
			if c := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionCompletionGated); len(tc.wantSilent) > 0 &&
				(c == nil || c.Reason != v1alpha1.ReasonGateSilent || !strings.Contains(c.Message, strings.Join(tc.wantSilent, ", "))) {
				t.Errorf("CompletionGated = %+v, want GateSilent naming %v", c, tc.wantSilent)
			}
			if d := cmp.Diff(tc.wantPrefill, status.Prefill.Gate); d != "" {
				t.Errorf("prefill gate (-want +got):\n%s", d)
			}
			if d := cmp.Diff(tc.wantDecode, status.Decode.Gate); d != "" {
				t.Errorf("decode gate (-want +got):\n%s", d)
			}
			if after != tc.wantAfter {
				t.Errorf("requeue after %s, want %s", after, tc.wantAfter)
			}
		})
	}
}

func TestGateConditionNamesSilentPods(t *testing.T) {
	cond := func(s metav1.ConditionStatus, reason string) *metav1.Condition {
		return &metav1.Condition{Type: v1alpha1.ConditionCompletionGated, Status: s, Reason: reason}
	}
	cases := []struct {
		name       string
		disabled   bool
		before     *metav1.Condition
		silent     []string
		wantStatus metav1.ConditionStatus
		wantReason string
		wantInMsg  string
		wantEvents []string // reasons
	}{
		{name: "enabled, every gate reports", wantStatus: metav1.ConditionTrue, wantReason: v1alpha1.ReasonGateEnabled},
		{name: "a pod unready for its silent gate is named, once", before: cond(metav1.ConditionTrue, v1alpha1.ReasonGateEnabled), silent: []string{"d-0", "d-1"},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonGateSilent, wantInMsg: "d-0, d-1", wantEvents: []string{v1alpha1.ReasonGateSilent}},
		{name: "still silent: no new event", before: cond(metav1.ConditionFalse, v1alpha1.ReasonGateSilent), silent: []string{"d-0"},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonGateSilent, wantInMsg: "pdgate"},
		{name: "reports again", before: cond(metav1.ConditionFalse, v1alpha1.ReasonGateSilent),
			wantStatus: metav1.ConditionTrue, wantReason: v1alpha1.ReasonGateEnabled, wantEvents: []string{v1alpha1.ReasonGateEnabled}},
		{name: "disabled: silence does not apply", disabled: true, before: cond(metav1.ConditionFalse, v1alpha1.ReasonGateDisabled), silent: []string{"d-0"},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonGateDisabled},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := wrappers.MakePDCluster("ns", "c").Obj()
			if tc.disabled {
				p.Spec.KVTransfer.CompletionGate = v1alpha1.CompletionGateDisabled
			}
			if tc.before != nil {
				p.Status.Conditions = []metav1.Condition{*tc.before}
			}
			status := p.Status.DeepCopy()
			pending := gateCondition(p, status, tc.silent)
			c := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionCompletionGated)
			if c == nil || c.Status != tc.wantStatus || c.Reason != tc.wantReason || !strings.Contains(c.Message, tc.wantInMsg) {
				t.Errorf("condition = %+v, want %s/%s with %q", c, tc.wantStatus, tc.wantReason, tc.wantInMsg)
			}
			var reasons []string
			for _, e := range pending {
				reasons = append(reasons, e.reason)
			}
			if d := cmp.Diff(tc.wantEvents, reasons); d != "" {
				t.Errorf("events (-want +got):\n%s", d)
			}
		})
	}
}

// A decode pool asking for more GPUs than any node has: Ready and DecodeReady say why in the
// scheduler's words, with one Warning event, not "ComponentsNotReady: not ready: [decode]".
func TestUnschedulableDecodeIsTheReadyReason(t *testing.T) {
	p := pdc()
	deps := []client.Object{}
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode, v1alpha1.RoleRouter} {
		ready := int32(1)
		if role == v1alpha1.RoleDecode {
			ready = 0
		}
		deps = append(deps, &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: render.ObjectName("c", role), Generation: 1, Labels: render.Labels("c", role)},
			Spec:       appsv1.DeploymentSpec{Replicas: ptr.To[int32](1)},
			Status:     appsv1.DeploymentStatus{ObservedGeneration: 1, UpdatedReplicas: 1, ReadyReplicas: ready},
		})
	}
	for _, d := range deps {
		if err := controllerutil.SetControllerReference(p, d, newFakeClient(t).Build().Scheme()); err != nil {
			t.Fatal(err)
		}
	}
	c := newFakeClient(t).WithObjects(p, unschedulable(pod("d-0", v1alpha1.RoleDecode, 0)), pod("p-0", v1alpha1.RolePrefill, 0)).
		WithObjects(deps...).WithStatusSubresource(&v1alpha1.PDCluster{}).Build()
	rec := events.NewFakeRecorder(100)
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), Recorder: rec, Options: render.DefaultOptions(), Clock: clocktesting.NewFakePassiveClock(start)}
	in := statusInputs{pdc: p, obs: r.observe(context.Background(), p, nil, r.now())}
	if err := in.obs.err(); err != nil {
		t.Fatal(err)
	}
	st, _ := computeStatus(in)
	status := &st
	for _, typ := range []string{v1alpha1.ConditionReady, v1alpha1.ConditionDecodeReady} {
		cond := meta.FindStatusCondition(status.Conditions, typ)
		if cond == nil || cond.Status != metav1.ConditionFalse || cond.Reason != v1alpha1.ReasonUnschedulable || !strings.Contains(cond.Message, gpuMessage) {
			t.Errorf("%s = %+v, want False/Unschedulable with the scheduler's message", typ, cond)
		}
	}
	if got := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionReady).Message; !strings.HasPrefix(got, "decode: pod d-0: ") {
		t.Errorf("Ready message %q does not name the pool and the pod", got)
	}
	evs := poolProblemEvents(nil, status)
	if len(evs) != 1 || evs[0].kind != corev1.EventTypeWarning || evs[0].reason != v1alpha1.ReasonUnschedulable {
		t.Fatalf("events = %+v, want one Warning Unschedulable", evs)
	}
	if again := poolProblemEvents(status.Conditions, status); len(again) != 0 {
		t.Errorf("events on an unchanged reason: %+v", again)
	}

	// Through Reconcile: the event is recorded once.
	for range 2 {
		if _, err := r.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(p)}); err != nil {
			t.Fatalf("reconcile: %v", err)
		}
	}
	n := 0
	for len(rec.Events) > 0 {
		if e := <-rec.Events; strings.Contains(e, "Unschedulable") {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d Unschedulable events over two reconciles, want 1", n)
	}
}

// Right after a scale from 2 to 3 the cache may still hold the Deployment as it was, fully
// ready: that is not a Ready pool of 3.
func TestStaleCachedDeploymentIsNotReady(t *testing.T) {
	p := pdc() // decode: 2 replicas
	var objs []client.Object
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		dep, err := render.EngineDeployment(p, render.DefaultOptions(), role)
		if err != nil {
			t.Fatal(err)
		}
		dep.Status = appsv1.DeploymentStatus{ObservedGeneration: dep.Generation, Replicas: *dep.Spec.Replicas, UpdatedReplicas: *dep.Spec.Replicas, ReadyReplicas: *dep.Spec.Replicas}
		if err := controllerutil.SetControllerReference(p, dep, newFakeClient(t).Build().Scheme()); err != nil {
			t.Fatal(err)
		}
		objs = append(objs, dep)
	}
	c := newFakeClient(t).WithObjects(objs...).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), Recorder: events.NewFakeRecorder(10), Options: render.DefaultOptions()}
	applied := func() []render.Object {
		objs, err := render.Render(p, render.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		return objs
	}
	status := poolStatusOf(t, r, p, applied())
	if cond := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionDecodeReady); cond == nil || cond.Status != metav1.ConditionTrue {
		t.Fatalf("DecodeReady = %+v with the cache in step, want True", cond)
	}
	p.Spec.Decode.Replicas = ptr.To[int32](3) // applied; the cache has not seen it yet
	status = poolStatusOf(t, r, p, applied())
	cond := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionDecodeReady)
	if cond == nil || cond.Status != metav1.ConditionFalse || cond.Reason != v1alpha1.ReasonRollingOut {
		t.Errorf("DecodeReady = %+v, want False/RollingOut while the cache is behind", cond)
	}
}

// A Deployment's counts, read as a pool's readiness. readyReplicas counts old pods too, so a
// rollout whose new pod is not ready yet must not read as ready (seen on the real node).
func TestPoolStatusFromDeploymentCounts(t *testing.T) {
	for _, tc := range []struct {
		name                           string
		generation, observed           int64
		replicas, updated, ready, want int32
		reason                         string
	}{
		{"all new and ready", 2, 2, 1, 1, 1, 1, v1alpha1.ReasonReplicasReady},
		{"spec not observed yet", 3, 2, 1, 1, 1, 1, v1alpha1.ReasonRollingOut},
		{"new pod created, old one still serving", 2, 2, 2, 1, 1, 1, v1alpha1.ReasonRollingOut},
		{"new pods not ready", 2, 2, 2, 2, 1, 2, v1alpha1.ReasonReplicasNotReady},
		{"scaled to zero", 2, 2, 0, 0, 0, 0, v1alpha1.ReasonScaledToZero},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dep := &appsv1.Deployment{
				ObjectMeta: metav1.ObjectMeta{Generation: tc.generation},
				Spec:       appsv1.DeploymentSpec{Replicas: ptr.To(tc.want)},
				Status:     appsv1.DeploymentStatus{ObservedGeneration: tc.observed, Replicas: tc.replicas, UpdatedReplicas: tc.updated, ReadyReplicas: tc.ready},
			}
			if _, _, reason, msg := poolStatus((&podSet{dep}).counts()); reason != tc.reason {
				t.Errorf("reason = %s (%s), want %s", reason, msg, tc.reason)
			}
		})
	}
}

// computeStatus is pure: each case gives what a reconcile learned and checks the status and
// events that come out, with no client.
func TestComputeStatus(t *testing.T) {
	readyDep := func(role v1alpha1.Role, replicas int32) *appsv1.Deployment {
		return &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: render.ObjectName("c", role), Generation: 1},
			Spec:       appsv1.DeploymentSpec{Replicas: ptr.To(replicas)},
			Status:     appsv1.DeploymentStatus{ObservedGeneration: 1, Replicas: replicas, UpdatedReplicas: replicas, ReadyReplicas: replicas},
		}
	}
	allReady := map[v1alpha1.Role]*podSet{
		v1alpha1.RolePrefill: {readyDep(v1alpha1.RolePrefill, 1)}, v1alpha1.RoleDecode: {readyDep(v1alpha1.RoleDecode, 2)}, v1alpha1.RoleRouter: {readyDep(v1alpha1.RoleRouter, 1)},
	}
	// prev is a PDCluster that was ready, with one decode restart counted and gate counts.
	prev := func() *v1alpha1.PDCluster {
		p := pdc()
		p.Status.Decode = v1alpha1.PoolStatus{Replicas: 2, ReadyReplicas: 2, UpdatedReplicas: 2, Ready: "2/2", ConnectorRestarts: 1,
			Gate: &v1alpha1.PoolGateStatus{ReportingPods: 2, PassedCompletions: 7}}
		p.Status.Conditions = []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonAllReady}}
		return p
	}
	d0 := connectorhealth.Pod{Name: "d-0", Role: v1alpha1.RoleDecode}
	restartedD0 := healthOutcome{decided: true, restarted: []connectorhealth.Pod{d0},
		decision: connectorhealth.Decision{Unhealthy: []connectorhealth.Pod{d0}, Due: []connectorhealth.Pod{d0}, Restart: []connectorhealth.Pod{d0}}}
	decodePod := func(name string) *corev1.Pod {
		return wrappers.MakeEnginePod("ns", name, "c", v1alpha1.RoleDecode, start).Obj()
	}
	recomputing := &kvverify.Verdict{Status: metav1.ConditionFalse, Reason: v1alpha1.ReasonDecodeRecomputing, Message: "d-0 0% external",
		KV: v1alpha1.KVTransferStatus{ExternalSharePercent: ptr.To[int32](0), LocalComputeTokens: 20000, RecomputingPods: []string{"d-0"}}}
	for _, tc := range []struct {
		name       string
		in         func(p *v1alpha1.PDCluster) statusInputs
		wantDecode v1alpha1.PoolStatus
		wantReady  string // reason
		wantEvents []string
	}{
		{
			name: "apply failed: Ready says so, the rest is kept",
			in: func(p *v1alpha1.PDCluster) statusInputs {
				return statusInputs{pdc: p, childrenErr: &readyError{v1alpha1.ReasonApplyFailed, "Apply", "apply x: refused", errors.New("refused")}}
			},
			wantDecode: prev().Status.Decode,
			wantReady:  v1alpha1.ReasonApplyFailed,
			wantEvents: []string{"Warning ApplyFailed", "Warning Degraded"},
		},
		{
			name: "Deployments unknown: pools keep their counts, a restart is still counted, Ready keeps its word",
			in: func(p *v1alpha1.PDCluster) statusInputs {
				return statusInputs{pdc: p, now: start, obs: observed{depsErr: errors.New("unavailable"), pods: []corev1.Pod{*decodePod("d-0")}}, health: restartedD0}
			},
			wantDecode: v1alpha1.PoolStatus{Replicas: 2, ReadyReplicas: 2, UpdatedReplicas: 2, Ready: "2/2", ConnectorRestarts: 2},
			wantReady:  v1alpha1.ReasonAllReady,
			wantEvents: []string{"Warning ConnectorRestarted"},
		},
		{
			name: "gate counts of the pool's answering pods, a restarted pod's left out",
			in: func(p *v1alpha1.PDCluster) statusInputs {
				return statusInputs{pdc: p, now: start, health: restartedD0, obs: observed{sets: allReady, gatesRead: true, gates: []gateRead{
					{v1alpha1.RoleDecode, decodePod("d-0"), loaded(100, 100, 100), start},
					{v1alpha1.RoleDecode, decodePod("d-1"), loaded(1, 2, 3), start},
				}}}
			},
			wantDecode: v1alpha1.PoolStatus{Replicas: 2, ReadyReplicas: 2, UpdatedReplicas: 2, Ready: "2/2", ConnectorRestarts: 2,
				Gate: &v1alpha1.PoolGateStatus{ReportingPods: 1, GatedCompletions: 1, PassedCompletions: 2, FailedPulls: 3}},
			wantReady:  v1alpha1.ReasonAllReady,
			wantEvents: []string{"Warning ConnectorRestarted"},
		},
		{
			name: "KV not verified: a condition and a Warning, Ready untouched",
			in: func(p *v1alpha1.PDCluster) statusInputs {
				return statusInputs{pdc: p, now: start, obs: observed{sets: allReady}, kv: recomputing}
			},
			wantDecode: v1alpha1.PoolStatus{Replicas: 2, ReadyReplicas: 2, UpdatedReplicas: 2, Ready: "2/2", ConnectorRestarts: 1},
			wantReady:  v1alpha1.ReasonAllReady,
			wantEvents: []string{"Warning DecodeRecomputing"},
		},
		{
			name: "KV not verified with requiredForReady: Ready False for it, Degraded",
			in: func(p *v1alpha1.PDCluster) statusInputs {
				q := p.DeepCopy() // the spec of this case; computeStatus must not change its input
				q.Spec.KVTransfer.Verification.RequiredForReady = true
				return statusInputs{pdc: q, now: start, obs: observed{sets: allReady}, kv: recomputing}
			},
			wantDecode: v1alpha1.PoolStatus{Replicas: 2, ReadyReplicas: 2, UpdatedReplicas: 2, Ready: "2/2", ConnectorRestarts: 1},
			wantReady:  v1alpha1.ReasonDecodeRecomputing,
			wantEvents: []string{"Warning DecodeRecomputing", "Warning Degraded"},
		},
		{
			name: "what each pool's scaler asked, beside what its Deployment runs",
			in: func(p *v1alpha1.PDCluster) statusInputs {
				scale := &scaleDecision{requested: map[v1alpha1.Role]int32{v1alpha1.RolePrefill: 1, v1alpha1.RoleDecode: 5},
					effective: scaling.Effective{Prefill: 1, Decode: 2, Why: scaling.AsRequested}}
				return statusInputs{pdc: p, now: start, obs: observed{sets: allReady}, scale: scale}
			},
			wantDecode: v1alpha1.PoolStatus{Replicas: 2, ReadyReplicas: 2, UpdatedReplicas: 2, Ready: "2/2", ConnectorRestarts: 1, RequestedReplicas: ptr.To[int32](5)},
			wantReady:  v1alpha1.ReasonAllReady,
		},
		{
			name: "the decode Deployment gone: counts cleared, restarts kept, Degraded",
			in: func(p *v1alpha1.PDCluster) statusInputs {
				deps := map[v1alpha1.Role]*podSet{v1alpha1.RolePrefill: allReady[v1alpha1.RolePrefill], v1alpha1.RoleRouter: allReady[v1alpha1.RoleRouter]}
				return statusInputs{pdc: p, now: start, obs: observed{sets: deps}}
			},
			wantDecode: v1alpha1.PoolStatus{ConnectorRestarts: 1},
			wantReady:  v1alpha1.ReasonNotReady,
			wantEvents: []string{"Warning Degraded"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := prev()
			before := p.DeepCopy()
			got, evs := computeStatus(tc.in(p))
			if d := cmp.Diff(before, p); d != "" {
				t.Errorf("computeStatus changed its input (-before +after):\n%s", d)
			}
			if d := cmp.Diff(tc.wantDecode, got.Decode); d != "" {
				t.Errorf("status.decode (-want +got):\n%s", d)
			}
			if c := meta.FindStatusCondition(got.Conditions, v1alpha1.ConditionReady); c == nil || c.Reason != tc.wantReady {
				t.Errorf("Ready = %+v, want reason %s", c, tc.wantReady)
			}
			if d := cmp.Diff(tc.wantEvents, reasons(evs)); d != "" {
				t.Errorf("events (-want +got):\n%s", d)
			}
			if got.ObservedGeneration != p.Generation {
				t.Errorf("observedGeneration %d, want %d", got.ObservedGeneration, p.Generation)
			}
		})
	}
}
