// Package router is the P/D proxy in front of the engines: the Mooncake concurrent flow (both
// legs at once, sharing a transfer_id) and the NIXL sequential flow (prefill first, its
// kv_transfer_params passed to decode). Decode output is streamed back as it comes.
package router

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
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
	Flow routerconfig.Flow
	// Balance picks an engine in each pool; empty: least-in-flight.
	Balance routerconfig.Balance
	Prefill []Prefill
	Decode  []string
	// PrefillTimeout bounds the prefill leg.
	PrefillTimeout time.Duration
	// MaxBodyBytes bounds a client's request body (413 past it); 0: DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// MaxInFlight bounds the requests proxied at once (503 past it); 0: DefaultMaxInFlight.
	MaxInFlight int64
	// UpstreamHeaderTimeout bounds the wait for an engine's response headers; 0: the default
	// of 10 minutes. A non-streaming completion's headers come only when it has finished.
	UpstreamHeaderTimeout time.Duration
}

// Defaults of Config's limits.
const (
	DefaultMaxBodyBytes int64 = 32 << 20
	DefaultMaxInFlight  int64 = 4096
)

// Validate reports a configuration the router cannot serve with.
func (c Config) Validate() error {
	if err := c.Flow.Validate(); err != nil {
		return err
	}
	if err := c.Balance.Validate(); err != nil {
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
	// prefill and decode pick each pool's engines on their own: one shared turn counter,
	// advanced twice per request, would pin every request to the same pair when both pools
	// have an even size.
	prefill, decode *balancer
	inFlight        atomic.Int64
	log             logr.Logger
	requests        *prometheus.CounterVec
}

// A prefill's engine id is asked again in the background once its answer is older than
// bootstrapRefresh, and not used at all past bootstrapMaxAge: a producer that restarted has a
// new id, and a pull naming the old one fails (or, with kv_load_failure_policy recompute,
// quietly recomputes), so a busy router must learn the new id within about bootstrapRefresh.
// A failed leg makes it ask at once. Asking on every request was a tenth of a request's cost.
const (
	bootstrapRefresh = 100 * time.Millisecond
	bootstrapMaxAge  = 2 * time.Second
)

// New validates cfg and returns a Router; metrics register on reg.
func New(cfg Config, log logr.Logger, reg prometheus.Registerer) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	if cfg.PrefillTimeout <= 0 {
		cfg.PrefillTimeout = 10 * time.Minute
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = DefaultMaxInFlight
	}
	if cfg.UpstreamHeaderTimeout <= 0 {
		cfg.UpstreamHeaderTimeout = 10 * time.Minute
	}
	boot := bootstrap.NewClient()
	boot.MaxAge, boot.RefreshAfter = bootstrapMaxAge, bootstrapRefresh
	r := &Router{
		cfg: cfg, hc: upstreamClient(cfg.UpstreamHeaderTimeout), boot: boot, log: log,
		prefill: newBalancer(cfg.Balance), decode: newBalancer(cfg.Balance),
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

// newID is 128 random bits (base32): a transfer id names the KV a pull takes, so one client's
// ids must tell it nothing of another's. crypto/rand reads through the vDSO on Linux 6.11+,
// without a system call.
func newID() string { return rand.Text() }

func (r *Router) proxy(w http.ResponseWriter, req *http.Request) {
	sw := &statusWriter{ResponseWriter: w}
	defer func() { r.requests.WithLabelValues(string(r.cfg.Flow), strconv.Itoa(sw.code())).Inc() }()
	if n := r.inFlight.Add(1); n > r.cfg.MaxInFlight {
		r.inFlight.Add(-1)
		sw.Header().Set("Retry-After", "1")
		writeError(sw, http.StatusServiceUnavailable, fmt.Sprintf("%d requests in flight, the router's limit", r.cfg.MaxInFlight))
		return
	}
	defer r.inFlight.Add(-1)
	raw, err := io.ReadAll(http.MaxBytesReader(sw, req.Body, r.cfg.MaxBodyBytes))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			writeError(sw, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body larger than %d bytes", r.cfg.MaxBodyBytes))
			return
		}
		writeError(sw, http.StatusBadRequest, "read body: "+err.Error())
		return
	}
	// Values stay raw: the router reads none of them, and re-encoding a long prompt's token list
	// was a tenth of its time.
	var body map[string]json.RawMessage
	if err := json.Unmarshal(raw, &body); err != nil || body == nil {
		writeError(sw, http.StatusBadRequest, "body must be a JSON object")
		return
	}
	if clientSetsTransferParams(body) {
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
	} else if !validRequestID(reqID) {
		writeError(sw, http.StatusBadRequest, fmt.Sprintf("X-Request-Id must be at most %d printable ASCII characters without spaces", maxRequestIDBytes))
		return
	}
	pools := r.pools.Load()
	if len(pools.Prefill) == 0 || len(pools.Decode) == 0 {
		writeError(sw, http.StatusServiceUnavailable, fmt.Sprintf("no ready engines: %d prefill, %d decode", len(pools.Prefill), len(pools.Decode)))
		return
	}
	pi := r.prefill.pick(len(pools.Prefill), func(i int) string { return pools.Prefill[i].URL })
	defer r.prefill.done(pi)
	p := pools.Prefill[pi.index]
	di := r.decode.pick(len(pools.Decode), func(i int) string { return pools.Decode[i] })
	defer r.decode.done(di)
	d := pools.Decode[di.index]
	switch r.cfg.Flow {
	case routerconfig.FlowMooncake:
		r.mooncake(sw, req, body, reqID, p, d)
	case routerconfig.FlowNIXL:
		r.nixl(sw, req, body, reqID, p, d)
	}
}

// rawJSON encodes v, which cannot fail for the maps of strings, numbers and bools given here.
func rawJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// withParams is body with kv_transfer_params set.
func withParams(body map[string]json.RawMessage, params map[string]any) map[string]json.RawMessage {
	b := maps.Clone(body)
	b["kv_transfer_params"] = rawJSON(params)
	return b
}

var (
	jsonOne   = json.RawMessage("1")
	jsonFalse = json.RawMessage("false")
)

// prefillBody is the prefill leg: one token, no streaming, the given transfer params.
func prefillBody(body map[string]json.RawMessage, params map[string]any) map[string]json.RawMessage {
	pb := withParams(body, params)
	pb["max_tokens"] = jsonOne
	if _, ok := pb["max_completion_tokens"]; ok {
		pb["max_completion_tokens"] = jsonOne
	}
	pb["stream"] = jsonFalse
	delete(pb, "stream_options")
	return pb
}

// mooncake runs both legs at once. The prefill leg is never cancelled by the client: its
// blocks are released by the decode's pull (or cleanup pull) either way.
func (r *Router) mooncake(w http.ResponseWriter, req *http.Request, body map[string]json.RawMessage, reqID string, p Prefill, d string) {
	engineID, dp, err := r.engine(req.Context(), p.Bootstrap)
	if err != nil {
		writeError(w, http.StatusBadGateway, fmt.Sprintf("prefill bootstrap %s: %v", p.Bootstrap, err))
		return
	}
	transfer := "xfer-" + newID()
	pb := prefillBody(body, map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer})
	db := withParams(body, map[string]any{
		"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": transfer,
		"remote_bootstrap_addr": p.Bootstrap, "remote_engine_id": engineID,
	})
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
		r.boot.Invalidate(p.Bootstrap)
		writeError(w, http.StatusBadGateway, fmt.Sprintf("decode leg %s failed: %v", d, err))
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 500 {
		// A decode that failed may have pulled with a stale engine id: ask again next time.
		r.boot.Invalidate(p.Bootstrap)
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
func (r *Router) nixl(w http.ResponseWriter, req *http.Request, body map[string]json.RawMessage, reqID string, p Prefill, d string) {
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
		KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(pbody, &pr); err != nil || len(pr.KVTransferParams) == 0 || string(pr.KVTransferParams) == "null" {
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

func (r *Router) post(ctx context.Context, url string, body map[string]json.RawMessage, reqID string, headers map[string]string) (*http.Response, error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(encodeBody(body)))
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

// appendJSONString appends s as a JSON string: plain ASCII as it is, anything else through
// encoding/json.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' {
			q, _ := json.Marshal(s)
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// encodeBody writes body as a JSON object, keys sorted as json.Marshal would. The values are
// copied as they are: they came from json.Unmarshal or rawJSON, so they are valid JSON, and
// json.Marshal would only scan them again.
func encodeBody(body map[string]json.RawMessage) []byte {
	keys := slices.Sorted(maps.Keys(body))
	n := 2
	for _, k := range keys {
		n += len(k) + len(body[k]) + 4
	}
	b := make([]byte, 0, n+16)
	b = append(b, '{')
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, k)
		b = append(b, ':')
		b = append(b, body[k]...)
	}
	return append(b, '}')
}

func drain(resp *http.Response) error {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(b))
	}
	return nil
}

// copyResponse streams resp to w: a stream of server-sent events flushed as chunks arrive,
// any other answer copied whole with its length (no flush per read, no chunked encoding).
func copyResponse(w http.ResponseWriter, resp *http.Response) {
	stream := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	for _, h := range []string{"Content-Type", "Cache-Control", "Content-Length"} {
		if v := resp.Header.Get(h); v != "" && (h != "Content-Length" || !stream) {
			w.Header().Set(h, v)
		}
	}
	if !stream {
		b, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes+1))
		if err == nil && len(b) > maxResponseBytes {
			err = fmt.Errorf("answer larger than %d bytes", maxResponseBytes)
		}
		if err != nil {
			w.Header().Del("Content-Length")
			writeError(w, http.StatusBadGateway, "read engine answer: "+err.Error())
			return
		}
		if stripped, ok := withoutTransferParams(b); ok {
			b = stripped
			w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(b)
		return
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
