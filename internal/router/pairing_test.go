package router

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// Pairing by topology over three racks: prefill in a and b, decode in a, b and c.
func TestPairingByDomain(t *testing.T) {
	kv := newLedger()
	prefill, decode := servingEngines(kv, []string{"a-p0", "b-p0"}, []string{"a-d0", "b-d0", "b-d1", "c-d0"})
	f := newPD(t, routerconfig.FlowNIXL, DefaultFailurePolicy(), prefill, decode)
	rack := map[string]string{}
	for _, e := range append(append([]*testEngine(nil), prefill...), decode...) {
		rack[e.url] = e.name[:1]
	}
	pools := func(decode []*testEngine) Pools {
		p := Pools{Domains: rack}
		for _, e := range prefill {
			p.Prefill = append(p.Prefill, Prefill{URL: e.url})
		}
		for _, e := range decode {
			p.Decode = append(p.Decode, e.url)
		}
		return p
	}
	// send sends n requests and counts the pairs by decode and whether both were of one rack.
	send := func(n int) (same, cross int, byDecode map[string]int) {
		byDecode = map[string]int{}
		for range n {
			d, p := f.sendPair(t)
			byDecode[d]++
			if d[:1] == p[:1] {
				same++
			} else {
				cross++
			}
		}
		return same, cross, byDecode
	}
	counted := func() (float64, float64) {
		return f.counter(t, "pdcluster_router_pairs_total", "locality", "same-domain"), f.counter(t, "pdcluster_router_pairs_total", "locality", "cross-domain")
	}

	// Without pairing, rack c's decode, which no prefill shares a rack with, gets requests:
	// what pairing must change (so the test can fail).
	if err := f.r.SetPools(pools(decode)); err != nil {
		t.Fatal(err)
	}
	if _, cross, by := send(40); cross == 0 || by["c-d0"] == 0 {
		t.Fatalf("without pairing: %d cross-rack pairs, c-d0 %d: the fixture does not exercise pairing", cross, by["c-d0"])
	}

	for _, mode := range []routerconfig.PairingMode{routerconfig.PairingPreferred, routerconfig.PairingRequired} {
		t.Run(string(mode), func(t *testing.T) {
			f.r.cfg.Pairing = mode
			if err := f.r.SetPools(pools(decode)); err != nil {
				t.Fatal(err)
			}
			same0, cross0 := counted()
			same, cross, by := send(40)
			if cross != 0 || by["c-d0"] != 0 || by["a-d0"] == 0 || by["b-d0"]+by["b-d1"] == 0 {
				t.Errorf("both racks with both pools: %d same, %d cross, by decode %v; want every pair within its rack", same, cross, by)
			}
			if s, c := counted(); s-same0 != float64(same) || c != cross0 {
				t.Errorf("pairs_total same-domain +%v cross-domain +%v, want +%d and +0", s-same0, c-cross0, same)
			}

			// Rack a loses its decode engine: its prefill engine pairs across racks
			// (Preferred) or is not used (Required).
			if err := f.r.SetPools(pools(decode[1:])); err != nil {
				t.Fatal(err)
			}
			_, cross0 = counted()
			same, cross, _ = send(40)
			if _, c := counted(); c-cross0 != float64(cross) {
				t.Errorf("pairs_total cross-domain +%v, want +%d", c-cross0, cross)
			}
			switch mode {
			case routerconfig.PairingPreferred:
				if cross == 0 {
					t.Errorf("rack a without decode, Preferred: no cross-rack pair (%d same): a-p0 was never used", same)
				}
			case routerconfig.PairingRequired:
				if cross != 0 {
					t.Errorf("rack a without decode, Required: %d cross-rack pairs", cross)
				}
			}
		})
	}

	// GET /pairs answers the same counts, for the operator's status.
	resp, err := http.Get(f.url + routerconfig.PairsPath)
	if err != nil {
		t.Fatal(err)
	}
	var pc routerconfig.PairCounts
	if err := json.NewDecoder(resp.Body).Decode(&pc); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if s, c := counted(); pc.SameDomain != int64(s) || pc.CrossDomain != int64(c) || pc.SameDomain == 0 {
		t.Errorf("GET /pairs %+v, counters %v same %v cross", pc, s, c)
	}

	// Required with no rack holding both pools: 503, never a cross-rack pair.
	f.r.cfg.Pairing = routerconfig.PairingRequired
	p := pools(decode[3:]) // c-d0 only: prefill in a and b
	if err := f.r.SetPools(p); err != nil {
		t.Fatal(err)
	}
	if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusServiceUnavailable || !strings.Contains(body, "no topology domain has a ready engine in both pools") {
		t.Errorf("Required, no rack with both pools: got %d %s, want 503 saying why", code, body)
	}
}

