// Package connectorhealth decides when the operator restarts pods whose connector sidecar is
// unhealthy. It is pure: the reconciler observes pods, asks Decide, deletes what it is told and
// records the round, so every rule (threshold, backoff, budget, decode cascade) is tested
// without a cluster or a clock.
package connectorhealth

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// Policy is ConnectorHealthPolicy with its defaults applied.
type Policy struct {
	Period                   time.Duration
	FailureThreshold         int32
	InitialBackoff           time.Duration
	MaxBackoff               time.Duration
	Budget                   int32
	Window                   time.Duration
	RestartDecodeWithPrefill bool
	// CascadeBudget bounds the rounds in Window that restart decode pods with a prefill pod.
	CascadeBudget int32
}

// PolicyFrom reads a defaulted spec ((*PDCluster).SetDefaults) into durations.
func PolicyFrom(spec v1alpha1.ConnectorHealthPolicy) Policy {
	sec := func(p *int32) time.Duration { return time.Duration(*p) * time.Second }
	return Policy{
		Period:                   sec(spec.PeriodSeconds),
		FailureThreshold:         *spec.FailureThreshold,
		InitialBackoff:           sec(spec.InitialBackoffSeconds),
		MaxBackoff:               sec(spec.MaxBackoffSeconds),
		Budget:                   *spec.RestartBudget,
		Window:                   sec(spec.BudgetWindowSeconds),
		RestartDecodeWithPrefill: *spec.RestartDecodeWithPrefill,
		CascadeBudget:            *spec.DecodeCascadeBudget,
	}
}

// Threshold is how long a connector may stay unready before its pod is restarted.
func (p Policy) Threshold() time.Duration { return p.Period * time.Duration(p.FailureThreshold) }

// Backoff is the wait after the n-th consecutive restart round (n >= 1).
func (p Policy) Backoff(n int32) time.Duration {
	b := p.InitialBackoff
	for i := int32(1); i < n && b < p.MaxBackoff; i++ {
		b *= 2
	}
	return min(b, p.MaxBackoff)
}

// Pod is one engine pod as health sees it.
type Pod struct {
	Name string
	UID  types.UID
	Role v1alpha1.Role
	// Revision is the pod's KV revision: a prefill pod is connected only to the decode pods
	// of its own (the router never pairs across revisions).
	Revision string
	// Group is the LeaderWorkerSet group the pod belongs to (its group-key label), for a
	// replica across pods; empty for a pod that is a replica alone. Restarting one pod of a
	// group restarts the group (RecreateGroupOnPodRestart).
	Group string
	// Ready is the connector container's readiness.
	Ready bool
	// StartedAt is when the connector container last started (zero when it is not running).
	StartedAt time.Time
	// ContainerRestarts are the kubelet's restarts of the connector container.
	ContainerRestarts int32
}

// Observe reads a pod's connector health. Pods that cannot have a healthy connector yet
// (pending, terminating, not started) are not judged: ok is false.
func Observe(pod *corev1.Pod) (Pod, bool) {
	role := v1alpha1.Role(pod.Labels[v1alpha1.LabelRole])
	if (role != v1alpha1.RolePrefill && role != v1alpha1.RoleDecode) || pod.DeletionTimestamp != nil || pod.Status.Phase != corev1.PodRunning {
		return Pod{}, false
	}
	i := slices.IndexFunc(pod.Status.ContainerStatuses, func(cs corev1.ContainerStatus) bool { return cs.Name == v1alpha1.ConnectorContainerName })
	if i < 0 {
		return Pod{}, false
	}
	cs := pod.Status.ContainerStatuses[i]
	p := Pod{Name: pod.Name, UID: pod.UID, Role: role, Revision: pod.Labels[v1alpha1.LabelKVRevision], Group: pod.Labels[lwsv1.GroupUniqueHashLabelKey],
		Ready: cs.Ready, ContainerRestarts: cs.RestartCount}
	if r := cs.State.Running; r != nil {
		p.StartedAt = r.StartedAt.Time
	}
	return p, true
}

