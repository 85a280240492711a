package controllers

// The PDCluster's status is computed here, in one pure function, from what a reconcile applied
// and observed and what connector health did: every status field has one writer below, and
// the events of its transitions come out with it. The reconciler writes the result once.

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers/connectorhealth"
	"pdcluster.dev/pdcluster-operator/controllers/kvverify"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// statusInputs are what one reconcile learned.
type statusInputs struct {
	// pdc is the PDCluster as read: its spec, generation and the status it had.
	pdc *v1alpha1.PDCluster
	now time.Time
	// childrenErr is the render or apply error, if any; a *readyError is reported in Ready.
	// With it nothing was observed.
	childrenErr error
	// applied are the children this reconcile applied, as rendered.
	applied []render.Object
	obs     observed
	health  healthOutcome
	// scale is what each pool's scaler asked and what the pools run; nil when undecided.
	scale *scaleDecision
	// kv is the KV transfer verdict; nil when verification is off or nothing was read.
	kv *kvverify.Verdict
	// topo is the nodes' topology domains (spec.scheduling.pairing).
	topo topology
}

// readyError is a render or apply failure as the Ready condition and a Warning event report it.
type readyError struct {
	reason, action, message string
	err                     error
}

func (e *readyError) Error() string { return e.err.Error() }
func (e *readyError) Unwrap() error { return e.err }

// event is one to emit after the status write.
type event struct{ kind, reason, action, note string }

// computeStatus returns the PDCluster's new status and the events of its transitions.
func computeStatus(in statusInputs) (v1alpha1.PDClusterStatus, []event) {
	status := *in.pdc.Status.DeepCopy()
	var events []event
	if in.childrenErr != nil {
		var re *readyError
		if errors.As(in.childrenErr, &re) {
			setCondition(&status, in.pdc, v1alpha1.ConditionReady, metav1.ConditionFalse, re.reason, re.message)
			events = append(events, event{corev1.EventTypeWarning, re.reason, re.action, re.message})
		}
	} else {
		gates := gateSummary(gateAnswers(in.pdc, in.obs), in.health.restarted)
		events = append(events, connectorStatus(&status, in)...)
		kvEvents, kv := kvStatus(&status, in.pdc, in.kv)
		events = append(events, kvEvents...)
		poolsReady := poolStatuses(&status, in, gates, kv)
		events = append(events, ratioStatus(&status, in.pdc, in.scale)...)
		events = append(events, revisionStatus(&status, in, poolsReady)...)
		pairingStatus(&status, in)
		routingStatus(&status, in)
		events = append(events, gateCondition(in.pdc, &status, gates.silent)...)
		gangStatus(&status, in.pdc, in.obs)
		events = append(events, gangEvents(in.pdc.Status.Conditions, &status)...)
	}
	events = append(events, poolProblemEvents(in.pdc.Status.Conditions, &status)...)
	events = append(events, readinessEvents(in.pdc.Status.Conditions, &status)...)
	status.ObservedGeneration = in.pdc.Generation
	return status, events
}

// connectorStatus writes status.connector and the ConnectorHealthy condition from the health
// decision and the restarts made on it.
func connectorStatus(status *v1alpha1.PDClusterStatus, in statusInputs) []event {
	h := in.health
	if !h.decided {
		return nil // the pods are unknown: keep what was known
	}
	pdc, d, policy := in.pdc, h.decision, h.policy
	status.Connector = *d.Status.DeepCopy()
	if h.deferred {
		return nil
	}
	connectorhealth.RecordRound(&status.Connector, in.now, d, h.restarted)
	before := meta.FindStatusCondition(pdc.Status.Conditions, v1alpha1.ConditionConnectorHealthy)
	msg := connectorhealth.Describe(policy, d)
	switch {
	case h.err != nil:
		msg = fmt.Sprintf("restart pods with an unready connector: %v", h.err)
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionFalse, v1alpha1.ReasonRestartFailed, msg)
		return []event{{corev1.EventTypeWarning, v1alpha1.ReasonRestartFailed, "RestartPod", msg}}
	case len(d.Unhealthy) == 0:
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionTrue, v1alpha1.ReasonConnectorsReady, msg)
		if before != nil && before.Status != metav1.ConditionTrue {
			return []event{{corev1.EventTypeNormal, v1alpha1.ReasonConnectorsReady, "Observe", msg}}
		}
	case len(h.restarted) > 0:
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionFalse, v1alpha1.ReasonConnectorRestarted, msg)
		return []event{{corev1.EventTypeWarning, v1alpha1.ReasonConnectorRestarted, "RestartPod",
			fmt.Sprintf("%s (round %d; %d of %d rounds in %s spent)", msg, status.Connector.ConsecutiveRounds, len(status.Connector.RecentRounds), policy.Budget, policy.Window)}}
	case d.Blocked != "":
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionFalse, d.Blocked, msg)
		if d.Blocked == v1alpha1.ReasonRestartBudgetExhausted && (before == nil || before.Reason != d.Blocked) {
			return []event{{corev1.EventTypeWarning, d.Blocked, "RestartPod", msg}}
		}
	default:
		setCondition(status, pdc, v1alpha1.ConditionConnectorHealthy, metav1.ConditionFalse, v1alpha1.ReasonConnectorNotReady, msg)
		if before == nil || before.Status == metav1.ConditionTrue {
			return []event{{corev1.EventTypeWarning, v1alpha1.ReasonConnectorNotReady, "Observe", msg}}
		}
	}
	return nil
}

