package sandbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

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
// benchDuration (after a warm-up) and reports the latency percentiles, the throughput, the
// failures and, for each entry of cpu, the CPU time of those processes per request.
func loadTokens(b *testing.B, url string, clients, maxTokens int, cpu map[string][]int) {
	b.Helper()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients, MaxConnsPerHost: clients}}
	body, _ := json.Marshal(map[string]any{"prompt": benchPrompt, "max_tokens": maxTokens, "ignore_eos": true})
	one := func() (time.Duration, error) {
		start := time.Now()
		resp, err := client.Post(url+"/v1/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			return 0, err
		}
		data, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return 0, err
		}
		if resp.StatusCode != http.StatusOK {
			return 0, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(data)))
		}
		return time.Since(start), nil
	}
	run := func(d time.Duration) ([]time.Duration, []error) {
		var mu sync.Mutex
		var lat []time.Duration
		var errs []error
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		var wg sync.WaitGroup
		for range clients {
			wg.Go(func() {
				for ctx.Err() == nil {
					l, err := one()
					mu.Lock()
					if err != nil {
						errs = append(errs, err)
					} else {
						lat = append(lat, l)
					}
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		return lat, errs
	}
	run(benchWarmup)
	before := map[string]time.Duration{}
	for name, pids := range cpu {
		before[name] = cpuTime(b, pids)
	}
	b.ResetTimer()
	start := time.Now()
	lat, errs := run(benchDuration)
	elapsed := time.Since(start)
	b.StopTimer()
	if len(lat) == 0 {
		b.Fatalf("no request succeeded: %v", errs)
	}
	slices.Sort(lat)
	pct := func(p float64) float64 {
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds()) / 1000
	}
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	b.ReportMetric(float64(len(lat))/elapsed.Seconds(), "req/s")
	b.ReportMetric(float64(len(errs)), "errors")
	for name, pids := range cpu {
		used := cpuTime(b, pids) - before[name]
		b.ReportMetric(float64(used.Microseconds())/1000/float64(len(lat)+len(errs)), name)
	}
	if len(errs) > 0 {
		b.Logf("%d requests failed, the first: %v", len(errs), errs[0])
	}
}

// cpuTime is the user and system CPU time the processes have used (/proc/<pid>/stat).
func cpuTime(b *testing.B, pids []int) time.Duration {
	b.Helper()
	var total time.Duration
	for _, pid := range pids {
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			b.Fatalf("CPU time of %d: %v", pid, err)
		}
		// The command name (field 2) may hold spaces; fields 14 and 15 follow its ')'.
		fields := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+1:]))
		utime, _ := strconv.ParseInt(fields[11], 10, 64)
		stime, _ := strconv.ParseInt(fields[12], 10, 64)
		total += time.Duration(utime+stime) * time.Second / 100 // USER_HZ is 100 on Linux
	}
	return total
}
