package agent

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	clocktesting "k8s.io/utils/clock/testing"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/localapi"
	vllmplugin "pdcluster.dev/pdcluster-operator/connector/vllm"
)

var gateT0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

func postGate(t *testing.T, g *gateWatch, body string) int {
	t.Helper()
	rec := httptest.NewRecorder()
	g.handle(rec, httptest.NewRequest(http.MethodPost, localapi.PathGate, strings.NewReader(body)))
	return rec.Code
}

func TestGateReadiness(t *testing.T) {
	const heartbeat = `{"connector":"GatedMooncakeConnector","vllm_version":"0.27.0","counts":{"gated":2,"passed":5}}`
	cases := []struct {
		name      string
		required  bool
		heartbeat *time.Duration // when the heartbeat came, after start; nil: never
		at        time.Duration  // when readiness is asked
		wantWhy   string         // "" for ready
	}{
		{"not required: always ready", false, nil, time.Hour, ""},
		{"model still loading: ready within the grace", true, nil, 5 * time.Minute, ""},
		{"no heartbeat after the grace", true, nil, 16 * time.Minute, "has not reported in 15m0s"},
		{"fresh heartbeat", true, ptr(time.Minute), time.Minute + 10*time.Second, ""},
		{"heartbeat stopped", true, ptr(time.Minute), 2 * time.Minute, "last reported 1m0s ago"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			clk := clocktesting.NewFakePassiveClock(gateT0)
			g := newGateWatch(GateConfig{Required: tc.required, Clock: clk})
			if tc.heartbeat != nil {
				clk.SetTime(gateT0.Add(*tc.heartbeat))
				if code := postGate(t, g, heartbeat); code != http.StatusNoContent {
					t.Fatalf("POST /v1/gate = %d", code)
				}
			}
			clk.SetTime(gateT0.Add(tc.at))
			why := g.unready()
			if (tc.wantWhy == "") != (why == "") || !strings.Contains(why, tc.wantWhy) {
				t.Errorf("unready() = %q, want %q", why, tc.wantWhy)
			}
		})
	}
}

func ptr(d time.Duration) *time.Duration { return &d }

func TestGateRejectsBadReports(t *testing.T) {
	g := newGateWatch(GateConfig{})
	for _, body := range []string{`{`, `{"counts":{}}`} {
		if code := postGate(t, g, body); code != http.StatusBadRequest {
			t.Errorf("POST %s = %d, want 400", body, code)
		}
	}
}

func TestGateMetrics(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(gateT0)
	g := newGateWatch(GateConfig{Clock: clk})
	reg := prometheus.NewRegistry()
	reg.MustRegister(g)
	const loadedHeader = `
# HELP pdcluster_connector_gate_loaded 1 while the engine's completion gate heartbeats (labels: connector class, vLLM version), else 0.
# TYPE pdcluster_connector_gate_loaded gauge
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(loadedHeader+`pdcluster_connector_gate_loaded{connector="",vllm_version=""} 0
`), "pdcluster_connector_gate_loaded"); err != nil {
		t.Errorf("before any report: %v", err)
	}
	postGate(t, g, `{"connector":"GatedNixlConnector","vllm_version":"0.27.0","counts":{"gated":3,"passed":7,"failed":1,"expired":4,"send_failures":5}}`)
	want := `
# HELP pdcluster_connector_gate_completions_total finished_recving reports the engine's completion gate saw, by result: gated (a pull with no local block, kept from the scheduler) or passed.
# TYPE pdcluster_connector_gate_completions_total counter
pdcluster_connector_gate_completions_total{result="gated"} 3
pdcluster_connector_gate_completions_total{result="passed"} 7
# HELP pdcluster_connector_gate_failed_pulls_total failed_recving reports of pulls with local blocks the engine's completion gate saw (vLLM's scheduler handles them).
# TYPE pdcluster_connector_gate_failed_pulls_total counter
pdcluster_connector_gate_failed_pulls_total 1
# HELP pdcluster_connector_gate_loaded 1 while the engine's completion gate heartbeats (labels: connector class, vLLM version), else 0.
# TYPE pdcluster_connector_gate_loaded gauge
pdcluster_connector_gate_loaded{connector="GatedNixlConnector",vllm_version="0.27.0"} 1
# HELP pdcluster_connector_gate_heartbeats_dropped_total Heartbeats the engine's gate could not deliver to this sidecar.
# TYPE pdcluster_connector_gate_heartbeats_dropped_total counter
pdcluster_connector_gate_heartbeats_dropped_total 5
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"pdcluster_connector_gate_completions_total", "pdcluster_connector_gate_failed_pulls_total",
		"pdcluster_connector_gate_loaded", "pdcluster_connector_gate_heartbeats_dropped_total"); err != nil {
		t.Error(err)
	}
	clk.SetTime(gateT0.Add(time.Minute))
	if err := testutil.GatherAndCompare(reg, strings.NewReader(loadedHeader+`pdcluster_connector_gate_loaded{connector="GatedNixlConnector",vllm_version="0.27.0"} 0
`), "pdcluster_connector_gate_loaded"); err != nil {
		t.Errorf("after the heartbeat stopped: %v", err)
	}
}

