package router

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// Two conversations, each turn's prompt the conversation so far: with PrefixAware routing every
// turn of one goes to the engines that served its first, in both pools (their prefix caches
// hold it), while the other conversation starts on the next engines; with the default,
// least-in-flight takes turns and scatters them. The metrics count the chunks held.
func TestPrefixAwareKeepsAConversationOnItsEngines(t *testing.T) {
	history := map[string]string{
		"a": strings.Repeat("You are a terse assistant for conversation a. ", 8),
		"b": strings.Repeat("You answer in French, conversation b, always. ", 8),
	}
	for _, tc := range []struct {
		name    string
		routing *routerconfig.Routing
		// together: each conversation stays on one prefill and one decode engine.
		together bool
	}{
		{"PrefixAware", &routerconfig.Routing{Strategy: routerconfig.RoutingPrefixAware, LoadSlack: 2}, true},
		{"LeastInFlight", &routerconfig.Routing{Strategy: routerconfig.RoutingLeastInFlight}, false},
		{"no routing", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kv := newLedger()
			prefill, decode := servingEngines(kv, []string{"p0", "p1", "p2"}, []string{"d0", "d1", "d2"})
			f := newPDWith(t, Config{Flow: routerconfig.FlowMooncake, Routing: tc.routing}, prefill, decode)
			served := map[string]map[string]bool{} // conversation -> engines
			for turn := range 4 {
				for _, conv := range []string{"a", "b"} {
					history[conv] += fmt.Sprintf("Turn %d of %s: tell me more about it, please. ", turn, conv)
					body, _ := json.Marshal(map[string]any{"model": "m", "prompt": history[conv], "max_tokens": 1})
					before := calls(append(prefill, decode...))
					if code, out := f.send(t, string(body)); code != http.StatusOK {
						t.Fatalf("turn %d of %s: %d %s", turn, conv, code, out)
					}
					if served[conv] == nil {
						served[conv] = map[string]bool{}
					}
					for name, n := range calls(append(prefill, decode...)) {
						if n > before[name] {
							served[conv][name] = true
						}
					}
				}
			}
			for conv, engines := range served {
				if together := len(engines) == 2; together != tc.together {
					t.Errorf("conversation %s went to %v: together %v, want %v", conv, engines, together, tc.together)
				}
			}
			matched, prompt := f.counter(t, "pdcluster_router_prefix_matched_chunks_total"), f.counter(t, "pdcluster_router_prefix_prompt_chunks_total")
			// GET /routing says the same, for the operator's status.
			if rc, ok := f.routing(t); ok != (tc.routing != nil && tc.routing.Strategy == routerconfig.RoutingPrefixAware) {
				t.Errorf("GET /routing answered %v", ok)
			} else if ok && (float64(rc.Prefill.PromptChunks+rc.Decode.PromptChunks) != prompt || float64(rc.Prefill.HeldChunks+rc.Decode.HeldChunks) != matched) {
				t.Errorf("GET /routing %+v, want the metrics' %v held of %v prompt chunks", rc, matched, prompt)
			}
			if tc.together {
				// Every turn after the first holds its whole history but the newest chunks.
				if prompt == 0 || matched < prompt/2 {
					t.Errorf("matched %v of %v prompt chunks, want most", matched, prompt)
				}
				if n := f.counter(t, "pdcluster_router_prefix_index_chunks", "pool", "decode"); n == 0 {
					t.Error("the decode pool's index is empty")
				}
			} else if prompt != 0 || matched != 0 {
				t.Errorf("prefix metrics %v/%v without PrefixAware routing", matched, prompt)
			}
		})
	}
}

// calls are the requests each engine got, by name.
func calls(es []*testEngine) map[string]int {
	out := map[string]int{}
	for _, e := range es {
		out[e.name] = len(e.got())
	}
	return out
}

// routing is the router's answer to GET /routing, and whether it answers it.
func (f *pdFixture) routing(t *testing.T) (routerconfig.RoutingCounts, bool) {
	t.Helper()
	var rc routerconfig.RoutingCounts
	resp, err := http.Get(f.url + routerconfig.RoutingPath)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return rc, false
	}
	if err := json.NewDecoder(resp.Body).Decode(&rc); err != nil {
		t.Fatal(err)
	}
	return rc, true
}

// An engine that holds more of the prompt but has loadSlack requests in flight past the least
// loaded one is passed over, and pdcluster_router_prefix_load_bound_total counts it (issue 57:
// the counter was never asserted): with loadSlack 0, a third request of a prompt while the
// second still runs on its holders goes to the other engines.
func TestPrefixAwarePassesOverALoadedHolder(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("p0", "p1"), engines("d0", "d1")
	release := make(chan struct{})
	var hold atomic.Bool
	for _, e := range prefill {
		ok := prefillOK(kv)
		e.do = func(e *testEngine, w http.ResponseWriter, r *http.Request, params map[string]any) {
			if hold.Load() {
				<-release
			}
			ok(e, w, r, params)
		}
	}
	for _, e := range decode {
		e.do = decodeOK(kv)
	}
	f := newPDWith(t, Config{Flow: routerconfig.FlowNIXL, Routing: &routerconfig.Routing{Strategy: routerconfig.RoutingPrefixAware}}, prefill, decode)
	body, _ := json.Marshal(map[string]any{"model": "m", "prompt": strings.Repeat("A system prompt every request shares, then the question. ", 8), "max_tokens": 1})
	if code, out := f.send(t, string(body)); code != http.StatusOK {
		t.Fatalf("%d %s", code, out)
	}
	holder, other := prefill[0], prefill[1]
	if len(holder.got()) == 0 {
		holder, other = other, holder
	}
	hold.Store(true)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = f.send(t, string(body))
	}()
	for deadline := time.Now().Add(10 * time.Second); len(holder.got()) < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the second request never reached the holder")
		}
	}
	hold.Store(false)
	if code, out := f.send(t, string(body)); code != http.StatusOK {
		t.Fatalf("%d %s", code, out)
	}
	close(release)
	<-done
	if n := len(other.got()); n != 1 {
		t.Errorf("%s got %d requests, want the third (its holder %s was busy)", other.name, n, holder.name)
	}
	// Both legs' engines are picked before prefill runs: the decode engine that holds the
	// prompt has the second request too, and is passed over alike.
	for _, pool := range []string{"prefill", "decode"} {
		if n := f.counter(t, "pdcluster_router_prefix_load_bound_total", "pool", pool); n != 1 {
			t.Errorf("%s load-bound picks: %v, want 1", pool, n)
		}
	}
}
