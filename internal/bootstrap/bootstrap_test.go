package bootstrap

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/google/go-cmp/cmp"
)

func TestRegisterFollowsVLLMRules(t *testing.T) {
	r := NewRegistry()
	steps := []struct {
		name string
		reg  Registration
		want string // "" for ok, else part of the error
	}{
		{"first worker", Registration{EngineID: "e1", TPRank: 0, Addr: "tcp://a:1"}, ""},
		{"same address again is a no-op", Registration{EngineID: "e1", TPRank: 0, Addr: "tcp://a:1"}, ""},
		{"second tp rank", Registration{EngineID: "e1", TPRank: 1, Addr: "tcp://a:2"}, ""},
		{"moved worker", Registration{EngineID: "e1", TPRank: 0, Addr: "tcp://b:1"}, "is already registered at tcp://a:1, but still want to register at tcp://b:1"},
		{"other engine on the dp rank", Registration{EngineID: "e2", TPRank: 2, Addr: "tcp://c:1"}, "Engine ID mismatch"},
		{"other dp rank", Registration{EngineID: "e2", DPRank: 1, Addr: "tcp://c:1"}, ""},
		{"missing addr", Registration{EngineID: "e3", DPRank: 2}, "required"},
	}
	for _, s := range steps {
		err := r.Register(s.reg)
		if (s.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), s.want)) {
			t.Errorf("%s: err = %v, want %q", s.name, err, s.want)
		}
	}
	want := Topology{
		"0": {EngineID: "e1", WorkerAddr: map[string]map[string]string{"0": {"0": "tcp://a:1"}, "1": {"0": "tcp://a:2"}}},
		"1": {EngineID: "e2", WorkerAddr: map[string]map[string]string{"0": {"0": "tcp://c:1"}}},
	}
	if d := cmp.Diff(want, r.Snapshot()); d != "" {
		t.Errorf("topology (-want +got):\n%s", d)
	}
}

// The registry's owner re-registers a worker that restarted under a new engine id; over HTTP
// the same registration stays refused, as in vLLM.
func TestHandlerSpeaksTheMooncakeJSON(t *testing.T) {
	srv := httptest.NewServer(NewRegistry().Handler())
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/register", "application/json", strings.NewReader(`{"engine_id":"e","dp_rank":0,"tp_rank":0,"pp_rank":0,"addr":"tcp://h:9"}`))
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("register: %v %v", resp.Status, err)
	}
	resp, _ = http.Post(srv.URL+"/register", "application/json", strings.NewReader(`{"engine_id":"x","dp_rank":0,"tp_rank":1,"addr":"tcp://h:8"}`))
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("engine mismatch: %s, want 400", resp.Status)
	}
	resp, err = http.Get(srv.URL + "/query")
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&raw)
	want := map[string]any{"0": map[string]any{"engine_id": "e", "worker_addr": map[string]any{"0": map[string]any{"0": "tcp://h:9"}}}}
	if d := cmp.Diff(want, raw); d != "" {
		t.Errorf("/query (-want +got):\n%s", d)
	}
}

func TestClientCachesUntilInvalidated(t *testing.T) {
	reg := NewRegistry()
	_ = reg.Register(Registration{EngineID: "e", Addr: "tcp://h:1"})
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		reg.Handler().ServeHTTP(w, r)
	}))
	defer srv.Close()
	ctx := context.Background()

	c := NewClient()
	for i := 0; i < 3; i++ {
		if _, err := c.Query(ctx, srv.URL); err != nil {
			t.Fatal(err)
		}
	}
	if n := hits.Load(); n != 1 {
		t.Errorf("cached client asked %d times, want 1", n)
	}
	c.Invalidate(srv.URL)
	if _, err := c.Query(ctx, srv.URL); err != nil || hits.Load() != 2 {
		t.Errorf("after Invalidate: %d asks, err %v; want 2", hits.Load(), err)
	}

	// A client with MaxAge uses an answer that long, then asks again.
	clk := clocktesting.NewFakeClock(time.Unix(0, 0))
	mc := NewClient()
	mc.MaxAge, mc.Clock = 2*time.Second, clk
	for range 3 {
		_, _ = mc.Query(ctx, srv.URL)
		clk.Step(500 * time.Millisecond)
	}
	if n := hits.Load(); n != 3 {
		t.Errorf("MaxAge client within its age: %d asks in all, want 3", n)
	}
	clk.Step(time.Second)
	_, _ = mc.Query(ctx, srv.URL)
	if n := hits.Load(); n != 4 {
		t.Errorf("MaxAge client past its age: %d asks in all, want 4", n)
	}
	if _, err := c.Query(ctx, "http://127.0.0.1:1"); err == nil {
		t.Error("query of a closed port succeeded")
	}
}

// Past RefreshAfter an answer is still given at once, and asked again in the background: the
// next query has the registry's new answer.
func TestQueryRefreshesOldAnswersInTheBackground(t *testing.T) {
	var engine atomic.Value
	engine.Store("engine-a")
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		hits.Add(1)
		_ = json.NewEncoder(w).Encode(Topology{"0": {EngineID: engine.Load().(string)}})
	}))
	defer srv.Close()
	clk := clocktesting.NewFakeClock(time.Unix(0, 0))
	c := NewClient()
	c.MaxAge, c.RefreshAfter, c.Clock = 2*time.Second, 100*time.Millisecond, clk
	ctx := context.Background()
	if topo, err := c.Query(ctx, srv.URL); err != nil || topo["0"].EngineID != "engine-a" {
		t.Fatalf("first query: %v, %v", topo, err)
	}
	engine.Store("engine-b") // the producer restarted
	clk.Step(150 * time.Millisecond)
	if topo, _ := c.Query(ctx, srv.URL); topo["0"].EngineID != "engine-a" {
		t.Errorf("an answer past RefreshAfter was not served at once from the cache: %v", topo)
	}
	for deadline := time.Now().Add(5 * time.Second); hits.Load() < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no background refresh")
		}
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if topo, _ := c.Query(ctx, srv.URL); topo["0"].EngineID == "engine-b" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the refreshed answer never replaced the old one")
		}
	}
}

