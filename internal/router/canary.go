// The canary: a never-cached prompt through the router's own P/D path at an interval, and how
// many of its tokens the decode engine that answered received from prefill.

package router

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bounded"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// decodeSeenKey marks a request of the router's own (the canary): its exchange writes the
// decode engine that answered into the *string the context holds. Clients cannot set it.
type decodeSeenKey struct{}

// canaryState is the canary's last result and its metrics.
type canaryState struct {
	last     atomic.Pointer[routerconfig.CanaryResult]
	results  *prometheus.CounterVec
	external prometheus.Gauge
	at       prometheus.Gauge
}

func newCanaryState() *canaryState {
	c := &canaryState{
		results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_canary_requests_total",
			Help: "Canary requests sent through the P/D path, by result: External (decode received the prompt's KV from prefill), Recomputed, Failed.",
		}, []string{"result"}),
		external: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pdcluster_router_canary_external_tokens", Help: "Prompt tokens of the newest canary the decode engine counted as received from prefill.",
		}),
		at: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pdcluster_router_canary_last_timestamp_seconds", Help: "When the newest canary's answer came (Unix time).",
		}),
	}
	for _, r := range []routerconfig.CanaryOutcome{routerconfig.CanaryExternal, routerconfig.CanaryRecomputed, routerconfig.CanaryFailed} {
		c.results.WithLabelValues(string(r))
	}
	return c
}

func (c *canaryState) collectors() []prometheus.Collector {
	return []prometheus.Collector{c.results, c.external, c.at}
}

// RunCanary sends a canary every cfg.IntervalSeconds until ctx ends.
func (r *Router) RunCanary(ctx context.Context, cfg routerconfig.Canary) {
	t := time.NewTicker(time.Duration(cfg.IntervalSeconds) * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		res := r.Canary(ctx, cfg)
		r.canary.last.Store(&res)
		r.canary.results.WithLabelValues(string(res.Result)).Inc()
		r.canary.external.Set(float64(res.ExternalTokens))
		r.canary.at.Set(float64(res.Time.Unix()))
		if res.Result != routerconfig.CanaryExternal {
			r.log.Info("canary request: KV did not come from prefill", "result", res.Result, "decode", res.Decode, "message", res.Message)
		}
	}
}

// Canary sends one canary and judges it. The decode engines' external-token counters are read
// before and after (vllm:prompt_tokens_by_source_total on their API port, which the router
// reaches): other requests on the same engine meanwhile only add to the count, so a canary is
// judged Recomputed only when that engine received less than half its prompt.
func (r *Router) Canary(ctx context.Context, cfg routerconfig.Canary) routerconfig.CanaryResult {
	failed := func(format string, a ...any) routerconfig.CanaryResult {
		return routerconfig.CanaryResult{Time: time.Now(), Result: routerconfig.CanaryFailed, Message: fmt.Sprintf(format, a...)}
	}
	pools := r.pools.Load()
	before := map[string]float64{}
	for _, d := range pools.Decode {
		if n, err := r.externalTokens(ctx, d); err == nil {
			before[d] = n
		}
	}
	body, _ := json.Marshal(map[string]any{"model": cfg.Model, "prompt": canaryPrompt(int(cfg.PromptWords)), "max_tokens": 1})
	var decode string
	req, err := http.NewRequestWithContext(context.WithValue(ctx, decodeSeenKey{}, &decode), http.MethodPost, "/v1/completions", bytes.NewReader(body))
	if err != nil {
		return failed("build the canary: %v", err)
	}
	rec := &recorder{header: http.Header{}}
	r.proxy(rec, req)
	if rec.code != http.StatusOK {
		return failed("the canary request answered %d: %s", rec.code, bytes.TrimSpace(rec.body.Bytes()))
	}
	var answer struct {
		Usage struct {
			PromptTokens int64 `json:"prompt_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(rec.body.Bytes(), &answer); err != nil || answer.Usage.PromptTokens == 0 {
		return failed("the canary's answer has no usage.prompt_tokens: %s", bounded.Snippet(bytes.NewReader(rec.body.Bytes())))
	}
	start, ok := before[decode]
	if !ok {
		return failed("decode engine %q's prompt token counts were not read before the canary", decode)
	}
	after, err := r.externalTokens(ctx, decode)
	if err != nil {
		return failed("decode engine %s's prompt token counts after the canary: %v", decode, err)
	}
	res := routerconfig.CanaryResult{Time: time.Now(), Result: routerconfig.CanaryExternal, PromptTokens: answer.Usage.PromptTokens,
		ExternalTokens: int64(after - start), Decode: decode}
	if 2*res.ExternalTokens < res.PromptTokens {
		res.Result = routerconfig.CanaryRecomputed
		res.Message = fmt.Sprintf("decode engine %s received %d of the canary's %d prompt tokens from prefill", decode, res.ExternalTokens, res.PromptTokens)
	}
	return res
}

// externalTokens is a decode engine's vllm:prompt_tokens_by_source_total{source=
// "external_kv_transfer"}, summed over its data-parallel ranks.
func (r *Router) externalTokens(ctx context.Context, engine string) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, engine+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := r.hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	st, err := vllm.ParseEngineMetrics(resp.Body)
	if err != nil {
		return 0, err
	}
	if !st.HasPromptSources {
		return 0, fmt.Errorf("the engine exports no vllm:prompt_tokens_by_source_total")
	}
	return st.ExternalKVTokens, nil
}

// canaryPrompt is words words that begin with a random one: no prefix cache (prefill's or
// decode's) holds any of its blocks.
func canaryPrompt(words int) string {
	w := make([]string, words)
	w[0] = "canary-" + strings.ToLower(rand.Text())
	for i := 1; i < words; i++ {
		w[i] = fmt.Sprintf("c%d", i)
	}
	return strings.Join(w, " ")
}

// recorder is the canary's response writer.
type recorder struct {
	header http.Header
	code   int
	body   bytes.Buffer
}

func (w *recorder) Header() http.Header { return w.header }
func (w *recorder) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
}
func (w *recorder) Write(b []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return w.body.Write(b)
}
func (w *recorder) Flush() {}

// serveCanary is GET /canary: the newest canary, or 404 before the first (or without one).
func (r *Router) serveCanary(w http.ResponseWriter, _ *http.Request) {
	last := r.canary.last.Load()
	if last == nil {
		writeError(w, http.StatusNotFound, "no canary sent yet (spec.kvTransfer.verification.mode Canary)")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(last)
}

// The relay flushes a streamed answer as it goes.
var _ http.Flusher = (*recorder)(nil)
