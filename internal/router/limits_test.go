package router

import (
	"bufio"
	"encoding/base32"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// A client's own requests must tell it nothing about the next transfer's id (a pull naming it
// would take another client's KV): every id is 128 random bits, none shares a prefix.
func TestIDsAreUnguessable(t *testing.T) {
	p, d := &fakeEngine{}, &fakeEngine{reply: `{}`}
	srv := newRouter(t, routerconfig.FlowMooncake, p, d)
	const n = 64
	for range n {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/completions", strings.NewReader(`{"prompt":"x"}`))
		resp, err := http.DefaultClient.Do(req) // no X-Request-Id: the router makes one
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	// The prefill leg runs beside decode's: the last one may still be on its way.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		p.mu.Lock()
		got := len(p.got)
		p.mu.Unlock()
		if got >= n {
			break
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.got) != n {
		t.Fatalf("prefill got %d requests, want %d", len(p.got), n)
	}
	for _, kind := range []struct {
		name string
		id   func(seen) string
	}{
		{"transfer id", func(s seen) string {
			id, _ := s.body["kv_transfer_params"].(map[string]any)["transfer_id"].(string)
			return strings.TrimPrefix(id, "xfer-")
		}},
		{"request id", func(s seen) string { return s.headers.Get("X-Request-Id") }},
	} {
		prefixes := map[string]string{}
		for _, s := range p.got {
			id := kind.id(s)
			raw, err := base32.StdEncoding.WithPadding(base32.NoPadding).DecodeString(id)
			if err != nil || len(raw) < 16 {
				t.Fatalf("%s %q: want at least 128 bits in base32 (%v)", kind.name, id, err)
			}
			// 40 random bits: a collision among 64 ids is a chance of 2^-28.
			if other, ok := prefixes[id[:8]]; ok {
				t.Fatalf("%ss %q and %q share a prefix: the next one can be guessed", kind.name, other, id)
			}
			prefixes[id[:8]] = id
		}
	}
}

// A body key that folds to kv_transfer_params is refused like the key itself: an engine whose
// JSON decoder folds keys (Go's does) would take it as the router's transfer parameters.
func TestRefusesClientTransferParams(t *testing.T) {
	srv := newRouter(t, routerconfig.FlowMooncake, &fakeEngine{}, &fakeEngine{reply: `{}`})
	for _, key := range []string{
		"kv_transfer_params", "KV_Transfer_Params", "kv_tranſfer_params", `kv_tran\u017ffer_params`,
		"\u212av_transfer_params", `kv_transfer\u005fparams`,
	} {
		body := fmt.Sprintf(`{"prompt":"x","%s":{"remote_engine_id":"victim"}}`, key)
		if code, got := send(t, srv.URL, body); code != http.StatusBadRequest || !strings.Contains(got, "set by the router") {
			t.Errorf("key %q: got %d %s, want 400", key, code, got)
		}
	}
	if code, got := send(t, srv.URL, `{"prompt":"x","kv_transfer":1}`); code != http.StatusOK {
		t.Errorf("an unrelated key: got %d %s", code, got)
	}
}

// The client's X-Request-Id reaches both engines, so it is bounded: short, printable ASCII.
func TestRequestIDHeaderIsBounded(t *testing.T) {
	p, d := &fakeEngine{}, &fakeEngine{reply: `{}`}
	srv := newRouter(t, routerconfig.FlowMooncake, p, d)
	for _, tc := range []struct {
		id   string
		want int
	}{
		{"req-1_a.b:c", http.StatusOK},
		{strings.Repeat("a", maxRequestIDBytes), http.StatusOK},
		{strings.Repeat("a", maxRequestIDBytes+1), http.StatusBadRequest},
		{"req 1", http.StatusBadRequest},
		{"réq", http.StatusBadRequest},
		{"req\t1", http.StatusBadRequest},
	} {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/completions", strings.NewReader(`{"prompt":"x"}`))
		req.Header.Set("X-Request-Id", tc.id)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.want || (tc.want != http.StatusOK && !strings.Contains(string(b), "X-Request-Id")) {
			t.Errorf("X-Request-Id %q: got %d %s, want %d", tc.id, resp.StatusCode, b, tc.want)
		}
	}
}

func TestBodyLimit(t *testing.T) {
	d := &fakeEngine{reply: `{}`}
	srv := routerWith(t, Config{Flow: routerconfig.FlowMooncake, MaxBodyBytes: 1024}, &fakeEngine{}, d)
	prompt := func(n int) string { return fmt.Sprintf(`{"prompt":%q}`, strings.Repeat("a", n)) }
	if code, got := send(t, srv.URL, prompt(1000)); code != http.StatusOK {
		t.Fatalf("a body under the limit: %d %s", code, got)
	}
	if code, got := send(t, srv.URL, prompt(1024)); code != http.StatusRequestEntityTooLarge || !strings.Contains(got, "1024 bytes") {
		t.Errorf("a body over the limit: got %d %s, want 413 naming the limit", code, got)
	}
}

// The bytes of bodies in flight are bounded over all requests: past the budget a body is
// refused with 503 and Retry-After (and counted), and the budget is whole again once the
// requests holding it have ended; bodies that state no length (chunked) alike, charged as they
// are read (issue 56: the third large chunked body was taken where a sized one got 503). A
// budget that cannot hold one body of the largest size is a configuration error.
func TestBodyBudget(t *testing.T) {
	const maxBody = 1 << 20
	cfg := Config{Flow: routerconfig.FlowMooncake, MaxBodyBytes: maxBody, MaxBodyBytesInFlight: 2 * bodyCopies * maxBody}
	big := fmt.Sprintf(`{"prompt":%q}`, strings.Repeat("a", 900<<10))
	for _, chunked := range []bool{false, true} {
		t.Run(map[bool]string{false: "sized", true: "chunked"}[chunked], func(t *testing.T) {
			slow, entered, release := heldEngine(func(body int64) bool { return body > 1<<10 }) // the large bodies wait
			defer release()                                                                     // before the servers close: they wait for their handlers
			reg := prometheus.NewRegistry()
			srv := routerMetered(t, cfg, &fakeEngine{}, slow, reg)
			// post sends body, chunked or with its length, and is answered within 5 s: a body
			// taken past the budget would wait with the held ones.
			post := func(body string) (int, string, http.Header, error) {
				var r io.Reader = strings.NewReader(body)
				if chunked {
					r = struct{ io.Reader }{r} // no length known: chunked
				}
				req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/completions", r)
				resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
				if err != nil {
					return 0, "", nil, err
				}
				defer resp.Body.Close()
				got, _ := io.ReadAll(resp.Body)
				if chunked && req.ContentLength > 0 {
					t.Fatalf("the request states its length %d, want chunked", req.ContentLength)
				}
				return resp.StatusCode, string(got), resp.Header, nil
			}
			held := make(chan int, 2)
			for range 2 {
				go func() {
					code, _, _, _ := post(big)
					held <- code
				}()
				<-entered
			}
			if got, want := metricSum(t, reg, "pdcluster_router_body_bytes_in_flight"), float64(2*bodyCopies*len(big)); got != want {
				t.Errorf("two large bodies held: pdcluster_router_body_bytes_in_flight = %v, want %v", got, want)
			}
			code, got, h, err := post(big)
			if err != nil || code != http.StatusServiceUnavailable || !strings.Contains(got, "request bodies") || h.Get("Retry-After") == "" {
				t.Errorf("a third large body with two held: got %d %s (Retry-After %q, error %v), want 503 naming the budget at once", code, got, h.Get("Retry-After"), err)
			}
			if code, got, _, err := post(`{"prompt":"x"}`); code != http.StatusOK {
				t.Errorf("a small body beside them: got %d %s (%v), want it taken", code, got, err)
			}
			release()
			for range 2 {
				if code := <-held; code != http.StatusOK {
					t.Errorf("a held request: %d", code)
				}
			}
			if code, got, _, err := post(big); code != http.StatusOK {
				t.Errorf("a large body once the others ended: %d %s (%v)", code, got, err)
			}
			if got := metricSum(t, reg, "pdcluster_router_body_budget_refused_total"); got != 1 {
				t.Errorf("pdcluster_router_body_budget_refused_total = %v, want 1", got)
			}
			if got := metricSum(t, reg, "pdcluster_router_body_bytes_in_flight"); got != 0 {
				t.Errorf("pdcluster_router_body_bytes_in_flight = %v after every request ended, want 0", got)
			}
		})
	}
	if _, err := New(Config{Flow: routerconfig.FlowMooncake, MaxBodyBytes: maxBody, MaxBodyBytesInFlight: maxBody}, logr.Discard(), nil); err == nil {
		t.Error("New took a body budget smaller than one body of the largest size")
	}
}

// heldEngine answers {} to each request, holding those whose body size held says until
// release; entered gets a value as each held one arrives. Call release before the test's
// servers close (defer it): they wait for their handlers.
func heldEngine(held func(body int64) bool) (h http.Handler, entered chan struct{}, release func()) {
	gate := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(gate) }) }
	entered = make(chan struct{}, 4)
	h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n, _ := io.Copy(io.Discard, r.Body); held(n) {
			entered <- struct{}{}
			<-gate
		}
		_, _ = io.WriteString(w, `{}`)
	})
	return h, entered, release
}

