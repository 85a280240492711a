package router

import (
	"context"
	"encoding/json"
	"math"
	"net"
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"pdcluster.dev/pdcluster-operator/internal/router/kvevents"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
)

// startPublisher stands in for one engine's vLLM KV events publisher on host (the router's
// follower is tested against vLLM's own in internal/router/kvevents).
func startPublisher(t *testing.T, host string, port, replayPort int) *kvpublish.Publisher {
	t.Helper()
	at := func(port int) string { return "tcp://" + net.JoinHostPort(host, strconv.Itoa(port)) }
	p, err := kvpublish.Listen(at(port), at(replayPort), "kv", 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// store publishes that the engine behind p cached tokens in blocks of size.
func store(t *testing.T, p *kvpublish.Publisher, tokens []uint32, size int) {
	t.Helper()
	n := len(tokens) / size
	hashes := make([]uint64, n)
	for i := range hashes {
		hashes[i] = uint64(1000 + i)
	}
	if err := p.Publish(kvpublish.Stored(hashes, nil, tokens[:n*size], size)); err != nil {
		t.Fatal(err)
	}
}

// sharedFreePort is a port free on every host.
func sharedFreePort(t *testing.T, hosts ...string) int {
	t.Helper()
	for range 20 {
		l, err := net.Listen("tcp", net.JoinHostPort(hosts[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		free := true
		for _, h := range hosts[1:] {
			if o, err := net.Listen("tcp", net.JoinHostPort(h, strconv.Itoa(port))); err != nil {
				free = false
			} else {
				o.Close()
			}
		}
		l.Close()
		if free {
			return port
		}
	}
	t.Fatal("no port free on every host")
	return 0
}

// kvEventsFixture is a router with KVEvents routing over prefill engines p0, p1 and decode
// engines d0, d1, each with a KV events publisher of its own on a loopback address.
type kvEventsFixture struct {
	f               *pdFixture
	pubs            map[string]*kvpublish.Publisher
	prefill, decode []*testEngine
	// prompt is 40 token ids: 5 blocks of 8.
	prompt []uint32
}

func newKVEventsFixture(t *testing.T) *kvEventsFixture {
	t.Helper()
	hosts := map[string]string{"p0": "127.0.0.11", "p1": "127.0.0.12", "d0": "127.0.0.21", "d1": "127.0.0.22"}
	all := []string{hosts["p0"], hosts["p1"], hosts["d0"], hosts["d1"]}
	port := sharedFreePort(t, all...)
	replayPort := sharedFreePort(t, all...)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	k := &kvEventsFixture{pubs: map[string]*kvpublish.Publisher{}}
	for name, host := range hosts {
		k.pubs[name] = startPublisher(t, host, port, replayPort)
	}
	kv := newLedger()
	k.prefill, k.decode = engines("p0", "p1"), engines("d0", "d1")
	for _, e := range k.prefill {
		e.do, e.host = prefillOK(kv), hosts[e.name]
	}
	for _, e := range k.decode {
		e.do, e.host = decodeOK(kv), hosts[e.name]
	}
	routing := &routerconfig.Routing{Strategy: routerconfig.RoutingKVEvents, LoadSlack: 2,
		KVEvents: &routerconfig.KVEventsEndpoints{Port: int32(port), ReplayPort: int32(replayPort), Topic: "kv"}}
	k.f = newPDWith(t, Config{Flow: routerconfig.FlowMooncake, Routing: routing}, k.prefill, k.decode)
	done := make(chan struct{})
	go func() { defer close(done); k.f.r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	k.prompt = make([]uint32, 40)
	for i := range k.prompt {
		k.prompt[i] = uint32(7000 + i)
	}
	return k
}

// publish has each named engine's publisher store its tokens in blocks of 8 until the router's
// index holds want blocks in all (a PUB drops what it sends before the subscriber joined).
func (k *kvEventsFixture) publish(t *testing.T, held map[string][]uint32, want float64) {
	t.Helper()
	for range 2 {
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			for name, tokens := range held {
				store(t, k.pubs[name], tokens, 8)
			}
			if k.f.counter(t, "pdcluster_router_kv_events_index_blocks") == want {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the router's index holds %v blocks, want %v", k.f.counter(t, "pdcluster_router_kv_events_index_blocks"), want)
			}
		}
	}
}

// vouch records that the router sent prompt to each of es (PrefixAware's record, which
// vouches for what their events claim of it), as routing a request there does.
func (k *kvEventsFixture) vouch(t *testing.T, prompt []uint32, es ...*testEngine) {
	t.Helper()
	raw, err := json.Marshal(prompt)
	if err != nil {
		t.Fatal(err)
	}
	hashes := kvEventsOf(k.f.r).estimate.promptHashes(map[string]json.RawMessage{"model": json.RawMessage(`"m"`), "prompt": raw})
	for _, e := range es {
		l := legDecode
		if slices.Contains(k.prefill, e) {
			l = legPrefill
		}
		kvEventsOf(k.f.r).estimate.pools[l].Record(e.url, hashes)
	}
}

// With KVEvents routing, token-id prompts go to the engines whose events say they hold the
// prompt's start, in both pools, every time (least-in-flight alone would take turns); a text
// prompt, and any prompt once an engine of the pool stops publishing, is routed by PrefixAware's
// estimate, and the metrics say why.
func TestKVEventsRouteToTheEnginesThatHoldThePrompt(t *testing.T) {
	k := newKVEventsFixture(t)
	f, pubs, prefill, decode := k.f, k.pubs, k.prefill, k.decode
	prompt := k.prompt
	// p1 and d1 hold the prompt's first 32 tokens, and the router sent it to them before;
	// p0 and d0 hold something else.
	k.vouch(t, prompt, prefill[1], decode[1])
	k.publish(t, map[string][]uint32{"p1": prompt[:32], "d1": prompt[:32], "p0": make([]uint32, 16), "d0": make([]uint32, 16)}, 4+4+2+2)
	send := func(prompt any) {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "max_tokens": 1})
		if code, out := f.send(t, string(body)); code != http.StatusOK {
			t.Fatalf("%d %s", code, out)
		}
	}
	for range 4 {
		send(prompt)
	}
	if got := calls(append(prefill, decode...)); got["p1"] != 4 || got["d1"] != 4 {
		t.Errorf("calls %v: want all 4 on p1 and d1, which hold the prompt", got)
	}
	for _, pool := range []string{"prefill", "decode"} {
		// 40 tokens are 5 blocks of 8, of which p1 and d1 hold 4.
		prompt, matched := f.counter(t, "pdcluster_router_kv_events_prompt_blocks_total", "pool", pool), f.counter(t, "pdcluster_router_kv_events_matched_blocks_total", "pool", pool)
		if prompt != 20 || matched != 16 {
			t.Errorf("%s: matched %v of %v blocks, want 16 of 20", pool, matched, prompt)
		}
	}
	// A batch may still arrive while the answer and the metric are read: the lag GET /routing
	// says is the metric's as read before or after it.
	lagBefore := map[string]float64{}
	for _, pool := range []string{"prefill", "decode"} {
		lagBefore[pool] = f.counter(t, "pdcluster_router_kv_events_lag_seconds", "pool", pool)
	}
	if rc, ok := f.routing(t); !ok || rc.Prefill.PromptBlocks != 20 || rc.Prefill.HeldBlocks != 16 || rc.Decode.PromptBlocks != 20 || rc.Decode.HeldBlocks != 16 {
		t.Errorf("GET /routing %+v (answered %v), want 16 of 20 blocks held in each pool", rc, ok)
	} else {
		// The index and the lag as the metrics say them (a batch's lag is at least 0 ms).
		for pool, c := range map[string]routerconfig.PoolRoutingCounts{"prefill": rc.Prefill, "decode": rc.Decode} {
			if index := f.counter(t, "pdcluster_router_kv_events_index_blocks", "pool", pool); c.IndexBlocks != 6 || float64(c.IndexBlocks) != index {
				t.Errorf("%s: GET /routing says the index holds %d blocks, the metric %v; want 6 (4 and 2)", pool, c.IndexBlocks, index)
			}
			lag := f.counter(t, "pdcluster_router_kv_events_lag_seconds", "pool", pool)
			// Whole milliseconds, truncated: within one of the metric's seconds.
			asRead := func(l float64) bool { return math.Abs(float64(c.EventsLagMilliseconds)-l*1000) <= 1 }
			if c.EventsLagMilliseconds < 0 || !asRead(lagBefore[pool]) && !asRead(lag) {
				t.Errorf("%s: GET /routing says the events lag %d ms, the metric %v s before it and %v s after", pool, c.EventsLagMilliseconds, lagBefore[pool], lag)
			}
		}
	}

	send("a text prompt has no token ids the router can read")
	if n := f.counter(t, "pdcluster_router_kv_events_estimated_total", "reason", "text"); n != 2 {
		t.Errorf("estimated for text: %v, want 2 (one per pool)", n)
	}
	// A router whose body budget holds the body but not its token ids routes by estimate: the
	// ids (4 bytes each, 40 of them) are charged before they are parsed.
	body, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "max_tokens": 1})
	f.r.bodies.limit = bodyCopies*int64(len(body)) + 4*int64(len(prompt)) - 1
	send(prompt)
	f.r.bodies.limit = f.r.cfg.MaxBodyBytesInFlight
	for _, pool := range []string{"prefill", "decode"} {
		if n := f.counter(t, "pdcluster_router_kv_events_estimated_total", "pool", pool, "reason", "budget"); n != 1 {
			t.Errorf("%s estimated for the budget: %v, want 1", pool, n)
		}
	}
	if used := f.r.bodies.used.Load(); used != 0 {
		t.Errorf("%d bytes of the body budget still taken after the answers", used)
	}

	for _, pool := range []string{"prefill", "decode"} {
		if n := f.counter(t, "pdcluster_router_kv_events_connected_publishers", "pool", pool); n != 2 {
			t.Errorf("%s: %v publishers connected, want its 2 engines'", pool, n)
		}
	}
	pubs["p0"].Close()
	for deadline := time.Now().Add(20 * time.Second); f.counter(t, "pdcluster_router_kv_events_connected_publishers", "pool", "prefill") != 1; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the router says %v prefill publishers are connected after p0's closed, want 1", f.counter(t, "pdcluster_router_kv_events_connected_publishers", "pool", "prefill"))
		}
	}
	if kvEventsOf(f.r).follow[legPrefill].Streams()[prefill[0].url].Connected {
		t.Error("the follower still says p0's publisher is connected")
	}
	send(prompt)
	if n := f.counter(t, "pdcluster_router_kv_events_estimated_total", "pool", "prefill", "reason", "untrusted"); n != 1 {
		t.Errorf("prefill estimated for an engine not publishing: %v, want 1", n)
	}
	if n := f.counter(t, "pdcluster_router_kv_events_estimated_total", "pool", "decode", "reason", "untrusted"); n != 0 {
		t.Errorf("decode estimated: %v, want 0 (its engines publish)", n)
	}

	// d1's events are lost past its replay buffer: the decode pool routes by estimate (for a
	// minute), though every decode engine is connected.
	pubs["d1"].Lose(3)
	for deadline := time.Now().Add(20 * time.Second); f.counter(t, "pdcluster_router_kv_events_lost_total", "pool", "decode") == 0; time.Sleep(50 * time.Millisecond) {
		store(t, pubs["d1"], prompt[:32], 8)
		if time.Now().After(deadline) {
			t.Fatal("the router counted no loss of d1's events")
		}
	}
	if !kvEventsOf(f.r).follow[legDecode].Streams()[decode[1].url].Connected {
		t.Fatal("d1's follower disconnected: the test wants a loss alone")
	}
	send(prompt)
	if n := f.counter(t, "pdcluster_router_kv_events_estimated_total", "pool", "decode", "reason", "untrusted"); n != 1 {
		t.Errorf("decode estimated after a loss: %v, want 1", n)
	}
}

