package router

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	clocktesting "k8s.io/utils/clock/testing"

	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// kvLedger is the KV a prefill engine made, by transfer: a decode engine, like vLLM's, answers
// only once its transfer's KV exists (Mooncake), or fails its load when it never comes.
type kvLedger struct {
	mu   sync.Mutex
	made map[string]string // transfer id -> prefill engine name
	wake chan struct{}
}

func newLedger() *kvLedger { return &kvLedger{made: map[string]string{}, wake: make(chan struct{})} }

func (k *kvLedger) make(transfer, engine string) {
	k.mu.Lock()
	k.made[transfer] = engine
	close(k.wake)
	k.wake = make(chan struct{})
	k.mu.Unlock()
}

// wait is the engine that made transfer's KV, or "" when it is not made within d or ctx ends.
func (k *kvLedger) wait(ctx context.Context, transfer string, d time.Duration) string {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		k.mu.Lock()
		e, wake := k.made[transfer], k.wake
		k.mu.Unlock()
		if e != "" {
			return e
		}
		select {
		case <-wake:
		case <-t.C:
			return ""
		case <-ctx.Done():
			return ""
		}
	}
}

// engineCall is one request an engine got.
type engineCall struct {
	params    map[string]any // kv_transfer_params
	cancelled bool           // the router cancelled it before it was answered
	path      string         // the URL's path: the router's probes are GET /health
}

// testEngine is one engine of a pool: its behaviour, and the requests it got.
type testEngine struct {
	name string
	// do answers a request; nil: the engine is not there (its address refuses connections).
	do    func(e *testEngine, w http.ResponseWriter, r *http.Request, params map[string]any)
	mu    sync.Mutex
	calls []engineCall
	url   string
	// bootstrapDown: its Mooncake bootstrap server refuses connections.
	bootstrapDown bool
	// host is the loopback address it listens on ("": 127.0.0.1): an engine's other ports
	// (its KV events) are on its host.
	host string
}

func (e *testEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body map[string]json.RawMessage
	_ = json.NewDecoder(r.Body).Decode(&body)
	var params map[string]any
	_ = json.Unmarshal(body["kv_transfer_params"], &params)
	e.mu.Lock()
	i := len(e.calls)
	e.calls = append(e.calls, engineCall{params: params, path: r.URL.Path})
	e.mu.Unlock()
	e.do(e, w, r, params)
	if r.Context().Err() != nil {
		e.mu.Lock()
		e.calls[i].cancelled = true
		e.mu.Unlock()
	}
}

func (e *testEngine) got() []engineCall {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]engineCall(nil), e.calls...)
}

// prefillOK makes the KV of each transfer (Mooncake), or names it in its answer (NIXL).
func prefillOK(kv *kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
	return func(e *testEngine, w http.ResponseWriter, _ *http.Request, params map[string]any) {
		transfer, _ := params["transfer_id"].(string)
		if transfer == "" {
			transfer = "nixl-" + e.name + fmt.Sprint(len(e.got()))
		}
		kv.make(transfer, e.name)
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"choices":[{"text":"x"}],"kv_transfer_params":{"transfer_id":%q,"remote_engine_id":%q}}`, transfer, e.name)
	}
}

// decodeOK answers once its KV exists, naming the prefill engine that made it; without the KV
// it fails its load, as vLLM's decode does with kv_load_failure_policy fail. A request without
// kv_transfer_params is computed here.
func decodeOK(kv *kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
	return func(e *testEngine, w http.ResponseWriter, r *http.Request, params map[string]any) {
		from := "local"
		if params != nil {
			transfer, _ := params["transfer_id"].(string)
			if from = kv.wait(r.Context(), transfer, 2*time.Second); from == "" {
				if r.Context().Err() == nil {
					http.Error(w, `{"error":{"message":"KV load from the prefill engine failed"}}`, http.StatusInternalServerError)
				}
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"choices":[{"text":"decoded by %s from %s"}]}`, e.name, from)
	}
}

func answer(status int) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
	return func(_ *testEngine, w http.ResponseWriter, _ *http.Request, _ map[string]any) {
		http.Error(w, `{"error":{"message":"engine says no"}}`, status)
	}
}

// resets closes the connection without an answer: the engine died mid-request.
func resets(_ *testEngine, w http.ResponseWriter, _ *http.Request, _ map[string]any) {
	c, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		_ = c.(*net.TCPConn).SetLinger(0)
		_ = c.Close()
	}
}

// hangs answers nothing until the router gives up on it (or, should the router never give up,
// until a test's own deadline has failed it: a server with a handler still running cannot
// close, and the package would hang).
func hangs(_ *testEngine, _ http.ResponseWriter, r *http.Request, _ map[string]any) {
	select {
	case <-r.Context().Done():
	case <-time.After(sendDeadline + 5*time.Second):
	}
}

// deadAddr is an address that refuses connections, and that nothing else takes meanwhile: a
// socket bound to a loopback port that does not listen. (A closed listener's port was taken by
// another test process once, and the "dead" engine answered 404.)
func deadAddr(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		_ = syscall.Close(fd)
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		_ = syscall.Close(fd)
		t.Fatal(err)
	}
	addr := "http://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
	deadSockets.Store(addr, fd)
	t.Cleanup(func() {
		if _, ok := deadSockets.LoadAndDelete(addr); ok { // revive took it otherwise
			_ = syscall.Close(fd)
		}
	})
	return addr
}

// deadSockets are deadAddr's sockets by URL, for revive.
var deadSockets sync.Map

type pdFixture struct {
	r       *Router
	url     string
	reg     *prometheus.Registry
	clock   *clocktesting.FakeClock
	prefill []*testEngine
	decode  []*testEngine
}

// newPD is a round-robin router (so the first attempt goes to engine 0 of each pool) over the
// given engines, each prefill engine with its own bootstrap server.
func newPD(t *testing.T, flow routerconfig.Flow, policy FailurePolicy, prefill, decode []*testEngine) *pdFixture {
	t.Helper()
	return newPDWith(t, Config{Flow: flow, Balance: routerconfig.BalanceRoundRobin, Failure: &policy}, prefill, decode)
}

