package sandbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
)

type soakReq struct {
	body    map[string]any
	path    string
	abortIn time.Duration // 0: the client waits for the answer
	want    int           // completion tokens expected (ignore_eos), 0 when not checked
}

// soakMix builds n requests: lengths from 1 to 700 tokens, a third sharing one of a few long
// prefixes (prefix hits on both engines), streaming and chat, and a tenth aborted by the client
// mid-flight (a decode leg aborted before it is scheduled, and vLLM's rejection notice for a
// cancelled non-streaming one, are cleanup pulls with no local block).
func soakMix(n int, rng *rand.Rand) []soakReq {
	prefixes := make([][]int, 6)
	for i := range prefixes {
		prefixes[i] = tokens(128+64*i, 10_000*(i+1))
	}
	out := make([]soakReq, n)
	for i := range out {
		var prompt []int
		switch rng.IntN(3) {
		case 0:
			p := prefixes[rng.IntN(len(prefixes))]
			prompt = append(append([]int(nil), p...), tokens(rng.IntN(3)*40, 90_000+i)...)
		default:
			prompt = tokens(1+rng.IntN(700), 100*i)
		}
		maxTok := 1 + rng.IntN(24)
		r := soakReq{path: "/v1/completions", want: maxTok, body: map[string]any{"prompt": prompt, "max_tokens": maxTok, "ignore_eos": true}}
		switch rng.IntN(5) {
		case 0:
			r.body["stream"] = true
		case 1:
			r.path = "/v1/chat/completions"
			words := make([]string, 1+rng.IntN(300))
			for j := range words {
				words[j] = fmt.Sprintf("w%d", rng.IntN(50))
			}
			delete(r.body, "prompt")
			r.body["messages"] = []map[string]string{{"role": "user", "content": strings.Join(words, " ")}}
		}
		if rng.IntN(10) == 0 {
			r.abortIn = time.Duration(1+rng.IntN(30)) * time.Millisecond
			r.want = 0
		}
		out[i] = r
	}
	return out
}

func run(b *box, reqs []soakReq, workers int) (ok, aborted int, failures []string) {
	var mu sync.Mutex
	ch := make(chan soakReq)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range ch {
				ctx, cancel := context.Background(), context.CancelFunc(func() {})
				if r.abortIn > 0 {
					ctx, cancel = context.WithTimeout(ctx, r.abortIn)
				}
				res := post(ctx, b.state.Router+r.path, r.body)
				cancel()
				mu.Lock()
				switch {
				case r.abortIn > 0 && (errors.Is(res.err, context.DeadlineExceeded) || res.status == http.StatusOK):
					aborted++
				case res.err != nil || res.status != http.StatusOK:
					failures = append(failures, fmt.Sprintf("%s: %d %v %s", r.path, res.status, res.err, tail(res.body, 300)))
				case r.want > 0 && res.tokens != r.want:
					failures = append(failures, fmt.Sprintf("%s: %d tokens, want %d", r.path, res.tokens, r.want))
				default:
					ok++
				}
				mu.Unlock()
			}
		}()
	}
	for _, r := range reqs {
		ch <- r
	}
	close(ch)
	wg.Wait()
	return ok, aborted, failures
}

// The soak: 1,319 requests of mixed lengths, prefix hits and client aborts through two prefill
// and two decode engines end with no error, no block pinned or held anywhere, and every
// report delivered exactly once (a second one would have killed a decode engine).
func TestSoak1319Requests(t *testing.T) {
	if testing.Short() {
		t.Skip("soak")
	}
	b := start(t, "--block-size", "64", "--prefill", "2", "--decode", "2", "--hold-timeout", "5s", "--pull-timeout", "8s")
	reqs := soakMix(1319, rand.New(rand.NewPCG(1319, 42)))
	ok, aborted, failures := run(b, reqs, 48)
	if len(failures) > 0 {
		t.Fatalf("%d failures (of %d), first: %v", len(failures), len(reqs), failures[:min(5, len(failures))])
	}
	if ok+aborted != len(reqs) || aborted == 0 {
		t.Fatalf("ok %d + aborted %d != %d requests (and some must be aborted)", ok, aborted, len(reqs))
	}
	b.waitIdle(2048, 20*time.Second)
	var empty, verified, external, received float64
	for _, d := range b.state.Decode {
		if code, body := get(t, d.Engine+"/health"); code != http.StatusOK {
			t.Fatalf("decode engine %s died: %s", d.Engine, body)
		}
		st := b.engineState(d.Engine)
		reported := metric(t, d.Engine, "pdcluster_connector_completions_total")
		if float64(st.Scheduler.Completions) != reported {
			t.Errorf("%s: scheduler accepted %d completions, its transfer engine reported %v: each must arrive exactly once", d.Engine, st.Scheduler.Completions, reported)
		}
		empty += metric(t, d.Engine, "pdcluster_connector_empty_pulls_total")
		verified += float64(st.Engine.BlocksVerified)
		external += metric(t, d.Engine, vllm.MetricPromptTokensBySource, vllm.MetricSourceLabel, vllm.SourceExternalKV)
		received += metric(t, d.Engine, "pdcluster_connector_transfer_bytes_received_total")
		if n := metric(t, d.Engine, "pdcluster_connector_pulls_in_flight"); n != 0 {
			t.Errorf("%s: %v pulls still in flight", d.Engine, n)
		}
	}
	if empty == 0 || verified == 0 {
		t.Errorf("the mix did not exercise both paths: %v empty pulls, %v blocks verified", empty, verified)
	}
	// Decode counts as external (vLLM's metric) only tokens whose blocks it pulled: at most
	// every pulled block's 64 tokens. vLLM counts a request's tokens when it is scheduled, so a
	// request aborted between that and its first step counts its pulled tokens without their
	// blocks being verified: the bound is the blocks received (1024 bytes each: the sandbox's
	// --block-bytes), not the blocks verified.
	pulled := received / 1024
	if external == 0 || external > pulled*64 || verified > pulled {
		t.Errorf("decode counted %v external prompt tokens for %v pulled 64-token blocks (%v verified)", external, pulled, verified)
	}
	t.Logf("%d ok, %d aborted, %v notify-only pulls, %v pulled blocks verified byte for byte", ok, aborted, empty, verified)
}

