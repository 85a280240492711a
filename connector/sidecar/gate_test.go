package sidecar

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	clocktesting "k8s.io/utils/clock/testing"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/needs"
)

var gateT0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

func postGate(t *testing.T, g *gateWatch, body string) int {
	t.Helper()
	s := &Sidecar{gate: g, refusals: refusalLog{every: time.Second, log: logr.Discard(), clock: g.cfg.Clock}}
	rec := httptest.NewRecorder()
	s.LocalHandler(prometheus.NewRegistry()).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, localapi.PathGate, strings.NewReader(body)))
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
	for _, body := range []string{`{`, `{"counts":{}}`, `{"connector":"` + strings.Repeat("x", maxReportBytes) + `"}`} {
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
# HELP pdcluster_connector_gate_loaded 1 while the completion gate of every data-parallel rank on the pod heartbeats (labels: connector class, vLLM version), else 0.
# TYPE pdcluster_connector_gate_loaded gauge
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(loadedHeader+`pdcluster_connector_gate_loaded{connector="",vllm_version=""} 0
`), "pdcluster_connector_gate_loaded"); err != nil {
		t.Errorf("before any report: %v", err)
	}
	postGate(t, g, `{"connector":"GatedNixlConnector","vllm_version":"0.27.0","counts":{"gated":3,"passed":7,"failed":1,"expired":4,"send_failures":5}}`)
	want := `
# HELP pdcluster_connector_gate_completions_total finished_recving reports the engine's completion gate saw, by result: gated (a pull with no local block, kept from the scheduler) or passed; engine is the data-parallel rank, as in vLLM's metrics.
# TYPE pdcluster_connector_gate_completions_total counter
pdcluster_connector_gate_completions_total{engine="0",result="gated"} 3
pdcluster_connector_gate_completions_total{engine="0",result="passed"} 7
# HELP pdcluster_connector_gate_failed_pulls_total failed_recving reports of pulls with local blocks the engine's completion gate saw (vLLM's scheduler handles them), by data-parallel rank.
# TYPE pdcluster_connector_gate_failed_pulls_total counter
pdcluster_connector_gate_failed_pulls_total{engine="0"} 1
# HELP pdcluster_connector_gate_loaded 1 while the completion gate of every data-parallel rank on the pod heartbeats (labels: connector class, vLLM version), else 0.
# TYPE pdcluster_connector_gate_loaded gauge
pdcluster_connector_gate_loaded{connector="GatedNixlConnector",vllm_version="0.27.0"} 1
# HELP pdcluster_connector_gate_heartbeats_dropped_total Heartbeats the engine's gate could not deliver to this sidecar, by data-parallel rank.
# TYPE pdcluster_connector_gate_heartbeats_dropped_total counter
pdcluster_connector_gate_heartbeats_dropped_total{engine="0"} 5
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

// vLLM runs one EngineCore, so one scheduler and one gate, per data-parallel rank: a pod with
// two ranks hears two gates, from one process id. Each rank's counts are its own series, and
// the pod's state is their sum; before, the last heartbeat replaced the other rank's, so the
// counts flipped between ranks on every beat.
func TestGateKeepsEachDataParallelRank(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(gateT0)
	g := newGateWatch(GateConfig{Clock: clk, Ranks: 2, Required: true})
	reg := prometheus.NewRegistry()
	reg.MustRegister(g)
	for _, body := range []string{
		`{"connector":"GatedMooncakeConnector","vllm_version":"0.33.0","pid":40,"dp_rank":0,"counts":{"gated":3,"passed":7,"failed":1},"held_sends":2}`,
		`{"connector":"GatedMooncakeConnector","vllm_version":"0.33.0","pid":40,"dp_rank":1,"counts":{"gated":5,"passed":11,"expired":2},"held_sends":4}`,
	} {
		if code := postGate(t, g, body); code != http.StatusNoContent {
			t.Fatalf("POST %s = %d", body, code)
		}
	}
	clk.SetTime(gateT0.Add(5 * time.Second))
	want := vllm.State{Loaded: true, AgeSeconds: 5, Ranks: 2, Report: &vllm.Report{
		Connector: "GatedMooncakeConnector", VLLMVersion: "0.33.0", PID: 40,
		Counts: vllm.Counts{Gated: 8, Passed: 18, Failed: 1, Expired: 2}, HeldSends: held(6)}}
	if d := cmp.Diff(want, g.state()); d != "" {
		t.Errorf("state (-want +got):\n%s", d)
	}
	if n, known, current := g.heldSends(); n != 6 || !known || !current {
		t.Errorf("heldSends() = %d, %v, %v; want 6 held by the two ranks, known and current", n, known, current)
	}
	const completions = `
