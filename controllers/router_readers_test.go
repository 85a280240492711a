package controllers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// The reader's side of GET /canary: the router's answer in routerconfig's type (which the
// router encodes), 404 before the first canary, and an error for anything else.
func TestHTTPRouterReader(t *testing.T) {
	at := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	var answer http.HandlerFunc
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != routerconfig.CanaryPath {
			http.NotFound(w, r)
			return
		}
		answer(w, r)
	}))
	defer srv.Close()
	h := NewHTTPRouterReader()
	h.Addr = func(*corev1.Pod) string { return strings.TrimPrefix(srv.URL, "http://") }
	want := routerconfig.CanaryResult{Time: at, Result: routerconfig.CanaryRecomputed, PromptTokens: 256, Decode: "http://d:8000", Message: "m"}
	answer = func(w http.ResponseWriter, _ *http.Request) { _ = json.NewEncoder(w).Encode(want) }
	got, err := h.ReadCanary(context.Background(), &corev1.Pod{})
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("canary (-want +got):\n%s", d)
	}
	answer = func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) }
	if _, err := h.ReadCanary(context.Background(), &corev1.Pod{}); !errors.Is(err, errNoCanary) {
		t.Errorf("404: err = %v, want errNoCanary", err)
	}
	answer = func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusInternalServerError) }
	if _, err := h.ReadCanary(context.Background(), &corev1.Pod{}); err == nil || errors.Is(err, errNoCanary) {
		t.Errorf("500: err = %v, want an error", err)
	}
	// The reader reads the port the rendered router serves them on, which its clients cannot
	// reach: the router container's "metrics" port and its --metrics-listen.
	_, dep := wrappers.RenderRouter(t, wrappers.MakePDCluster("ns", "c").Obj())
	c := dep.Spec.Template.Spec.Containers[0]
	i := slices.IndexFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.Name == "metrics" })
	if got := NewHTTPRouterReader().Port; i < 0 || c.Ports[i].ContainerPort != got || !slices.Contains(c.Args, fmt.Sprintf("--metrics-listen=:%d", got)) {
		t.Errorf("the reader reads port %d; the router declares %v and runs %v", got, c.Ports, c.Args)
	}
	if got := NewHTTPRouterReader().Port; got == render.RouterPort {
		t.Errorf("the reader reads the router's clients' port %d", got)
	}
	if _, err := NewHTTPRouterReader().ReadCanary(context.Background(), &corev1.Pod{}); err == nil || !strings.Contains(err.Error(), "no IP") {
		t.Errorf("a pod without an IP: %v", err)
	}
}

type fakeCanaries map[string]routerconfig.CanaryResult

func (f fakeCanaries) ReadCanary(_ context.Context, pod *corev1.Pod) (routerconfig.CanaryResult, error) {
	if res, ok := f[pod.Name]; ok {
		return res, nil
	}
	return routerconfig.CanaryResult{}, errNoCanary
}

// In mode Canary the reconcile reads the running routers' canaries and keeps the newest, in the
// PDCluster's words (to the second, as status stores it); in other modes it reads none.
func TestObserveReadsTheNewestCanary(t *testing.T) {
	at := time.Date(2026, 12, 4, 12, 0, 0, 500, time.UTC)
	router := func(name string) *corev1.Pod {
		p := wrappers.MakeEnginePod("ns", name, "c", v1alpha1.RoleRouter, at).Obj()
		return p
	}
	p := pdc()
	p.Spec.KVTransfer.Verification.Mode = v1alpha1.KVVerificationCanary
	c := newFakeClient(t).WithObjects(p, router("r-0"), router("r-1"), router("r-2")).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), CanaryReader: fakeCanaries{
		"r-0": {Time: at, Result: routerconfig.CanaryExternal, PromptTokens: 256, ExternalTokens: 255},
		"r-1": {Time: at.Add(time.Minute), Result: routerconfig.CanaryRecomputed, PromptTokens: 256, Message: "m"},
	}}
	o := r.observe(context.Background(), p, nil, r.now())
	want := &v1alpha1.CanaryResult{Time: metav1.NewTime(at.Add(time.Minute).Truncate(time.Second)), Router: "r-1", Result: v1alpha1.CanaryRecomputed, PromptTokens: 256, Message: "m"}
	if d := cmp.Diff(want, o.canary); d != "" {
		t.Errorf("observed canary (-want +got):\n%s", d)
	}
	p.Spec.KVTransfer.Verification.Mode = v1alpha1.KVVerificationPassive
	if o := r.observe(context.Background(), p, nil, r.now()); o.canary != nil {
		t.Errorf("mode Passive read a canary: %+v", o.canary)
	}
	var _ client.Object = p
}

// A router's canary dated past the operator's clock (and its skew allowance) is refused, one
// within it is taken as now: a router's clock cannot keep its canary the newest for ever.
func TestObserveRefusesCanariesFromTheFuture(t *testing.T) {
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	router := func(name string) *corev1.Pod {
		return wrappers.MakeEnginePod("ns", name, "c", v1alpha1.RoleRouter, now).Obj()
	}
	p := pdc()
	p.Spec.KVTransfer.Verification.Mode = v1alpha1.KVVerificationCanary
	c := newFakeClient(t).WithObjects(p, router("r-0"), router("r-1"), router("r-2")).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), Clock: clocktesting.NewFakePassiveClock(now), CanaryReader: fakeCanaries{
		"r-0": {Time: now.Add(-time.Minute), Result: routerconfig.CanaryExternal},
		"r-1": {Time: time.Date(2999, 1, 1, 0, 0, 0, 0, time.UTC), Result: routerconfig.CanaryExternal},
		"r-2": {Time: now.Add(20 * time.Second), Result: routerconfig.CanaryRecomputed},
	}}
	o := r.observe(context.Background(), p, nil, r.now())
	want := &v1alpha1.CanaryResult{Time: metav1.NewTime(now), Router: "r-2", Result: v1alpha1.CanaryRecomputed}
	if d := cmp.Diff(want, o.canary); d != "" {
		t.Errorf("observed canary (-want +got):\n%s", d)
	}
}

// The routers' pair counts are summed without overflow, and a router answering a negative
// count is left out.
func TestReadPairsSaturatesAndRefusesNegatives(t *testing.T) {
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	var pods []corev1.Pod
	for _, name := range []string{"r-0", "r-1", "r-2"} {
		pods = append(pods, *wrappers.MakeEnginePod("ns", name, "c", v1alpha1.RoleRouter, now).Obj())
	}
	r := &PDClusterReconciler{PairsReader: fakePairs{
		"r-0": {SameDomain: math.MaxInt64 - 1, CrossDomain: 3},
		"r-1": {SameDomain: 5, CrossDomain: 4},
		"r-2": {SameDomain: -9, CrossDomain: 100},
	}}
	got := r.readPairs(context.Background(), pods)
	want := &routerconfig.PairCounts{SameDomain: math.MaxInt64, CrossDomain: 7}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("pairs (-want +got):\n%s", d)
	}
}
