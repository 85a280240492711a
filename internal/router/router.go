// Package router is the P/D proxy in front of the engines: the Mooncake concurrent flow (both
// legs at once, sharing a transfer_id) and the NIXL sequential flow (prefill first, its
// kv_transfer_params passed to decode). Decode output is streamed back as it comes.
package router

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"pdcluster.dev/pdcluster-operator/connector/bootstrap"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// Prefill is one prefill engine and its bootstrap registry.
type Prefill struct {
	URL       string `json:"url"`
	Bootstrap string `json:"bootstrap"`
}

// Config is the router's configuration: its mode and the engines it starts with (SetPools
// replaces them, e.g. from ResolvePools as pods come and go).
type Config struct {
	Flow    routerconfig.Flow
	Prefill []Prefill
	Decode  []string
	// PrefillTimeout bounds the prefill leg.
	PrefillTimeout time.Duration
}

// Validate reports a configuration the router cannot serve with.
func (c Config) Validate() error {
	if err := c.Flow.Validate(); err != nil {
		return err
	}
	return validatePrefill(c.Flow, c.Prefill)
}

func validatePrefill(flow routerconfig.Flow, prefill []Prefill) error {
	for i, p := range prefill {
		if p.URL == "" || (flow == routerconfig.FlowMooncake && p.Bootstrap == "") {
			return fmt.Errorf("prefill[%d]: url and (for mooncake) bootstrap are required", i)
		}
	}
	return nil
}

// Router proxies requests to prefill and decode engines.
type Router struct {
	cfg   Config
	pools atomic.Pointer[Pools]
	hc    *http.Client
	boot  *bootstrap.Client
	// nextP and nextD round-robin each pool on its own: one shared counter, advanced twice per
	// request, would pin every request to the same pair when both pools have an even size.
	nextP, nextD atomic.Uint64
	log          logr.Logger
	requests     *prometheus.CounterVec
}

// New validates cfg and returns a Router; metrics register on reg.
func New(cfg Config, log logr.Logger, reg prometheus.Registerer) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	if cfg.PrefillTimeout <= 0 {
		cfg.PrefillTimeout = 10 * time.Minute
	}
	boot := bootstrap.NewClient()
	boot.NoCache = true // the engine id changes when a producer restarts; asking is cheap
	r := &Router{
		cfg: cfg, hc: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}, boot: boot, log: log,
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_requests_total", Help: "Requests proxied, by flow and HTTP status code.",
		}, []string{"flow", "code"}),
	}
	if reg != nil {
		if err := reg.Register(r.requests); err != nil {
			return nil, err
		}
	}
	r.pools.Store(&Pools{Prefill: cfg.Prefill, Decode: cfg.Decode})
	return r, nil
}

// SetPools replaces the engines requests go to; requests in flight keep theirs.
func (r *Router) SetPools(p Pools) error {
	if err := validatePrefill(r.cfg.Flow, p.Prefill); err != nil {
		return fmt.Errorf("router: %w", err)
	}
	r.pools.Store(&p)
	return nil
}

// Handler serves the OpenAI routes, /health, /ready and /metrics (from gatherer, if not nil).
func (r *Router) Handler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", r.proxy)
	mux.HandleFunc("POST /v1/chat/completions", r.proxy)
	// /health is liveness: the process serves. /ready is readiness: it also knows an engine of
	// each pool, so a Ready PDCluster answers completions instead of 503.
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /ready", func(w http.ResponseWriter, _ *http.Request) {
		pools := r.pools.Load()
		if len(pools.Prefill) == 0 || len(pools.Decode) == 0 {
			writeError(w, http.StatusServiceUnavailable, fmt.Sprintf("pools not resolved yet: %d prefill and %d decode engines", len(pools.Prefill), len(pools.Decode)))
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, req *http.Request) {
		pools := r.pools.Load()
		if len(pools.Decode) == 0 {
			writeError(w, http.StatusServiceUnavailable, "no ready decode engine")
			return
		}
		resp, err := r.hc.Get(pools.Decode[0] + "/v1/models")
		if err != nil {
			writeError(w, http.StatusBadGateway, "decode engine unreachable: "+err.Error())
			return
		}
		defer resp.Body.Close()
		copyResponse(w, resp)
	})
	if gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
	return mux
}