// Past MaxInFlight requests the router answers 503 at once instead of queueing without bound.
func TestInFlightLimit(t *testing.T) {
	slow, entered, release := heldEngine(func(int64) bool { return true })
	defer release() // before the servers close: they wait for their handlers
	srv := routerWith(t, Config{Flow: routerconfig.FlowMooncake, MaxInFlight: 1}, &fakeEngine{}, slow)
	first := make(chan int, 1)
	go func() {
		code, _ := send(t, srv.URL, `{"prompt":"x"}`)
		first <- code
	}()
	<-entered
	code, got := send(t, srv.URL, `{"prompt":"x"}`)
	if code != http.StatusServiceUnavailable || !strings.Contains(got, "in flight") {
		t.Errorf("a request past the limit: got %d %s, want 503", code, got)
	}
	release()
	if code := <-first; code != http.StatusOK {
		t.Errorf("the request in flight: %d", code)
	}
	if code, got := send(t, srv.URL, `{"prompt":"x"}`); code != http.StatusOK {
		t.Errorf("after the first ended: %d %s", code, got)
	}
}

// Decode's kv_transfer_params names engines, addresses and blocks: never the client's to see.
func TestDecodeTransferParamsNotReturned(t *testing.T) {
	for _, tc := range []struct{ reply, want string }{
		{`{"id":"c","kv_transfer_params":{"remote_host":"10.0.0.7","remote_block_ids":[1]},"choices":[]}`, `{"choices":[],"id":"c"}`},
		{`{"id":"c","kv_transfer_params":null}`, `{"id":"c","kv_transfer_params":null}`},
		{`{"id":"c"}`, `{"id":"c"}`},
	} {
		srv := newRouter(t, routerconfig.FlowMooncake, &fakeEngine{}, &fakeEngine{reply: tc.reply})
		if code, got := send(t, srv.URL, `{"prompt":"x"}`); code != http.StatusOK || got != tc.want {
			t.Errorf("decode answered %s: client got %d %s, want %s", tc.reply, code, got, tc.want)
		}
	}
}

