// Package sidecar is the connector sidecar run beside each vLLM engine. vLLM moves the KV itself
// (Mooncake, NIXL) and runs the completion gate in-process (connector/vllm/pdgate); the sidecar
// hears the gate's heartbeat on the pod-local socket, answers the kubelet's probes (unready while
// a required gate is silent), reads its engine's KV evidence from the engine's /metrics on
// loopback (engine.go), serves both to the operator (GET /gate), and exports the gate's counts.
package sidecar

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// Config configures a Sidecar.
type Config struct {
	// Gate is how the sidecar watches its engine's completion gate.
	Gate GateConfig
	// Engine is how it reads its engine's KV evidence (vLLM's /metrics).
	Engine EngineConfig
	Log    logr.Logger
	// Metrics is where the sidecar registers its collectors; nil means a private registry.
	Metrics prometheus.Registerer
	// RefusalLogEvery bounds how often refused requests are logged (one line, with the count
	// since the last): a misbehaving client cannot flood the log. Zero is 10 s.
	RefusalLogEvery time.Duration
	// DrainPoll is how often a drain looks at the engine's held sends again; zero is 1 s.
	DrainPoll time.Duration
	// DrainOver is how long after a drain ended a sidecar still running is ready again; zero
	// is drainOver (tests shorten it).
	DrainOver time.Duration
}

// Sidecar watches one engine's completion gate.
type Sidecar struct {
	gate     *gateWatch
	engine   *engineWatch
	log      logr.Logger
	refusals refusalLog
	// draining is set once the pod is being deleted (POST /v1/drain): unready from then on,
	// until drainOver after the last drain ended; drains counts the drains running or within
	// that time.
	draining  atomic.Bool
	drains    atomic.Int32
	drainPoll time.Duration
	drainOver time.Duration
}

// New builds a sidecar from cfg.
func New(cfg Config) (*Sidecar, error) {
	s := &Sidecar{gate: newGateWatch(cfg.Gate), engine: newEngineWatch(cfg.Engine, cfg.Log), log: cfg.Log,
		drainPoll: cmp.Or(cfg.DrainPoll, time.Second), drainOver: cmp.Or(cfg.DrainOver, drainOver)}
	s.gate.log = cfg.Log
	s.refusals = refusalLog{every: cfg.RefusalLogEvery, log: cfg.Log, clock: s.gate.cfg.Clock}
	if s.refusals.every <= 0 {
		s.refusals.every = 10 * time.Second
	}
	reg := cfg.Metrics
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	for _, c := range []prometheus.Collector{s.gate, drainCollector{s}} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("sidecar: metrics: %w", err)
		}
	}
	return s, nil
}

// Run reads the engine's metrics until ctx ends (nothing to do when no URL is set).
func (s *Sidecar) Run(ctx context.Context) { s.engine.run(ctx) }

// State is GET /gate: the gate as last heard of, and the engine's KV evidence as last read.
func (s *Sidecar) State() vllm.State {
	st := s.gate.state()
	st.Engine = s.engine.state()
	return st
}

// LocalHandler serves the pod-local API (the gate's heartbeat, POST /v1/gate) and everything
// PublicHandler serves. A pod binds it to the socket on the volume the engine and the sidecar
// share. It does not drain: anything in the engine's container could, and a drain makes the
// pod unready (ControlHandler).
func (s *Sidecar) LocalHandler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	s.handlePublic(mux, gatherer)
	mux.HandleFunc("POST "+localapi.PathGate, s.handleGate)
	return mux
}

// ControlHandler serves POST /v1/drain, the sidecar's preStop hook. A pod binds it to a socket
// on a volume only the sidecar's container mounts: a drain makes the pod unready, and the
// operator replaces a pod unready too long (with every decode pod of its KV revision, for a
// prefill pod), so nothing in the engine's container may start one.
func (s *Sidecar) ControlHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+localapi.PathDrain, s.handleDrain)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.refuse(w, r, http.StatusNotFound, "no such endpoint on the connector's control socket")
	})
	return mux
}

// PublicHandler serves what the kubelet, the operator and monitoring reach on the pod's
// address: /healthz, /readyz, /metrics and the gate's state (GET /gate). It takes no input.
func (s *Sidecar) PublicHandler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	s.handlePublic(mux, gatherer)
	return mux
}

func (s *Sidecar) handlePublic(mux *http.ServeMux, gatherer prometheus.Gatherer) {
	mux.HandleFunc("GET "+vllm.StatePath, func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, s.State()) })
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if s.draining.Load() {
			http.Error(w, "draining: the pod is being deleted", http.StatusServiceUnavailable)
			return
		}
		if why := s.gate.unready(); why != "" {
			http.Error(w, why, http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	// Anything else is refused (404 or 405) and logged, so a probe or client that asks for
	// what the sidecar no longer serves is seen.
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.refuse(w, r, http.StatusNotFound, "no such endpoint on the connector sidecar")
	})
}

// maxReportBytes bounds a heartbeat: a report is a few hundred bytes.
const maxReportBytes = 64 << 10

func (s *Sidecar) handleGate(w http.ResponseWriter, r *http.Request) {
	var rep vllm.Report
	if err := json.NewDecoder(io.LimitReader(r.Body, maxReportBytes)).Decode(&rep); err != nil {
		s.refuse(w, r, http.StatusBadRequest, "bad gate report: "+err.Error())
		return
	}
	if rep.Connector == "" {
		s.refuse(w, r, http.StatusBadRequest, "bad gate report: connector is required")
		return
	}
	if why := s.gate.admit(rep); why != "" {
		s.refuse(w, r, http.StatusBadRequest, why)
		return
	}
	s.gate.record(rep)
	w.WriteHeader(http.StatusNoContent)
}

func (s *Sidecar) refuse(w http.ResponseWriter, r *http.Request, code int, why string) {
	s.refusals.note(r.Method+" "+r.URL.Path, code, why)
	http.Error(w, why, code)
}

// refusalLog logs refused requests at most once per period, with how many it held back.
type refusalLog struct {
	every time.Duration
	log   logr.Logger
	clock interface{ Now() time.Time }

	mu      sync.Mutex
	last    time.Time
	skipped int
}

func (l *refusalLog) note(what string, code int, why string) {
	l.mu.Lock()
	now := l.clock.Now()
	if !l.last.IsZero() && now.Sub(l.last) < l.every {
		l.skipped++
		l.mu.Unlock()
		return
	}
	skipped := l.skipped
	l.last, l.skipped = now, 0
	l.mu.Unlock()
	l.log.Info("refused a request", "request", what, "status", code, "reason", why, "refusedSinceLastLine", skipped)
}

// writeJSON answers v, or 500 saying why it cannot be encoded: never a 200 with no body.
func writeJSON(w http.ResponseWriter, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, "encode: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(b, '\n'))
}