// poolStatuses writes status.prefill, status.decode and status.router (replica counts, what the
// pools' scalers asked, the restarts counted so far, the gate counts), the pool conditions and
// Ready (kv is KVTransferVerified as it stands). It returns whether both engine pools' conditions
// are True, for the rollout's completion.
func poolStatuses(status *v1alpha1.PDClusterStatus, in statusInputs, gates gateCounts, kv *metav1.Condition) (poolsReady bool) {
	pdc := in.pdc
	restarted := map[v1alpha1.Role]int32{}
	gone := map[string]bool{}
	for _, p := range in.health.restarted {
		restarted[p.Role]++
		gone[p.Name] = true
	}
	components := []struct {
		role      v1alpha1.Role
		condition string
		out       *v1alpha1.PoolStatus
		gate      *v1alpha1.PoolGateStatus
	}{
		{v1alpha1.RolePrefill, v1alpha1.ConditionPrefillReady, &status.Prefill, gates.prefill},
		{v1alpha1.RoleDecode, v1alpha1.ConditionDecodeReady, &status.Decode, gates.decode},
		{v1alpha1.RoleRouter, v1alpha1.ConditionRouterReady, &status.Router, nil},
	}
	// A cached Deployment that differs from what this reconcile applied is the cache not having
	// caught up with the write yet, and its counts describe the previous spec (a pool just
	// scaled from 2 to 3 would read "2/2", ready).
	desired := map[string]client.Object{}
	for _, o := range in.applied {
		if _, ok := asPodSet(o); ok {
			desired[o.GetName()] = o
		}
	}
	var notReady []string
	var problem struct{ reason, msg string } // the first pool's pod problem, for Ready
	for _, c := range components {
		ps := *c.out // kept as it was while the Deployments are unknown
		ps.ConnectorRestarts = c.out.ConnectorRestarts + restarted[c.role]
		ps.Gate = c.gate
		if in.obs.depsErr != nil {
			*c.out = ps
			continue
		}
		dep, older := in.obs.sets[c.role], in.obs.olderSets[c.role]
		if dep == nil && len(older) == 0 {
			*c.out = v1alpha1.PoolStatus{ConnectorRestarts: ps.ConnectorRestarts, Gate: ps.Gate}
			setCondition(status, pdc, c.condition, metav1.ConditionFalse, v1alpha1.ReasonDeploymentAbsent, fmt.Sprintf("Deployment %s not found", render.ObjectName(pdc.Name, c.role)))
			notReady = append(notReady, string(c.role))
			continue
		}
		counts, condStatus, reason, msg := poolStatus(withOlder(dep, older))
		if dep != nil {
			if want, ok := desired[dep.GetName()]; ok && !upToDate(want, dep.Object) {
				condStatus, reason, msg = metav1.ConditionFalse, v1alpha1.ReasonRollingOut, "applying the new spec"
			}
		}
		counts.ConnectorRestarts, counts.Gate = ps.ConnectorRestarts, ps.Gate
		*c.out = counts
		if condStatus != metav1.ConditionTrue {
			// Replica counts say that pods are missing; the pods say why (not the ones just
			// restarted: they are on their way out).
			var pods []corev1.Pod
			for _, p := range podsOf(in.obs.pods, c.role) {
				if !gone[p.Name] {
					pods = append(pods, p)
				}
			}
			if why, detail := podProblem(pods); why != "" {
				reason, msg = why, detail
				if problem.reason == "" {
					problem.reason, problem.msg = why, fmt.Sprintf("%s: %s", c.role, detail)
				}
			}
			notReady = append(notReady, string(c.role))
		}
		setCondition(status, pdc, c.condition, condStatus, reason, msg)
	}
	if d := in.scale; d != nil {
		// What each pool's scaler asked (the Deployments run the decision's effective counts).
		status.Prefill.RequestedReplicas = ptrTo(d.requested[v1alpha1.RolePrefill])
		status.Decode.RequestedReplicas = ptrTo(d.requested[v1alpha1.RoleDecode])
	}
	kvReason, kvMsg := kvBlocksReady(pdc, kv)
	switch {
	case in.obs.depsErr != nil:
		// Unknown: Ready keeps what it said.
	case len(notReady) == 0 && kvReason != "":
		setCondition(status, pdc, v1alpha1.ConditionReady, metav1.ConditionFalse, kvReason, kvMsg)
	case len(notReady) == 0:
		setCondition(status, pdc, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAllReady, "prefill, decode and router are ready")
	case problem.reason != "":
		setCondition(status, pdc, v1alpha1.ConditionReady, metav1.ConditionFalse, problem.reason, problem.msg)
	default:
		setCondition(status, pdc, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonNotReady, fmt.Sprintf("not ready: %v", notReady))
	}
	return meta.IsStatusConditionTrue(status.Conditions, v1alpha1.ConditionPrefillReady) &&
		meta.IsStatusConditionTrue(status.Conditions, v1alpha1.ConditionDecodeReady)
}

