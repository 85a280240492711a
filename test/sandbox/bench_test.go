package sandbox_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"pdcluster.dev/pdcluster-operator/test/loadgen"
	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
)

// Benchmarks of the request path (make bench). Every figure is measured against a reference in
// the same run, on the same machine, with traffic on loopback only; each run is bounded in time.

const (
	benchWarmup   = 300 * time.Millisecond
	benchDuration = 2 * time.Second
)

// benchPrompt is 64 tokens: four KV blocks of 16 move per request.
var benchPrompt = func() []int {
	p := make([]int, 64)
	for i := range p {
		p[i] = 100 + i
	}
	return p
}()

// BenchmarkRouter sends 1-token completions through the router (the Mooncake P/D path: both
// legs, the bootstrap lookup, the KV pull between the engines' transfer engines) and the same requests through a
// plain Go reverse proxy straight to the same decode engines (reference), at 1, 8 and 64
// concurrent clients. Engines take no simulated step time, so what is measured is the path.
func BenchmarkRouter(b *testing.B) {
	box := start(b, "--prefill", "2", "--decode", "2", "--block-size", "16", "--step-time", "0")
	var decode []string
	for _, n := range box.state.Decode {
		decode = append(decode, n.Engine)
	}
	proxy, proxyPID := startPlainProxy(b, decode)
	routerPIDs := []int{box.state.RouterPID}
	var allPIDs []int // the router, the sidecars and the engines: the whole P/D path
	allPIDs = append(allPIDs, routerPIDs...)
	for _, n := range append(slices.Clone(box.state.Prefill), box.state.Decode...) {
		allPIDs = append(allPIDs, n.SidecarPID, n.EnginePID)
	}
	for _, clients := range []int{1, 8, 64} {
		b.Run(fmt.Sprintf("clients=%d/project", clients), func(b *testing.B) {
			pids := func(nodes []sandbox.Node) []int {
				var out []int
				for _, n := range nodes {
					out = append(out, n.EnginePID)
				}
				return out
			}
			// Where the path's CPU goes, process kind by process kind.
			load(b, box.state.Router, clients, map[string][]int{"cpu-ms/req": routerPIDs, "path-cpu-ms/req": allPIDs,
				"prefill-engine-cpu-ms/req": pids(box.state.Prefill), "decode-engine-cpu-ms/req": pids(box.state.Decode)})
		})
		b.Run(fmt.Sprintf("clients=%d/reference", clients), func(b *testing.B) {
			var decodePIDs []int
			for _, n := range box.state.Decode {
				decodePIDs = append(decodePIDs, n.EnginePID)
			}
			load(b, proxy, clients, map[string][]int{"cpu-ms/req": {proxyPID}, "path-cpu-ms/req": append(decodePIDs, proxyPID)})
		})
	}
}

// BenchmarkBalance puts one slow engine in each pool (5 ms a step against none) and sends
// 16 concurrent clients' completions of 8 tokens through a router that picks the engines with
// the fewest requests in flight (project) and through one that takes turns (reference).
func BenchmarkBalance(b *testing.B) {
	for _, tc := range []struct{ name, balance string }{{"project", "least-in-flight"}, {"reference", "round-robin"}} {
		b.Run(tc.name, func(b *testing.B) {
			box := start(b, "--prefill", "2", "--decode", "2", "--block-size", "16", "--step-time", "0",
				"--slow-step-time", "5ms", "--balance", tc.balance)
			loadTokens(b, box.state.Router, 16, 8, nil)
		})
	}
}

// BenchmarkPrefixRouting is the router's cost of routing by what the engines hold: the same
// requests as BenchmarkRouter's at 8 clients (their 64-token prompt, 4 chunks or blocks to hash
// and match per pool) through a router with PrefixAware (project), one with KVEvents (kv-events:
// the engines publish their caches' events, which the router follows and indexes) and one with
// LeastInFlight (reference).
func BenchmarkPrefixRouting(b *testing.B) {
	for _, tc := range []struct{ name, routing string }{{"project", "PrefixAware"}, {"kv-events", "KVEvents"}, {"reference", "LeastInFlight"}} {
		b.Run(tc.name, func(b *testing.B) {
			box := start(b, "--prefill", "2", "--decode", "2", "--block-size", "16", "--step-time", "0", "--routing", tc.routing)
			load(b, box.state.Router, 8, map[string][]int{"cpu-ms/req": {box.state.RouterPID}})
		})
	}
}

func startPlainProxy(b *testing.B, backends []string) (string, int) {
	b.Helper()
	addr := freeAddr(b)
	args := []string{"--listen", addr}
	for _, u := range backends {
		args = append(args, "--backend", u)
	}
	cmd := exec.Command(filepath.Join(binDir, "plainproxy"), args...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	url := "http://" + addr
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if resp, err := http.Get(url + "/health"); err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("plain proxy did not start")
		}
	}
	return url, cmd.Process.Pid
}

func load(b *testing.B, url string, clients int, cpu map[string][]int) {
	loadTokens(b, url, clients, 1, cpu)
}

// loadTokens runs clients concurrent loops of completions of maxTokens tokens against url for
// benchDuration (after a warm-up) and reports what loadgen.Run reports.
func loadTokens(b *testing.B, url string, clients, maxTokens int, cpu map[string][]int) {
	b.Helper()
	body, _ := json.Marshal(map[string]any{"prompt": benchPrompt, "max_tokens": maxTokens, "ignore_eos": true})
	loadgen.Run(b, url, clients, body, benchWarmup, benchDuration, cpu)
}