// An engine's claims count only as far as the router sent it the prompt (issue 56: a hostile
// engine claiming a prefix clients share drew every request): p1 and d1 claim more of the
// prompt than p0 and d0 hold, but the router sent the prompt only to p0 and d0, so every request
// goes there and p1's and d1's claims are counted as unvouched. Once the router has sent p1 and
// d1 the prompt (an honest engine would then hold it), their claims win.
func TestKVEventsClaimsOnlyWhatTheRouterSent(t *testing.T) {
	k := newKVEventsFixture(t)
	k.vouch(t, k.prompt, k.prefill[0], k.decode[0])
	k.publish(t, map[string][]uint32{"p0": k.prompt[:24], "d0": k.prompt[:24], "p1": k.prompt, "d1": k.prompt}, 3+3+5+5)
	send := func() {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"model": "m", "prompt": k.prompt, "max_tokens": 1})
		if code, out := k.f.send(t, string(body)); code != http.StatusOK {
			t.Fatalf("%d %s", code, out)
		}
	}
	for range 4 {
		send()
	}
	if got := calls(append(k.prefill, k.decode...)); got["p0"] != 4 || got["d0"] != 4 {
		t.Errorf("calls %v: want all 4 on p0 and d0, the engines the router sent the prompt", got)
	}
	for _, pool := range []string{"prefill", "decode"} {
		matched := k.f.counter(t, "pdcluster_router_kv_events_matched_blocks_total", "pool", pool)
		unvouched := k.f.counter(t, "pdcluster_router_kv_events_unvouched_blocks_total", "pool", pool)
		if matched != 4*3 || unvouched != 4*5 {
			t.Errorf("%s: %v blocks matched, %v unvouched; want 12 (p0's and d0's 3 each time) and 20 (the other engine's 5 each time)", pool, matched, unvouched)
		}
	}
	// The router sent p1 the prompt's first two chunks of JSON (128 bytes, "[7000," and 24 more
	// ids and commas: 25 whole ids): 3 blocks of p1's 5 are vouched for.
	raw, _ := json.Marshal(k.prompt)
	hashes := kvEventsOf(k.f.r).estimate.promptHashes(map[string]json.RawMessage{"model": json.RawMessage(`"m"`), "prompt": raw})
	kvEventsOf(k.f.r).estimate.pools[legPrefill].Record(k.prefill[1].url, hashes[:2])
	send()
	if n := k.f.counter(t, "pdcluster_router_kv_events_unvouched_blocks_total", "pool", "prefill"); n != 4*5+2 {
		t.Errorf("prefill: %v blocks unvouched, want 22 (2 of p1's 5 past the two chunks sent)", n)
	}
	k.vouch(t, k.prompt, k.prefill[1], k.decode[1])
	before := calls(append(k.prefill, k.decode...))
	send()
	if got := calls(append(k.prefill, k.decode...)); got["p1"] != before["p1"]+1 || got["d1"] != before["d1"]+1 {
		t.Errorf("calls %v (before %v): want the last on p1 and d1, which hold more of it and were sent it", got, before)
	}
}