// Required pairing during a KV rollout: a domain pairs only engines of one revision. Racks
// that hold both pools only across two revisions pair nothing, so /ready says not ready; a
// revision without a pairable domain gets no request while another has one.
func TestRequiredPairingWithinOneRevision(t *testing.T) {
	kv := newLedger()
	prefill, decode := servingEngines(kv, []string{"old-p", "new-p", "new-p2"}, []string{"old-d", "new-d"})
	f := newPD(t, routerconfig.FlowNIXL, DefaultFailurePolicy(), prefill, decode)
	f.r.cfg.Pairing = routerconfig.PairingRequired
	rack := map[string]string{prefill[0].url: "a", decode[0].url: "b", prefill[1].url: "b", decode[1].url: "a", prefill[2].url: "a"}
	rev := func(name string, p []*testEngine, d ...*testEngine) Revision {
		out := Revision{Name: name}
		for _, e := range p {
			out.Prefill = append(out.Prefill, Prefill{URL: e.url})
		}
		for _, e := range d {
			out.Decode = append(out.Decode, e.url)
		}
		return out
	}
	ready := func() (int, string) {
		resp, err := http.Get(f.url + "/ready")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	// old: prefill in a, decode in b; new: prefill in b, decode in a. Each rack has both pools,
	// but only across the two revisions.
	if err := f.r.SetPools(Pools{Domains: rack, Revisions: []Revision{rev("old", prefill[:1], decode[0]), rev("new", prefill[1:2], decode[1])}}); err != nil {
		t.Fatal(err)
	}
	if code, body := ready(); code != http.StatusServiceUnavailable || !strings.Contains(body, "no topology domain") {
		t.Errorf("/ready with racks pairable only across revisions: %d %s, want 503 saying why", code, body)
	}
	if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusServiceUnavailable {
		t.Errorf("request with racks pairable only across revisions: %d %s, want 503", code, body)
	}

	// new gains a prefill in rack a: it pairs there; old still cannot, and must get nothing.
	if err := f.r.SetPools(Pools{Domains: rack, Revisions: []Revision{rev("old", prefill[:1], decode[0]), rev("new", prefill[1:], decode[1])}}); err != nil {
		t.Fatal(err)
	}
	if code, body := ready(); code != http.StatusOK {
		t.Errorf("/ready with revision new pairable in rack a: %d %s", code, body)
	}
	for range 40 {
		if d, p := f.sendPair(t); d != "new-d" || p != "new-p2" {
			t.Fatalf("request paired %s with %s, want new-d with new-p2 (the only pair within a rack and a revision)", d, p)
		}
	}
}

// Required pairing when a domain's only decode fails a request in a way the router retries
// (503: not serving): the retry stays in the domain, so there is no decode left to try and the
// client gets the failure; rack b's decode, which a cross-domain retry would reach (and answer
// 200 from), gets nothing.
func TestRequiredPairingRetriesNoDecodeAcrossDomains(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("a-p0"), engines("a-d0", "b-d0")
	prefill[0].do = prefillOK(kv)
	decode[0].do = answer(http.StatusServiceUnavailable) // retried (a new attempt), see failure.go
	decode[1].do = decodeOK(kv)
	f := newPD(t, routerconfig.FlowNIXL, DefaultFailurePolicy(), prefill, decode)
	f.r.cfg.Pairing = routerconfig.PairingRequired
	p := Pools{Domains: map[string]string{}}
	for _, e := range append(append([]*testEngine(nil), prefill...), decode...) {
		p.Domains[e.url] = e.name[:1]
	}
	p.Prefill = []Prefill{{URL: prefill[0].url}}
	p.Decode = []string{decode[0].url, decode[1].url}
	if err := f.r.SetPools(p); err != nil {
		t.Fatal(err)
	}
	code, body := f.send(t, `{"prompt":"hi"}`)
	if code == http.StatusOK {
		t.Errorf("rack a's only decode failed: answered %d %s, want the failure (a retry in rack b would pair across racks)", code, body)
	}
	if n := len(decode[0].got()); n == 0 {
		t.Errorf("a-d0 got no request: the fixture does not exercise a failing decode")
	}
	if n := len(decode[1].got()); n != 0 {
		t.Errorf("b-d0 got %d requests: Required pairing paired across racks", n)
	}
	if c := f.counter(t, "pdcluster_router_pairs_total", "locality", "cross-domain"); c != 0 {
		t.Errorf("pairs_total cross-domain %v, want 0", c)
	}
}
