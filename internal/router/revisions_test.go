package router

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// With KV revisions a request's prefill and decode always share one; traffic follows the
// revisions' engines; a revision missing a pool gets nothing, and with none serving in both
// pools the router fails closed (503, saying why) instead of pairing across revisions.
func TestRevisionsNeverMix(t *testing.T) {
	kv := newLedger()
	prefill, decode := servingEngines(kv, []string{"a-p0", "a-p1", "b-p0"}, []string{"a-d0", "b-d0", "c-d0"})
	f := newPD(t, routerconfig.FlowNIXL, DefaultFailurePolicy(), prefill, decode)
	rev := func(name string, p []*testEngine, d []*testEngine) Revision {
		out := Revision{Name: name}
		for _, e := range p {
			out.Prefill = append(out.Prefill, Prefill{URL: e.url})
		}
		for _, e := range d {
			out.Decode = append(out.Decode, e.url)
		}
		return out
	}
	// a: 2 prefill + 1 decode; b: 1 + 1; c: decode only (its prefill is gone).
	if err := f.r.SetPools(Pools{Revisions: []Revision{
		rev("a", prefill[:2], decode[:1]), rev("b", prefill[2:], decode[1:2]), rev("c", nil, decode[2:]),
	}}); err != nil {
		t.Fatal(err)
	}
	const n = 400
	got := map[string]int{}
	for range n {
		d, p := f.sendPair(t)
		if d[:1] != p[:1] {
			t.Fatalf("decode %s paired with prefill %s of another revision", d, p)
		}
		got[d[:1]]++
	}
	if got["c"] != 0 {
		t.Errorf("revision c, which has no prefill, got %d requests", got["c"])
	}
	// Weighted by engines: a has 3, b has 2 of the 5 serving.
	if share := float64(got["a"]) / n; share < 0.5 || share > 0.7 {
		t.Errorf("revision a got %.0f%% of the requests, want about 60%%", 100*share)
	}
	if a, b := f.counter(t, "pdcluster_router_revision_requests_total", "revision", "a"), f.counter(t, "pdcluster_router_revision_requests_total", "revision", "b"); int(a) != got["a"] || int(b) != got["b"] {
		t.Errorf("revision_requests_total a=%v b=%v, want %d and %d", a, b, got["a"], got["b"])
	}
	if p := f.counter(t, "pdcluster_router_endpoints", "pool", "prefill"); p != 3 {
		t.Errorf("endpoints{prefill} = %v, want every revision's 3", p)
	}

	// No revision with both pools: fail closed.
	if err := f.r.SetPools(Pools{Revisions: []Revision{rev("a", prefill[:2], nil), rev("c", nil, decode[2:])}}); err != nil {
		t.Fatal(err)
	}
	code, body := f.send(t, `{"prompt":"hi"}`)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "no KV revision has a ready engine in both pools") || !strings.Contains(body, "a: 2 prefill, 0 decode") {
		t.Errorf("got %d %s, want 503 naming each revision's engines", code, body)
	}
}

// sendPair sends a request and returns the names of the decode and prefill engines that
// served it (the test engines answer "decoded by <decode> from <prefill>").
func (f *pdFixture) sendPair(t *testing.T) (decode, prefill string) {
	t.Helper()
	code, body := f.send(t, `{"prompt":"hi"}`)
	if code != http.StatusOK {
		t.Fatalf("got %d %s", code, body)
	}
	if _, err := fmt.Sscanf(body[strings.Index(body, "decoded by"):], "decoded by %s from %s", &decode, &prefill); err != nil {
		t.Fatalf("answer %s: %v", body, err)
	}
	return decode, strings.TrimRight(prefill, `"}]`)
}