// An engine's redirect is not followed: the router's requests go to the pools' engines only.
func TestUpstreamRedirectsAreNotFollowed(t *testing.T) {
	var trapped atomic.Int32
	trap := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { trapped.Add(1) }))
	defer trap.Close()
	redirect := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, trap.URL+"/steal", http.StatusTemporaryRedirect)
	})
	srv := routerWith(t, Config{Flow: routerconfig.FlowMooncake}, &fakeEngine{}, redirect)
	code, got := send(t, srv.URL, `{"prompt":"x"}`)
	if code != http.StatusBadGateway || !strings.Contains(got, "redirect") {
		t.Errorf("decode redirected: got %d %s, want 502", code, got)
	}
	if c := trapped.Load(); c != 0 {
		t.Errorf("the redirect's target got %d requests", c)
	}
}

// An engine that never answers is cut after UpstreamHeaderTimeout, not held forever.
func TestUpstreamHeaderTimeout(t *testing.T) {
	stop := make(chan struct{})
	hang := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-stop })
	defer close(stop) // before the engine's server closes: deferred calls run before cleanups
	srv := routerWith(t, Config{Flow: routerconfig.FlowMooncake, UpstreamHeaderTimeout: 100 * time.Millisecond}, &fakeEngine{}, hang)
	code, got := send(t, srv.URL, `{"prompt":"x"}`)
	if code != http.StatusBadGateway || !strings.Contains(got, "timeout") {
		t.Errorf("decode hung: got %d %s, want 502", code, got)
	}
}

// Slow bodies and idle keep-alive connections are cut by the server's timeouts.
func TestServerCutsSlowAndIdleConnections(t *testing.T) {
	srv := NewServer("", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
	}), ServerLimits{ReadHeader: time.Second, Read: 200 * time.Millisecond, Idle: 200 * time.Millisecond})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()
	closedWithin := func(c net.Conn, d time.Duration) bool {
		_ = c.SetReadDeadline(time.Now().Add(d))
		_, err := io.Copy(io.Discard, c)
		return err == nil // EOF: the server closed it; a timeout: still open
	}
	t.Run("slow body", func(t *testing.T) {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: r\r\nContent-Length: 100\r\n\r\nonly ten b")
		if !closedWithin(c, 3*time.Second) {
			t.Error("a body that never completes kept its connection")
		}
	})
	t.Run("idle keep-alive", func(t *testing.T) {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("first request: %v %v", resp, err)
		}
		if !closedWithin(c, 3*time.Second) {
			t.Error("an idle keep-alive connection was kept")
		}
	})
	if srv.MaxHeaderBytes == 0 || srv.MaxHeaderBytes > 1<<20 {
		t.Errorf("MaxHeaderBytes = %d: want a bound below net/http's 1 MiB default", srv.MaxHeaderBytes)
	}
}
