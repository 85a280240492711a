package router

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

type seen struct {
	body    map[string]any
	headers http.Header
}

type fakeEngine struct {
	mu     sync.Mutex
	got    []seen
	status int
	reply  string
}

func (f *fakeEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body map[string]any
	_ = json.NewDecoder(r.Body).Decode(&body)
	f.mu.Lock()
	f.got = append(f.got, seen{body, r.Header.Clone()})
	status, reply := f.status, f.reply
	f.mu.Unlock()
	if status == 0 {
		status = 200
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, reply)
}

func (f *fakeEngine) last(t *testing.T) seen {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.got) == 0 {
		t.Fatal("engine got no request")
	}
	return f.got[len(f.got)-1]
}

func newRouter(t *testing.T, flow routerconfig.Flow, p, d *fakeEngine) *httptest.Server {
	t.Helper()
	return routerWith(t, Config{Flow: flow}, p, d)
}

// routerWith is a router over one prefill engine p (registered at a bootstrap registry) and one
// decode engine d, with cfg's flow and limits.
func routerWith(t *testing.T, cfg Config, p, d http.Handler) *httptest.Server {
	t.Helper()
	return routerMetered(t, cfg, p, d, nil)
}

// routerMetered is routerWith registering the router's metrics in metrics (nil: none).
func routerMetered(t *testing.T, cfg Config, p, d http.Handler, metrics prometheus.Registerer) *httptest.Server {
	t.Helper()
	reg := bootstrap.NewRegistry()
	_ = reg.Register(bootstrap.Registration{EngineID: "engine-p", DPRank: 0, Addr: "tcp://127.0.0.1:1"})
	boot := httptest.NewServer(reg.Handler())
	ps, ds := httptest.NewServer(p), httptest.NewServer(d)
	t.Cleanup(func() { boot.Close(); ps.Close(); ds.Close() })
	r, err := New(cfg, logr.Discard(), metrics)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	if err := r.SetPools(Pools{Prefill: []Prefill{{URL: ps.URL, Bootstrap: boot.URL}}, Decode: []string{ds.URL}}); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(r.Handler(nil))
	t.Cleanup(srv.Close)
	return srv
}

