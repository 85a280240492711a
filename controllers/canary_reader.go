package controllers

import (
	"context"
	"errors"
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

// HTTPCanaryReader reads GET /canary on the router's port (render.RouterPort) at the pod's IP.
type HTTPCanaryReader struct{ podHTTP }

// NewHTTPCanaryReader reads the routers this operator renders.
func NewHTTPCanaryReader() *HTTPCanaryReader { return &HTTPCanaryReader{newPodHTTP(render.RouterPort)} }

// ReadCanary implements CanaryReader.
func (h *HTTPCanaryReader) ReadCanary(ctx context.Context, pod *corev1.Pod) (routerconfig.CanaryResult, error) {
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
	for i := range pods {
		pod := &pods[i]
		if pod.Labels[v1alpha1.LabelRole] != string(v1alpha1.RoleRouter) || pod.Status.Phase != corev1.PodRunning || pod.DeletionTimestamp != nil {
			continue
		}
		res, err := r.CanaryReader.ReadCanary(ctx, pod)
		if err != nil {
			if !errors.Is(err, errNoCanary) {
				log.FromContext(ctx).V(1).Info("canary not read", "pod", pod.Name, "error", err.Error())
			}
			continue
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