// promptTokens charges the ids' memory before it parses them, at most 4 bytes for each comma
// and one more, and parses nothing the budget refuses.
func TestPromptTokensChargesTheBudget(t *testing.T) {
	for _, tc := range []struct {
		name, prompt string
		budget       int64
		want         []uint32
		charged      int64
		overBudget   bool
	}{
		{"ids", `[1,2,3]`, 100, []uint32{1, 2, 3}, 12, false},
		{"a batch of one", `[[1, 2]]`, 100, []uint32{1, 2}, 8, false},
		{"ids past the budget", `[1,2,3]`, 11, nil, 0, true},
		{"text: nothing to charge", `"hello, world"`, 0, nil, 0, false},
		{"a batch of two", `[[1],[2]]`, 100, nil, 8, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var charged int64
			got, over := promptTokens(map[string]json.RawMessage{"prompt": json.RawMessage(tc.prompt)}, func(n int64) bool {
				if charged+n > tc.budget {
					return false
				}
				charged += n
				return true
			})
			if d := cmp.Diff(tc.want, got); d != "" || over != tc.overBudget || charged != tc.charged {
				t.Errorf("ids (-want +got):\n%s\nover budget %v, want %v; charged %d, want %d", d, over, tc.overBudget, charged, tc.charged)
			}
		})
	}
}