// gateCounts are the gate's counts per pool and the pods whose connector is unready while
// their gate is silent (the gate is why).
type gateCounts struct {
	prefill, decode *v1alpha1.PoolGateStatus
	silent          []string
}

// gateAnswers are the sidecars' answers that speak of the gate: none with the gate disabled (the
// sidecars are then read for their engine's KV counts only).
func gateAnswers(pdc *v1alpha1.PDCluster, o observed) []gateRead {
	if !render.GateEnabled(pdc.Spec.KVTransfer) {
		return nil
	}
	return o.gates
}

// gateSummary sums the gate counts each pool's engines answered, leaving out the pods just
// restarted.
func gateSummary(reads []gateRead, restarted []connectorhealth.Pod) gateCounts {
	var g gateCounts
	for _, rd := range reads {
		if slices.ContainsFunc(restarted, func(p connectorhealth.Pod) bool { return p.Name == rd.pod.Name }) {
			continue
		}
		out := &g.prefill
		if rd.role == v1alpha1.RoleDecode {
			out = &g.decode
		}
		if *out == nil {
			*out = &v1alpha1.PoolGateStatus{}
		}
		s := *out
		if !rd.st.Loaded || rd.st.Report == nil {
			s.SilentPods++
			if !connectorReady(rd.pod) {
				g.silent = append(g.silent, rd.pod.Name)
			}
			continue
		}
		c := rd.st.Report.Counts
		s.ReportingPods++
		s.GatedCompletions += c.Gated
		s.PassedCompletions += c.Passed
		s.FailedPulls += c.Failed
	}
	slices.Sort(g.silent)
	return g
}

// connectorReady is the kubelet's readiness of the pod's connector container.
func connectorReady(pod *corev1.Pod) bool {
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == v1alpha1.ConnectorContainerName {
			return cs.Ready
		}
	}
	return false
}

// poolProblemEvents are Warning events for pool conditions that turned to a pod problem
// (Unschedulable, ImagePullFailed, CrashLoopBackOff, ContainerFailed), once per change of reason.
func poolProblemEvents(before []metav1.Condition, after *v1alpha1.PDClusterStatus) []event {
	var out []event
	for _, typ := range []string{v1alpha1.ConditionPrefillReady, v1alpha1.ConditionDecodeReady, v1alpha1.ConditionRouterReady} {
		cur := meta.FindStatusCondition(after.Conditions, typ)
		if cur == nil || cur.Status == metav1.ConditionTrue || !slices.Contains(problemReasons, cur.Reason) {
			continue
		}
		if old := meta.FindStatusCondition(before, typ); old != nil && old.Reason == cur.Reason {
			continue
		}
		out = append(out, event{corev1.EventTypeWarning, cur.Reason, "Reconcile", cur.Message})
	}
	return out
}

// poolStatus summarises a Deployment: ready only when every desired replica is ready and runs
// the current template.
func poolStatus(c podCounts) (v1alpha1.PoolStatus, metav1.ConditionStatus, string, string) {
	desired := c.wants
	ps := v1alpha1.PoolStatus{
		Replicas:        desired,
		ReadyReplicas:   c.ready,
		UpdatedReplicas: c.updated,
		Ready:           fmt.Sprintf("%d/%d", c.ready, desired),
	}
	switch {
	case desired == 0:
		return ps, metav1.ConditionTrue, v1alpha1.ReasonScaledToZero, "scaled to zero replicas"
	case !c.current || c.updated < desired:
		return ps, metav1.ConditionFalse, v1alpha1.ReasonRollingOut, fmt.Sprintf("%d/%d replicas updated", c.updated, desired)
	case c.replicas > c.updated:
		// readyReplicas counts the old pods too: until they are gone, a new pod that is not
		// ready yet hides behind an old one that is.
		return ps, metav1.ConditionFalse, v1alpha1.ReasonRollingOut, fmt.Sprintf("%d old replicas still running", c.replicas-c.updated)
	case c.ready < desired:
		return ps, metav1.ConditionFalse, v1alpha1.ReasonReplicasNotReady, fmt.Sprintf("%d/%d replicas ready", c.ready, desired)
	}
	return ps, metav1.ConditionTrue, v1alpha1.ReasonReplicasReady, fmt.Sprintf("%d/%d replicas ready", c.ready, desired)
}