func send(t *testing.T, url, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	req.Header.Set("X-Request-Id", "req-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (f *fakeEngine) wait(t *testing.T) seen {
	t.Helper()
	for i := 0; i < 200; i++ {
		f.mu.Lock()
		n := len(f.got)
		f.mu.Unlock()
		if n > 0 {
			return f.last(t)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("engine got no request")
	return seen{}
}

func TestMooncakeLegsShareTheTransfer(t *testing.T) {
	p, d := &fakeEngine{}, &fakeEngine{reply: `{"choices":[{"text":"ok"}]}`}
	srv := newRouter(t, routerconfig.FlowMooncake, p, d)
	code, body := send(t, srv.URL, `{"prompt":"hi","max_tokens":32,"stream":true,"stream_options":{"include_usage":true}}`)
	if code != 200 || !strings.Contains(body, `"ok"`) {
		t.Fatalf("got %d %s", code, body)
	}
	dl, pl := d.wait(t), p.wait(t)
	pk, _ := pl.body["kv_transfer_params"].(map[string]any)
	dk, _ := dl.body["kv_transfer_params"].(map[string]any)
	transfer, _ := pk["transfer_id"].(string)
	if !strings.HasPrefix(transfer, "xfer-") {
		t.Fatalf("prefill transfer_id = %v", pk["transfer_id"])
	}
	if d := cmp.Diff(map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer}, pk); d != "" {
		t.Errorf("prefill kv_transfer_params (-want +got):\n%s", d)
	}
	if dk["transfer_id"] != transfer || dk["remote_engine_id"] != "engine-p" || dk["do_remote_prefill"] != true || !strings.HasPrefix(dk["remote_bootstrap_addr"].(string), "http://") {
		t.Errorf("decode kv_transfer_params = %v", dk)
	}
	if pl.body["max_tokens"] != float64(1) || pl.body["stream"] != false || pl.body["stream_options"] != nil {
		t.Errorf("prefill leg not primed for one token: %v", pl.body)
	}
	if dl.body["max_tokens"] != float64(32) || dl.body["stream"] != true {
		t.Errorf("decode leg lost the client's fields: %v", dl.body)
	}
	if pl.headers.Get("X-Request-Id") != "req-1" || dl.headers.Get("X-Request-Id") != "req-1" || pl.headers.Get("X-data-parallel-rank") != "0" {
		t.Errorf("headers: prefill %v, decode %v", pl.headers, dl.headers)
	}
}

func TestNIXLPassesPrefillParamsToDecode(t *testing.T) {
	p := &fakeEngine{reply: `{"kv_transfer_params":{"do_remote_prefill":true,"transfer_id":"t-9","remote_engine_id":"e"}}`}
	d := &fakeEngine{reply: `{"choices":[]}`}
	srv := newRouter(t, routerconfig.FlowNIXL, p, d)
	if code, body := send(t, srv.URL, `{"prompt":"hi","max_tokens":5}`); code != 200 {
		t.Fatalf("got %d %s", code, body)
	}
	want := map[string]any{"do_remote_prefill": true, "transfer_id": "t-9", "remote_engine_id": "e"}
	if diff := cmp.Diff(want, d.last(t).body["kv_transfer_params"]); diff != "" {
		t.Errorf("decode params (-want +got):\n%s", diff)
	}
	pk := p.last(t).body["kv_transfer_params"].(map[string]any)
	if pk["do_remote_decode"] != true || pk["remote_block_ids"] != nil {
		t.Errorf("prefill params = %v", pk)
	}
}

func TestFailuresSayWhy(t *testing.T) {
	t.Run("nixl prefill 4xx is the client's answer", func(t *testing.T) {
		p := &fakeEngine{status: 400, reply: `{"error":{"message":"max_tokens must be at least 1"}}`}
		srv := newRouter(t, routerconfig.FlowNIXL, p, &fakeEngine{})
		if code, body := send(t, srv.URL, `{"prompt":"hi"}`); code != 400 || !strings.Contains(body, "max_tokens") {
			t.Errorf("got %d %s", code, body)
		}
	})
	t.Run("decode 5xx names both legs", func(t *testing.T) {
		// Prefill's verdict (a 500, not its absence): decode answers for itself. (A prefill
		// that is not there or said 503 ends the attempt at once: its KV never comes.)
		p := &fakeEngine{status: 500, reply: `agent down`}
		d := &fakeEngine{status: 500, reply: `{"error":{"message":"KV load failed"}}`}
		srv := newRouter(t, routerconfig.FlowMooncake, p, d)
		code, body := send(t, srv.URL, `{"prompt":"hi"}`)
		if code != 500 || !strings.Contains(body, "KV load failed") || !strings.Contains(body, "decode leg") || !strings.Contains(body, "agent down") {
			t.Errorf("got %d %s", code, body)
		}
	})
	t.Run("bad bodies", func(t *testing.T) {
		srv := newRouter(t, routerconfig.FlowMooncake, &fakeEngine{}, &fakeEngine{})
		for body, want := range map[string]string{
			`[1]`:                                    "JSON object",
			`{"max_tokens":1}`:                       "prompt",
			`{"prompt":"x","kv_transfer_params":{}}`: "set by the router",
		} {
			if code, got := send(t, srv.URL, body); code != 400 || !strings.Contains(got, want) {
				t.Errorf("%s: got %d %s, want 400 with %q", body, code, got, want)
			}
		}
	})
	t.Run("config", func(t *testing.T) {
		if _, err := New(Config{Flow: "x"}, logr.Discard(), nil); err == nil {
			t.Error("bad mode accepted")
		}
		r, err := New(Config{Flow: routerconfig.FlowMooncake}, logr.Discard(), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.SetPools(Pools{Prefill: []Prefill{{URL: "http://p"}}, Decode: []string{"http://d"}}); err == nil {
			t.Error("mooncake without bootstrap accepted")
		}
	})
}

// Readiness follows the pools: not ready until an engine of each pool is known (of one KV
// revision), and not ready again when a pool empties; liveness stays up throughout.
func TestReadyNeedsAnEngineInEachPool(t *testing.T) {
	type served struct {
		r   *Router
		url string
	}
	routers := map[routerconfig.PairingMode]served{}
	for _, mode := range []routerconfig.PairingMode{"", routerconfig.PairingRequired} {
		r, err := New(Config{Flow: routerconfig.FlowNIXL, Pairing: mode}, logr.Discard(), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Close)
		srv := httptest.NewServer(r.Handler(nil))
		t.Cleanup(srv.Close)
		routers[mode] = served{r, srv.URL}
	}
	get := func(url string) (int, string) {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// Nothing listens there: a request the router sends on is refused at once.
	const pURL, p2URL, dURL = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
	p, d := []Prefill{{URL: pURL}}, []string{dURL}
	racks := map[string]string{pURL: "rack-a", dURL: "rack-b", p2URL: "rack-b"}
	for _, step := range []struct {
		name    string
		pairing routerconfig.PairingMode
		pools   Pools
		ready   int
	}{
		{"no pools yet", "", Pools{}, http.StatusServiceUnavailable},
		{"decode only", "", Pools{Decode: d}, http.StatusServiceUnavailable},
		{"both", "", Pools{Prefill: p, Decode: d}, http.StatusOK},
		{"prefill gone", "", Pools{Decode: d}, http.StatusServiceUnavailable},
		{"two KV revisions, each with one pool", "", Pools{Revisions: []Revision{
			{Name: "a", Prefill: p}, {Name: "b", Decode: d},
		}}, http.StatusServiceUnavailable},
		{"one KV revision with both", "", Pools{Revisions: []Revision{
			{Name: "a", Prefill: p}, {Name: "b", Prefill: []Prefill{{URL: p2URL}}, Decode: d},
		}}, http.StatusOK},
		{"Required pairing, both pools in two racks", routerconfig.PairingRequired, Pools{Prefill: p, Decode: d, Domains: racks}, http.StatusServiceUnavailable},
		{"Required pairing, a rack with both", routerconfig.PairingRequired, Pools{Prefill: append(slices.Clone(p), Prefill{URL: p2URL}), Decode: d, Domains: racks}, http.StatusOK},
		{"Required pairing, a KV revision with both in two racks", routerconfig.PairingRequired, Pools{Domains: racks, Revisions: []Revision{
			{Name: "a", Prefill: p, Decode: d},
		}}, http.StatusServiceUnavailable},
	} {
		t.Run(step.name, func(t *testing.T) {
			r, base := routers[step.pairing].r, routers[step.pairing].url
			if err := r.SetPools(step.pools); err != nil {
				t.Fatal(err)
			}
			ready, why := get(base + "/ready")
			if ready != step.ready {
				t.Errorf("/ready = %d %s, want %d", ready, why, step.ready)
			}
			if code, _ := get(base + "/health"); code != http.StatusOK {
				t.Errorf("/health = %d, want 200 (liveness)", code)
			}
			// The proxy decides as /ready does: refused with the same reason when not ready.
			code, body := send(t, base, `{"prompt":"x"}`)
			if ready != http.StatusOK && (code != ready || body != why) {
				t.Errorf("a completion while /ready says %d %s: %d %s, want the same", ready, why, code, body)
			}
			if ready == http.StatusOK && code == http.StatusServiceUnavailable && !strings.Contains(body, "endpoint") {
				t.Errorf("a completion while /ready says 200: %d %s", code, body)
			}
		})
	}
}

// The router writes the legs' bodies itself: the same JSON as encoding/json, whatever the keys.
func TestEncodeBodyIsJSON(t *testing.T) {
	body := map[string]json.RawMessage{
		"prompt": json.RawMessage(`[1, 2, 3]`), "max_tokens": json.RawMessage(`1`), `quo"te`: json.RawMessage(`"x"`),
		"tab\tkey": json.RawMessage(`null`), "ünïcode": json.RawMessage(`{"a": [true]}`), `back\slash`: json.RawMessage(`2.5`),
	}
	want, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	var gotV, wantV any
	if err := json.Unmarshal(encodeBody(body), &gotV); err != nil {
		t.Fatalf("not JSON: %v: %s", err, encodeBody(body))
	}
	_ = json.Unmarshal(want, &wantV)
	if diff := cmp.Diff(wantV, gotV); diff != "" {
		t.Errorf("body (-encoding/json +router):\n%s", diff)
	}
}

// The router's latencies, per flow: the prefill leg that succeeded, the first byte to the
// client, the whole request; one observation each per request, in that order of size.
func TestLatencyHistograms(t *testing.T) {
	for _, flow := range []routerconfig.Flow{routerconfig.FlowMooncake, routerconfig.FlowNIXL} {
		t.Run(string(flow), func(t *testing.T) {
			p := &fakeEngine{reply: `{"kv_transfer_params":{"do_remote_prefill":true,"transfer_id":"t-1"}}`}
			slowPrefill := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(30 * time.Millisecond)
				p.ServeHTTP(w, r)
			})
			d := &fakeEngine{reply: `{"choices":[{"text":"ok"}]}`}
			metrics := prometheus.NewRegistry()
			srv := routerMetered(t, Config{Flow: flow}, slowPrefill, d, metrics)
			if code, body := send(t, srv.URL, `{"prompt":"hi","max_tokens":5}`); code != 200 {
				t.Fatalf("got %d %s", code, body)
			}
			// The Mooncake prefill leg may end after the answer: wait for its observation.
			got := map[string]*dto.Histogram{}
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				mfs, err := metrics.Gather()
				if err != nil {
					t.Fatal(err)
				}
				for _, mf := range mfs {
					if h := mf.GetMetric()[0].GetHistogram(); h != nil {
						if l := mf.GetMetric()[0].GetLabel(); len(l) != 1 || l[0].GetValue() != string(flow) {
							t.Fatalf("%s labels %v, want flow=%s", mf.GetName(), l, flow)
						}
						got[mf.GetName()] = h
					}
				}
				if h := got["pdcluster_router_prefill_leg_seconds"]; h.GetSampleCount() == 1 || time.Now().After(deadline) {
					break
				}
			}
			for _, name := range []string{"pdcluster_router_prefill_leg_seconds", "pdcluster_router_first_token_seconds", "pdcluster_router_request_duration_seconds"} {
				if h := got[name]; h.GetSampleCount() != 1 {
					t.Errorf("%s: %d observations, want 1", name, h.GetSampleCount())
				}
			}
			prefill, first, whole := got["pdcluster_router_prefill_leg_seconds"].GetSampleSum(),
				got["pdcluster_router_first_token_seconds"].GetSampleSum(), got["pdcluster_router_request_duration_seconds"].GetSampleSum()
			if prefill < 0.03 || first > whole {
				t.Errorf("prefill leg %.3fs (a 30 ms prefill), first byte %.3fs, whole request %.3fs", prefill, first, whole)
			}
			if flow == routerconfig.FlowNIXL && first < prefill {
				t.Errorf("NIXL's first byte (%.3fs) came before its prefill leg ended (%.3fs)", first, prefill)
			}
		})
	}
}

// A Mooncake prefill engine with several data-parallel ranks (one engine id each in its
// bootstrap registry) gets requests on every rank, each prefill leg pinned with
// X-data-parallel-rank to the rank whose engine id the decode leg names.
func TestMooncakeSpreadsOverDataParallelRanks(t *testing.T) {
	const ranks = 12 // past 10, where ranks sorted as strings and as numbers differ
	reg := bootstrap.NewRegistry()
	for dp := range ranks {
		if err := reg.Register(bootstrap.Registration{EngineID: fmt.Sprintf("engine-%d", dp), DPRank: dp, Addr: fmt.Sprintf("tcp://127.0.0.1:%d", dp+1)}); err != nil {
			t.Fatal(err)
		}
	}
	p, d := &fakeEngine{}, &fakeEngine{reply: `{"choices":[{"text":"ok"}]}`}
	boot, ps, ds := httptest.NewServer(reg.Handler()), httptest.NewServer(p), httptest.NewServer(d)
	t.Cleanup(func() { boot.Close(); ps.Close(); ds.Close() })
	r, err := New(Config{Flow: routerconfig.FlowMooncake}, logr.Discard(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.SetPools(Pools{Prefill: []Prefill{{URL: ps.URL, Bootstrap: boot.URL, DataParallel: ranks}}, Decode: []string{ds.URL}}); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(r.Handler(nil))
	t.Cleanup(srv.Close)
	const n = 30 * ranks
	for range n {
		if code, body := send(t, srv.URL, `{"prompt":"hi","max_tokens":4}`); code != http.StatusOK {
			t.Fatalf("got %d %s", code, body)
		}
	}
	// The prefill legs run beside the decode legs: wait for all of them.
	for range 200 {
		p.mu.Lock()
		got := len(p.got)
		p.mu.Unlock()
		if got == n {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	rankOf := map[string]string{} // transfer id -> the prefill leg's rank
	byRank := map[string]int{}
	for _, s := range p.got {
		kv, _ := s.body["kv_transfer_params"].(map[string]any)
		rank := s.headers.Get("X-data-parallel-rank")
		rankOf[fmt.Sprint(kv["transfer_id"])] = rank
		byRank[rank]++
	}
	for _, s := range d.got {
		kv, _ := s.body["kv_transfer_params"].(map[string]any)
		if rank, want := rankOf[fmt.Sprint(kv["transfer_id"])], kv["remote_engine_id"]; "engine-"+rank != want {
			t.Fatalf("decode pulls from %v, but its prefill leg was pinned to dp rank %q", want, rank)
		}
	}
	for dp := range ranks {
		// Uniform would give 30 each; fewer than 10 is one chance in millions.
		if got := byRank[fmt.Sprint(dp)]; got < 10 {
			t.Errorf("dp rank %d got %d of %d prefill legs (by rank %v), want its share", dp, got, n, byRank)
		}
	}
}

// A prefill pod's bootstrap registry takes any registration from anyone who reaches its port
// (vLLM's does), and vLLM does not check the KV it pulls. The router pins prefill legs, and
// names to decode, only ranks the pod runs whose workers are on the pod: a stranger's rank
// past the pod's, or within them at its own address, never gets a pull; the refusals are
// counted.
func TestPoisonedRegistryEntriesAreNeverUsed(t *testing.T) {
	reg := bootstrap.NewRegistry() // no limits, as vLLM's
	for _, r := range []bootstrap.Registration{
		{EngineID: "engine-0", DPRank: 0, Addr: "tcp://127.0.0.1:1"},
		{EngineID: "stranger-rank", DPRank: 7, Addr: "tcp://127.0.0.1:7"},            // a rank the pod does not run
		{EngineID: "stranger-addr", DPRank: 1, Addr: "tcp://10.9.9.9:1"},             // the pod's rank, another host
		{EngineID: "stranger-addr", DPRank: 1, TPRank: 1, Addr: "tcp://127.0.0.1:2"}, // one worker on the pod does not make it the pod's
	} {
		if err := reg.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	p, d := &fakeEngine{}, &fakeEngine{reply: `{"choices":[{"text":"ok"}]}`}
	boot, ps, ds := httptest.NewServer(reg.Handler()), httptest.NewServer(p), httptest.NewServer(d)
	t.Cleanup(func() { boot.Close(); ps.Close(); ds.Close() })
	metrics := prometheus.NewRegistry()
	r, err := New(Config{Flow: routerconfig.FlowMooncake}, logr.Discard(), metrics)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.SetPools(Pools{Prefill: []Prefill{{URL: ps.URL, Bootstrap: boot.URL, DataParallel: 2}}, Decode: []string{ds.URL}}); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(r.Handler(nil))
	t.Cleanup(srv.Close)
	for range 40 {
		if code, body := send(t, srv.URL, `{"prompt":"hi","max_tokens":4}`); code != http.StatusOK {
			t.Fatalf("got %d %s", code, body)
		}
	}
	d.mu.Lock()
	for _, s := range d.got {
		kv, _ := s.body["kv_transfer_params"].(map[string]any)
		if kv["remote_engine_id"] != "engine-0" {
			t.Errorf("decode was told to pull from %v, want engine-0, the pod's only own rank", kv["remote_engine_id"])
		}
	}
	d.mu.Unlock()
	p.wait(t)
	p.mu.Lock()
	for _, s := range p.got {
		if rank := s.headers.Get("X-data-parallel-rank"); rank != "0" {
			t.Errorf("a prefill leg was pinned to dp rank %q, want 0", rank)
		}
	}
	p.mu.Unlock()
	for _, reason := range []string{"rank", "address"} {
		if got := metricSum(t, metrics, "pdcluster_router_bootstrap_entries_refused_total", "reason", reason); got < 1 {
			t.Errorf("pdcluster_router_bootstrap_entries_refused_total{reason=%s} = %v, want it counted", reason, got)
		}
	}
}