// newPDWith is newPD with cfg.
func newPDWith(t *testing.T, cfg Config, prefill, decode []*testEngine) *pdFixture {
	t.Helper()
	serve := func(h http.Handler) string {
		s := httptest.NewServer(h)
		t.Cleanup(s.Close)
		return s.URL
	}
	serveEngine := func(e *testEngine) string {
		if e.host == "" {
			return serve(e)
		}
		l, err := net.Listen("tcp", net.JoinHostPort(e.host, "0"))
		if err != nil {
			t.Fatal(err)
		}
		s := httptest.NewUnstartedServer(e)
		s.Listener = l
		s.Start()
		t.Cleanup(s.Close)
		return s.URL
	}
	var pools Pools
	for _, e := range prefill {
		e.url = deadAddr(t)
		if e.do != nil {
			e.url = serveEngine(e)
		}
		boot := deadAddr(t)
		if !e.bootstrapDown {
			reg := bootstrap.NewRegistry()
			_ = reg.Register(bootstrap.Registration{EngineID: "engine-" + e.name, Addr: "tcp://127.0.0.1:1"})
			boot = serve(reg.Handler())
		}
		pools.Prefill = append(pools.Prefill, Prefill{URL: e.url, Bootstrap: boot})
	}
	for _, e := range decode {
		e.url = deadAddr(t)
		if e.do != nil {
			e.url = serveEngine(e)
		}
		pools.Decode = append(pools.Decode, e.url)
	}
	reg := prometheus.NewRegistry()
	r, err := New(cfg, logr.Discard(), reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close) // its probes end with the test (the fake clock never ends an ejection)
	clk := clocktesting.NewFakeClock(time.Now())
	r.eject.clock, r.budget.clock = clk, clk
	r.probeEvery = 20 * time.Millisecond
	if err := r.SetPools(pools); err != nil {
		t.Fatal(err)
	}
	return &pdFixture{r: r, url: serve(r.Handler(reg)), reg: reg, clock: clk, prefill: prefill, decode: decode}
}

// sendDeadline bounds a test request: a router that hangs fails the test that sent it, not
// the whole package at go test's timeout.
const sendDeadline = 60 * time.Second