// The seam from the other side: the plugin's own Reporter (Python) posts to the agent's local
// API on a Unix socket, as in a pod.
func TestPluginHeartbeatReachesTheAgent(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := localapi.Listen("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	g := newGateWatch(GateConfig{Required: true})
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+localapi.PathGate, g.handle)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()
	script := `
import sys
from pdgate import gate
c = gate.Counts(); c.gated = 4; c.passed = 9
ok = gate.Reporter(sys.argv[1], c, "GatedMooncakeConnector", "0.27.0", "SCHEDULER").send_once()
sys.exit(0 if ok else 1)
`
	cmd := exec.Command(python, "-c", script, sock)
	cmd.Dir = filepath.Join("..", "vllm")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("plugin heartbeat: %v\n%s", err, out)
	}
	last, _ := g.snapshot()
	if last == nil || last.Connector != "GatedMooncakeConnector" || last.Counts.Gated != 4 || last.Counts.Passed != 9 {
		t.Errorf("agent recorded %+v", last)
	}
}

// GET /gate is what the operator reads for status: the last report and whether it is fresh.
func TestGateState(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(gateT0)
	g := newGateWatch(GateConfig{Clock: clk})
	if st := g.state(); st.Loaded || st.Report != nil {
		t.Fatalf("before any report: %+v", st)
	}
	postGate(t, g, `{"connector":"GatedMooncakeConnector","counts":{"gated":3,"passed":7}}`)
	clk.SetTime(gateT0.Add(10 * time.Second))
	rec := httptest.NewRecorder()
	g.serveState(rec, httptest.NewRequest(http.MethodGet, vllmplugin.StatePath, nil))
	var st vllmplugin.State
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
		t.Fatal(err)
	}
	want := vllmplugin.State{Loaded: true, AgeSeconds: 10, Report: &vllmplugin.Report{Connector: "GatedMooncakeConnector", Counts: vllmplugin.Counts{Gated: 3, Passed: 7}}}
	if d := cmp.Diff(want, st); d != "" {
		t.Errorf("GET /gate (-want +got):\n%s", d)
	}
	clk.SetTime(gateT0.Add(time.Minute))
	if st := g.state(); st.Loaded {
		t.Error("a stale heartbeat still counts as loaded")
	}
}

// The sidecar's side of "unready while the gate is silent": what the kubelet's probe of
// /readyz on the public handler sees, as the engine's gate posts heartbeats to the local API
// and the (injected) clock moves on.
func TestReadyzFollowsTheGate(t *testing.T) {
	const heartbeat = `{"connector":"GatedMooncakeConnector","vllm_version":"0.27.0","counts":{}}`
	type step struct {
		at        time.Duration // since the agent started
		heartbeat bool          // the gate posts a heartbeat at this time, before the probe
		wantCode  int
		wantBody  string // a part of /readyz's answer
	}
	cases := []struct {
		name     string
		required bool
		steps    []step
	}{
		{"required", true, []step{
			{at: 0, wantCode: http.StatusOK, wantBody: "ok"},
			{at: 2 * time.Minute, wantCode: http.StatusOK, wantBody: "ok"}, // the grace, to the end
			{at: 2*time.Minute + time.Second, wantCode: http.StatusServiceUnavailable, wantBody: "completion gate has not reported in 2m0s"},
			{at: 3 * time.Minute, heartbeat: true, wantCode: http.StatusOK, wantBody: "ok"},
			{at: 3*time.Minute + 45*time.Second, wantCode: http.StatusOK, wantBody: "ok"}, // as old as allowed
			{at: 3*time.Minute + 46*time.Second, wantCode: http.StatusServiceUnavailable, wantBody: "completion gate (GatedMooncakeConnector) last reported 46s ago"},
			{at: 4 * time.Minute, heartbeat: true, wantCode: http.StatusOK, wantBody: "ok"},
		}},
		{"not required", false, []step{
			{at: 0, wantCode: http.StatusOK, wantBody: "ok"},
			{at: time.Hour, wantCode: http.StatusOK, wantBody: "ok"}, // silent long past the grace
			{at: 2 * time.Hour, heartbeat: true, wantCode: http.StatusOK, wantBody: "ok"},
			{at: 3 * time.Hour, wantCode: http.StatusOK, wantBody: "ok"}, // the heartbeat long stale
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			clk := clocktesting.NewFakePassiveClock(gateT0)
			a := servingAgent(t, Config{Role: v1alpha1.KVConsumer, KV: openKV(t, "c.kv"), PullTimeout: time.Minute,
				Gate: GateConfig{Required: tc.required, StartupGrace: 2 * time.Minute, HeartbeatTimeout: 45 * time.Second, Clock: clk}})
			local, public := a.Handler(prometheus.NewRegistry()), a.PublicHandler(prometheus.NewRegistry())
			for _, s := range tc.steps {
				clk.SetTime(gateT0.Add(s.at))
				if s.heartbeat {
					rec := httptest.NewRecorder()
					local.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, localapi.PathGate, strings.NewReader(heartbeat)))
					if rec.Code != http.StatusNoContent {
						t.Fatalf("at %v: POST %s = %d %s", s.at, localapi.PathGate, rec.Code, rec.Body)
					}
				}
				rec := httptest.NewRecorder()
				public.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
				if rec.Code != s.wantCode || !strings.Contains(rec.Body.String(), s.wantBody) {
					t.Errorf("at %v: GET /readyz = %d %q, want %d with %q", s.at, rec.Code, rec.Body, s.wantCode, s.wantBody)
				}
			}
		})
	}
}

// servingAgent builds a consumer agent from cfg and serves it until the test ends, returning
// once it is up (ready but for the gate).
func servingAgent(t *testing.T, cfg Config) *Agent {
	t.Helper()
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = a.Serve(ctx, nil) }()
	t.Cleanup(func() { cancel(); <-done })
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		a.mu.Lock()
		up := a.ready
		a.mu.Unlock()
		if up {
			return a
		}
		if time.Now().After(deadline) {
			t.Fatal("consumer agent not up after 5s")
		}
	}
}