// An engine pooled since the follower's last sync (not followed yet) makes its pool route by
// estimate, counted as untrusted: its events are unknown, not empty (issue 57: counting it as
// holding nothing passed every test).
func TestKVEventsEstimateForAnEngineNotFollowedYet(t *testing.T) {
	k := newKVEventsFixture(t)
	k.vouch(t, k.prompt, k.prefill[1])
	k.publish(t, map[string][]uint32{"p1": k.prompt[:32], "d1": k.prompt[:32], "p0": make([]uint32, 16), "d0": make([]uint32, 16)}, 4+4+2+2)
	raw, _ := json.Marshal(k.prompt)
	q := kvEventsOf(k.f.r).prepare(map[string]json.RawMessage{"model": json.RawMessage(`"m"`), "prompt": raw}, func(int64) bool { return true }).(*kvRequest)
	urls := []string{k.prefill[0].url, k.prefill[1].url}
	if pref, _ := q.fromEvents(legPrefill, 2, func(i int) string { return urls[i] }); pref == nil || pref.matched[1] != 4 {
		t.Fatalf("the followed engines: preference %+v, want p1 matching 4 blocks", pref)
	}
	before := k.f.counter(t, "pdcluster_router_kv_events_estimated_total", "pool", "prefill", "reason", "untrusted")
	urls = append(urls, "http://127.0.0.13:8000")
	if pref, _ := q.fromEvents(legPrefill, 3, func(i int) string { return urls[i] }); pref != nil {
		t.Errorf("with an engine not followed yet: preference %+v, want none (the estimate)", pref)
	}
	if n := k.f.counter(t, "pdcluster_router_kv_events_estimated_total", "pool", "prefill", "reason", "untrusted"); n != before+1 {
		t.Errorf("estimated as untrusted: %v, want %v", n, before+1)
	}
}

