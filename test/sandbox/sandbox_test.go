// Package sandbox_test runs the whole request path on loopback: the sandbox with the real
// engine simulators (their KV transfer in-process), connector sidecars and router, built from
// this tree.
package sandbox_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
)

var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "pdcluster-sandbox-bin-")
	if err != nil {
		panic(err)
	}
	build := exec.Command("go", "build", "-o", dir, "./test/sim/cmd/sandbox", "./cmd/connector", "./test/sim/cmd/enginesim", "./cmd/router", "./test/sim/cmd/plainproxy")
	build.Dir = filepath.Join("..", "..")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build binaries:", err)
		os.Exit(1)
	}
	binDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

type box struct {
	t     testing.TB
	dir   string
	state sandbox.State
}

func freeAddr(t testing.TB) string {
	t.Helper()
	ports, err := sandbox.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", ports[0])
}

// start runs the sandbox with args and waits for it to report ready.
func start(t testing.TB, args ...string) *box {
	t.Helper()
	dir := t.TempDir()
	all := append([]string{"--listen", freeAddr(t), "--work-dir", dir, "--bin-dir", binDir}, args...)
	cmd := exec.Command(filepath.Join(binDir, "sandbox"), all...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		if t.Failed() {
			for _, f := range []string{"decode-0-engine", "decode-0-sidecar", "prefill-0-engine", "prefill-0-sidecar"} {
				b, _ := os.ReadFile(filepath.Join(dir, f+".log"))
				t.Logf("%s.log (tail):\n%s", f, tail(string(b), 3000))
			}
		}
	})
	ready := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "sandbox ready") {
				ready <- nil
				_, _ = io.Copy(io.Discard, out)
				return
			}
		}
		ready <- fmt.Errorf("sandbox exited before ready: %s", stderr.String())
	}()
	select {
	case err := <-ready:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(90 * time.Second):
		t.Fatalf("sandbox not ready: %s", stderr.String())
	}
	b := &box{t: t, dir: dir}
	b.reload()
	return b
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func (b *box) reload() {
	b.t.Helper()
	raw, err := os.ReadFile(sandbox.StateFile(b.dir))
	if err != nil {
		b.t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &b.state); err != nil {
		b.t.Fatal(err)
	}
}

type result struct {
	status int
	body   string
	tokens int
	err    error
}

type completion struct {
	Usage struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

func post(ctx context.Context, url string, body any) result {
	raw, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(raw))
	if err != nil {
		return result{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return result{err: err}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return result{status: resp.StatusCode, err: err}
	}
	r := result{status: resp.StatusCode, body: string(data)}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		for _, line := range strings.Split(r.body, "\n") {
			if strings.HasPrefix(line, "data: {") {
				var chunk struct {
					Choices []struct {
						Text  string `json:"text"`
						Delta struct {
							Content string `json:"content"`
						} `json:"delta"`
					} `json:"choices"`
					Error any `json:"error"`
				}
				if json.Unmarshal([]byte(line[6:]), &chunk) == nil {
					if chunk.Error != nil {
						r.status = 500 // an error event inside a 200 stream
					}
					for _, c := range chunk.Choices {
						if c.Text != "" || c.Delta.Content != "" {
							r.tokens++
						}
					}
				}
			}
		}
		return r
	}
	var c completion
	if json.Unmarshal(data, &c) == nil {
		r.tokens = c.Usage.CompletionTokens
	}
	return r
}