# HELP pdcluster_connector_gate_completions_total finished_recving reports the engine's completion gate saw, by result: gated (a pull with no local block, kept from the scheduler) or passed; engine is the data-parallel rank, as in vLLM's metrics.
# TYPE pdcluster_connector_gate_completions_total counter
pdcluster_connector_gate_completions_total{engine="0",result="gated"} 3
pdcluster_connector_gate_completions_total{engine="0",result="passed"} 7
pdcluster_connector_gate_completions_total{engine="1",result="gated"} 5
pdcluster_connector_gate_completions_total{engine="1",result="passed"} 11
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(completions), "pdcluster_connector_gate_completions_total"); err != nil {
		t.Error(err)
	}
	if why := g.unready(); why != "" {
		t.Errorf("both ranks fresh: unready %q", why)
	}
	// Rank 0 keeps beating; rank 1's EngineCore went quiet.
	clk.SetTime(gateT0.Add(40 * time.Second))
	postGate(t, g, `{"connector":"GatedMooncakeConnector","pid":40,"dp_rank":0,"counts":{"gated":3,"passed":7,"failed":1}}`)
	if why := g.unready(); !strings.Contains(why, "(GatedMooncakeConnector, data-parallel rank 1) last reported 40s ago") {
		t.Errorf("rank 1 silent: unready %q, want it named", why)
	}
	if st := g.state(); st.Loaded {
		t.Error("one rank stale, but the pod's gate is loaded")
	}
	if _, _, current := g.heldSends(); current {
		t.Error("one rank stale, but its held sends are current")
	}
}

// Every rank must report: one rank heard is not a gated pod.
func TestGateWaitsForEveryRank(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(gateT0)
	g := newGateWatch(GateConfig{Clock: clk, Ranks: 2, Required: true, StartupGrace: time.Minute})
	clk.SetTime(gateT0.Add(50 * time.Second))
	postGate(t, g, `{"connector":"GatedMooncakeConnector","dp_rank":0,"counts":{}}`)
	if why := g.unready(); why != "" {
		t.Errorf("within the grace: unready %q", why)
	}
	if st := g.state(); st.Loaded || st.Ranks != 1 {
		t.Errorf("rank 1 not heard: state %+v, want not loaded with 1 rank", st)
	}
	if _, _, current := g.heldSends(); current {
		t.Error("rank 1 not heard, but the held sends are current")
	}
	clk.SetTime(gateT0.Add(61 * time.Second))
	postGate(t, g, `{"connector":"GatedMooncakeConnector","dp_rank":0,"counts":{}}`)
	if why := g.unready(); !strings.Contains(why, "data-parallel rank(s) [1] has not reported in 1m0s (1 of 2 ranks report)") {
		t.Errorf("past the grace: unready %q, want rank 1 named", why)
	}
}

// A rank the pod does not run says the engine and the sidecar were rendered apart: refused with
// the flag to look at, not kept as a rank nobody waits for.
func TestGateRefusesARankOutOfRange(t *testing.T) {
	for _, tc := range []struct {
		ranks int
		body  string
		want  int
	}{
		{1, `{"connector":"GatedMooncakeConnector","dp_rank":0}`, http.StatusNoContent},
		{1, `{"connector":"GatedMooncakeConnector","dp_rank":1}`, http.StatusBadRequest},
		{4, `{"connector":"GatedMooncakeConnector","dp_rank":3}`, http.StatusNoContent},
		{4, `{"connector":"GatedMooncakeConnector","dp_rank":4}`, http.StatusBadRequest},
		{4, `{"connector":"GatedMooncakeConnector","dp_rank":-1}`, http.StatusBadRequest},
	} {
		g := newGateWatch(GateConfig{Ranks: tc.ranks})
		if code := postGate(t, g, tc.body); code != tc.want {
			t.Errorf("ranks %d: POST %s = %d, want %d", tc.ranks, tc.body, code, tc.want)
		}
		if got, _ := g.snapshot(); tc.want != http.StatusNoContent && len(got) != 0 {
			t.Errorf("ranks %d: refused %s but kept it", tc.ranks, tc.body)
		}
	}
	why := newGateWatch(GateConfig{Ranks: 2}).admit(vllm.Report{DPRank: 2})
	if !strings.Contains(why, "--gate-ranks=2") {
		t.Errorf("refusal %q does not name the sidecar's flag", why)
	}
}

