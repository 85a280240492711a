package agent

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
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

// Handler serves the local API, the bootstrap registry (when this agent hosts it), /healthz,
// /readyz and /metrics. gatherer is what /metrics serves.
func (a *Agent) Handler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	a.handlePublic(mux, gatherer)
	mux.HandleFunc("POST "+agentapi.PathPulls, func(w http.ResponseWriter, r *http.Request) {
		var p agentapi.Pull
		if !decode(w, r, &p) {
			return
		}
		if a.puller == nil {
			http.Error(w, "this agent is a kv_producer: pulls go to kv_consumer agents", http.StatusConflict)
			return
		}
		if p.Request == "" || p.Transfer == "" {
			http.Error(w, "request_id and transfer_id are required", http.StatusBadRequest)
			return
		}
		if err := a.startPull(r.Context(), p.Meta()); err != nil {
			status := http.StatusInternalServerError
			if errors.Is(err, kvtransfer.ErrDuplicateRequest) {
				status = http.StatusConflict
			}
			http.Error(w, err.Error(), status)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusAccepted)
		_ = json.NewEncoder(w).Encode(agentapi.EpochReply{Epoch: a.epoch})
	})
	producerOp := func(op func(agentapi.Hold) []kvtransfer.Decision) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			var h agentapi.Hold
			if !decode(w, r, &h) {
				return
			}
			if a.producer == nil {
				http.Error(w, "this agent is a kv_consumer: holds go to kv_producer agents", http.StatusConflict)
				return
			}
			if h.Transfer == "" {
				http.Error(w, "transfer_id is required", http.StatusBadRequest)
				return
			}
			a.dispatch(op(h))
			writeJSON(w, agentapi.EpochReply{Epoch: a.epoch})
		}
	}
	mux.HandleFunc("POST "+agentapi.PathExpect, producerOp(func(h agentapi.Hold) []kvtransfer.Decision {
		a.producer.Expect(h.Transfer, h.Request)
		a.wakeEarly(h.Transfer)
		return nil
	}))
	mux.HandleFunc("POST "+agentapi.PathReady, producerOp(func(h agentapi.Hold) []kvtransfer.Decision {
		d := a.producer.Ready(h.Transfer, h.Request, h.Blocks)
		a.wakeEarly(h.Transfer)
		return d
	}))
	mux.HandleFunc("POST "+agentapi.PathAbort, producerOp(func(h agentapi.Hold) []kvtransfer.Decision {
		return a.producer.Abort(h.Transfer)
	}))
	mux.HandleFunc("GET "+agentapi.PathInfo, func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, a.Info()) })
	mux.HandleFunc("GET "+agentapi.PathEvents, func(w http.ResponseWriter, r *http.Request) {
		wait, _ := strconv.Atoi(r.URL.Query().Get("wait_ms"))
		c, rel := a.events.drain(r.Context(), time.Duration(min(max(wait, 0), 30_000))*time.Millisecond)
		writeJSON(w, agentapi.Events{Epoch: a.epoch, Completions: c, Releases: rel})
	})
	return mux
}

// PublicHandler serves only what other pods and the kubelet need: the bootstrap registry (when
// this agent hosts it), /healthz, /readyz and /metrics. The local API that moves KV stays on
// Handler, which a pod binds to loopback.
func (a *Agent) PublicHandler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	a.handlePublic(mux, gatherer)
	return mux
}

func (a *Agent) handlePublic(mux *http.ServeMux, gatherer prometheus.Gatherer) {
	if a.registry != nil {
		b := a.registry.Handler()
		mux.Handle("POST /register", b)
		mux.Handle("GET /query", b)
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		a.mu.Lock()
		ready := a.ready
		a.mu.Unlock()
		if !ready {
			http.Error(w, "starting: data plane or bootstrap registration not up yet", http.StatusServiceUnavailable)
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