func get(t testing.TB, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// metric sums a metric's series scraped from url.
func metric(t *testing.T, url, name string, labels ...string) float64 {
	t.Helper()
	v, err := scrape(url, name, labels...)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func scrape(url, name string, labels ...string) (float64, error) {
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		return 0, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return 0, fmt.Errorf("parse metrics of %s: %w", url, err)
	}
	var sum float64
	f, ok := fams[name]
	if !ok {
		return 0, nil
	}
series:
	for _, m := range f.Metric {
		have := map[string]string{}
		for _, l := range m.Label {
			have[l.GetName()] = l.GetValue()
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if have[labels[i]] != labels[i+1] {
				continue series
			}
		}
		sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
	}
	return sum, nil
}

type engineState struct {
	Scheduler struct {
		Requests    int
		FreeBlocks  int
		Completions int
		ByStatus    map[string]int
	} `json:"scheduler"`
	Engine struct {
		BlocksVerified int
	} `json:"engine"`
	Connector map[string]int `json:"connector"`
}

func (b *box) engineState(url string) engineState {
	b.t.Helper()
	_, body := get(b.t, url+"/debug/state")
	var st engineState
	if err := json.Unmarshal([]byte(body), &st); err != nil {
		b.t.Fatalf("engine state %s: %v", body, err)
	}
	return st
}

// waitIdle waits until no engine holds a request or a block and no producer pins a block: the
// leak check. The wait is bounded by the sandbox's hold timeout, which frees orphaned holds.
func (b *box) waitIdle(kvBlocks int, within time.Duration) {
	b.t.Helper()
	deadline := time.Now().Add(within)
	for {
		var busy []string
		for _, n := range append(append([]sandbox.Node(nil), b.state.Prefill...), b.state.Decode...) {
			st := b.engineState(n.Engine)
			if st.Scheduler.Requests != 0 || st.Scheduler.FreeBlocks != kvBlocks {
				busy = append(busy, fmt.Sprintf("%s: %d requests %v (connector %v), %d/%d blocks free", n.Engine, st.Scheduler.Requests, st.Scheduler.ByStatus, st.Connector, st.Scheduler.FreeBlocks, kvBlocks))
			}
		}
		b.reload() // a restarted engine keeps its address
		for _, n := range b.state.Prefill {
			p, err := scrape(n.Engine, "pdcluster_connector_producer_blocks_pinned")
			switch {
			case err != nil:
				busy = append(busy, err.Error()) // restarting
			case p != 0:
				busy = append(busy, fmt.Sprintf("%s pins %v blocks", n.Engine, p))
			}
		}
		if len(busy) == 0 {
			return
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("not idle after %v: %v", within, busy)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func tokens(n, base int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = base + i
	}
	return out
}

// A 13-token prompt with 64-token blocks moves as one partial block, as on vLLM itself
// (test/realengine testNormal: all 100 tokens of a 100-token prompt external): a pull with a
// local block, reported to the scheduler, in both flows.
func TestShortPromptMovesItsPartialBlock(t *testing.T) {
	for _, flow := range []string{"mooncake", "nixl"} {
		t.Run(flow, func(t *testing.T) {
			b := start(t, "--block-size", "64", "--flow", flow)
			r := post(context.Background(), b.state.Router+"/v1/completions", map[string]any{
				"prompt": tokens(13, 1), "max_tokens": 32, "ignore_eos": true,
			})
			if r.err != nil || r.status != http.StatusOK || r.tokens != 32 {
				t.Fatalf("got %d, %d tokens, err %v: %s; want 200 with 32 tokens", r.status, r.tokens, r.err, r.body)
			}
			d := b.state.Decode[0]
			if n := metric(t, d.Engine, "pdcluster_connector_empty_pulls_total"); n != 0 {
				t.Errorf("empty pulls = %v, want 0: the partial block is a local block", n)
			}
			if n := metric(t, d.Engine, "pdcluster_connector_completions_total"); n != 1 {
				t.Errorf("completions reported = %v, want 1", n)
			}
			if n := metric(t, d.Engine, "vllm:prompt_tokens_by_source_total", "source", "external_kv_transfer"); n != 13 {
				t.Errorf("external KV tokens = %v, want the prompt's 13", n)
			}
			b.waitIdle(2048, 10*time.Second) // the producer was told and let go
		})
	}
}

// refuse sends n requests whose decode leg the engine's API server refuses (max_tokens past
// the model length) after a normal prefill leg: each is a cleanup pull with no local block on
// decode, whose report reaches the scheduler at decode's next step.
func refuse(t *testing.T, b *box, n int) {
	t.Helper()
	for i := range n {
		r := post(context.Background(), b.state.Router+"/v1/completions", map[string]any{"prompt": tokens(40, 3+i), "max_tokens": 1 << 20})
		if r.status != http.StatusBadRequest {
			t.Fatalf("refused request %d: %d %s, want the engine's 400", i, r.status, r.body)
		}
	}
}

// Decode legs the API server refuses: the gated connector keeps their cleanup pulls from the
// scheduler, the next request is served, and prefill lets their blocks go, in both flows.
// Real vLLM: test/realengine testRejectedDecodeLeg.
func TestRefusedDecodeLegsAreGated(t *testing.T) {
	for _, flow := range []string{"mooncake", "nixl"} {
		t.Run(flow, func(t *testing.T) {
			b := start(t, "--block-size", "64", "--flow", flow)
			refuse(t, b, 3)
			r := post(context.Background(), b.state.Router+"/v1/completions", map[string]any{"prompt": tokens(100, 1), "max_tokens": 8})
			if r.err != nil || r.status != http.StatusOK || r.tokens != 8 {
				t.Fatalf("the request after: %d, %d tokens, err %v: %s; want 200 with 8 tokens", r.status, r.tokens, r.err, r.body)
			}
			d := b.state.Decode[0]
			if code, body := get(t, d.Engine+"/health"); code != http.StatusOK {
				t.Fatalf("decode engine unhealthy: %d %s", code, body)
			}
			if n := metric(t, d.Engine, "pdcluster_connector_empty_pulls_total"); n != 3 {
				t.Errorf("empty pulls = %v, want 3", n)
			}
			if n := metric(t, d.Engine, "pdcluster_connector_completions_total"); n != 1 {
				t.Errorf("completions reported = %v, want 1 (the request after)", n)
			}
			b.waitIdle(2048, 10*time.Second) // the producer was told and let go
		})
	}
}

// The same refused leg through a connector that reports pulls with no local block (vLLM's
// stock Mooncake worker before 0.32) kills the decode engine at its next step: the check
// above is one that can fail.
func TestUngatedConnectorKillsDecodeEngine(t *testing.T) {
	b := start(t, "--block-size", "64", "--unsafe-ungated-completions")
	refuse(t, b, 1)
	// The cleanup pull's report goes with the engine's next step, which an idle engine takes only for
	// its next request.
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, body := get(t, b.state.Decode[0].Engine+"/health")
		if code == http.StatusInternalServerError && strings.Contains(body, "AssertionError") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("decode engine still healthy (%d %s)", code, body)
		}
		time.Sleep(50 * time.Millisecond)
		post(context.Background(), b.state.Router+"/v1/completions", map[string]any{"prompt": tokens(64, 2), "max_tokens": 1})
	}
	r := post(context.Background(), b.state.Router+"/v1/completions", map[string]any{"prompt": tokens(13, 1), "max_tokens": 4})
	if r.status != http.StatusInternalServerError || !strings.Contains(r.body, "EngineCore died") {
		t.Errorf("request to the dead engine: %d %s, want 500 naming EngineCore", r.status, r.body)
	}
}

func TestBadRequestsGetClear4xx(t *testing.T) {
	b := start(t, "--block-size", "16")
	cases := []struct {
		name string
		body any
		code int
		want string
	}{
		{"not an object", []int{1}, 400, "JSON object"},
		{"no prompt", map[string]any{"max_tokens": 3}, 400, "prompt"},
		{"client sets kv params", map[string]any{"prompt": "hi", "kv_transfer_params": map[string]any{}}, 400, "set by the router"},
		{"zero max_tokens", map[string]any{"prompt": "hello world", "max_tokens": 0}, 400, "max_tokens must be at least 1"},
		{"too long", map[string]any{"prompt": tokens(10, 1), "max_tokens": 1 << 20}, 400, "maximum context length"},
	}
	t.Run("models", func(t *testing.T) {
		code, body := get(t, b.state.Router+"/v1/models")
		if code != http.StatusOK || !strings.Contains(body, `"id":"sim/model"`) {
			t.Errorf("GET /v1/models: %d %s", code, body)
		}
	})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := post(context.Background(), b.state.Router+"/v1/completions", tc.body)
			if r.status != tc.code || !strings.Contains(r.body, tc.want) {
				t.Errorf("got %d %s, want %d containing %q", r.status, r.body, tc.code, tc.want)
			}
		})
	}
}