func (f *pdFixture) send(t *testing.T, body string) (int, string) {
	t.Helper()
	client := &http.Client{Timeout: sendDeadline}
	resp, err := client.Post(f.url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("no answer from the router within %s: %v", sendDeadline, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (f *pdFixture) counter(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	return metricSum(t, f.reg, name, labels...)
}

// metricSum is the sum of reg's series of the metric name (a counter's or a gauge's value)
// that carry every label of labels (name, value pairs).
func metricSum(t *testing.T, reg prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					found = found || (l.GetName() == labels[i] && l.GetValue() == labels[i+1])
				}
				if !found {
					continue metric
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

// waitCalls waits until e got n requests (a Mooncake prefill leg ends after the answer).
func waitCalls(t *testing.T, e *testEngine, n int) []engineCall {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(e.got()) < n && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	return e.got()
}

// revive starts e, which was not there, at its address with do and a /health that answers: an
// engine restarted in place.
func revive(t *testing.T, e *testEngine, do func(*testEngine, http.ResponseWriter, *http.Request, map[string]any)) {
	t.Helper()
	fd, ok := deadSockets.LoadAndDelete(e.url)
	if !ok {
		t.Fatalf("%s is not a dead address", e.url)
	}
	f := os.NewFile(uintptr(fd.(int)), e.url)
	defer f.Close() // the listener has its own copy
	if err := syscall.Listen(fd.(int), 128); err != nil {
		t.Fatal(err)
	}
	l, err := net.FileListener(f)
	if err != nil {
		t.Fatal(err)
	}
	e.do = do
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.Handle("/", e)
	back := &httptest.Server{Listener: l, Config: &http.Server{Handler: mux}}
	back.Start()
	t.Cleanup(back.Close)
}

// servingEngines are engines named prefill and decode that serve their legs, the KV made by
// prefill and pulled by decode through kv.
func servingEngines(kv *kvLedger, prefill, decode []string) (p, d []*testEngine) {
	p, d = engines(prefill...), engines(decode...)
	for _, e := range p {
		e.do = prefillOK(kv)
	}
	for _, e := range d {
		e.do = decodeOK(kv)
	}
	return p, d
}

func engines(names ...string) []*testEngine {
	out := make([]*testEngine, len(names))
	for i, n := range names {
		out[i] = &testEngine{name: n}
	}
	return out
}

// Every failure that says the chosen endpoint is not there or not serving, seen before the
// first byte reached the client, is retried on another endpoint of that pool; the client gets
// the answer made from the second prefill's KV, and no decode request is sent twice with one
// transfer.
func TestRetriesBeforeTheFirstByte(t *testing.T) {
	cases := []struct {
		name string
		flow routerconfig.Flow
		// bad sets up engine 0 of the failing pool.
		badPrefill, badDecode func(kv *kvLedger, e *testEngine)
		cause                 string
		// wantPrefillCalls is what the healthy prefill engine gets; wantDecodeCalls what
		// decode engine 1 (the healthy one, or the only one) gets.
		wantFrom string
	}{
		{name: "mooncake prefill refuses", flow: routerconfig.FlowMooncake, badPrefill: func(_ *kvLedger, e *testEngine) { e.do = nil }, cause: "connect", wantFrom: "p1"},
		{name: "mooncake bootstrap down", flow: routerconfig.FlowMooncake, badPrefill: func(kv *kvLedger, e *testEngine) { e.do, e.bootstrapDown = prefillOK(kv), true }, cause: "bootstrap", wantFrom: "p1"},
		{name: "mooncake prefill 503", flow: routerconfig.FlowMooncake, badPrefill: func(_ *kvLedger, e *testEngine) { e.do = answer(503) }, cause: "unavailable", wantFrom: "p1"},
		{name: "mooncake prefill resets", flow: routerconfig.FlowMooncake, badPrefill: func(_ *kvLedger, e *testEngine) { e.do = resets }, cause: "reset", wantFrom: "p1"},
		{name: "mooncake decode refuses", flow: routerconfig.FlowMooncake, badDecode: func(_ *kvLedger, e *testEngine) { e.do = nil }, cause: "connect", wantFrom: "p0"},
		{name: "mooncake decode 503", flow: routerconfig.FlowMooncake, badDecode: func(_ *kvLedger, e *testEngine) { e.do = answer(503) }, cause: "unavailable"},
		{name: "nixl prefill refuses", flow: routerconfig.FlowNIXL, badPrefill: func(_ *kvLedger, e *testEngine) { e.do = nil }, cause: "connect", wantFrom: "p1"},
		{name: "nixl prefill 503", flow: routerconfig.FlowNIXL, badPrefill: func(_ *kvLedger, e *testEngine) { e.do = answer(503) }, cause: "unavailable", wantFrom: "p1"},
		{name: "nixl prefill resets", flow: routerconfig.FlowNIXL, badPrefill: func(_ *kvLedger, e *testEngine) { e.do = resets }, cause: "reset", wantFrom: "p1"},
		{name: "nixl decode refuses", flow: routerconfig.FlowNIXL, badDecode: func(_ *kvLedger, e *testEngine) { e.do = nil }, cause: "connect", wantFrom: "p0"},
		{name: "nixl decode resets", flow: routerconfig.FlowNIXL, badDecode: func(_ *kvLedger, e *testEngine) { e.do = resets }, cause: "reset"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			kv := newLedger()
			prefill, decode := servingEngines(kv, []string{"p0", "p1"}, []string{"d0", "d1"})
			leg := "decode"
			if tc.badPrefill != nil {
				tc.badPrefill(kv, prefill[0])
				leg = "prefill"
			} else {
				tc.badDecode(kv, decode[0])
			}
			f := newPD(t, tc.flow, DefaultFailurePolicy(), prefill, decode)
			code, body := f.send(t, `{"prompt":"hi","max_tokens":4}`)
			if code != http.StatusOK {
				t.Fatalf("got %d %s, want 200 from the retry", code, body)
			}
			if tc.wantFrom != "" && !strings.Contains(body, "from "+tc.wantFrom) {
				t.Errorf("answer %s, want decode's made from %s's KV", body, tc.wantFrom)
			}
			if got := f.counter(t, "pdcluster_router_retries_total", "leg", leg, "cause", tc.cause); got != 1 {
				t.Errorf("retries{leg=%s,cause=%s} = %v, want 1", leg, tc.cause, got)
			}
			// Nothing listening is out at once; one bad answer is not an outage (3 in a row are).
			wantEjected := map[bool]float64{true: 1, false: 0}[tc.cause == "connect" || tc.cause == "bootstrap"]
			if got := f.counter(t, "pdcluster_router_ejections_total", "pool", leg); got != wantEjected {
				t.Errorf("ejections{pool=%s} = %v, want %v", leg, got, wantEjected)
			}
			// One transfer, one decode request: a retry that reached decode again has a new one.
			transfers := map[string]int{}
			for _, e := range decode {
				for _, c := range e.got() {
					id := fmt.Sprint(c.params["transfer_id"])
					if transfers[id]++; transfers[id] > 1 {
						t.Errorf("decode got transfer %s twice", id)
					}
				}
			}
			if tc.cause == "connect" && tc.badDecode != nil {
				// Decode 0 never got the request: decode 1 takes the same transfer, and prefill
				// is not asked again.
				if n := len(waitCalls(t, prefill[0], 1)); n != 1 {
					t.Errorf("prefill got %d requests, want 1 (the same transfer goes to the other decode)", n)
				}
			}
		})
	}
}

// What is the engine's verdict on the request, not its absence, is not retried: a request
// that kills an engine must not be sent to the next one. Nor is prefill retried with
// onPrefillFailure: Fail.
func TestFailuresNotRetried(t *testing.T) {
	cases := []struct {
		name     string
		flow     routerconfig.Flow
		policy   routerconfig.OnPrefillFailure
		prefill0 func(kv *kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any)
		decode0  func(kv *kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any)
		want     int
	}{
		{"nixl prefill 500", routerconfig.FlowNIXL, routerconfig.PrefillFailureRetry, func(*kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
			return answer(500)
		}, decodeOK, 500},
		{"nixl prefill 400", routerconfig.FlowNIXL, routerconfig.PrefillFailureRetry, func(*kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
			return answer(400)
		}, decodeOK, 400},
		{"mooncake decode 500", routerconfig.FlowMooncake, routerconfig.PrefillFailureRetry, prefillOK, func(*kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
			return answer(500)
		}, 500},
		{"nixl decode 500", routerconfig.FlowNIXL, routerconfig.PrefillFailureRetry, prefillOK, func(*kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
			return answer(500)
		}, 500},
		{"prefill refuses, policy Fail", routerconfig.FlowNIXL, routerconfig.PrefillFailureFail, nil, decodeOK, 502},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			kv := newLedger()
			prefill, decode := engines("p0", "p1"), engines("d0", "d1")
			prefill[1].do, decode[1].do = prefillOK(kv), decodeOK(kv)
			if tc.prefill0 != nil {
				prefill[0].do = tc.prefill0(kv)
			}
			decode[0].do = tc.decode0(kv)
			policy := DefaultFailurePolicy()
			policy.OnPrefillFailure = tc.policy
			f := newPD(t, tc.flow, policy, prefill, decode)
			if code, body := f.send(t, `{"prompt":"hi"}`); code != tc.want {
				t.Errorf("got %d %s, want %d", code, body, tc.want)
			}
			if n := len(prefill[1].got()) + len(decode[1].got()); n != 0 {
				t.Errorf("the other endpoints got %d requests: the failure was retried", n)
			}
			if got := f.counter(t, "pdcluster_router_retries_total"); got != 0 {
				t.Errorf("retries = %v, want 0", got)
			}
		})
	}
}

// Once the client has seen a byte, nothing is retried: a stream that breaks stays broken.
func TestNeverRetriedAfterTheFirstByte(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("p0"), engines("d0", "d1")
	prefill[0].do = prefillOK(kv)
	decode[0].do = func(_ *testEngine, w http.ResponseWriter, _ *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"text\":\"first\"}]}\n\n")
		http.NewResponseController(w).Flush()
		resets(nil, w, nil, nil)
	}
	decode[1].do = decodeOK(kv)
	f := newPD(t, routerconfig.FlowNIXL, DefaultFailurePolicy(), prefill, decode)
	code, body := f.send(t, `{"prompt":"hi","stream":true}`)
	if code != http.StatusOK || !strings.Contains(body, "first") {
		t.Errorf("got %d %q, want the stream's first chunk", code, body)
	}
	if n := len(decode[1].got()); n != 0 {
		t.Errorf("the other decode got %d requests after the client saw a byte", n)
	}
}