// Decision is what to do about the observed pods.
type Decision struct {
	// Unhealthy are the pods whose connector is not ready, by name.
	Unhealthy []Pod
	// Due are the unhealthy pods past the threshold.
	Due []Pod
	// Restart are the pods to restart now: Due, then Cascade, one per LeaderWorkerSet group
	// (its first: the group goes with it). Empty when Blocked.
	Restart []Pod
	// Cascade are the decode pods restarted because a due prefill pod of their KV revision is
	// (restartDecodeWithPrefill), the end of Restart.
	Cascade []Pod
	// CascadeWithheld are the decode pods that would have gone with a due prefill pod but for a
	// spent cascade budget.
	CascadeWithheld []Pod
	// Blocked says why due pods are not restarted (v1alpha1.ReasonRestartBackoff, v1alpha1.ReasonRestartBudgetExhausted).
	Blocked string
	// BlockedFor is how long the block lasts (RequeueAfter may be sooner, for another pod).
	BlockedFor time.Duration
	// RequeueAfter is when the decision may change without any pod changing; 0: never.
	RequeueAfter time.Duration
	// Running counts the judged pods: running, not terminating, connector started.
	Running int
	// Status is prev with the unhealthy pods, the budget window and the consecutive rounds
	// brought up to now; RecordRound adds a round once its pods are restarted.
	Status v1alpha1.ConnectorStatus
}

// Decide applies the policy to the observed pods at now. desired is how many engine pods the
// pools should run: the consecutive rounds (and with them the backoff) reset only once that many
// pods run a ready connector, not while restarted pods are still coming back.
func Decide(now time.Time, p Policy, prev v1alpha1.ConnectorStatus, pods []Pod, desired int) Decision {
	d := Decision{Status: *prev.DeepCopy(), Running: len(pods)}
	pods = slices.Clone(pods)
	sort.Slice(pods, func(i, j int) bool { return pods[i].Name < pods[j].Name })
	wake := func(after time.Duration) {
		if after > 0 && (d.RequeueAfter == 0 || after < d.RequeueAfter) {
			d.RequeueAfter = after
		}
	}
	d.Status.ContainerRestarts = 0
	// The pod's status has no time for the connector turning unready (ContainersReady may have
	// turned False long before, for the engine), so the threshold counts from when the operator
	// first saw it, kept in status, or from the connector's last start if that is later.
	seen := map[string]time.Time{}
	for _, u := range prev.UnhealthyPods {
		seen[u.Name] = u.Since.Time
	}
	d.Status.UnhealthyPods = nil
	for _, pod := range pods {
		d.Status.ContainerRestarts += pod.ContainerRestarts
		if pod.Ready {
			continue
		}
		since, ok := seen[pod.Name]
		if !ok || since.After(now) {
			since = now
		}
		if pod.StartedAt.After(since) && !pod.StartedAt.After(now) {
			since = pod.StartedAt
		}
		d.Status.UnhealthyPods = append(d.Status.UnhealthyPods, v1alpha1.UnhealthyPod{Name: pod.Name, Since: metav1.NewTime(since)})
		d.Unhealthy = append(d.Unhealthy, pod)
		if unready := now.Sub(since); unready >= p.Threshold() {
			d.Due = append(d.Due, pod)
		} else {
			wake(p.Threshold() - unready)
		}
	}
	d.Status.RecentRounds = inWindow(d.Status.RecentRounds, now, p.Window)
	d.Status.RecentCascadeRounds = inWindow(d.Status.RecentCascadeRounds, now, p.Window)
	if len(d.Unhealthy) == 0 {
		if len(pods) >= desired {
			d.Status.ConsecutiveRounds = 0
		}
		return d
	}
	if len(d.Due) == 0 {
		return d
	}
	if int32(len(d.Status.RecentRounds)) >= p.Budget {
		d.Blocked = v1alpha1.ReasonRestartBudgetExhausted
		if len(d.Status.RecentRounds) > 0 {
			d.BlockedFor = d.Status.RecentRounds[0].Add(p.Window).Sub(now)
			wake(d.BlockedFor)
		}
		return d
	}
	if n := d.Status.ConsecutiveRounds; n > 0 && d.Status.LastRestartTime != nil {
		if next := d.Status.LastRestartTime.Add(p.Backoff(n)); next.After(now) {
			d.Blocked, d.BlockedFor = v1alpha1.ReasonRestartBackoff, next.Sub(now)
			wake(d.BlockedFor)
			return d
		}
	}
	d.Restart = append(d.Restart, d.Due...)
	var cascade []Pod
	if p.RestartDecodeWithPrefill {
		for _, pod := range pods {
			connected := slices.ContainsFunc(d.Due, func(x Pod) bool { return x.Role == v1alpha1.RolePrefill && x.Revision == pod.Revision })
			if pod.Role == v1alpha1.RoleDecode && connected && !slices.ContainsFunc(d.Due, func(x Pod) bool { return x.Name == pod.Name }) {
				cascade = append(cascade, pod)
			}
		}
	}
	switch {
	case len(cascade) == 0:
	case int32(len(d.Status.RecentCascadeRounds)) < p.CascadeBudget:
		d.Cascade = cascade
		d.Restart = append(d.Restart, cascade...)
	default:
		d.CascadeWithheld = cascade
	}
	d.Restart = onePerGroup(d.Restart)
	wake(p.Threshold())
	return d
}