// An engine that leaves its pool is forgotten: its follower stops (its stream and its blocks
// go from the index) and PrefixAware's record of what the router sent it goes too (issue 57:
// both stayed, the follower dialling for ever).
func TestEnginesThatLeaveAreForgotten(t *testing.T) {
	k := newKVEventsFixture(t)
	k.vouch(t, k.prompt, k.prefill[0], k.prefill[1])
	k.publish(t, map[string][]uint32{"p1": k.prompt[:32], "d1": k.prompt[:32], "p0": make([]uint32, 16), "d0": make([]uint32, 16)}, 4+4+2+2)
	cur := k.f.r.pools.Load()
	stay := slices.DeleteFunc(slices.Clone(cur.Prefill), func(p Prefill) bool { return p.URL == k.prefill[0].url })
	if err := k.f.r.SetPools(Pools{Prefill: stay, Decode: cur.Decode}); err != nil {
		t.Fatal(err)
	}
	follower := kvEventsOf(k.f.r).follow[legPrefill]
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		_, followed := follower.Streams()[k.prefill[0].url]
		if !followed && k.f.counter(t, "pdcluster_router_kv_events_index_blocks", "pool", "prefill") == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("p0 left: still followed %v, the prefill index holds %v blocks (want p1's 4)", followed, k.f.counter(t, "pdcluster_router_kv_events_index_blocks", "pool", "prefill"))
		}
	}
	raw, _ := json.Marshal(k.prompt)
	hashes := kvEventsOf(k.f.r).estimate.promptHashes(map[string]json.RawMessage{"model": json.RawMessage(`"m"`), "prompt": raw})
	sent := make([]int, 2)
	urls := []string{k.prefill[0].url, k.prefill[1].url}
	kvEventsOf(k.f.r).estimate.pools[legPrefill].Match(hashes, func(i int) string { return urls[i] }, sent)
	if sent[0] != 0 || sent[1] != len(hashes) {
		t.Errorf("PrefixAware's record after p0 left: %v chunks of p0, %v of p1; want 0 and %d", sent[0], sent[1], len(hashes))
	}
}

// A data-parallel prefill pod is followed on every rank's publisher, each on its engine's
// ports plus its rank and keyed by rank (issue 57: following rank 0 alone passed every test).
func TestKVEventsFollowEveryRankOfAPod(t *testing.T) {
	k := &kvEvents{endpoints: routerconfig.KVEventsEndpoints{Port: 5557, ReplayPort: 5757}}
	want, ranks := k.sources(&Pools{Prefill: []Prefill{{URL: "http://10.0.0.1:8000", DataParallel: 3}}, Decode: []string{"http://10.0.0.2:8000"}})
	src := func(key, port, replay string) kvevents.Source {
		return kvevents.Source{Engine: key, Endpoint: "tcp://" + port, Replay: "tcp://" + replay}
	}
	if d := cmp.Diff(map[string]kvSource{
		"prefill http://10.0.0.1:8000":   {legPrefill, src("http://10.0.0.1:8000", "10.0.0.1:5557", "10.0.0.1:5757")},
		"prefill http://10.0.0.1:8000#1": {legPrefill, src("http://10.0.0.1:8000#1", "10.0.0.1:5558", "10.0.0.1:5758")},
		"prefill http://10.0.0.1:8000#2": {legPrefill, src("http://10.0.0.1:8000#2", "10.0.0.1:5559", "10.0.0.1:5759")},
		"decode http://10.0.0.2:8000":    {legDecode, src("http://10.0.0.2:8000", "10.0.0.2:5557", "10.0.0.2:5757")},
	}, want, cmp.AllowUnexported(kvSource{})); d != "" {
		t.Errorf("publishers followed (-want +got):\n%s", d)
	}
	if d := cmp.Diff(map[leg]map[string][]string{
		legPrefill: {"http://10.0.0.1:8000": {"http://10.0.0.1:8000", "http://10.0.0.1:8000#1", "http://10.0.0.1:8000#2"}},
		legDecode:  {"http://10.0.0.2:8000": {"http://10.0.0.2:8000"}},
	}, ranks); d != "" {
		t.Errorf("index keys by engine (-want +got):\n%s", d)
	}
}

// kvEventsOf is r's KVEvents strategy.
func kvEventsOf(r *Router) *kvEvents { return r.strategy.(*kvEvents) }
