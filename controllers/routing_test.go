package controllers

import (
	"context"
	"math"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/router"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

type fakeRouting map[string]routerconfig.RoutingCounts

func (f fakeRouting) ReadRouting(_ context.Context, pod *corev1.Pod) (routerconfig.RoutingCounts, error) {
	return f[pod.Name], nil
}

// routingStatus writes status.routing from the routers' counts, for the strategies that weigh
// what engines hold: KVEvents' share is of the blocks its events matched once it matched any,
// PrefixAware's of the chunks; counts the routers did not answer keep what status said.
func TestRoutingStatus(t *testing.T) {
	before := &v1alpha1.RoutingStatus{Prefill: v1alpha1.PoolRoutingStatus{PromptChunks: 10, HeldChunks: 5, HeldPercent: ptr.To[int32](50)}}
	counts := &routerconfig.RoutingCounts{
		Prefill: routerconfig.PoolRoutingCounts{PromptBlocks: 8, HeldBlocks: 6, PromptChunks: 40, HeldChunks: 10, IndexBlocks: 12, EventsLagMilliseconds: 3},
		Decode:  routerconfig.PoolRoutingCounts{PromptChunks: 40, HeldChunks: 30},
	}
	for _, tc := range []struct {
		name     string
		strategy v1alpha1.RoutingStrategy
		counts   *routerconfig.RoutingCounts
		want     *v1alpha1.RoutingStatus
	}{
		{name: "least in flight: none", strategy: v1alpha1.RoutingLeastInFlight, counts: counts},
		{name: "no answer: kept", strategy: v1alpha1.RoutingPrefixAware, want: before},
		{name: "prefix aware: the chunks' share", strategy: v1alpha1.RoutingPrefixAware, counts: counts,
			want: &v1alpha1.RoutingStatus{
				Prefill: v1alpha1.PoolRoutingStatus{PromptBlocks: 8, HeldBlocks: 6, PromptChunks: 40, HeldChunks: 10, HeldPercent: ptr.To[int32](25), IndexBlocks: 12, EventsLagMilliseconds: 3},
				Decode:  v1alpha1.PoolRoutingStatus{PromptChunks: 40, HeldChunks: 30, HeldPercent: ptr.To[int32](75)},
			}},
		{name: "kv events: the blocks' share, the chunks' where no block was matched", strategy: v1alpha1.RoutingKVEvents, counts: counts,
			want: &v1alpha1.RoutingStatus{
				Prefill: v1alpha1.PoolRoutingStatus{PromptBlocks: 8, HeldBlocks: 6, PromptChunks: 40, HeldChunks: 10, HeldPercent: ptr.To[int32](75), IndexBlocks: 12, EventsLagMilliseconds: 3},
				Decode:  v1alpha1.PoolRoutingStatus{PromptChunks: 40, HeldChunks: 30, HeldPercent: ptr.To[int32](75)},
			}},
		{name: "nothing routed yet: no share", strategy: v1alpha1.RoutingKVEvents, counts: &routerconfig.RoutingCounts{},
			want: &v1alpha1.RoutingStatus{}},
		// Summed counts saturate at MaxInt64, where float64 rounds one short of all up to all.
		{name: "saturated: exact", strategy: v1alpha1.RoutingPrefixAware,
			counts: &routerconfig.RoutingCounts{Prefill: routerconfig.PoolRoutingCounts{PromptChunks: math.MaxInt64, HeldChunks: math.MaxInt64 - 1}},
			want:   &v1alpha1.RoutingStatus{Prefill: v1alpha1.PoolRoutingStatus{PromptChunks: math.MaxInt64, HeldChunks: math.MaxInt64 - 1, HeldPercent: ptr.To[int32](99)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc()
			p.Spec.Router.Routing.Strategy = tc.strategy
			p.Status.Routing = before.DeepCopy()
			status := p.Status.DeepCopy()
			routingStatus(status, statusInputs{pdc: p, obs: observed{routing: tc.counts}})
			if d := cmp.Diff(tc.want, status.Routing); d != "" {
				t.Errorf("status.routing (-want +got):\n%s", d)
			}
		})
	}
}

// The routers' routing counts are summed without overflow, their indexes' sizes and lags are
// the largest (every router follows the same engines); a router answering a negative count,
// more held than routed, a negative index, or a lag past an hour, is left out.
func TestReadRoutingSaturatesAndRefusesNonsense(t *testing.T) {
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	var pods []corev1.Pod
	for _, name := range []string{"r-0", "r-1", "r-2", "r-3", "r-4", "r-5", "r-6"} {
		pods = append(pods, *wrappers.MakeEnginePod("ns", name, "c", v1alpha1.RoleRouter, now).Obj())
	}
	r := &PDClusterReconciler{RoutingReader: fakeRouting{
		"r-0": {Prefill: routerconfig.PoolRoutingCounts{PromptChunks: math.MaxInt64 - 1, HeldChunks: 1}, Decode: routerconfig.PoolRoutingCounts{PromptBlocks: 4, HeldBlocks: 3, IndexBlocks: 40, EventsLagMilliseconds: 2}},
		"r-1": {Prefill: routerconfig.PoolRoutingCounts{PromptChunks: 5, HeldChunks: 4}, Decode: routerconfig.PoolRoutingCounts{IndexBlocks: 38, EventsLagMilliseconds: 9}},
		"r-2": {Prefill: routerconfig.PoolRoutingCounts{PromptChunks: -9}},
		"r-3": {Decode: routerconfig.PoolRoutingCounts{PromptBlocks: 1, HeldBlocks: 2}},
		"r-4": {Decode: routerconfig.PoolRoutingCounts{EventsLagMilliseconds: -1}},
		"r-5": {Decode: routerconfig.PoolRoutingCounts{EventsLagMilliseconds: 56 * 365 * 24 * 3600 * 1000}}, // a batch dated 1970
		"r-6": {Prefill: routerconfig.PoolRoutingCounts{PromptChunks: 1, IndexBlocks: -1000}},
	}}
	got := r.readRouting(context.Background(), pods)
	want := &routerconfig.RoutingCounts{
		Prefill: routerconfig.PoolRoutingCounts{PromptChunks: math.MaxInt64, HeldChunks: 5},
		Decode:  routerconfig.PoolRoutingCounts{PromptBlocks: 4, HeldBlocks: 3, IndexBlocks: 40, EventsLagMilliseconds: 9},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("routing counts (-want +got):\n%s", d)
	}
}

// Through a reconcile: with PrefixAware or KVEvents routing the running router's counts reach
// status.routing (KVEvents' held share from the engines' blocks, with the index and the lag);
// back to LeastInFlight, status.routing goes.
func TestRoutingCountsReachStatus(t *testing.T) {
	for _, tc := range []struct {
		strategy v1alpha1.RoutingStrategy
		counts   routerconfig.PoolRoutingCounts
		want     v1alpha1.PoolRoutingStatus
	}{
		{v1alpha1.RoutingPrefixAware, routerconfig.PoolRoutingCounts{PromptChunks: 8, HeldChunks: 6},
			v1alpha1.PoolRoutingStatus{PromptChunks: 8, HeldChunks: 6, HeldPercent: ptr.To[int32](75)}},
		{v1alpha1.RoutingKVEvents, routerconfig.PoolRoutingCounts{PromptBlocks: 10, HeldBlocks: 4, PromptChunks: 8, HeldChunks: 6, IndexBlocks: 300, EventsLagMilliseconds: 12},
			v1alpha1.PoolRoutingStatus{PromptBlocks: 10, HeldBlocks: 4, PromptChunks: 8, HeldChunks: 6, IndexBlocks: 300, EventsLagMilliseconds: 12, HeldPercent: ptr.To[int32](40)}},
	} {
		t.Run(string(tc.strategy), func(t *testing.T) {
			p := pdc()
			p.Spec.Router.Routing.Strategy = tc.strategy
			f := newRolloutFixture(t, p)
			ctx := context.Background()
			router := wrappers.MakeEnginePod("ns", "router-0", "c", v1alpha1.RoleRouter, time.Now()).Obj()
			if err := f.c.Create(ctx, router); err != nil {
				t.Fatal(err)
			}
			f.r.RoutingReader = fakeRouting{"router-0": {Prefill: tc.counts}}
			f.reconcile()
			var got v1alpha1.PDCluster
			if err := f.c.Get(ctx, client.ObjectKeyFromObject(p), &got); err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(&v1alpha1.RoutingStatus{Prefill: tc.want}, got.Status.Routing); d != "" {
				t.Errorf("status.routing (-want +got):\n%s", d)
			}
			got.Spec.Router.Routing.Strategy = v1alpha1.RoutingLeastInFlight
			if err := f.c.Update(ctx, &got); err != nil {
				t.Fatal(err)
			}
			f.reconcile()
			if err := f.c.Get(ctx, client.ObjectKeyFromObject(p), &got); err != nil {
				t.Fatal(err)
			}
			if got.Status.Routing != nil {
				t.Errorf("status.routing %+v with LeastInFlight, want none", got.Status.Routing)
			}
		})
	}
}

// The reader's side of GET /routing against the router's own handler: a router routing by what
// engines hold answers its counts in routerconfig's type; one that does not answers 404, an
// error the reconciler logs and leaves out.
func TestHTTPRouterReaderReadsTheRoutersRouting(t *testing.T) {
	for _, tc := range []struct {
		routing *routerconfig.Routing
		answers bool
	}{
		{&routerconfig.Routing{Strategy: routerconfig.RoutingPrefixAware, LoadSlack: 2}, true},
		{nil, false},
	} {
		r, err := router.New(router.Config{Flow: routerconfig.FlowMooncake, Routing: tc.routing}, logr.Discard(), nil)
		if err != nil {
			t.Fatal(err)
		}
		// What the router serves on its metrics port, where the reader reads.
		srv := httptest.NewServer(r.ObserverHandler(nil))
		h := NewHTTPRouterReader()
		h.Addr = func(*corev1.Pod) string { return strings.TrimPrefix(srv.URL, "http://") }
		got, err := h.ReadRouting(context.Background(), &corev1.Pod{})
		srv.Close()
		if (err == nil) != tc.answers || got != (routerconfig.RoutingCounts{}) {
			t.Errorf("routing %+v: read %+v, %v; want an answer %v", tc.routing, got, err, tc.answers)
		}
	}
}