// onePerGroup is pods without a second pod of a group already in it: deleting one pod of a
// LeaderWorkerSet group recreates all of them, and a delete of each would only race it.
func onePerGroup(pods []Pod) []Pod {
	seen := map[string]bool{}
	return slices.DeleteFunc(pods, func(p Pod) bool {
		if p.Group == "" {
			return false
		}
		dup := seen[p.Group]
		seen[p.Group] = true
		return dup
	})
}

// inWindow keeps the rounds younger than window at now (nil for none).
func inWindow(rounds []metav1.Time, now time.Time, window time.Duration) []metav1.Time {
	rounds = slices.DeleteFunc(rounds, func(t metav1.Time) bool { return !t.Add(window).After(now) })
	if len(rounds) == 0 {
		return nil
	}
	return rounds
}

// RecordRound adds the restart round d decided at now to status, counting the pods restarted
// (those deleted, or already gone): a round that restarted none is no round, and one whose
// restarted pods include some of d.Cascade is a cascade round too.
func RecordRound(status *v1alpha1.ConnectorStatus, now time.Time, d Decision, restarted []Pod) {
	if len(restarted) == 0 {
		return
	}
	t := metav1.NewTime(now)
	status.Restarts += int32(len(restarted))
	status.ConsecutiveRounds++
	status.LastRestartTime = &t
	status.RecentRounds = append(status.RecentRounds, t)
	var cascaded int32
	for _, r := range restarted {
		if slices.ContainsFunc(d.Cascade, func(c Pod) bool { return c.Name == r.Name }) {
			cascaded++
		}
	}
	if cascaded > 0 {
		status.DecodeCascadeRestarts += cascaded
		status.RecentCascadeRounds = append(status.RecentCascadeRounds, t)
	}
}

// Names lists the pods' names.
func Names(pods []Pod) []string {
	if len(pods) == 0 {
		return nil
	}
	out := make([]string, len(pods))
	for i, p := range pods {
		out[i] = p.Name
	}
	return out
}

// Describe is the user-facing account of d, for the ConnectorHealthy condition.
func Describe(p Policy, d Decision) string {
	switch {
	case len(d.Unhealthy) == 0:
		return fmt.Sprintf("%d running connectors ready", d.Running)
	case d.Blocked == v1alpha1.ReasonRestartBudgetExhausted && p.Budget == 0:
		return fmt.Sprintf("connector not ready in %s; operator restarts are off (restartBudget: 0)", strings.Join(Names(d.Unhealthy), ", "))
	case d.Blocked == v1alpha1.ReasonRestartBudgetExhausted:
		return fmt.Sprintf("connector not ready in %s; %d restart rounds in the last %s spent the budget, so restarts stop until the window frees one: check the connector logs",
			strings.Join(Names(d.Unhealthy), ", "), len(d.Status.RecentRounds), p.Window)
	case d.Blocked == v1alpha1.ReasonRestartBackoff:
		return fmt.Sprintf("connector not ready in %s; next restart in %s (backoff after %d rounds)",
			strings.Join(Names(d.Unhealthy), ", "), d.BlockedFor.Round(time.Second), d.Status.ConsecutiveRounds)
	case len(d.Cascade) > 0:
		return fmt.Sprintf("restarted %s: connector not ready for %s or more; restarted the decode pods connected to it too: %s",
			strings.Join(Names(d.Due), ", "), p.Threshold(), strings.Join(Names(d.Cascade), ", "))
	case len(d.Restart) > 0 && len(d.CascadeWithheld) > 0:
		return fmt.Sprintf("restarted %s: connector not ready for %s or more; the decode pods connected to it (%s) keep running: the decodeCascadeBudget is spent (%d rounds in the last %s took decode pods along)",
			strings.Join(Names(d.Restart), ", "), p.Threshold(), strings.Join(Names(d.CascadeWithheld), ", "), len(d.Status.RecentCascadeRounds), p.Window)
	case len(d.Restart) > 0:
		return fmt.Sprintf("restarted %s: connector not ready for %s or more", strings.Join(Names(d.Restart), ", "), p.Threshold())
	}
	return fmt.Sprintf("connector not ready in %s; a pod is restarted after %s unready", strings.Join(Names(d.Unhealthy), ", "), p.Threshold())
}
