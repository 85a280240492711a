package router

import (
	"encoding/json"
	"net/http"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// pinned is a strategy that prefers engine want of each pool, and notes its cycle.
type pinned struct {
	leastInFlight
	want int

	mu       sync.Mutex
	prepared int
	scored   map[leg]int
	recorded []string // "<leg> <url>"
}

func (s *pinned) prepare(map[string]json.RawMessage, func(int64) bool) scorer {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.prepared++
	return pinnedRequest{s}
}

type pinnedRequest struct{ s *pinned }

func (q pinnedRequest) score(l leg, n int, _ func(int) string) *preference {
	q.s.mu.Lock()
	defer q.s.mu.Unlock()
	q.s.scored[l]++
	matched := make([]int, n)
	matched[q.s.want] = 1
	return &preference{matched: matched, slack: 100}
}

func (q pinnedRequest) record(l leg, _ picked, url string, pref *preference) {
	q.s.mu.Lock()
	defer q.s.mu.Unlock()
	if pref == nil || pref.matched[q.s.want] != 1 {
		q.s.recorded = append(q.s.recorded, "a preference score did not give")
	}
	q.s.recorded = append(q.s.recorded, string(l)+" "+url)
}

// The pick seam drives every pick of the request path: a strategy prepares each request once,
// scores each attempt's legs, and is told each pick, with the preference it gave; a retry
// scores again and the engine that failed in the request is left out whatever the score (what
// an endpoint picker driving the seam relies on).
func TestAStrategyDrivesThePicks(t *testing.T) {
	kv := newLedger()
	prefill, decode := servingEngines(kv, []string{"p0", "p1", "p2"}, []string{"d0", "d1", "d2"})
	f := newPDWith(t, Config{Flow: routerconfig.FlowMooncake}, prefill, decode)
	s := &pinned{want: 1, scored: map[leg]int{}}
	f.r.strategy = s
	for range 3 {
		if code, out := f.send(t, `{"model":"m","prompt":"hello"}`); code != http.StatusOK {
			t.Fatalf("%d %s", code, out)
		}
	}
	if d := cmp.Diff(map[string]int{"p0": 0, "p1": 3, "p2": 0, "d0": 0, "d1": 3, "d2": 0}, calls(append(prefill, decode...))); d != "" {
		t.Errorf("engine calls (-want +got):\n%s", d)
	}
	p1, d1 := "prefill "+prefill[1].url, "decode "+decode[1].url
	if d := cmp.Diff([]string{p1, d1, p1, d1, p1, d1}, s.recorded); d != "" {
		t.Errorf("picks recorded (-want +got):\n%s", d)
	}

	// p1 resets the connection: the request's second attempt is scored again and picks
	// another prefill engine.
	prefill[1].do = resets
	if code, out := f.send(t, `{"model":"m","prompt":"hello"}`); code != http.StatusOK {
		t.Fatalf("with p1 resetting: %d %s", code, out)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.prepared != 4 || s.scored[legPrefill] != 5 || s.scored[legDecode] != 5 {
		t.Errorf("prepared %d requests, scored %v legs; want 4 (once per request), 5 prefill and 5 decode (once per attempt)", s.prepared, s.scored)
	}
	if got := s.recorded[6:]; len(got) != 4 || got[0] != p1 || got[1] != d1 || got[2] == p1 || got[3] != d1 {
		t.Errorf("picks recorded for the request p1 failed: %q, want p1 and d1, then another prefill and d1", got)
	}
}
