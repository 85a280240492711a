package sidecar

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/utils/clock"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// EngineConfig is how the sidecar reads its engine's KV evidence from the engine's own
// /metrics: on loopback, so the operator needs no path to the engine's port.
type EngineConfig struct {
	// MetricsURL is the engine's /metrics (http://127.0.0.1:8000/metrics); empty: not read.
	MetricsURL string
	// Every is how often it is read (15 s when unset).
	Every time.Duration
	// Client reads it (a 5 s timeout when nil).
	Client *http.Client
	// Clock ages the last read; nil is the wall clock.
	Clock clock.PassiveClock
}

// engineWatch keeps the last KV evidence read from the engine.
type engineWatch struct {
	cfg EngineConfig
	log logr.Logger

	mu     sync.Mutex
	last   *vllm.EngineStats // the last counts read
	lastAt time.Time
	err    string // why the last read failed; "" when it did not
}

func newEngineWatch(cfg EngineConfig, log logr.Logger) *engineWatch {
	if cfg.Every <= 0 {
		cfg.Every = 15 * time.Second
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Timeout: 5 * time.Second,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	return &engineWatch{cfg: cfg, log: log}
}

// run reads the engine every cfg.Every until ctx ends.
func (e *engineWatch) run(ctx context.Context) {
	if e.cfg.MetricsURL == "" {
		return
	}
	t := time.NewTicker(e.cfg.Every)
	defer t.Stop()
	for {
		e.readOnce(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (e *engineWatch) readOnce(ctx context.Context) {
	st, err := e.read(ctx)
	e.mu.Lock()
	defer e.mu.Unlock()
	if err != nil {
		if e.err == "" {
			e.log.Info("engine metrics not read", "url", e.cfg.MetricsURL, "error", err.Error())
		}
		e.err = err.Error()
		return
	}
	e.last, e.lastAt, e.err = &st, e.cfg.Clock.Now(), ""
}

func (e *engineWatch) read(ctx context.Context) (vllm.EngineStats, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.cfg.MetricsURL, nil)
	if err != nil {
		return vllm.EngineStats{}, err
	}
	// The text format: the parser below reads it, and vLLM serves it by default.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := e.cfg.Client.Do(req)
	if err != nil {
		return vllm.EngineStats{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return vllm.EngineStats{}, fmt.Errorf("GET %s: %s", e.cfg.MetricsURL, resp.Status)
	}
	return vllm.ParseEngineMetrics(resp.Body)
}

// state is the evidence for GET /gate: the last counts read, their age, and why the read
// after them failed; nil when the engine is not read or never answered.
func (e *engineWatch) state() *vllm.EngineStats {
	if e == nil {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.cfg.MetricsURL == "" || (e.last == nil && e.err == "") {
		return nil
	}
	st := vllm.EngineStats{Error: e.err}
	if e.last != nil {
		st = *e.last
		st.AgeSeconds, st.Error = e.cfg.Clock.Since(e.lastAt).Seconds(), e.err
	}
	return &st
}