// Under a full outage of a pool the retries stay within the router's budget: a sick pool's
// load is not multiplied by the retries.
func TestRetryBudgetCapsRetriesUnderAnOutage(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("p0", "p1", "p2"), engines("d0")
	for _, e := range prefill {
		e.do = answer(503)
	}
	decode[0].do = decodeOK(kv)
	policy := DefaultFailurePolicy()
	policy.Eject = time.Nanosecond // every endpoint stays a candidate: only the budget limits
	policy.RetryBudgetPercent = 20
	f := newPD(t, routerconfig.FlowNIXL, policy, prefill, decode)
	const n = 50
	for range n {
		f.clock.Step(time.Millisecond) // past the last ejections, within the budget's window
		if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusServiceUnavailable {
			t.Fatalf("got %d %s, want 503 (every prefill says so)", code, body)
		}
	}
	attempts := 0
	for _, e := range prefill {
		attempts += len(e.got())
	}
	retries := f.counter(t, "pdcluster_router_retries_total")
	if limit := float64(n * 20 / 100); retries > limit || retries == 0 {
		t.Errorf("retries = %v, want some and at most %v (20%% of %d requests)", retries, limit, n)
	}
	if float64(attempts) != n+retries {
		t.Errorf("prefill attempts = %d, want %d requests + %v retries", attempts, n, retries)
	}
	if f.counter(t, "pdcluster_router_retries_denied_total") == 0 {
		t.Error("no retry was denied by the budget")
	}
}

// An endpoint that answers 503 consecutiveFailures times in a row is left out for the ejection
// time, then tried again (and counted afresh); a pool whose last endpoint in fails too keeps it
// (its failures withheld from ejection) and answers 503 saying which are out, with Retry-After.
func TestEjectionAndReturn(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("p0", "p1"), engines("d0")
	prefill[0].do, prefill[1].do, decode[0].do = answer(503), prefillOK(kv), decodeOK(kv)
	policy := DefaultFailurePolicy()
	policy.Eject = time.Minute
	f := newPD(t, routerconfig.FlowNIXL, policy, prefill, decode)
	for range 10 {
		if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusOK {
			t.Fatalf("got %d %s", code, body)
		}
	}
	if n := len(prefill[0].got()); n != policy.ConsecutiveFailures {
		t.Errorf("the failing endpoint got %d requests, want %d (its failures in a row to ejection), then none while ejected", n, policy.ConsecutiveFailures)
	}
	f.clock.Step(61 * time.Second)
	for range 10 {
		f.send(t, `{"prompt":"hi"}`)
	}
	if n := len(prefill[0].got()); n != 2*policy.ConsecutiveFailures {
		t.Errorf("after its ejection the endpoint got %d requests in all, want %d (tried again, ejected again)", n, 2*policy.ConsecutiveFailures)
	}

	prefill[1].do = answer(503) // now both
	f.clock.Step(61 * time.Second)
	for range 2 * policy.ConsecutiveFailures {
		f.send(t, `{"prompt":"hi"}`)
	}
	if got := f.r.eject.count(); got != 1 {
		t.Errorf("ejected = %d with both failing, want 1: the pool's last endpoint in stays", got)
	}
	if got := f.counter(t, "pdcluster_router_ejections_withheld_total", "pool", "prefill"); got == 0 {
		t.Error("pdcluster_router_ejections_withheld_total{pool=prefill} = 0, want the withheld ejections counted")
	}
	f.clock.Step(11 * time.Second) // a fresh retry budget; p0 still out
	resp, err := http.Post(f.url+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(b), "ejected") || resp.Header.Get("Retry-After") == "" {
		t.Errorf("one prefill ejected, the other failing: got %d %s (Retry-After %q), want 503 saying so", resp.StatusCode, b, resp.Header.Get("Retry-After"))
	}
}

// The last endpoint of a pool is never ejected: a pool of one that failed serves again with its
// next good answer, instead of the router answering 503 for the whole ejection time.
func TestTheLastEndpointOfAPoolIsNeverEjected(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("p0"), engines("d0")
	prefill[0].do, decode[0].do = answer(503), decodeOK(kv)
	policy := DefaultFailurePolicy()
	policy.ConsecutiveFailures, policy.Eject = 1, time.Hour
	f := newPD(t, routerconfig.FlowNIXL, policy, prefill, decode)
	for range 3 {
		if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusServiceUnavailable {
			t.Fatalf("got %d %s, want the engine's 503", code, body)
		}
	}
	prefill[0].do = prefillOK(kv)
	if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusOK {
		t.Errorf("the pool's only engine answers again: got %d %s, want 200", code, body)
	}
	if got := f.counter(t, "pdcluster_router_ejections_total"); got != 0 {
		t.Errorf("ejections = %v, want 0", got)
	}
	if got := f.counter(t, "pdcluster_router_ejections_withheld_total", "pool", "prefill"); got != 3 {
		t.Errorf("ejections withheld = %v, want 3", got)
	}
}

