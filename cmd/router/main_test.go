package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/router"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// The operator starts this command with the arguments render puts in the router Deployment;
// every one of them must be a flag it defines.
func TestAcceptsTheRenderedArguments(t *testing.T) {
	pdc := &v1alpha1.PDCluster{Spec: v1alpha1.PDClusterSpec{Router: v1alpha1.RouterSpec{Replicas: ptr.To[int32](1)}}}
	pdc.Name, pdc.Namespace = "c", "ns"
	cm, dep := wrappers.RenderRouter(t, pdc)
	c := dep.Spec.Template.Spec.Containers[0]
	args := wrappers.ContainerArgs(t, c, "10.244.0.9")
	o, err := parseFlags(args)
	if err != nil {
		t.Fatalf("rendered router args %v: %v", args, err)
	}
	if o.configPath == "" {
		t.Errorf("rendered router args %v name no --config", args)
	}
	// The clients' port and the observers' are the container's declared ones, apart.
	declared := map[string]string{}
	for _, p := range c.Ports {
		declared[p.Name] = ":" + strconv.Itoa(int(p.ContainerPort))
	}
	if o.listen != declared["http"] || o.metricsListen != declared["metrics"] || o.listen == o.metricsListen {
		t.Errorf("--listen %q and --metrics-listen %q, want the container's ports http and metrics apart (%v)", o.listen, o.metricsListen, declared)
	}
	// The heap and the body budget follow the container's memory limit (the default, 1Gi).
	if want := c.Resources.Limits.Memory().Value(); o.memoryLimit != want || want != 1<<30 {
		t.Errorf("--memory-limit %d, want the container's limit %d (1Gi)", o.memoryLimit, want)
	}
	if got, want := bodyBudget(o), int64(1<<30)/4; got != want {
		t.Errorf("body budget %d, want a quarter of the memory limit, %d", got, want)
	}
	// spec.router.maxRequestBody reaches --max-body-bytes.
	pdc.Spec.Router.MaxRequestBody = ptr.To(resource.MustParse("20Mi"))
	if dep, err = render.RouterDeployment(pdc, render.DefaultOptions(), cm); err != nil {
		t.Fatal(err)
	}
	if o, err = parseFlags(wrappers.ContainerArgs(t, dep.Spec.Template.Spec.Containers[0], "10.244.0.9")); err != nil || o.maxBodyBytes != 20<<20 {
		t.Errorf("maxRequestBody 20Mi: --max-body-bytes %d (%v), want %d", o.maxBodyBytes, err, 20<<20)
	}
	if _, err := parseFlags([]string{"--no-such-flag"}); err == nil {
		t.Error("an unknown flag was accepted")
	}
}

