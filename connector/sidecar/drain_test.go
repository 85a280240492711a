package sidecar

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	clocktesting "k8s.io/utils/clock/testing"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
)

func heartbeatHolding(held *int64) string {
	if held == nil {
		return `{"connector":"GatedMooncakeConnector","role":"SCHEDULER","counts":{}}`
	}
	return fmt.Sprintf(`{"connector":"GatedMooncakeConnector","role":"SCHEDULER","counts":{},"held_sends":%d}`, *held)
}

func held(n int64) *int64 { return &n }

type drainFixture struct {
	s *Sidecar
	// srv is the pod-local API (heartbeats, probes); ctl the control socket's (drains).
	srv, ctl *httptest.Server
	reg      *prometheus.Registry
}

func newDrainFixture(t *testing.T, cfg Config) *drainFixture {
	t.Helper()
	cfg.Log, cfg.DrainPoll = logr.Discard(), 5*time.Millisecond
	reg := prometheus.NewRegistry()
	cfg.Metrics = reg
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv, ctl := httptest.NewServer(s.LocalHandler(reg)), httptest.NewServer(s.ControlHandler())
	t.Cleanup(func() { srv.Close(); ctl.Close() })
	return &drainFixture{s: s, srv: srv, ctl: ctl, reg: reg}
}