// Failures eject only in a row: an endpoint that answers between its failures stays in, one
// that fails consecutiveFailures times in a row goes; a refused connection ejects at the first.
func TestOnlyFailuresInARowEject(t *testing.T) {
	for _, tc := range []struct {
		name        string
		do          func(*kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any)
		wantEjected bool
	}{
		{"503 every other answer", func(kv *kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
			ok := prefillOK(kv)
			return func(e *testEngine, w http.ResponseWriter, r *http.Request, p map[string]any) {
				if len(e.got())%2 == 1 {
					answer(503)(e, w, r, p)
					return
				}
				ok(e, w, r, p)
			}
		}, false},
		{"503 twice in a row", func(kv *kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
			ok := prefillOK(kv)
			return func(e *testEngine, w http.ResponseWriter, r *http.Request, p map[string]any) {
				if n := len(e.got()); n%3 != 0 {
					answer(503)(e, w, r, p)
					return
				}
				ok(e, w, r, p)
			}
		}, false},
		{"503 from the first", func(*kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
			return answer(503)
		}, true},
		{"resets from the first", func(*kvLedger) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) { return resets }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kv := newLedger()
			prefill, decode := engines("p0", "p1"), engines("d0")
			prefill[0].do, prefill[1].do, decode[0].do = tc.do(kv), prefillOK(kv), decodeOK(kv)
			policy := DefaultFailurePolicy()
			policy.RetryBudgetPercent = 100 // every failure retried: the client never sees one
			f := newPD(t, routerconfig.FlowNIXL, policy, prefill, decode)
			// The requests an ejected endpoint gets are its failures in a row alone: a reset
			// engine's /health answers, and a probe every 500 ms brought it back within a slow
			// run's 24 requests (under -race on a busy machine: 5 and 6 requests, not 3).
			f.r.probeEvery = time.Hour
			for range 24 {
				if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusOK {
					t.Fatalf("got %d %s", code, body)
				}
			}
			got := f.counter(t, "pdcluster_router_ejections_total", "pool", "prefill")
			if (got == 1) != tc.wantEjected || got > 1 {
				t.Errorf("ejections = %v, want ejected %v (once at most)", got, tc.wantEjected)
			}
			if n := len(prefill[0].got()); tc.wantEjected && n != 3 {
				t.Errorf("the endpoint got %d requests, want 3: its failures in a row, then it is out", n)
			}
		})
	}
	// A dead endpoint is out at its first refused connection.
	kv := newLedger()
	prefill, decode := engines("p0", "p1"), engines("d0")
	prefill[0].do, prefill[1].do, decode[0].do = nil, prefillOK(kv), decodeOK(kv)
	f := newPD(t, routerconfig.FlowNIXL, DefaultFailurePolicy(), prefill, decode)
	if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusOK {
		t.Fatalf("got %d %s", code, body)
	}
	if got := f.r.eject.count(); got != 1 {
		t.Errorf("ejected = %d after a refused connection, want 1", got)
	}
}

// The probes of an ejected endpoint end when it leaves the pools (its address may be the next
// pod's) and when the router closes: probes that outlived their routers asked whatever listened
// at the address next (this package's tests' engines got strangers' /health requests).
func TestProbesEndWithThePoolsAndTheRouter(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(*pdFixture)
	}{
		{"the endpoint leaves the pools", func(f *pdFixture) {
			p := *f.r.pools.Load()
			p.Prefill = p.Prefill[1:]
			if err := f.r.SetPools(p); err != nil {
				t.Fatal(err)
			}
		}},
		{"the router closes", func(f *pdFixture) { f.r.Close() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kv := newLedger()
			prefill, decode := engines("p0", "p1"), engines("d0")
			prefill[0].do, prefill[1].do, decode[0].do = resets, prefillOK(kv), decodeOK(kv)
			policy := DefaultFailurePolicy()
			policy.RetryBudgetPercent = 100
			f := newPD(t, routerconfig.FlowNIXL, policy, prefill, decode)
			for i := 0; f.r.eject.count() == 0; i++ {
				if i == 20 {
					t.Fatal("p0 resets every connection and was not ejected")
				}
				f.send(t, `{"prompt":"hi"}`)
			}
			probes := func() int {
				n := 0
				for _, c := range prefill[0].got() {
					if c.path == "/health" {
						n++
					}
				}
				return n
			}
			for deadline := time.Now().Add(20 * time.Second); probes() == 0; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the ejected endpoint was never probed")
				}
			}
			tc.end(f)
			time.Sleep(100 * time.Millisecond) // a probe already sent lands
			n := probes()
			time.Sleep(300 * time.Millisecond) // 15 of the fixture's probe periods
			if more := probes() - n; more > 0 {
				t.Errorf("the endpoint was probed %d more times after %s", more, tc.name)
			}
		})
	}
}

// An endpoint ejected for not being there comes back as soon as its health check answers (a
// restarted engine at the same address), without waiting out the ejection.
func TestEjectedEndpointReturnsWhenHealthy(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("p0", "p1"), engines("d0")
	prefill[0].do, prefill[1].do, decode[0].do = nil, prefillOK(kv), decodeOK(kv)
	policy := DefaultFailurePolicy()
	policy.Eject = time.Hour
	f := newPD(t, routerconfig.FlowNIXL, policy, prefill, decode)
	if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusOK {
		t.Fatalf("got %d %s", code, body)
	}
	if f.r.eject.count() != 1 {
		t.Fatalf("ejected = %d, want 1", f.r.eject.count())
	}
	// The engine comes back at its address.
	revive(t, prefill[0], prefillOK(kv))
	for deadline := time.Now().Add(5 * time.Second); f.r.eject.count() > 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if f.r.eject.count() != 0 {
		t.Fatal("the endpoint was not restored after its health check answered")
	}
	for range 2 {
		f.send(t, `{"prompt":"hi"}`)
	}
	if n := len(prefill[0].got()); n != 1 {
		t.Errorf("the restored endpoint got %d requests of 2, want its turn", n)
	}
}