// With routing KVEvents, the simulated engines publish their prefix caches as vLLM's KV events
// and the router follows them: once a prompt is served, every later send of it goes to the
// prefill and decode engine holding it, by its events (matched, nothing estimated), and the
// holders answer from their caches.
func TestKVEventsRoutingFollowsTheSimulatedEngines(t *testing.T) {
	b := start(t, "--prefill", "2", "--decode", "2", "--block-size", "16", "--routing", "KVEvents")
	router := b.state.Router
	send := func() {
		t.Helper()
		r := post(context.Background(), router+"/v1/completions", map[string]any{"prompt": tokens(72, 500), "max_tokens": 2, "ignore_eos": true})
		if r.err != nil || r.status != http.StatusOK {
			t.Fatalf("got %d, err %v: %s", r.status, r.err, r.body)
		}
	}
	send()
	// 72 tokens are 4 full blocks of 16, stored by one prefill and one decode engine.
	for deadline := time.Now().Add(20 * time.Second); metric(t, router, "pdcluster_router_kv_events_index_blocks") < 8; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the router's index holds %v blocks, want the 8 the engines stored", metric(t, router, "pdcluster_router_kv_events_index_blocks"))
		}
	}
	// An engine that stored nothing yet may not be followed yet (the router dials each publisher
	// once a second until it answers): until all are, the pool routes by estimate.
	for _, pool := range []string{"prefill", "decode"} {
		for deadline := time.Now().Add(20 * time.Second); metric(t, router, "pdcluster_router_kv_events_connected_publishers", "pool", pool) < 2; time.Sleep(100 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the router follows %v of the %s pool's 2 engines' KV events", metric(t, router, "pdcluster_router_kv_events_connected_publishers", "pool", pool), pool)
			}
		}
	}
	hits := func(nodes []sandbox.Node) []float64 {
		var out []float64
		for _, n := range nodes {
			out = append(out, metric(t, n.Engine, "vllm:prompt_tokens_by_source_total", "source", "local_cache_hit"))
		}
		return out
	}
	before := map[string]float64{}
	for _, pool := range []string{"prefill", "decode"} {
		for _, m := range []string{"prompt_blocks", "matched_blocks", "estimated"} {
			before[pool+m] = metric(t, router, "pdcluster_router_kv_events_"+m+"_total", "pool", pool)
		}
	}
	p0, d0 := hits(b.state.Prefill), hits(b.state.Decode)
	for range 4 {
		send()
	}
	for _, pool := range []string{"prefill", "decode"} {
		delta := func(m string) float64 {
			return metric(t, router, "pdcluster_router_kv_events_"+m+"_total", "pool", pool) - before[pool+m]
		}
		if p, m, e := delta("prompt_blocks"), delta("matched_blocks"), delta("estimated"); p != 16 || m != 16 || e != 0 {
			t.Errorf("%s: %v of %v prompt blocks matched, %v requests estimated; want 16 of 16, none estimated", pool, m, p, e)
		}
	}
	// Each pool's 4 requests went to the one engine that held the prompt: its cache answered.
	for pool, nodes := range map[string][2][]float64{"prefill": {p0, hits(b.state.Prefill)}, "decode": {d0, hits(b.state.Decode)}} {
		gained := 0
		for i := range nodes[0] {
			if nodes[1][i] > nodes[0][i] {
				gained++
			}
		}
		if gained != 1 {
			t.Errorf("%s engines' cache hits went from %v to %v: want one engine answering every repeat", pool, nodes[0], nodes[1])
		}
	}
}
