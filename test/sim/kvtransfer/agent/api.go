package agent

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
)

// eventQueue holds reports until the engine drains them.
type eventQueue struct {
	mu          sync.Mutex
	completions []agentapi.Completion
	releases    []agentapi.Release
	signal      chan struct{} // closed and replaced on every push
}

func newEventQueue() *eventQueue { return &eventQueue{signal: make(chan struct{})} }

func (q *eventQueue) push(c *agentapi.Completion, r *agentapi.Release) {
	q.mu.Lock()
	if c != nil {
		q.completions = append(q.completions, *c)
	}
	if r != nil {
		q.releases = append(q.releases, *r)
	}
	close(q.signal)
	q.signal = make(chan struct{})
	q.mu.Unlock()
}

// drain returns the queued reports, waiting up to wait for one.
func (q *eventQueue) drain(ctx context.Context, wait time.Duration) ([]agentapi.Completion, []agentapi.Release) {
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	for {
		q.mu.Lock()
		if len(q.completions) > 0 || len(q.releases) > 0 || wait <= 0 {
			c, r := q.completions, q.releases
			q.completions, q.releases = nil, nil
			q.mu.Unlock()
			return c, r
		}
		sig := q.signal
		q.mu.Unlock()
		select {
		case <-sig:
		case <-deadline.C:
			wait = 0
		case <-ctx.Done():
			return nil, nil
		}
	}
}

// routes adds what both halves answer: the engine's reports (GET /v1/events), /healthz,
// /readyz and /metrics (gatherer).
func (h *half) routes(mux *http.ServeMux, gatherer prometheus.Gatherer) {
	mux.HandleFunc("GET "+agentapi.PathEvents, func(w http.ResponseWriter, r *http.Request) {
		wait, _ := strconv.Atoi(r.URL.Query().Get("wait_ms"))
		c, rel := h.events.drain(r.Context(), time.Duration(min(max(wait, 0), 30_000))*time.Millisecond)
		writeJSON(w, agentapi.Events{Epoch: h.epoch, Completions: c, Releases: rel})
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !h.ready.Load() {
			http.Error(w, "starting: the transfer engine is not serving yet", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
}

func decode(w http.ResponseWriter, r *http.Request, v any) bool {
	if err := json.NewDecoder(io.LimitReader(r.Body, 16<<20)).Decode(v); err != nil {
		http.Error(w, "bad request body: "+err.Error(), http.StatusBadRequest)
		return false
	}
	return true
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}
