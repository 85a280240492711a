package controllers

import (
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// problemReasons are the pool condition reasons podProblem gives, for events on a change.
var problemReasons = []string{v1alpha1.ReasonUnschedulable, v1alpha1.ReasonImagePullFailed, v1alpha1.ReasonCrashLoopBackOff, v1alpha1.ReasonContainerFailed}

// waitingReasons maps a container's waiting reason to the pool condition's reason.
var waitingReasons = map[string]string{
	"CrashLoopBackOff":           v1alpha1.ReasonCrashLoopBackOff,
	"ErrImagePull":               v1alpha1.ReasonImagePullFailed,
	"ImagePullBackOff":           v1alpha1.ReasonImagePullFailed,
	"InvalidImageName":           v1alpha1.ReasonImagePullFailed,
	"ErrImageNeverPull":          v1alpha1.ReasonImagePullFailed,
	"CreateContainerConfigError": v1alpha1.ReasonContainerFailed,
	"CreateContainerError":       v1alpha1.ReasonContainerFailed,
	"RunContainerError":          v1alpha1.ReasonContainerFailed,
}

// maxProblemMessage bounds what a container's own message adds to a condition.
const maxProblemMessage = 300

// podProblem is the most actionable reason pods are not running, in the words of whoever found
// it: a pod the scheduler cannot place first (nothing else happens to it), then an image that
// cannot be pulled, then a container that cannot start or keeps crashing. Empty when none.
func podProblem(pods []corev1.Pod) (reason, message string) {
	pods = slices.Clone(pods)
	slices.SortFunc(pods, func(a, b corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	rank := func(r string) int { return slices.Index(problemReasons, r) }
	for _, pod := range pods {
		if pod.DeletionTimestamp != nil {
			continue
		}
		for _, c := range pod.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
				return v1alpha1.ReasonUnschedulable, fmt.Sprintf("pod %s: %s", pod.Name, c.Message)
			}
		}
		for _, cs := range pod.Status.ContainerStatuses {
			w := cs.State.Waiting
			if w == nil {
				continue
			}
			r, ok := waitingReasons[w.Reason]
			if !ok || (reason != "" && rank(r) >= rank(reason)) {
				continue
			}
			reason, message = r, fmt.Sprintf("pod %s container %s: %s", pod.Name, cs.Name, w.Reason)
			if last := cs.LastTerminationState.Terminated; r == v1alpha1.ReasonCrashLoopBackOff && last != nil {
				message += fmt.Sprintf(" (%d restarts); last exit code %d", cs.RestartCount, last.ExitCode)
				if last.Reason != "" {
					message += " (" + last.Reason + ")"
				}
				if last.Message != "" {
					message += ": " + clip(last.Message)
				}
			} else if w.Message != "" {
				message += ": " + clip(w.Message)
			}
		}
	}
	return reason, message
}

// clipped marks where clip cut a message.
const clipped = " ... "

// clip bounds a container's message to maxProblemMessage bytes (and the mark), keeping both
// ends: the kubelet and the engine say what failed first and why last (containerd's cause of a
// failed pull, Python's exception), cut on rune boundaries.
func clip(s string) string {
	s = strings.TrimSpace(s)
	if len(s) <= maxProblemMessage {
		return s
	}
	head, tail := maxProblemMessage/3, len(s)-(maxProblemMessage-maxProblemMessage/3)
	for head > 0 && !utf8.RuneStart(s[head]) {
		head--
	}
	for tail < len(s) && !utf8.RuneStart(s[tail]) {
		tail++
	}
	return s[:head] + clipped + s[tail:]
}
