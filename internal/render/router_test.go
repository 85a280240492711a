package render_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/router"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// loadRouterJSON is cm's router.json as cmd/router loads it from the mount.
func loadRouterJSON(t *testing.T, cm *corev1.ConfigMap) routerconfig.File {
	t.Helper()
	file := filepath.Join(t.TempDir(), routerconfig.FileName)
	if err := os.WriteFile(file, []byte(cm.Data[routerconfig.FileName]), 0o600); err != nil {
		t.Fatal(err)
	}
	fc, err := routerconfig.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	return fc
}

// The router reads the router.json render writes, from where its Deployment mounts it, and
// probes what the router serves.
func TestRouterReadsTheRenderedConfig(t *testing.T) {
	for _, tc := range []struct {
		in      string
		balance v1alpha1.RouterBalance
		flow    routerconfig.Flow
		want    routerconfig.Balance
	}{
		{"testdata/mooncake-rdma.yaml", "", routerconfig.FlowMooncake, ""},
		{"testdata/nixl-tcp.yaml", v1alpha1.RouterBalanceLeastInFlight, routerconfig.FlowNIXL, ""},
		{"testdata/mooncake-rdma.yaml", v1alpha1.RouterBalanceRoundRobin, routerconfig.FlowMooncake, routerconfig.BalanceRoundRobin},
	} {
		t.Run(tc.in+"/"+string(tc.balance), func(t *testing.T) {
			pdc := load(t, tc.in)
			pdc.Spec.Router.Balance = tc.balance
			cm, dep := wrappers.RenderRouter(t, pdc)
			pod := dep.Spec.Template.Spec
			c := pod.Containers[0]
			var path string
			for _, a := range c.Args {
				if v, ok := strings.CutPrefix(a, "--config="); ok {
					path = v
				}
			}
			mounts := mountPaths(c)
			if path != filepath.Join(mounts["config"], "router.json") || pod.Volumes[0].ConfigMap.Name != cm.Name {
				t.Fatalf("--config=%s, config volume at %q from ConfigMap %q; want router.json of %s", path, mounts["config"], pod.Volumes[0].ConfigMap.Name, cm.Name)
			}
			fc := loadRouterJSON(t, cm)
			if fc.Flow != tc.flow || fc.Balance != tc.want || fc.PrefillHost != render.ObjectName(pdc.Name, v1alpha1.RolePrefill)+"."+pdc.Namespace+".svc" {
				t.Errorf("router config %+v, want flow %s, balance %q and the prefill Service", fc, tc.flow, tc.want)
			}
			// The router the probes reach answers them (200 once it knows both pools), and
			// readiness is not liveness: an empty pool must not get the router killed.
			r, err := router.New(router.Config{Flow: fc.Flow, Balance: fc.Balance}, logr.Discard(), nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := r.SetPools(router.Pools{Prefill: []router.Prefill{{URL: "http://p:8000", Bootstrap: "http://p:8998"}}, Decode: []string{"http://d:8000"}}); err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(r.Handler(nil))
			defer srv.Close()
			for what, pr := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
				resp, err := http.Get(srv.URL + pr.HTTPGet.Path)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Errorf("%s probe GET %s = %d, want 200", what, pr.HTTPGet.Path, resp.StatusCode)
				}
			}
			if c.ReadinessProbe.HTTPGet.Path == c.LivenessProbe.HTTPGet.Path {
				t.Errorf("readiness and liveness share %s", c.LivenessProbe.HTTPGet.Path)
			}
		})
	}
}