func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func pick(next *atomic.Uint64, n int) int { return int(next.Add(1)-1) % n }

func (r *Router) proxy(w http.ResponseWriter, req *http.Request) {
	sw := &statusWriter{ResponseWriter: w}
	defer func() { r.requests.WithLabelValues(string(r.cfg.Flow), fmt.Sprint(sw.code())).Inc() }()
	raw, err := io.ReadAll(io.LimitReader(req.Body, 32<<20))
	if err != nil {
		writeError(sw, http.StatusBadRequest, "read body: "+err.Error())
		return
	}
	var body map[string]any
	if err := json.Unmarshal(raw, &body); err != nil || body == nil {
		writeError(sw, http.StatusBadRequest, "body must be a JSON object")
		return
	}
	if _, ok := body["kv_transfer_params"]; ok {
		writeError(sw, http.StatusBadRequest, "kv_transfer_params is set by the router, not by clients")
		return
	}
	_, hasPrompt := body["prompt"]
	_, hasMessages := body["messages"]
	if !hasPrompt && !hasMessages {
		writeError(sw, http.StatusBadRequest, "prompt (completions) or messages (chat) is required")
		return
	}
	reqID := req.Header.Get("X-Request-Id")
	if reqID == "" {
		reqID = newID()
	}
	pools := r.pools.Load()
	if len(pools.Prefill) == 0 || len(pools.Decode) == 0 {
		writeError(sw, http.StatusServiceUnavailable, fmt.Sprintf("no ready engines: %d prefill, %d decode", len(pools.Prefill), len(pools.Decode)))
		return
	}
	p := pools.Prefill[pick(&r.nextP, len(pools.Prefill))]
	d := pools.Decode[pick(&r.nextD, len(pools.Decode))]
	switch r.cfg.Flow {
	case routerconfig.FlowMooncake:
		r.mooncake(sw, req, body, reqID, p, d)
	case routerconfig.FlowNIXL:
		r.nixl(sw, req, body, reqID, p, d)
	}
}

// prefillBody is the prefill leg: one token, no streaming, the given transfer params.
func prefillBody(body map[string]any, params map[string]any) map[string]any {
	pb := maps.Clone(body)
	pb["kv_transfer_params"] = params
	pb["max_tokens"] = 1
	if _, ok := pb["max_completion_tokens"]; ok {
		pb["max_completion_tokens"] = 1
	}
	pb["stream"] = false
	delete(pb, "stream_options")
	return pb
}

// mooncake runs both legs at once. The prefill leg is never cancelled by the client: its
// blocks are released by the decode's pull (or cleanup pull) either way.
func (r *Router) mooncake(w http.ResponseWriter, req *http.Request, body map[string]any, reqID string, p Prefill, d string) {
	engineID, dp, err := r.engine(req.Context(), p.Bootstrap)
	if err != nil {
		writeError(w, http.StatusBadGateway, fmt.Sprintf("prefill bootstrap %s: %v", p.Bootstrap, err))
		return
	}
	transfer := "xfer-" + newID()
	pb := prefillBody(body, map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer})
	db := maps.Clone(body)
	db["kv_transfer_params"] = map[string]any{
		"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": transfer,
		"remote_bootstrap_addr": p.Bootstrap, "remote_engine_id": engineID,
	}
	prefillErr := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(req.Context()), r.cfg.PrefillTimeout)
		defer cancel()
		resp, err := r.post(ctx, p.URL+req.URL.Path, pb, reqID, map[string]string{"X-data-parallel-rank": dp})
		if err == nil {
			err = drain(resp)
		}
		if err != nil {
			r.log.Info("prefill leg failed", "request", reqID, "prefill", p.URL, "err", err.Error())
			r.boot.Invalidate(p.Bootstrap)
		}
		prefillErr <- err
	}()
	resp, err := r.post(req.Context(), d+req.URL.Path, db, reqID, nil)
	if err != nil {
		if req.Context().Err() != nil {
			return // the client went away
		}
		writeError(w, http.StatusBadGateway, fmt.Sprintf("decode leg %s failed: %v", d, err))
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 500 {
		// Say why: the prefill leg's failure is usually the cause of the decode's.
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		reason := fmt.Sprintf("decode leg %s: %s: %s", d, resp.Status, bytes.TrimSpace(b))
		select {
		case perr := <-prefillErr:
			if perr != nil {
				reason += fmt.Sprintf("; prefill leg %s: %v", p.URL, perr)
			}
		case <-time.After(100 * time.Millisecond):
		}
		writeError(w, resp.StatusCode, reason)
		return
	}
	copyResponse(w, resp)
}

