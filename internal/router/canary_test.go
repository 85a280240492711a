package router

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// canaryDecode is a decode engine for the canary: it counts the prompt tokens it received from
// prefill in vLLM's vllm:prompt_tokens_by_source_total on /metrics.
type canaryDecode struct {
	external atomic.Int64
	// receives: a request with kv_transfer_params adds its prompt to the external count
	// (false: decode computes it, as behind a router that drops them).
	receives bool
	status   int
	metrics  bool
	prompts  atomic.Int64
}

func (d *canaryDecode) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/metrics":
		if !d.metrics {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintf(w, "# TYPE vllm:prompt_tokens_by_source_total counter\nvllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"external_kv_transfer\"} %d\n"+
			"vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"local_compute\"} 0\n", d.external.Load())
	case "/v1/completions":
		var body struct {
			Prompt string          `json:"prompt"`
			Params json.RawMessage `json:"kv_transfer_params"`
			Max    int             `json:"max_tokens"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		if d.status != 0 {
			http.Error(w, `{"error":{"message":"boom"}}`, d.status)
			return
		}
		n := int64(len(strings.Fields(body.Prompt)))
		d.prompts.Add(1)
		if d.receives && len(body.Params) > 0 {
			d.external.Add(n - 1) // vLLM computes the last prompt token on decode
		}
		fmt.Fprintf(w, `{"choices":[{"text":"x"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d}}`, n, body.Max)
	default:
		http.NotFound(w, r)
	}
}

func canaryPrefill() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		fmt.Fprint(w, `{"choices":[{"text":"x"}],"kv_transfer_params":{"remote_engine_id":"p","remote_block_ids":[1],"remote_host":"p","remote_port":1}}`)
	})
}

// canaryRouter is a NIXL router over a prefill that always answers and decode d.
func canaryRouter(t *testing.T, d *canaryDecode) (*Router, *prometheus.Registry, string) {
	t.Helper()
	prefill := httptest.NewServer(canaryPrefill())
	t.Cleanup(prefill.Close)
	decode := httptest.NewServer(d)
	t.Cleanup(decode.Close)
	reg := prometheus.NewRegistry()
	r, err := New(Config{Flow: routerconfig.FlowNIXL}, logr.Discard(), reg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.SetPools(Pools{Prefill: []Prefill{{URL: prefill.URL}}, Decode: []string{decode.URL}}); err != nil {
		t.Fatal(err)
	}
	return r, reg, decode.URL
}

// The canary goes through the router's own P/D path and is judged by the external tokens the
// decode engine that answered counted meanwhile; GET /canary and the metrics report it.
func TestCanary(t *testing.T) {
	cfg := routerconfig.Canary{IntervalSeconds: 1, Model: "m", PromptWords: 64}
	cases := []struct {
		name        string
		decode      func() *canaryDecode
		want        routerconfig.CanaryOutcome
		wantMessage string
	}{
		{"decode receives the KV", func() *canaryDecode { return &canaryDecode{receives: true, metrics: true} }, routerconfig.CanaryExternal, ""},
		{"decode computes it", func() *canaryDecode { return &canaryDecode{receives: false, metrics: true} }, routerconfig.CanaryRecomputed, "received 0 of the canary's 64 prompt tokens"},
		{"decode fails it", func() *canaryDecode { return &canaryDecode{metrics: true, status: http.StatusInternalServerError} }, routerconfig.CanaryFailed, "answered 500"},
		{"decode's counts cannot be read", func() *canaryDecode { return &canaryDecode{receives: true} }, routerconfig.CanaryFailed, "were not read before the canary"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := tc.decode()
			r, _, decodeURL := canaryRouter(t, d)
			res := r.Canary(context.Background(), cfg)
			if res.Result != tc.want || !strings.Contains(res.Message, tc.wantMessage) {
				t.Fatalf("canary = %+v, want %s with %q", res, tc.want, tc.wantMessage)
			}
			if tc.want == routerconfig.CanaryExternal && (res.ExternalTokens != 63 || res.PromptTokens != 64 || res.Decode != decodeURL) {
				t.Errorf("canary = %+v, want 63 of 64 tokens external from %s", res, decodeURL)
			}
			if tc.want != routerconfig.CanaryFailed && d.prompts.Load() != 1 {
				t.Errorf("decode answered %d requests, want the one canary", d.prompts.Load())
			}
		})
	}
}

// RunCanary sends canaries at the interval and serves the newest on GET /canary (404 before
// the first), with its result counted.
func TestRunCanaryServesTheNewest(t *testing.T) {
	r, reg, _ := canaryRouter(t, &canaryDecode{receives: true, metrics: true})
	srv := httptest.NewServer(r.Handler(reg))
	defer srv.Close()
	get := func() (int, routerconfig.CanaryResult) {
		resp, err := http.Get(srv.URL + routerconfig.CanaryPath)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var res routerconfig.CanaryResult
		_ = json.NewDecoder(resp.Body).Decode(&res)
		return resp.StatusCode, res
	}
	if code, _ := get(); code != http.StatusNotFound {
		t.Fatalf("GET /canary before the first = %d, want 404", code)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go r.RunCanary(ctx, routerconfig.Canary{IntervalSeconds: 1, Model: "m", PromptWords: 32})
	waitUntil(t, func() bool { code, _ := get(); return code == http.StatusOK })
	if _, res := get(); res.Result != routerconfig.CanaryExternal || res.ExternalTokens != 31 {
		t.Errorf("GET /canary = %+v, want External with 31 tokens", res)
	}
	if got := testutil.ToFloat64(r.canary.results.WithLabelValues("External")); got < 1 {
		t.Errorf("canary_requests_total{result=External} = %v", got)
	}
}

func waitUntil(t *testing.T, cond func() bool) {
	t.Helper()
	for range 200 {
		if cond() {
			return
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Fatal("condition not met in 5s")
}