// spec.router.failurePolicy reaches the router through router.json: the API's defaults are the
// router's own (so a default policy is left out of the file), and any other policy is written
// whole and read back by the router.
func TestRouterJSONCarriesTheFailurePolicy(t *testing.T) {
	pdc := load(t, "testdata/minimal.yaml") // no --max-model-len: the default stream budget
	if got, want := render.RouterFailurePolicy(pdc), routerconfig.DefaultFailurePolicy(); got != want {
		t.Errorf("the API's default policy %+v is not the router's %+v", got, want)
	}
	readBack := func(pdc *v1alpha1.PDCluster) routerconfig.File {
		cm, _ := wrappers.RenderRouter(t, pdc)
		return loadRouterJSON(t, cm)
	}
	if fc := readBack(pdc); fc.FailurePolicy != nil {
		t.Errorf("default policy written into router.json: %+v", *fc.FailurePolicy)
	}
	pdc.Spec.KVTransfer.LoadFailurePolicy = v1alpha1.LoadFailurePolicyRecompute
	pdc.Spec.Router.FailurePolicy = v1alpha1.RouterFailurePolicy{
		Retries: ptr.To[int32](0), RetryBudgetPercent: ptr.To[int32](5), EjectSeconds: ptr.To[int32](30), ConsecutiveFailures: ptr.To[int32](7),
		FirstTokenTimeoutSeconds: ptr.To[int32](60), OnPrefillFailure: v1alpha1.OnPrefillFailureDecodeOnly,
	}
	want := routerconfig.FailurePolicy{Retries: 0, RetryBudgetPercent: 5, EjectSeconds: 30, ConsecutiveFailures: 7, FirstTokenTimeoutSeconds: 60, OnPrefillFailure: routerconfig.PrefillFailureDecodeOnly}
	fc := readBack(pdc)
	if diff := cmp.Diff(want, fc.Failure()); diff != "" {
		t.Errorf("router.json failure policy (-want +got):\n%s", diff)
	}
	p := router.PolicyFromFile(fc.Failure())
	if p.ConsecutiveFailures != 7 {
		t.Errorf("the router applies consecutiveFailures %d, want 7", p.ConsecutiveFailures)
	}
	if _, err := router.New(router.Config{Flow: fc.Flow, Failure: &p}, logr.Discard(), nil); err != nil {
		t.Errorf("the router refuses the rendered policy: %v", err)
	}
}

// verification mode Canary reaches the router through router.json: its interval, the served
// model and a prompt of four blocks of words; other modes write no canary.
func TestRouterJSONCarriesTheCanary(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	cm, _ := wrappers.RenderRouter(t, pdc)
	if fc := loadRouterJSON(t, cm); fc.Canary != nil {
		t.Errorf("mode %q wrote a canary: %+v", pdc.Spec.KVTransfer.Verification.Mode, *fc.Canary)
	}
	pdc.Spec.KVTransfer.Verification.Mode = v1alpha1.KVVerificationCanary
	pdc.Spec.KVTransfer.Verification.CanaryIntervalSeconds = ptr.To[int32](15)
	cm, _ = wrappers.RenderRouter(t, pdc)
	fc := loadRouterJSON(t, cm)
	served := pdc.Spec.Model.ServedModelName
	if served == "" {
		served = pdc.Spec.Model.Path
	}
	want := &routerconfig.Canary{IntervalSeconds: 15, Model: served, PromptWords: 4 * *pdc.Spec.Engine.BlockSize}
	if d := cmp.Diff(want, fc.Canary); d != "" {
		t.Errorf("router.json canary (-want +got):\n%s", d)
	}
	if err := fc.Validate(); err != nil {
		t.Errorf("the router refuses the rendered canary: %v", err)
	}
}