// nixl runs the prefill leg first and passes its kv_transfer_params to decode.
func (r *Router) nixl(w http.ResponseWriter, req *http.Request, body map[string]any, reqID string, p Prefill, d string) {
	pb := prefillBody(body, map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false,
		"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
	})
	ctx, cancel := context.WithTimeout(req.Context(), r.cfg.PrefillTimeout)
	defer cancel()
	presp, err := r.post(ctx, p.URL+req.URL.Path, pb, reqID, nil)
	if err != nil {
		if req.Context().Err() != nil {
			return
		}
		writeError(w, http.StatusBadGateway, fmt.Sprintf("prefill leg %s failed: %v", p.URL, err))
		return
	}
	pbody, err := io.ReadAll(io.LimitReader(presp.Body, 32<<20))
	presp.Body.Close()
	if err != nil {
		writeError(w, http.StatusBadGateway, fmt.Sprintf("prefill leg %s: read: %v", p.URL, err))
		return
	}
	if presp.StatusCode != http.StatusOK {
		// The prefill's own answer (a 4xx for a bad request) is the client's answer.
		w.Header().Set("Content-Type", presp.Header.Get("Content-Type"))
		w.WriteHeader(presp.StatusCode)
		_, _ = w.Write(pbody)
		return
	}
	var pr struct {
		KVTransferParams map[string]any `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(pbody, &pr); err != nil || pr.KVTransferParams == nil {
		writeError(w, http.StatusBadGateway, fmt.Sprintf("prefill leg %s returned no kv_transfer_params", p.URL))
		return
	}
	db := maps.Clone(body)
	db["kv_transfer_params"] = pr.KVTransferParams
	resp, err := r.post(req.Context(), d+req.URL.Path, db, reqID, nil)
	if err != nil {
		if req.Context().Err() != nil {
			return
		}
		writeError(w, http.StatusBadGateway, fmt.Sprintf("decode leg %s failed: %v", d, err))
		return
	}
	defer resp.Body.Close()
	copyResponse(w, resp)
}

// engine picks the first data-parallel rank registered at the prefill's bootstrap registry.
func (r *Router) engine(ctx context.Context, addr string) (engineID, dp string, err error) {
	topo, err := r.boot.Query(ctx, addr)
	if err != nil {
		return "", "", err
	}
	if len(topo) == 0 {
		r.boot.Invalidate(addr)
		return "", "", errors.New("no prefill worker registered yet")
	}
	dp = slices.Min(slices.Collect(maps.Keys(topo)))
	return topo[dp].EngineID, dp, nil
}

func (r *Router) post(ctx context.Context, url string, body map[string]any, reqID string, headers map[string]string) (*http.Response, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("X-Request-Id", reqID)
	for k, v := range headers {
		hr.Header.Set(k, v)
	}
	return r.hc.Do(hr)
}

func drain(resp *http.Response) error {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(b))
	}
	return nil
}

// copyResponse streams resp to w, flushing as chunks arrive (server-sent events).
func copyResponse(w http.ResponseWriter, resp *http.Response) {
	for _, h := range []string{"Content-Type", "Cache-Control"} {
		if v := resp.Header.Get(h); v != "" {
			w.Header().Set(h, v)
		}
	}
	w.WriteHeader(resp.StatusCode)
	fl, _ := w.(http.Flusher)
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if err != nil {
			return
		}
	}
}

func writeError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "code": status}})
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (s *statusWriter) code() int {
	if s.status == 0 {
		return 499 // the client went away before an answer
	}
	return s.status
}
