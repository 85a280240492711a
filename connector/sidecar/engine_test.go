package sidecar

import (
	"encoding/json"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	clocktesting "k8s.io/utils/clock/testing"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// The sidecar reads vLLM's own exposition (recorded from vLLM's metric definitions and its
// prometheus_client) and sums the prompt token sources and connector counters over the DP
// ranks (two in the fixture, every family with a series for each); GET /gate carries them with their age, keeps the last counts when a read fails, and
// says why.
func TestEngineEvidenceInGateState(t *testing.T) {
	fixture, err := os.ReadFile("testdata/vllm-decode.metrics")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	answer, status := string(fixture), http.StatusOK
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(status)
		_, _ = w.Write([]byte(answer))
	}))
	defer engine.Close()
	clk := clocktesting.NewFakePassiveClock(gateT0)
	s, err := New(Config{Engine: EngineConfig{MetricsURL: engine.URL + "/metrics", Clock: clk}, Gate: GateConfig{Clock: clk}, Log: logr.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	if st := gateState(t, s); st.Engine != nil {
		t.Fatalf("before the first read: engine = %+v, want none", st.Engine)
	}
	s.engine.readOnce(t.Context())
	clk.SetTime(gateT0.Add(20 * time.Second))
	want := &vllm.EngineStats{ExternalKVTokens: 13500, LocalComputeTokens: 60, LocalCacheHitTokens: 200,
		FailedTransfers: 5, FailedReceives: 2, HasPromptSources: true, TransferBytes: 3e7, TransferSeconds: 0.51, AgeSeconds: 20}
	if d := cmp.Diff(want, gateState(t, s).Engine); d != "" {
		t.Errorf("GET /gate engine (-want +got):\n%s", d)
	}

	// A failed read keeps the counts and says why.
	mu.Lock()
	status = http.StatusInternalServerError
	mu.Unlock()
	s.engine.readOnce(t.Context())
	got := gateState(t, s).Engine
	if got == nil || got.ExternalKVTokens != 13500 || !strings.Contains(got.Error, "500") {
		t.Errorf("after a failed read: engine = %+v, want the last counts and the 500", got)
	}

	// A count that is not a number (NaN, +Inf: the text format allows them) is a failed read
	// too, not counts GET /gate cannot encode (issue 56: it answered 200 with an empty body).
	for _, bad := range []string{"NaN", "+Inf"} {
		mu.Lock()
		status, answer = http.StatusOK, "# TYPE vllm:prompt_tokens_by_source counter\n"+vllm.MetricPromptTokensBySource+`{source="`+vllm.SourceExternalKV+`"} `+bad+"\n"
		mu.Unlock()
		s.engine.readOnce(t.Context())
		got := gateState(t, s).Engine
		if got == nil || got.ExternalKVTokens != 13500 || !strings.Contains(got.Error, "not a number") {
			t.Errorf("after a read of %s: engine = %+v, want the last counts and why", bad, got)
		}
	}

	// An engine without the metric (an older vLLM): no prompt sources, not zeros that look
	// like no traffic.
	mu.Lock()
	status, answer = http.StatusOK, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 1\n"
	mu.Unlock()
	s.engine.readOnce(t.Context())
	if d := cmp.Diff(&vllm.EngineStats{}, gateState(t, s).Engine, cmpopts.IgnoreFields(vllm.EngineStats{}, "AgeSeconds")); d != "" {
		t.Errorf("engine without prompt sources (-want +got):\n%s", d)
	}
}

func TestEngineMetricsBounded(t *testing.T) {
	big := strings.Repeat("# padding comment line of the exposition\n", vllm.MaxEngineMetrics/40+10)
	if _, err := vllm.ParseEngineMetrics(strings.NewReader(big)); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("oversized answer: err = %v, want refused", err)
	}
	if _, err := vllm.ParseEngineMetrics(strings.NewReader("vllm:prompt_tokens_by_source_total{source=\"x\" 1\n")); err == nil {
		t.Error("malformed answer: want an error")
	}
}

// Without a metrics URL the sidecar reads nothing and GET /gate has no engine part.
func TestNoEngineMetricsURL(t *testing.T) {
	s, err := New(Config{Log: logr.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	s.Run(t.Context()) // returns at once
	if st := gateState(t, s); st.Engine != nil {
		t.Errorf("engine = %+v, want none", st.Engine)
	}
}

func gateState(t *testing.T, s *Sidecar) vllm.State {
	t.Helper()
	rec := httptest.NewRecorder()
	s.PublicHandler(nil).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, vllm.StatePath, nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("GET /gate: %d %s", rec.Code, rec.Body)
	}
	var st vllm.State
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
		t.Fatalf("GET /gate: %v: %s", err, rec.Body)
	}
	return st
}

// What the sidecar cannot encode is a 500 that says so, never a 200 with no body (the
// operator would read that as an answer).
func TestWriteJSONSaysWhatItCannotEncode(t *testing.T) {
	rec := httptest.NewRecorder()
	writeJSON(rec, map[string]float64{"x": math.NaN()})
	if rec.Code != http.StatusInternalServerError || !strings.Contains(rec.Body.String(), "unsupported value") {
		t.Errorf("writeJSON(NaN) = %d %q, want 500 saying why", rec.Code, rec.Body)
	}
}