// A pool of one engine serves again as soon as its engine does: a request that finds every
// endpoint ejected asks the ones that were not there whether they are back before answering 503.
func TestPoolOfOneServesAgainAsSoonAsItsEngine(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("p0"), engines("d0")
	prefill[0].do, decode[0].do = prefillOK(kv), nil
	policy := DefaultFailurePolicy()
	policy.Eject = time.Hour
	f := newPD(t, routerconfig.FlowNIXL, policy, prefill, decode)
	f.r.probeEvery = time.Hour // only a request's recheck can bring it back
	if code, _ := f.send(t, `{"prompt":"hi"}`); code == http.StatusOK {
		t.Fatal("served by a decode engine that is not there")
	}
	if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusServiceUnavailable || !strings.Contains(body, "ejected") {
		t.Fatalf("got %d %s, want 503: the only decode is ejected and still not there", code, body)
	}
	revive(t, decode[0], decodeOK(kv))
	if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusOK {
		t.Errorf("got %d %s once the engine was back, want 200", code, body)
	}
}

// A request with no first token within the hang budget fails with a clear error, and both of
// its legs are cancelled (vLLM aborts them, freeing their blocks).
func TestFirstTokenTimeoutCancelsBothLegs(t *testing.T) {
	prefill, decode := engines("p0"), engines("d0")
	prefill[0].do, decode[0].do = hangs, hangs
	policy := DefaultFailurePolicy()
	policy.FirstTokenTimeout = 200 * time.Millisecond
	f := newPD(t, routerconfig.FlowMooncake, policy, prefill, decode)
	code, body := f.send(t, `{"prompt":"hi"}`)
	if code != http.StatusGatewayTimeout || !strings.Contains(body, "firstTokenTimeoutSeconds") {
		t.Errorf("got %d %s, want 504 naming the hang budget", code, body)
	}
	for _, e := range []*testEngine{prefill[0], decode[0]} {
		calls := waitCalls(t, e, 1)
		deadline := time.Now().Add(5 * time.Second)
		for !calls[0].cancelled && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
			calls = e.got()
		}
		if !calls[0].cancelled {
			t.Errorf("%s's leg was not cancelled", e.name)
		}
	}
	if got := f.counter(t, "pdcluster_router_leg_failures_total", "cause", "first_token_timeout"); got != 1 {
		t.Errorf("leg_failures{cause=first_token_timeout} = %v, want 1", got)
	}
}

// A hang is a typed 504 naming the engine that hung (decode once its prefill answered, else
// prefill) and counts toward that engine's ejection: after consecutiveFailures hangs it takes
// no more requests, and every later one is served. Unset, firstTokenTimeoutSeconds bounds
// streaming requests only: one that does not stream gets its whole answer, however long.
func TestHangsAreTypedAndEjectTheEngine(t *testing.T) {
	type apiError struct {
		Error struct {
			Type, Leg, Engine string
			Code              int
		}
	}
	kv := newLedger()
	prefill, decode := engines("p0"), engines("d0", "d1")
	prefill[0].do, decode[0].do, decode[1].do = prefillOK(kv), hangs, decodeOK(kv)
	policy := DefaultFailurePolicy()
	policy.FirstTokenTimeout, policy.StreamFirstTokenTimeout, policy.ConsecutiveFailures = 0, 200*time.Millisecond, 2
	f := newPD(t, routerconfig.FlowMooncake, policy, prefill, decode)
	hung := 0
	for range 8 {
		code, body := f.send(t, `{"prompt":"hi","stream":true}`)
		if code == http.StatusOK {
			continue
		}
		hung++
		var e apiError
		if err := json.Unmarshal([]byte(body), &e); err != nil || code != http.StatusGatewayTimeout ||
			e.Error.Type != "first_token_timeout" || e.Error.Leg != "decode" || e.Error.Engine != decode[0].url || e.Error.Code != 504 {
			t.Errorf("a hung decode: got %d %s, want a 504 of type first_token_timeout naming decode %s", code, body, decode[0].url)
		}
	}
	if hung != policy.ConsecutiveFailures {
		t.Errorf("%d requests hung, want %d: then the hung engine is ejected", hung, policy.ConsecutiveFailures)
	}
	if got := f.counter(t, "pdcluster_router_ejections_total", "pool", "decode"); got != 1 {
		t.Errorf("ejections{pool=decode} = %v, want 1", got)
	}

	// A prefill that hangs is named as prefill's.
	prefill, decode = engines("p0"), engines("d0")
	prefill[0].do, decode[0].do = hangs, decodeOK(kv)
	f = newPD(t, routerconfig.FlowMooncake, policy, prefill, decode)
	code, body := f.send(t, `{"prompt":"hi","stream":true}`)
	var e apiError
	if err := json.Unmarshal([]byte(body), &e); err != nil || code != http.StatusGatewayTimeout || e.Error.Leg != "prefill" || e.Error.Engine != prefill[0].url {
		t.Errorf("a hung prefill: got %d %s, want a 504 naming prefill %s", code, body, prefill[0].url)
	}

	// The stream budget leaves a request that does not stream alone.
	prefill, decode = engines("p0"), engines("d0")
	slow := decodeOK(kv)
	prefill[0].do = prefillOK(kv)
	decode[0].do = func(e *testEngine, w http.ResponseWriter, r *http.Request, p map[string]any) {
		time.Sleep(500 * time.Millisecond) // past the stream budget
		slow(e, w, r, p)
	}
	f = newPD(t, routerconfig.FlowMooncake, policy, prefill, decode)
	if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusOK {
		t.Errorf("a request that does not stream, answered in 500 ms: got %d %s, want its answer", code, body)
	}
	if code, _ := f.send(t, `{"prompt":"hi","stream":true}`); code != http.StatusGatewayTimeout {
		t.Errorf("a stream whose first byte comes in 500 ms: got %d, want 504 past the 200 ms budget", code)
	}
}