// A registry that stops answering is asked again at most once per RefreshAfter, not on every
// query; the old answer is used until MaxAge.
func TestBackgroundRefreshOfADeadRegistryIsPaced(t *testing.T) {
	var hits atomic.Int32
	var down atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		hits.Add(1)
		if down.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		_ = json.NewEncoder(w).Encode(Topology{"0": {EngineID: "engine-a"}})
	}))
	defer srv.Close()
	clk := clocktesting.NewFakeClock(time.Unix(0, 0))
	c := NewClient()
	c.MaxAge, c.RefreshAfter, c.Clock = 2*time.Second, 100*time.Millisecond, clk
	ctx := context.Background()
	if _, err := c.Query(ctx, srv.URL); err != nil {
		t.Fatal(err)
	}
	down.Store(true)
	clk.Step(150 * time.Millisecond)
	for range 40 {
		if topo, err := c.Query(ctx, srv.URL); err != nil || topo["0"].EngineID != "engine-a" {
			t.Fatalf("query within MaxAge: %v, %v; want the cached answer", topo, err)
		}
		time.Sleep(5 * time.Millisecond) // a failed refresh has ended before the next query
	}
	if n := hits.Load(); n != 2 {
		t.Errorf("registry asked %d times, want 2 (the answer, then one refresh per RefreshAfter)", n)
	}
}

// A registry's answer is bounded and never redirected: a topology is a few kilobytes, and a
// registry that answers 30 MiB or points elsewhere must cost its client nothing.
func TestQueryBoundsTheAnswer(t *testing.T) {
	var elsewhere atomic.Int32
	trap := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { elsewhere.Add(1) }))
	defer trap.Close()
	for _, tc := range []struct {
		name, want string
		serve      http.HandlerFunc
	}{
		{"huge", "larger than", func(w http.ResponseWriter, r *http.Request) {
			_, _ = w.Write([]byte(`{"0":{"engine_id":"` + strings.Repeat("e", MaxTopologyBytes) + `"}}`))
		}},
		{"redirect", "redirect", func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, trap.URL+"/query", http.StatusFound)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(tc.serve)
			defer srv.Close()
			if _, err := NewClient().Query(context.Background(), srv.URL); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Query = %v, want an error saying %q", err, tc.want)
			}
		})
	}
	if n := elsewhere.Load(); n != 0 {
		t.Errorf("the redirect was followed %d times", n)
	}
}

// With limits, POST /register takes only this engine's ranks, each at an address on the host
// the registration came from (the test's client is 127.0.0.1); vLLM's rules still apply after.
func TestRegistryLimits(t *testing.T) {
	cases := []struct {
		name   string
		limits RegistryLimits
		body   string
		want   int
	}{
		{"no limits: anything, as vLLM", RegistryLimits{}, `{"engine_id":"e","tp_rank":7,"pp_rank":3,"addr":"tcp://10.9.9.9:1"}`, http.StatusOK},
		{"own rank, own host", RegistryLimits{TP: 2, PP: 1, SameHost: true}, `{"engine_id":"e","tp_rank":1,"addr":"tcp://127.0.0.1:7"}`, http.StatusOK},
		{"tp rank past the engine's", RegistryLimits{TP: 2, PP: 1}, `{"engine_id":"e","tp_rank":2,"addr":"tcp://127.0.0.1:7"}`, http.StatusForbidden},
		{"pp rank past the engine's", RegistryLimits{TP: 2, PP: 1}, `{"engine_id":"e","pp_rank":1,"addr":"tcp://127.0.0.1:7"}`, http.StatusForbidden},
		{"own dp rank", RegistryLimits{DP: 2}, `{"engine_id":"e","dp_rank":1,"addr":"tcp://127.0.0.1:7"}`, http.StatusOK},
		{"dp rank past the pod's", RegistryLimits{DP: 2}, `{"engine_id":"e","dp_rank":2,"addr":"tcp://127.0.0.1:7"}`, http.StatusForbidden},
		{"another host's address", RegistryLimits{SameHost: true}, `{"engine_id":"e","addr":"tcp://10.9.9.9:7"}`, http.StatusForbidden},
		{"a name, not an address", RegistryLimits{SameHost: true}, `{"engine_id":"e","addr":"tcp://localhost:7"}`, http.StatusForbidden},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			reg := NewRegistry()
			reg.Limits = tc.limits
			srv := httptest.NewServer(reg.Handler())
			defer srv.Close()
			resp, err := http.Post(srv.URL+"/register", "application/json", strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.want {
				t.Errorf("POST /register %s = %s, want %d", tc.body, resp.Status, tc.want)
			}
			if n := len(reg.Snapshot()); (tc.want == http.StatusOK) != (n == 1) {
				t.Errorf("registry holds %d engines after %s", n, resp.Status)
			}
		})
	}
}
