package controllers

import (
	"context"
	"errors"
	"iter"
	"math"
	"net/http"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/log"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// CanaryReader reads a router pod's newest canary (verification mode Canary).
type CanaryReader interface {
	ReadCanary(ctx context.Context, pod *corev1.Pod) (routerconfig.CanaryResult, error)
}

// errNoCanary: the router has sent no canary yet.
var errNoCanary = errors.New("no canary yet")

// PairsReader reads a router pod's pair counts by locality (spec.scheduling.pairing).
type PairsReader interface {
	ReadPairs(ctx context.Context, pod *corev1.Pod) (routerconfig.PairCounts, error)
}

// RoutingReader reads what a router pod's routing strategy found the picked engines holding
// (spec.router.routing PrefixAware, KVEvents).
type RoutingReader interface {
	ReadRouting(ctx context.Context, pod *corev1.Pod) (routerconfig.RoutingCounts, error)
}

// HTTPRouterReader reads GET /canary, GET /pairs and GET /routing on the router's metrics port
// (render.RouterMetricsPort, which its clients cannot reach) at the pod's IP.
type HTTPRouterReader struct{ podHTTP }

// NewHTTPRouterReader reads the routers this operator renders.
func NewHTTPRouterReader() *HTTPRouterReader {
	return &HTTPRouterReader{newPodHTTP(render.RouterMetricsPort)}
}

// ReadPairs implements PairsReader.
func (h *HTTPRouterReader) ReadPairs(ctx context.Context, pod *corev1.Pod) (routerconfig.PairCounts, error) {
	var pc routerconfig.PairCounts
	_, err := h.getJSON(ctx, pod, routerconfig.PairsPath, &pc)
	return pc, err
}

// ReadRouting implements RoutingReader.
func (h *HTTPRouterReader) ReadRouting(ctx context.Context, pod *corev1.Pod) (routerconfig.RoutingCounts, error) {
	var rc routerconfig.RoutingCounts
	_, err := h.getJSON(ctx, pod, routerconfig.RoutingPath, &rc)
	return rc, err
}

// readRouting sums the routing counts of the PDCluster's running router pods (each router's
// index holds the same engines': of the index and the lag, the largest); nil when none
// answered.
func (r *PDClusterReconciler) readRouting(ctx context.Context, pods []corev1.Pod) *routerconfig.RoutingCounts {
	var sum *routerconfig.RoutingCounts
	for pod := range runningRouters(pods) {
		rc, err := r.RoutingReader.ReadRouting(ctx, pod)
		if err != nil {
			log.FromContext(ctx).V(1).Info("routing counts not read", "pod", pod.Name, "error", err.Error())
			continue
		}
		if !routingCountsValid(rc.Prefill) || !routingCountsValid(rc.Decode) {
			log.FromContext(ctx).Info("routing counts refused: a count below 0 or more held than routed", "pod", pod.Name, "counts", rc)
			continue
		}
		if sum == nil {
			sum = &routerconfig.RoutingCounts{}
		}
		for _, p := range []struct {
			into, from *routerconfig.PoolRoutingCounts
		}{{&sum.Prefill, &rc.Prefill}, {&sum.Decode, &rc.Decode}} {
			p.into.PromptBlocks = saturatingAdd(p.into.PromptBlocks, p.from.PromptBlocks)
			p.into.HeldBlocks = saturatingAdd(p.into.HeldBlocks, p.from.HeldBlocks)
			p.into.PromptChunks = saturatingAdd(p.into.PromptChunks, p.from.PromptChunks)
			p.into.HeldChunks = saturatingAdd(p.into.HeldChunks, p.from.HeldChunks)
			p.into.IndexBlocks = max(p.into.IndexBlocks, p.from.IndexBlocks)
			p.into.EventsLagMilliseconds = max(p.into.EventsLagMilliseconds, p.from.EventsLagMilliseconds)
		}
	}
	return sum
}

// routingCountsValid: a router pod is trusted no further than its counts' sense (a lag past
// routerconfig.MaxEventsLag is an engine's forged date the router should have refused).
func routingCountsValid(c routerconfig.PoolRoutingCounts) bool {
	return c.PromptBlocks >= 0 && c.PromptChunks >= 0 && c.HeldBlocks >= 0 && c.HeldChunks >= 0 &&
		c.HeldBlocks <= c.PromptBlocks && c.HeldChunks <= c.PromptChunks && c.IndexBlocks >= 0 &&
		c.EventsLagMilliseconds >= 0 && c.EventsLagMilliseconds <= routerconfig.MaxEventsLag.Milliseconds()
}

// readPairs sums the pair counts of the PDCluster's running router pods; nil when none
// answered.
func (r *PDClusterReconciler) readPairs(ctx context.Context, pods []corev1.Pod) *routerconfig.PairCounts {
	var sum *routerconfig.PairCounts
	for pod := range runningRouters(pods) {
		pc, err := r.PairsReader.ReadPairs(ctx, pod)
		if err != nil {
			log.FromContext(ctx).V(1).Info("pair counts not read", "pod", pod.Name, "error", err.Error())
			continue
		}
		if pc.SameDomain < 0 || pc.CrossDomain < 0 {
			log.FromContext(ctx).Info("pair counts refused: a count below 0", "pod", pod.Name, "sameDomain", pc.SameDomain, "crossDomain", pc.CrossDomain)
			continue
		}
		if sum == nil {
			sum = &routerconfig.PairCounts{}
		}
		// Router pods are trusted no further than their counts' type: a sum saturates.
		sum.SameDomain = saturatingAdd(sum.SameDomain, pc.SameDomain)
		sum.CrossDomain = saturatingAdd(sum.CrossDomain, pc.CrossDomain)
	}
	return sum
}

// saturatingAdd is a+b for non-negative a and b, math.MaxInt64 past it.
func saturatingAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// canaryClockSkew is how far in the future of the operator's clock a router may date its
// canary (clocks of different nodes): dated later, it is refused; dated within, it is taken as
// now, so that a router's clock cannot keep its canary the newest or fresh for ever.
const canaryClockSkew = time.Minute

// ReadCanary implements CanaryReader.
func (h *HTTPRouterReader) ReadCanary(ctx context.Context, pod *corev1.Pod) (routerconfig.CanaryResult, error) {
	var res routerconfig.CanaryResult
	code, err := h.getJSON(ctx, pod, routerconfig.CanaryPath, &res)
	switch {
	case code == http.StatusNotFound:
		return routerconfig.CanaryResult{}, errNoCanary
	case err != nil:
		return routerconfig.CanaryResult{}, err
	}
	return res, nil
}

// readCanary is the newest canary of the PDCluster's running router pods, or nil. Routers are
// few (spec.router.replicas); each read is bounded by the reader's timeout.
func (r *PDClusterReconciler) readCanary(ctx context.Context, pods []corev1.Pod) *v1alpha1.CanaryResult {
	var newest *v1alpha1.CanaryResult
	for pod := range runningRouters(pods) {
		res, err := r.CanaryReader.ReadCanary(ctx, pod)
		if err != nil {
			if !errors.Is(err, errNoCanary) {
				log.FromContext(ctx).V(1).Info("canary not read", "pod", pod.Name, "error", err.Error())
			}
			continue
		}
		now := r.now()
		if res.Time.After(now.Add(canaryClockSkew)) {
			log.FromContext(ctx).Info("canary refused: dated in the future of the operator's clock", "pod", pod.Name, "time", res.Time, "now", now)
			continue
		}
		if res.Time.After(now) {
			res.Time = now
		}
		c := canaryStatus(pod.Name, res)
		if newest == nil || c.Time.After(newest.Time.Time) {
			newest = &c
		}
	}
	return newest
}

// canaryStatus is a router's canary in the PDCluster's words.
func canaryStatus(router string, res routerconfig.CanaryResult) v1alpha1.CanaryResult {
	return v1alpha1.CanaryResult{Time: metav1Time(res.Time), Router: router, Result: v1alpha1.CanaryOutcome(res.Result),
		PromptTokens: res.PromptTokens, ExternalTokens: res.ExternalTokens, Message: res.Message}
}

func metav1Time(t time.Time) metav1.Time { return metav1.NewTime(t.Truncate(time.Second)) }

// runningRouters are the router pods among pods that run and are not being deleted.
func runningRouters(pods []corev1.Pod) iter.Seq[*corev1.Pod] {
	return func(yield func(*corev1.Pod) bool) {
		for i := range pods {
			pod := &pods[i]
			if pod.Labels[v1alpha1.LabelRole] == string(v1alpha1.RoleRouter) && pod.Status.Phase == corev1.PodRunning && pod.DeletionTimestamp == nil && !yield(pod) {
				return
			}
		}
	}
}