// Anything in the engine container can write to the gate's socket: counts that are negative,
// that fall within one process, or a held_sends past what any engine holds (it becomes the pod's
// deletion cost) are refused and leave the last good report in place.
func TestGateRefusesImpossibleCounts(t *testing.T) {
	const good = `{"connector":"GatedMooncakeConnector","pid":7,"counts":{"gated":5,"passed":9},"held_sends":2}`
	for _, tc := range []struct {
		name, body string
		want       int
	}{
		{"counts rise", `{"connector":"GatedMooncakeConnector","pid":7,"counts":{"gated":6,"passed":12},"held_sends":0}`, http.StatusNoContent},
		{"a new process starts from 0", `{"connector":"GatedMooncakeConnector","pid":8,"counts":{"gated":0},"held_sends":0}`, http.StatusNoContent},
		{"negative count", `{"connector":"GatedMooncakeConnector","pid":9,"counts":{"expired":-1}}`, http.StatusBadRequest},
		{"a count falls in one process", `{"connector":"GatedMooncakeConnector","pid":7,"counts":{"gated":4,"passed":9}}`, http.StatusBadRequest},
		{"negative held_sends", `{"connector":"GatedMooncakeConnector","pid":7,"counts":{"gated":5,"passed":9},"held_sends":-1}`, http.StatusBadRequest},
		{"absurd held_sends", `{"connector":"GatedMooncakeConnector","pid":7,"counts":{"gated":5,"passed":9},"held_sends":9223372036854775807}`, http.StatusBadRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newGateWatch(GateConfig{})
			if code := postGate(t, g, good); code != http.StatusNoContent {
				t.Fatalf("the good report: %d", code)
			}
			if code := postGate(t, g, tc.body); code != tc.want {
				t.Fatalf("POST %s = %d, want %d", tc.body, code, tc.want)
			}
			if tc.want == http.StatusNoContent {
				return
			}
			st := g.state()
			if st.Report == nil || st.Report.Counts.Gated != 5 || st.Report.Counts.Passed != 9 || *st.Report.HeldSends != 2 {
				t.Errorf("after a refused report: %+v, want the last good one kept", st.Report)
			}
		})
	}
}

// The seam from the other side: the plugin's own Reporter (Python) posts to the agent's local
// API on a Unix socket, as in a pod.
func TestPluginHeartbeatReachesTheSidecar(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		needs.Skip(t, "python3 not installed")
	}
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := localapi.Listen("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Gate: GateConfig{Required: true}, Log: logr.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	g := s.gate
	srv := &http.Server{Handler: s.LocalHandler(prometheus.NewRegistry()), ReadHeaderTimeout: 5 * time.Second}
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
	got, missing := g.snapshot()
	if len(got) != 1 || len(missing) != 0 {
		t.Fatalf("agent recorded %+v, missing ranks %v", got, missing)
	}
	if last := got[0].rep; last.Connector != "GatedMooncakeConnector" || last.DPRank != 0 || last.Counts.Gated != 4 || last.Counts.Passed != 9 {
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
	s := &Sidecar{gate: g}
	s.PublicHandler(prometheus.NewRegistry()).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, vllm.StatePath, nil))
	var st vllm.State
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
		t.Fatal(err)
	}
	want := vllm.State{Loaded: true, AgeSeconds: 10, Ranks: 1, Report: &vllm.Report{Connector: "GatedMooncakeConnector", Counts: vllm.Counts{Gated: 3, Passed: 7}}}
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
			a, err := New(Config{Log: logr.Discard(),
				Gate: GateConfig{Required: tc.required, StartupGrace: 2 * time.Minute, HeartbeatTimeout: 45 * time.Second, Clock: clk}})
			if err != nil {
				t.Fatal(err)
			}
			local, public := a.LocalHandler(prometheus.NewRegistry()), a.PublicHandler(prometheus.NewRegistry())
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