// The data-parallel ranks each prefill pod runs reach the router, which trusts only those
// ranks of a prefill pod's bootstrap registry: through router.json for the update revision
// (left out at one rank, the router's default) and, for an older revision, from its pods'
// own command line. A pod of a replica across pods (vLLM's hybrid load balancing) runs
// data/nodes ranks, and its registry and X-data-parallel-rank count them from 0 (vLLM's
// local_engines_only), so that is its number, not the replica's --data-parallel-size.
func TestRouterKnowsThePrefillDataParallelRanks(t *testing.T) {
	for _, tc := range []struct {
		name string
		par  v1alpha1.Parallelism
		want int32
	}{
		{"one rank", v1alpha1.Parallelism{Data: ptr.To[int32](1)}, 0},
		{"data 4 on one pod", v1alpha1.Parallelism{Data: ptr.To[int32](4)}, 4},
		{"data 16 over 2 pods", v1alpha1.Parallelism{Data: ptr.To[int32](16), Expert: true, Nodes: ptr.To[int32](2)}, 8},
		{"data 4 tp2 over 2 pods", v1alpha1.Parallelism{Data: ptr.To[int32](4), Tensor: ptr.To[int32](2), Nodes: ptr.To[int32](2)}, 2},
		{"model tp8 pp2 over 2 pods", v1alpha1.Parallelism{Tensor: ptr.To[int32](8), Pipeline: ptr.To[int32](2), Nodes: ptr.To[int32](2)}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pdc := load(t, "testdata/mooncake-rdma.yaml")
			pdc.Spec.Prefill.Parallelism = tc.par
			pdc.SetDefaults()
			cm, _ := wrappers.RenderRouter(t, pdc)
			fc := loadRouterJSON(t, cm)
			if fc.PrefillDataParallel != tc.want || (tc.want == 0) == strings.Contains(cm.Data[routerconfig.FileName], "prefillDataParallel") {
				t.Errorf("router.json's prefillDataParallel = %d, want %d (left out at one rank):\n%s", fc.PrefillDataParallel, tc.want, cm.Data[routerconfig.FileName])
			}
			pools, err := router.ResolvePools(t.Context(), fc, func(context.Context, string) ([]string, error) { return []string{"10.0.0.5"}, nil })
			if err != nil {
				t.Fatal(err)
			}
			if got := pools.Prefill[0].DataParallel; got != int(tc.want) {
				t.Errorf("the router's prefill has %d data-parallel ranks, want %d", got, tc.want)
			}
			objs, err := render.RenderServing(pdc, render.DefaultOptions(), render.Serving{})
			if err != nil {
				t.Fatal(err)
			}
			var spec *corev1.PodSpec
			for _, o := range objs {
				if o.GetLabels()[v1alpha1.LabelRole] != string(v1alpha1.RolePrefill) {
					continue
				}
				switch x := o.(type) {
				case *appsv1.Deployment:
					spec = &x.Spec.Template.Spec
				case *lwsv1.LeaderWorkerSet:
					spec = &x.Spec.LeaderWorkerTemplate.WorkerTemplate.Spec
				}
			}
			if spec == nil {
				t.Fatal("no prefill Deployment or LeaderWorkerSet rendered")
			}
			if got := render.DataParallelOf(spec); got != tc.want {
				t.Errorf("DataParallelOf(the prefill pods) = %d, want %d", got, tc.want)
			}
		})
	}
}

// Unset, firstTokenTimeoutSeconds becomes a budget for streaming requests from the engines'
// longest --max-model-len (a minute plus 100 tokens a second, at most 600 s; 300 s without
// one); set, it is the budget of every request and no stream default is written.
func TestStreamFirstTokenTimeoutFollowsTheModelLength(t *testing.T) {
	for _, tc := range []struct {
		name                  string
		engine, prefill       []string
		set                   *int32
		wantFirst, wantStream int32
	}{
		{"no model length", nil, nil, nil, 0, 300},
		{"8192 tokens", []string{"--max-model-len=8192"}, nil, nil, 0, 60 + 82},
		{"32k on prefill, the longest", []string{"--max-model-len", "4096"}, []string{"--max-model-len=32k"}, nil, 0, 60 + 320},
		{"128K, capped", []string{"--max-model-len=128K"}, nil, nil, 0, 600},
		{"unreadable", []string{"--max-model-len=auto"}, nil, nil, 0, 300},
		{"set", []string{"--max-model-len=8192"}, nil, ptr.To[int32](45), 45, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pdc := load(t, "testdata/minimal.yaml")
			pdc.Spec.Engine.Args, pdc.Spec.Prefill.Args = tc.engine, tc.prefill
			pdc.Spec.Router.FailurePolicy.FirstTokenTimeoutSeconds = tc.set
			cm, _ := wrappers.RenderRouter(t, pdc)
			got := loadRouterJSON(t, cm).Failure()
			if got.FirstTokenTimeoutSeconds != tc.wantFirst || got.StreamFirstTokenTimeoutSeconds != tc.wantStream {
				t.Errorf("router.json firstTokenTimeoutSeconds %d, streamFirstTokenTimeoutSeconds %d; want %d and %d",
					got.FirstTokenTimeoutSeconds, got.StreamFirstTokenTimeoutSeconds, tc.wantFirst, tc.wantStream)
			}
			p := router.PolicyFromFile(got)
			if p.StreamFirstTokenTimeout != time.Duration(tc.wantStream)*time.Second {
				t.Errorf("the router applies a stream budget of %s, want %ds", p.StreamFirstTokenTimeout, tc.wantStream)
			}
		})
	}
}