// When the decode leg fails while Mooncake's prefill leg still runs, the prefill leg is
// cancelled (or never sent): a decode that never got the request will not pull its blocks.
func TestFailedDecodeCancelsPrefill(t *testing.T) {
	prefill, decode := engines("p0"), engines("d0")
	prefill[0].do, decode[0].do = hangs, nil
	f := newPD(t, routerconfig.FlowMooncake, DefaultFailurePolicy(), prefill, decode)
	if code, body := f.send(t, `{"prompt":"hi"}`); code < 500 {
		t.Errorf("got %d %s, want a failure", code, body)
	}
	running := func() int {
		n := 0
		for _, c := range prefill[0].got() {
			if !c.cancelled {
				n++
			}
		}
		return n
	}
	// A prefill request still on its way when the leg was cancelled shows up cancelled too.
	start := time.Now()
	for (running() > 0 || time.Since(start) < 100*time.Millisecond) && time.Since(start) < 5*time.Second {
		time.Sleep(5 * time.Millisecond)
	}
	if n := running(); n > 0 {
		t.Errorf("%d prefill legs left running for a decode that never got the request", n)
	}
}

// onPrefillFailure: DecodeOnly sends a request whose prefill cannot be served to decode alone,
// without kv_transfer_params, and counts it.
func TestDecodeOnlyWhenPrefillCannotServe(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("p0"), engines("d0")
	prefill[0].do, decode[0].do = nil, decodeOK(kv)
	policy := DefaultFailurePolicy()
	policy.OnPrefillFailure = routerconfig.PrefillFailureDecodeOnly
	f := newPD(t, routerconfig.FlowNIXL, policy, prefill, decode)
	code, body := f.send(t, `{"prompt":"hi"}`)
	if code != http.StatusOK || !strings.Contains(body, "from local") {
		t.Fatalf("got %d %s, want decode's own answer", code, body)
	}
	if calls := decode[0].got(); len(calls) != 1 || calls[0].params != nil {
		t.Errorf("decode got %+v, want one request without kv_transfer_params", calls)
	}
	if got := f.counter(t, "pdcluster_router_decode_only_total"); got != 1 {
		t.Errorf("decode_only = %v, want 1", got)
	}
}

// Mooncake's only prefill engine dies (reset, refused) while decode waits for its KV: vLLM's
// decode does not fail that pull, it waits for the KV until its own abort timeout (minutes: a
// real vLLM 0.30.0 decode answered nothing in 2 minutes, test/realengine). The router cancels
// decode and answers at once, as when a pool has no endpoint left (Retry: 503 saying so; Fail:
// prefill's failure), or, with onPrefillFailure DecodeOnly, has decode compute the prompt
// alone. Before, it waited for decode's answer.
func TestMooncakeOnlyPrefillGoneDoesNotWaitForDecode(t *testing.T) {
	cases := []struct {
		name     string
		prefill  func(*testEngine, http.ResponseWriter, *http.Request, map[string]any)
		policy   routerconfig.OnPrefillFailure
		want     int
		wantBody string
	}{
		{"reset, Retry", resets, routerconfig.PrefillFailureRetry, http.StatusServiceUnavailable, "no prefill endpoint left"},
		{"refused, Retry", nil, routerconfig.PrefillFailureRetry, http.StatusServiceUnavailable, "no prefill endpoint left"},
		{"503, Retry", answer(503), routerconfig.PrefillFailureRetry, http.StatusServiceUnavailable, "no prefill endpoint left"},
		{"reset, Fail", resets, routerconfig.PrefillFailureFail, http.StatusBadGateway, "prefill leg"},
		{"reset, DecodeOnly", resets, routerconfig.PrefillFailureDecodeOnly, http.StatusOK, "from local"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			kv := newLedger()
			prefill, decode := engines("p0"), engines("d0")
			prefill[0].do = tc.prefill
			waited := make(chan struct{}, 4)
			decode[0].do = func(e *testEngine, w http.ResponseWriter, r *http.Request, params map[string]any) {
				if params == nil {
					decodeOK(kv)(e, w, r, params) // decode alone
					return
				}
				// vLLM's decode waiting for KV that never comes: until the router gives up.
				select {
				case <-r.Context().Done():
					waited <- struct{}{}
				case <-time.After(20 * time.Second):
					http.Error(w, `{"error":{"message":"KV load from the prefill engine timed out"}}`, http.StatusInternalServerError)
				}
			}
			policy := DefaultFailurePolicy()
			policy.OnPrefillFailure = tc.policy
			f := newPD(t, routerconfig.FlowMooncake, policy, prefill, decode)
			code, body := f.send(t, `{"prompt":"hi","max_tokens":4}`)
			if code != tc.want || !strings.Contains(body, tc.wantBody) {
				t.Fatalf("got %d %s, want %d naming %q", code, body, tc.want, tc.wantBody)
			}
			// Decode's leg, if it got there before prefill failed, was cancelled.
			select {
			case <-waited:
			case <-time.After(5 * time.Second):
				if n := len(decode[0].got()); n != 0 && tc.want != http.StatusOK {
					t.Errorf("decode's waiting leg was not cancelled (%d requests)", n)
				}
			}
		})
	}
}

// pdcluster_router_endpoints says how many engines of each pool the router knows, so that an
// operator (and the real-node test) can tell when a new pod has reached it.
func TestEndpointsMetricFollowsThePools(t *testing.T) {
	kv := newLedger()
	prefill, decode := engines("p0", "p1"), engines("d0")
	prefill[0].do, prefill[1].do, decode[0].do = prefillOK(kv), prefillOK(kv), decodeOK(kv)
	f := newPD(t, routerconfig.FlowNIXL, DefaultFailurePolicy(), prefill, decode)
	if p, d := f.counter(t, "pdcluster_router_endpoints", "pool", "prefill"), f.counter(t, "pdcluster_router_endpoints", "pool", "decode"); p != 2 || d != 1 {
		t.Errorf("endpoints = %v prefill, %v decode; want 2 and 1", p, d)
	}
	if err := f.r.SetPools(Pools{Prefill: []Prefill{{URL: prefill[0].url}}, Decode: []string{decode[0].url}}); err != nil {
		t.Fatal(err)
	}
	if p := f.counter(t, "pdcluster_router_endpoints", "pool", "prefill"); p != 1 {
		t.Errorf("endpoints after a resolution with one prefill = %v, want 1", p)
	}
}