// The pools come from one source: router.json's Services, or, for a file without pools (the
// sandbox's loopback engines, which no DNS name lists), the flags; the file's flow, balance and
// failure policy apply either way.
func TestConfigure(t *testing.T) {
	dir := t.TempDir()
	file := func(name, json string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(json), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	withPools := file("pools.json", `{"flow":"mooncake","prefillHost":"p","decodeHost":"d","enginePort":8000,"bootstrapPort":8998}`)
	prefixAware := file("prefix.json", `{"flow":"mooncake","prefillHost":"p","decodeHost":"d","enginePort":8000,"bootstrapPort":8998,"routing":{"strategy":"PrefixAware","chunkBytes":32,"loadSlack":3}}`)
	prefixRoundRobin := file("prefix-rr.json", `{"flow":"mooncake","balance":"round-robin","prefillHost":"p","decodeHost":"d","enginePort":8000,"bootstrapPort":8998,"routing":{"strategy":"PrefixAware","loadSlack":3}}`)
	noPools := file("nopools.json", `{"flow":"nixl","balance":"round-robin","failurePolicy":{"retries":1,"retryBudgetPercent":50,"ejectSeconds":3,"firstTokenTimeoutSeconds":7,"onPrefillFailure":"Fail"}}`)
	cases := []struct {
		name       string
		args       []string
		wantErr    string
		wantFlow   routerconfig.Flow
		wantPolicy router.FailurePolicy
		wantStatic int // prefill engines given by flag
		wantRanks  int // the first one's data-parallel ranks
		// wantRouting is router.json's routing as the router gets it.
		wantRouting *routerconfig.Routing
		// wantKVPorts are --kv-events-ports as the router gets them.
		wantKVPorts map[string]router.KVEventsPorts
		// wantIndexBlocks bounds each pool's KV events index, from --memory-limit.
		wantIndexBlocks int64
	}{
		{name: "file with PrefixAware routing", args: []string{"--config", prefixAware}, wantFlow: routerconfig.FlowMooncake, wantPolicy: router.DefaultFailurePolicy(),
			wantRouting: &routerconfig.Routing{Strategy: routerconfig.RoutingPrefixAware, ChunkBytes: 32, LoadSlack: 3}},
		{name: "PrefixAware with round robin", args: []string{"--config", prefixRoundRobin}, wantErr: "needs balance least-in-flight"},
		{name: "file with pools", args: []string{"--config", withPools}, wantFlow: routerconfig.FlowMooncake, wantPolicy: router.DefaultFailurePolicy()},
		{name: "file without pools, pools by flag", args: []string{"--config", noPools, "--prefill", "http://a", "--prefill", "http://b", "--decode", "http://c"},
			wantFlow: routerconfig.FlowNIXL, wantStatic: 2,
			wantPolicy: router.FailurePolicy{Retries: 1, RetryBudgetPercent: 50, Eject: 3 * time.Second, ConsecutiveFailures: 3, FirstTokenTimeout: 7 * time.Second, OnPrefillFailure: routerconfig.PrefillFailureFail}},
		{name: "two sources of pools", args: []string{"--config", withPools, "--decode", "http://c"}, wantErr: "may not name others"},
		{name: "file without pools, none by flag", args: []string{"--config", noPools}, wantErr: "need --config naming the pools"},
		{name: "flags alone", args: []string{"--flow", "nixl", "--prefill", "http://a", "--decode", "http://c"}, wantFlow: routerconfig.FlowNIXL, wantStatic: 1},
		{name: "prefill with its data-parallel ranks", args: []string{"--prefill", "http://a,http://a:8998,2", "--decode", "http://c"}, wantFlow: routerconfig.FlowMooncake, wantStatic: 1, wantRanks: 2},
		{name: "prefill with no data-parallel ranks", args: []string{"--prefill", "http://a,http://a:8998,0", "--decode", "http://c"}, wantErr: "data-parallel ranks"},
		{name: "engines' own KV events ports", args: []string{"--prefill", "http://a", "--decode", "http://c", "--kv-events-ports", "http://a=7001,7002", "--kv-events-ports", "http://c=7003,7004"},
			wantFlow: routerconfig.FlowMooncake, wantStatic: 1, wantKVPorts: map[string]router.KVEventsPorts{"http://a": {Port: 7001, ReplayPort: 7002}, "http://c": {Port: 7003, ReplayPort: 7004}}},
		{name: "the KV index within the memory limit", args: []string{"--prefill", "http://a", "--decode", "http://c", "--memory-limit", "1073741824"},
			wantFlow: routerconfig.FlowMooncake, wantStatic: 1, wantIndexBlocks: (1 << 30) / 16 * 3 / routerconfig.KVIndexBlockBytes},
		{name: "KV events ports without a replay port", args: []string{"--prefill", "http://a", "--decode", "http://c", "--kv-events-ports", "http://a=7001"}, wantErr: "want ENGINE_URL=PORT,REPLAY_PORT"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			o, err := parseFlags(tc.args)
			if err != nil {
				t.Fatal(err)
			}
			cfg, _, static, err := configure(o)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Flow != tc.wantFlow || len(static.Prefill) != tc.wantStatic {
				t.Errorf("flow %s with %d fixed prefill engines, want %s and %d", cfg.Flow, len(static.Prefill), tc.wantFlow, tc.wantStatic)
			}
			if len(static.Prefill) > 0 && static.Prefill[0].DataParallel != tc.wantRanks {
				t.Errorf("data-parallel ranks %d, want %d", static.Prefill[0].DataParallel, tc.wantRanks)
			}
			if d := cmp.Diff(tc.wantRouting, cfg.Routing); d != "" {
				t.Errorf("routing (-want +got):\n%s", d)
			}
			if cfg.KVIndexBlocks != tc.wantIndexBlocks {
				t.Errorf("KV index of %d blocks a pool, want %d", cfg.KVIndexBlocks, tc.wantIndexBlocks)
			}
			if d := cmp.Diff(tc.wantKVPorts, cfg.KVEventsPorts); d != "" {
				t.Errorf("KV events ports (-want +got):\n%s", d)
			}
			if tc.wantPolicy != (router.FailurePolicy{}) && (cfg.Failure == nil || *cfg.Failure != tc.wantPolicy) {
				t.Errorf("failure policy %+v, want %+v", cfg.Failure, tc.wantPolicy)
			}
			if _, err := router.New(cfg, logr.Discard(), nil); err != nil {
				t.Errorf("the router refuses the configuration: %v", err)
			}
		})
	}
}

// With --metrics-listen, the router's clients' port answers completions, /health and /ready
// and nothing of its counts; /metrics, /canary, /pairs and /routing answer on the metrics port
// alone (issue 56: they answered whoever reached the router). The binary, as rendered.
func TestCountsAnswerOnTheMetricsPortAlone(t *testing.T) {
	reg := bootstrap.NewRegistry()
	_ = reg.Register(bootstrap.Registration{EngineID: "engine-p", Addr: "tcp://127.0.0.1:1"})
	boot := httptest.NewServer(reg.Handler())
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, `{"choices":[{"text":"ok"}]}`)
	}))
	t.Cleanup(func() { boot.Close(); engine.Close() })
	ports, err := sandbox.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	config := filepath.Join(t.TempDir(), "router.json")
	if err := os.WriteFile(config, []byte(`{"flow":"mooncake","routing":{"strategy":"PrefixAware","loadSlack":2},"canary":{"intervalSeconds":3600,"model":"m","promptWords":8}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	metrics := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	clients, _ := runRouter(t, "--config="+config, "--prefill="+engine.URL+","+boot.URL, "--decode="+engine.URL, "--metrics-listen="+strings.TrimPrefix(metrics, "http://"))
	get := func(url string) int {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	resp, err := http.Post(clients+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi","max_tokens":1}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("a completion on the clients' port: %d, want 200", resp.StatusCode)
	}
	for _, path := range []string{"/health", "/ready"} {
		if code := get(clients + path); code != http.StatusOK {
			t.Errorf("GET %s on the clients' port: %d, want 200", path, code)
		}
	}
	for _, path := range []string{"/metrics", routerconfig.PairsPath, routerconfig.RoutingPath, routerconfig.CanaryPath} {
		if code := get(clients + path); code != http.StatusNotFound {
			t.Errorf("GET %s on the clients' port: %d, want 404", path, code)
		}
		// /canary is 404 until the first canary (an hour away): served, but none yet.
		if code := get(metrics + path); code != http.StatusOK && (path != routerconfig.CanaryPath || code != http.StatusNotFound) {
			t.Errorf("GET %s on the metrics port: %d, want it answered", path, code)
		}
	}
	resp, err = http.Post(metrics+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("a completion on the metrics port: %d, want 404", resp.StatusCode)
	}
}