// The public port takes no input: a heartbeat posted there (from another pod) is refused, and
// so is any path the sidecar does not serve, while the local socket takes the heartbeat.
func TestPublicHandlerTakesNoHeartbeat(t *testing.T) {
	s, err := New(Config{Log: logr.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	const heartbeat = `{"connector":"GatedMooncakeConnector","counts":{"gated":1}}`
	cases := []struct {
		name    string
		handler http.Handler
		method  string
		path    string
		want    int
	}{
		{"heartbeat on the local socket", s.LocalHandler(prometheus.NewRegistry()), http.MethodPost, localapi.PathGate, http.StatusNoContent},
		{"heartbeat on the public port", s.PublicHandler(prometheus.NewRegistry()), http.MethodPost, localapi.PathGate, http.StatusNotFound},
		{"the old KV API", s.LocalHandler(prometheus.NewRegistry()), http.MethodPost, "/v1/pulls", http.StatusNotFound},
		{"the old bootstrap registry", s.PublicHandler(prometheus.NewRegistry()), http.MethodPost, "/register", http.StatusNotFound},
		{"readiness", s.PublicHandler(prometheus.NewRegistry()), http.MethodGet, "/readyz", http.StatusOK},
		{"gate state", s.PublicHandler(prometheus.NewRegistry()), http.MethodGet, vllm.StatePath, http.StatusOK},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			tc.handler.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, strings.NewReader(heartbeat)))
			if rec.Code != tc.want {
				t.Errorf("%s %s = %d %s, want %d", tc.method, tc.path, rec.Code, rec.Body, tc.want)
			}
		})
	}
}

// Refusals are logged with their reason, at most once per period, and the line after a quiet
// period says how many were held back.
func TestRefusalsAreLoggedRateLimited(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(gateT0)
	var lines []string
	log := funcr.New(func(_, args string) { lines = append(lines, args) }, funcr.Options{})
	s, err := New(Config{Log: log, RefusalLogEvery: 10 * time.Second, Gate: GateConfig{Clock: clk}})
	if err != nil {
		t.Fatal(err)
	}
	h := s.LocalHandler(prometheus.NewRegistry())
	post := func(body string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, localapi.PathGate, strings.NewReader(body)))
		if rec.Code != http.StatusBadRequest {
			t.Fatalf("POST %s = %d, want 400", body, rec.Code)
		}
	}
	for range 5 {
		post(`{`)
	}
	clk.SetTime(gateT0.Add(11 * time.Second))
	post(`{"counts":{}}`)
	if len(lines) != 2 {
		t.Fatalf("logged %d lines, want 2 (the first refusal, then one after the period):\n%s", len(lines), strings.Join(lines, "\n"))
	}
	for i, want := range []string{`"refusedSinceLastLine"=0`, `"refusedSinceLastLine"=4`} {
		if !strings.Contains(lines[i], want) || !strings.Contains(lines[i], `"reason"="bad gate report`) {
			t.Errorf("line %d = %s, want the reason and %s", i, lines[i], want)
		}
	}
	if !strings.Contains(lines[1], "connector is required") {
		t.Errorf("line 1 = %s, want the second refusal's reason", lines[1])
	}
}

// The sidecar logs when the gate starts reporting and when it comes back after going silent.
func TestGateTransitionsAreLogged(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(gateT0)
	var lines []string
	log := funcr.New(func(_, args string) { lines = append(lines, args) }, funcr.Options{})
	s, err := New(Config{Log: log, Gate: GateConfig{Clock: clk, HeartbeatTimeout: 30 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	beat := func(at time.Duration, pid int) {
		clk.SetTime(gateT0.Add(at))
		s.gate.record(vllm.Report{Connector: "GatedMooncakeConnector", PID: pid})
	}
	beat(0, 7)
	beat(5*time.Second, 7)  // steady: not logged
	beat(10*time.Second, 7) // steady: not logged
	beat(time.Minute, 7)    // after silence
	beat(time.Minute+1, 8)  // a new engine process
	if len(lines) != 3 {
		t.Fatalf("logged %d lines, want 3:\n%s", len(lines), strings.Join(lines, "\n"))
	}
	for i, want := range []string{`"afterSilence"=false "newProcess"=false`, `"afterSilence"=true`, `"newProcess"=true`} {
		if !strings.Contains(lines[i], want) {
			t.Errorf("line %d = %s, want %s", i, lines[i], want)
		}
	}
}

// gate_required says where a silent gate matters: an alert on gate_loaded 0 joins on it.
func TestGateRequiredMetric(t *testing.T) {
	for _, required := range []bool{false, true} {
		reg := prometheus.NewRegistry()
		reg.MustRegister(newGateWatch(GateConfig{Required: required}))
		want := map[bool]string{false: "0", true: "1"}[required]
		if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP pdcluster_connector_gate_required 1 when the sidecar is unready without the engine's completion gate (--require-gate), else 0: alert on gate_loaded 0 only where it is 1.
# TYPE pdcluster_connector_gate_required gauge
pdcluster_connector_gate_required `+want+"\n"), "pdcluster_connector_gate_required"); err != nil {
			t.Errorf("required=%v: %v", required, err)
		}
	}
}