func setCondition(status *v1alpha1.PDClusterStatus, pdc *v1alpha1.PDCluster, typ string, s metav1.ConditionStatus, reason, msg string) {
	meta.SetStatusCondition(&status.Conditions, metav1.Condition{
		Type: typ, Status: s, Reason: reason, Message: msg, ObservedGeneration: pdc.Generation,
	})
}

// readinessEvents are the Degraded and Recovered events of a Ready transition.
func readinessEvents(before []metav1.Condition, after *v1alpha1.PDClusterStatus) []event {
	old := meta.FindStatusCondition(before, v1alpha1.ConditionReady)
	cur := meta.FindStatusCondition(after.Conditions, v1alpha1.ConditionReady)
	if cur == nil || (old != nil && old.Status == cur.Status) {
		return nil
	}
	switch {
	case cur.Status == metav1.ConditionTrue:
		return []event{{corev1.EventTypeNormal, "Ready", "Reconcile", cur.Message}}
	case old != nil && old.Status == metav1.ConditionTrue:
		return []event{{corev1.EventTypeWarning, "Degraded", "Reconcile", cur.Message}}
	}
	return nil
}

// gateCondition writes CompletionGated: whether the engines run the completion-gated
// connector; a user who turns it off is told, once, what that risks, and pods whose connector
// is unready because their gate is silent are named.
func gateCondition(pdc *v1alpha1.PDCluster, status *v1alpha1.PDClusterStatus, silent []string) []event {
	before := meta.FindStatusCondition(pdc.Status.Conditions, v1alpha1.ConditionCompletionGated)
	if render.GateEnabled(pdc.Spec.KVTransfer) && len(silent) > 0 {
		msg := fmt.Sprintf("the completion gate of %s has not reported, so its connector is unready and the pod is restarted: "+
			"is vLLM loading the pdgate plugin (kv_connector_module_path, PYTHONPATH)? see the engine log for an UnsupportedVLLM or import error",
			strings.Join(silent, ", "))
		setCondition(status, pdc, v1alpha1.ConditionCompletionGated, metav1.ConditionFalse, v1alpha1.ReasonGateSilent, msg)
		if before == nil || before.Reason != v1alpha1.ReasonGateSilent {
			return []event{{corev1.EventTypeWarning, v1alpha1.ReasonGateSilent, "Observe", msg}}
		}
		return nil
	}
	if render.GateEnabled(pdc.Spec.KVTransfer) {
		setCondition(status, pdc, v1alpha1.ConditionCompletionGated, metav1.ConditionTrue, v1alpha1.ReasonGateEnabled,
			"engines load the pdgate plugin: pulls with no local KV block are never reported to vLLM's scheduler as finished")
		switch {
		case before != nil && before.Reason == v1alpha1.ReasonGateDisabled:
			return []event{{corev1.EventTypeNormal, v1alpha1.ReasonGateEnabled, "Render", "completion gate enabled; engines roll to load it"}}
		case before != nil && before.Reason == v1alpha1.ReasonGateSilent:
			return []event{{corev1.EventTypeNormal, v1alpha1.ReasonGateEnabled, "Observe", "every engine's completion gate reports again"}}
		}
		return nil
	}
	msg := "kvTransfer.completionGate is Disabled: engines run vLLM's stock connector, which reports pulls with no local KV block (early aborts, rejected requests, full prefix hits) as finished and can kill the decode engine"
	setCondition(status, pdc, v1alpha1.ConditionCompletionGated, metav1.ConditionFalse, v1alpha1.ReasonGateDisabled, msg)
	if before == nil || before.Status != metav1.ConditionFalse {
		return []event{{corev1.EventTypeWarning, v1alpha1.ReasonGateDisabled, "Render", msg}}
	}
	return nil
}

// percentOf is part's whole percent of part+rest, rounded down; nil unless both are
// non-negative and one is positive. The routers' counts saturate at MaxInt64, so the whole is
// summed and multiplied in 128 bits: in int64 they wrap, in float64 99.99% rounds up to 100.
func percentOf(part, rest int64) *int32 {
	if part < 0 || rest < 0 || part == 0 && rest == 0 {
		return nil
	}
	whole := uint64(part) + uint64(rest) // < 2^64: each is below 2^63
	hi, lo := bits.Mul64(uint64(part), 100)
	q, _ := bits.Div64(hi, lo, whole) // hi < whole as part <= whole: no panic
	return ptrTo(int32(q))
}