func (f *drainFixture) heartbeat(t *testing.T, held *int64) {
	t.Helper()
	resp, err := http.Post(f.srv.URL+localapi.PathGate, "application/json", strings.NewReader(heartbeatHolding(held)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("heartbeat: %s", resp.Status)
	}
}

func (f *drainFixture) drain(t *testing.T, query string) (DrainResult, time.Duration) {
	t.Helper()
	start := time.Now()
	// A drain that never ends fails this test, not the package at go test's timeout.
	client := &http.Client{Timeout: 30 * time.Second}
	resp, err := client.Post(f.ctl.URL+localapi.PathDrain+"?"+query, "", nil)
	if err != nil {
		t.Fatalf("drain?%s did not answer within 30 s: %v", query, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("drain: %s %s", resp.Status, b)
	}
	var res DrainResult
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatalf("drain answer %s: %v", b, err)
	}
	return res, time.Since(start)
}

func (f *drainFixture) ready(t *testing.T) int {
	t.Helper()
	resp, err := http.Get(f.srv.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// A drain answers once the engine holds nothing for a pull not made yet, after min, and the
// sidecar is unready from its start: the kubelet's preStop hook waits on it.
func TestDrainWaitsForHeldSends(t *testing.T) {
	f := newDrainFixture(t, Config{})
	f.heartbeat(t, held(2))
	if code := f.ready(t); code != http.StatusOK {
		t.Fatalf("readyz before the drain = %d", code)
	}
	go func() {
		time.Sleep(150 * time.Millisecond)
		f.heartbeat(t, held(1))
		time.Sleep(100 * time.Millisecond)
		f.heartbeat(t, held(0))
	}()
	res, took := f.drain(t, "min=50ms&timeout=10s")
	if res.Reason != "drained" || res.HeldSends != 0 {
		t.Errorf("drain = %+v, want drained with 0 held", res)
	}
	if took < 250*time.Millisecond {
		t.Errorf("drain answered after %s, before the engine's held sends reached 0", took)
	}
	if code := f.ready(t); code != http.StatusServiceUnavailable {
		t.Errorf("readyz while draining = %d, want 503", code)
	}
	want := `
# HELP pdcluster_connector_draining 1 once the pod is being deleted and the sidecar drains, else 0.
# TYPE pdcluster_connector_draining gauge
pdcluster_connector_draining 1
# HELP pdcluster_connector_held_kv_sends Requests whose KV blocks the engine holds for a pull not made yet, as its completion gate last reported (a prefill pod deleted now would fail those pulls; absent until reported).
# TYPE pdcluster_connector_held_kv_sends gauge
pdcluster_connector_held_kv_sends 0
`
	if err := testutil.GatherAndCompare(f.reg, strings.NewReader(want), "pdcluster_connector_draining", "pdcluster_connector_held_kv_sends"); err != nil {
		t.Error(err)
	}
}

func TestDrainEnds(t *testing.T) {
	cases := []struct {
		name       string
		heartbeat  bool
		held       *int64
		query      string
		wantReason string
		wantHeld   int64
		atLeast    time.Duration
	}{
		{"held sends never reach 0: the timeout", true, held(3), "min=0s&timeout=200ms", "timeout", 3, 200 * time.Millisecond},
		{"nothing held: after min", true, held(0), "min=100ms&timeout=10s", "drained", 0, 100 * time.Millisecond},
		{"a plugin that does not count held sends: after min", true, nil, "min=100ms&timeout=10s", "drained", -1, 100 * time.Millisecond},
		{"an engine whose gate never reported: after min", false, nil, "min=100ms&timeout=10s", "engine silent", -1, 100 * time.Millisecond},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newDrainFixture(t, Config{})
			if tc.heartbeat {
				f.heartbeat(t, tc.held)
			}
			res, took := f.drain(t, tc.query)
			if res.Reason != tc.wantReason || res.HeldSends != tc.wantHeld {
				t.Errorf("drain = %+v, want %s with %d held", res, tc.wantReason, tc.wantHeld)
			}
			if took < tc.atLeast {
				t.Errorf("drain took %s, want at least %s", took, tc.atLeast)
			}
		})
	}
}

// An engine that stopped heartbeating (it finished its own drain, or died) is not waited for:
// its last count of held sends can no longer change.
func TestDrainStopsForASilentEngine(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(gateT0)
	f := newDrainFixture(t, Config{Gate: GateConfig{Clock: clk}})
	f.heartbeat(t, held(4))
	clk.SetTime(gateT0.Add(engineGone + time.Second))
	res, _ := f.drain(t, "min=0s&timeout=1h")
	if res.Reason != "engine silent" || res.HeldSends != 4 {
		t.Errorf("drain = %+v, want engine silent with 4 held", res)
	}
}

func TestDrainRefusesBadDurations(t *testing.T) {
	f := newDrainFixture(t, Config{})
	for _, q := range []string{"", "min=1s", "min=2s&timeout=1s", "min=-1s&timeout=1s", "min=x&timeout=1s"} {
		resp, err := http.Post(f.ctl.URL+localapi.PathDrain+"?"+q, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("drain?%s = %d, want 400", q, resp.StatusCode)
		}
	}
	if code := f.ready(t); code != http.StatusOK {
		t.Errorf("readyz after refused drains = %d, want 200 (no drain started)", code)
	}
}

// Only the control socket drains, which only the sidecar's container mounts (its preStop
// hook): a drain on the public port or on the pod-local API the engine shares is refused, so
// nothing off the pod or in the engine's container can make the pod unready (and have the
// operator replace it, with every decode pod of its KV revision).
func TestDrainOnlyOnTheControlSocket(t *testing.T) {
	s, err := New(Config{Log: logr.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	for name, h := range map[string]http.Handler{"public": s.PublicHandler(prometheus.NewRegistry()), "pod-local": s.LocalHandler(prometheus.NewRegistry())} {
		srv := httptest.NewServer(h)
		resp, err := http.Post(srv.URL+localapi.PathDrain+"?min=0s&timeout=1s", "", nil)
		srv.Close()
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode < 400 || s.draining.Load() {
			t.Errorf("%s POST %s = %d, draining %v; want refused", name, localapi.PathDrain, resp.StatusCode, s.draining.Load())
		}
	}
}

// A drain ends: a sidecar still running drainOver after its drain ended belongs to a pod that
// is not being deleted, and is ready again (unready for good, the operator would replace it).
// A second drain within that time keeps it unready until its own end.
func TestDrainIsOverIfThePodLives(t *testing.T) {
	f := newDrainFixture(t, Config{DrainOver: 200 * time.Millisecond})
	f.heartbeat(t, held(0))
	readyWithin := func(d time.Duration) bool {
		for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if f.ready(t) == http.StatusOK {
				return true
			}
		}
		return false
	}
	f.drain(t, "min=0s&timeout=10s")
	if code := f.ready(t); code != http.StatusServiceUnavailable {
		t.Fatalf("readyz right after the drain = %d, want 503", code)
	}
	if !readyWithin(5 * time.Second) {
		t.Fatal("the sidecar did not become ready again after its drain ended")
	}
	f.drain(t, "min=0s&timeout=10s")
	time.Sleep(100 * time.Millisecond)
	f.drain(t, "min=0s&timeout=10s") // within the first one's time
	if readyWithin(150 * time.Millisecond) {
		t.Error("ready again at the first drain's end while the second drain's time runs")
	}
	if !readyWithin(5 * time.Second) {
		t.Error("the sidecar did not become ready again after its second drain")
	}
}