// SIGKILL of an engine while blocks are on the wire (its transfer engine dies with it, as
// vLLM's does): requests caught in flight fail by the load-failure policy with a reason or are
// recomputed, nothing leaks on either side, and the restarted engine (a new engine id and data
// address) serves new requests. A restarted decode engine never hears of the dead run's pulls
// (a report of one would kill it on vLLM's assert), and a restarted prefill engine never
// sends the dead run's KV into another request's blocks (decode verifies every block's bytes).
func TestEngineKilledMidTransfer(t *testing.T) {
	for _, tc := range []struct {
		victim, policy string
	}{{"prefill", "fail"}, {"prefill", "recompute"}, {"decode", "fail"}} {
		t.Run(tc.victim+"/"+tc.policy, func(t *testing.T) {
			b := start(t, "--block-size", "16", "--send-delay", "10ms", "--kv-load-failure-policy", tc.policy,
				"--hold-timeout", "3s", "--pull-timeout", "5s")
			node := func() sandbox.Node {
				if tc.victim == "prefill" {
					return b.state.Prefill[0]
				}
				return b.state.Decode[0]
			}
			const n = 12
			results := make(chan result, n)
			for i := 0; i < n; i++ {
				go func() {
					results <- post(context.Background(), b.state.Router+"/v1/completions", map[string]any{
						"prompt": tokens(16*40, 1000*i), "max_tokens": 8, "ignore_eos": true, // 40 blocks: 400 ms on the wire
					})
				}()
			}
			time.Sleep(250 * time.Millisecond)
			victim := node().EnginePID
			if err := syscall.Kill(victim, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			var okN, failed int
			for i := 0; i < n; i++ {
				r := <-results
				switch {
				case r.status == http.StatusOK && r.tokens == 8:
					okN++
				case tc.victim == "prefill" && tc.policy == "fail" && r.status >= 500 && strings.Contains(r.body, "KV load from the prefill engine failed"):
					failed++
				case tc.victim == "decode" && r.status >= 500:
					failed++ // the engine serving it died: the router says so
				default:
					t.Errorf("unexpected result (%s killed, policy %s): %d %v %s", tc.victim, tc.policy, r.status, r.err, tail(r.body, 300))
				}
			}
			if tc.policy == "fail" && failed == 0 {
				t.Errorf("no request was caught mid-transfer (%d ok): the kill came too late to test anything", okN)
			}
			if tc.victim == "prefill" && tc.policy == "recompute" && okN != n {
				t.Errorf("recompute: %d of %d ok", okN, n)
			}

			// The engine comes back (the sandbox restarts it) and serves again.
			deadline := time.Now().Add(20 * time.Second)
			for {
				b.reload()
				if node().EnginePID != victim {
					if resp, err := http.Get(node().Engine + "/health"); err == nil { // refused while it restarts
						resp.Body.Close()
						if resp.StatusCode == http.StatusOK {
							break
						}
					}
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s engine not restarted", tc.victim)
				}
				time.Sleep(100 * time.Millisecond)
			}
			b.waitIdle(2048, 15*time.Second)
			restarts := node().EngineRestarts
			for i := 0; i < 3; i++ {
				r := post(context.Background(), b.state.Router+"/v1/completions", map[string]any{"prompt": tokens(100, 777_000+i*1000), "max_tokens": 4, "ignore_eos": true})
				if r.status != http.StatusOK || r.tokens != 4 {
					t.Fatalf("after restart: %d %v %s", r.status, r.err, r.body)
				}
			}
			if st := b.engineState(b.state.Decode[0].Engine); st.Engine.BlocksVerified == 0 {
				t.Errorf("no pulled block verified after the restart")
			}
			b.waitIdle(2048, 10*time.Second)
			b.reload()
			if got := node().EngineRestarts; got != restarts {
				t.Errorf("the restarted %s engine died again (%d restarts, then %d): a report or KV of its dead run reached it", tc.victim, restarts, got)
			}
		})
	}
}
