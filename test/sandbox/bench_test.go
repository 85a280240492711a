package sandbox_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
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
	// vLLM's own router (make bench installs it: hack/vllm-router-venv.sh) in front of the same
	// engines: what a vLLM user would run instead.
	vllmRouter, vllmRouterPID := "", 0
	if cmd := os.Getenv("PDCLUSTER_VLLM_ROUTER"); cmd != "" {
		vllmRouter, vllmRouterPID = startVLLMRouter(b, cmd, box.state)
	}
	for _, clients := range []int{1, 8, 64} {
		b.Run(fmt.Sprintf("clients=%d/vllm-router", clients), func(b *testing.B) {
			if vllmRouter == "" {
				b.Skip("PDCLUSTER_VLLM_ROUTER is not set: make bench sets it to vllm-router's command (hack/vllm-router-venv.sh)")
			}
			before := promptSources(b, box.state.Decode)
			load(b, vllmRouter, clients, map[string][]int{"cpu-ms/req": {vllmRouterPID}})
			// A fair comparison only if vllm-router's requests are P/D too: decode takes the
			// prompt from prefill's KV, never computes it.
			after := promptSources(b, box.state.Decode)
			if local := after.LocalComputeTokens - before.LocalComputeTokens; local > 0 || after.ExternalKVTokens <= before.ExternalKVTokens {
				b.Errorf("through vllm-router, decode computed %v prompt tokens itself and took %v from prefill: want none computed", local, after.ExternalKVTokens-before.ExternalKVTokens)
			}
		})
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

// startVLLMRouter runs vllm-router (command) in P/D mode in front of the sandbox's engines:
// Mooncake (its --kv-connector mooncake: it reads each prefill's engine id from its bootstrap
// server once, then runs prefill and decode one after the other), round robin in each pool as
// our router's reference balance, and returns its URL and process id (one process: the Python
// launcher loads the Rust router).
func startVLLMRouter(b *testing.B, command string, state sandbox.State) (string, int) {
	b.Helper()
	addr, metrics := freeAddr(b), freeAddr(b)
	host, port, _ := strings.Cut(addr, ":")
	_, metricsPort, _ := strings.Cut(metrics, ":")
	args := []string{"--vllm-pd-disaggregation", "--kv-connector", "mooncake", "--policy", "round_robin",
		"--host", host, "--port", port, "--prometheus-port", metricsPort, "--worker-startup-check-interval", "1"}
	for _, n := range state.Prefill {
		u, err := url.Parse(n.Bootstrap)
		if err != nil {
			b.Fatal(err)
		}
		args = append(args, "--prefill", n.Engine, u.Port())
	}
	for _, n := range state.Decode {
		args = append(args, "--decode", n.Engine)
	}
	cmd := exec.Command(command, args...)
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cmd.Process.Signal(syscall.SIGTERM); _ = cmd.Wait() })
	base := "http://" + addr
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if resp, err := http.Get(base + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			b.Fatalf("vllm-router did not answer /health within a minute: %s", tail(logs.String(), 3000))
		}
	}
	return base, cmd.Process.Pid
}

// promptSources sums the engines' vllm:prompt_tokens_by_source_total by source.
func promptSources(b *testing.B, nodes []sandbox.Node) vllm.EngineStats {
	b.Helper()
	var sum vllm.EngineStats
	for _, n := range nodes {
		resp, err := http.Get(n.Engine + "/metrics")
		if err != nil {
			b.Fatal(err)
		}
		st, err := vllm.ParseEngineMetrics(resp.Body)
		resp.Body.Close()
		if err != nil {
			b.Fatal(err)
		}
		sum.ExternalKVTokens += st.ExternalKVTokens
		sum.LocalComputeTokens += st.LocalComputeTokens
	}
	return sum
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