// spec.router.routing reaches router.json: nothing for LeastInFlight (router.json, and so the
// router's pods, as before the field), PrefixAware with the sizes set and loadSlack always
// (0 is a value); and the router takes what render writes.
func TestRouterRouting(t *testing.T) {
	for _, tc := range []struct {
		name    string
		routing v1alpha1.RouterRouting
		want    *routerconfig.Routing
	}{
		{"default", v1alpha1.RouterRouting{}, nil},
		{"least in flight", v1alpha1.RouterRouting{Strategy: v1alpha1.RoutingLeastInFlight}, nil},
		{"prefix aware, defaults", v1alpha1.RouterRouting{Strategy: v1alpha1.RoutingPrefixAware},
			&routerconfig.Routing{Strategy: routerconfig.RoutingPrefixAware, LoadSlack: v1alpha1.DefaultRouterLoadSlack}},
		{"prefix aware, every field", v1alpha1.RouterRouting{Strategy: v1alpha1.RoutingPrefixAware, PrefixAware: &v1alpha1.PrefixAwareRouting{
			ChunkBytes: ptr.To[int32](128), MaxChunks: ptr.To[int32](64), ChunksPerEngine: ptr.To[int32](1000), LoadSlack: ptr.To[int32](0)}},
			&routerconfig.Routing{Strategy: routerconfig.RoutingPrefixAware, ChunkBytes: 128, MaxChunks: 64, ChunksPerEngine: 1000, LoadSlack: 0}},
		{"kv events, defaults: the engines' ports", v1alpha1.RouterRouting{Strategy: v1alpha1.RoutingKVEvents},
			&routerconfig.Routing{Strategy: routerconfig.RoutingKVEvents, LoadSlack: v1alpha1.DefaultRouterLoadSlack,
				KVEvents: &routerconfig.KVEventsEndpoints{Port: 5557, ReplayPort: 5757, Topic: "kv"}}},
		{"kv events, every field", v1alpha1.RouterRouting{Strategy: v1alpha1.RoutingKVEvents,
			PrefixAware: &v1alpha1.PrefixAwareRouting{LoadSlack: ptr.To[int32](1)}, KVEvents: &v1alpha1.KVEventsRouting{BlocksPerEngine: ptr.To[int32](4096)}},
			&routerconfig.Routing{Strategy: routerconfig.RoutingKVEvents, LoadSlack: 1,
				KVEvents: &routerconfig.KVEventsEndpoints{Port: 5557, ReplayPort: 5757, Topic: "kv", BlocksPerEngine: 4096}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pdc := load(t, "testdata/mooncake-rdma.yaml")
			pdc.Spec.Router.Routing = tc.routing
			pdc.SetDefaults()
			cm, _ := wrappers.RenderRouter(t, pdc)
			fc := loadRouterJSON(t, cm)
			if d := cmp.Diff(tc.want, fc.Routing); d != "" {
				t.Errorf("router.json's routing (-want +got):\n%s", d)
			}
			if tc.want == nil && strings.Contains(cm.Data[routerconfig.FileName], "routing") {
				t.Errorf("router.json names routing for the default:\n%s", cm.Data[routerconfig.FileName])
			}
			if _, err := router.New(router.Config{Flow: fc.Flow, Balance: fc.Balance, Routing: fc.Routing}, logr.Discard(), nil); err != nil {
				t.Errorf("the router refuses router.json's routing: %v", err)
			}
		})
	}
}