// pdcluster_router_in_flight_requests counts, per pool, the legs on its engines now: NIXL's
// prefill legs until prefill answers, then the decode legs until the answer ends; failed legs
// leave nothing counted. It is the per-pool signal a scaler reads.
func TestInFlightMetricPerPool(t *testing.T) {
	gated := func(gate chan struct{}, then func(*testEngine, http.ResponseWriter, *http.Request, map[string]any)) func(*testEngine, http.ResponseWriter, *http.Request, map[string]any) {
		return func(e *testEngine, w http.ResponseWriter, r *http.Request, params map[string]any) {
			select {
			case <-gate:
			case <-r.Context().Done():
				return
			}
			then(e, w, r, params)
		}
	}
	inFlight := func(t *testing.T, f *pdFixture) [2]float64 {
		return [2]float64{f.counter(t, "pdcluster_router_in_flight_requests", "pool", "prefill"), f.counter(t, "pdcluster_router_in_flight_requests", "pool", "decode")}
	}
	waitFor := func(t *testing.T, f *pdFixture, want [2]float64) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for inFlight(t, f) != want && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if got := inFlight(t, f); got != want {
			t.Fatalf("in flight [prefill decode] = %v, want %v", got, want)
		}
	}
	const n = 3
	sendAll := func(f *pdFixture) chan int {
		codes := make(chan int, n)
		for range n {
			go func() {
				resp, err := http.Post(f.url+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi"}`))
				if err != nil {
					codes <- 0
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				codes <- resp.StatusCode
			}()
		}
		return codes
	}
	expectOK := func(t *testing.T, codes chan int) {
		t.Helper()
		for range n {
			if code := <-codes; code != http.StatusOK {
				t.Errorf("a request got %d, want 200", code)
			}
		}
	}

	t.Run("nixl: prefill legs, then decode legs", func(t *testing.T) {
		kv := newLedger()
		prefillGate, decodeGate := make(chan struct{}), make(chan struct{})
		prefill, decode := engines("p0", "p1"), engines("d0")
		prefill[0].do, prefill[1].do = gated(prefillGate, prefillOK(kv)), gated(prefillGate, prefillOK(kv))
		decode[0].do = gated(decodeGate, decodeOK(kv))
		f := newPD(t, routerconfig.FlowNIXL, DefaultFailurePolicy(), prefill, decode)
		waitFor(t, f, [2]float64{0, 0})
		codes := sendAll(f)
		waitFor(t, f, [2]float64{n, 0})
		close(prefillGate)
		waitFor(t, f, [2]float64{0, n})
		close(decodeGate)
		expectOK(t, codes)
		waitFor(t, f, [2]float64{0, 0})
	})

	t.Run("mooncake: both legs at once", func(t *testing.T) {
		kv := newLedger()
		gate := make(chan struct{})
		prefill, decode := engines("p0"), engines("d0")
		prefill[0].do, decode[0].do = gated(gate, prefillOK(kv)), decodeOK(kv)
		f := newPD(t, routerconfig.FlowMooncake, DefaultFailurePolicy(), prefill, decode)
		codes := sendAll(f)
		waitFor(t, f, [2]float64{n, n})
		close(gate)
		expectOK(t, codes)
		waitFor(t, f, [2]float64{0, 0})
	})

	t.Run("failed legs leave nothing counted", func(t *testing.T) {
		// p0 is not there (retried on p1); d0 is not there either, after p1's leg: the
		// request fails with both a prefill and a decode leg sent.
		kv := newLedger()
		prefill, decode := engines("p0", "p1"), engines("d0")
		prefill[1].do = prefillOK(kv)
		f := newPD(t, routerconfig.FlowNIXL, DefaultFailurePolicy(), prefill, decode)
		for range 4 {
			if code, body := f.send(t, `{"prompt":"hi"}`); code < 400 {
				t.Fatalf("got %d %s, want a failure", code, body)
			}
		}
		waitFor(t, f, [2]float64{0, 0})
	})
}

// A request never goes back to an endpoint that failed it, even when its ejection has already
// ended: with both prefill engines answering 503 and retries to spare, each gets one leg of a
// request, which then fails saying no prefill is left to try. Only the request's own list of
// the endpoints it tried says so: ejection alone, once over, would send the retries round
// the pool again until the retries ran out.
func TestARetryNeverGoesBackToAnEndpointThisRequestTried(t *testing.T) {
	policy := DefaultFailurePolicy()
	policy.Eject = time.Nanosecond
	policy.Retries = 5
	policy.RetryBudgetPercent = 100
	for i := range 5 { // both orders of the round robin, and more
		kv := newLedger()
		prefill, decode := engines("p0", "p1"), engines("d0")
		prefill[0].do, prefill[1].do, decode[0].do = answer(503), answer(503), decodeOK(kv)
		f := newPD(t, routerconfig.FlowNIXL, policy, prefill, decode)
		// Every reading of the ejector's clock is a millisecond later: an ejection is over by
		// the time the retry picks.
		f.r.eject.clock = &tickingClock{now: f.clock.Now()}
		for range i {
			f.r.prefill.turn.Add(1)
		}
		if code, body := f.send(t, `{"prompt":"hi"}`); code != http.StatusServiceUnavailable || !strings.Contains(body, "no prefill endpoint left to try") {
			t.Errorf("request %d: %d %s, want 503: no prefill endpoint left to try", i, code, body)
		}
		for _, e := range prefill {
			if got := len(e.got()); got != 1 {
				t.Errorf("request %d: %s got %d prefill legs, want one", i, e.name, got)
			}
		}
	}
}

// tickingClock moves a millisecond on at every reading.
type tickingClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *tickingClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(time.Millisecond)
	return c.now
}

func (c *tickingClock) Since(t time.Time) time.Duration { return c.Now().Sub(t) }
