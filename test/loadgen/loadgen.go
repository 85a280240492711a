// Package loadgen is the benchmarks' client (make bench): concurrent loops of one completion
// request against a URL for a bounded time, reporting latency percentiles, throughput,
// failures and the CPU time of given processes per request. Traffic stays on loopback.
package loadgen

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Run runs clients concurrent loops of POST url+"/v1/completions" with body for duration
// (after warmup) and reports the latency percentiles (p50-ms, p99-ms), the throughput (req/s),
// the failures (errors) and, for each entry of cpu, the CPU time of those processes per
// request under that name.
func Run(b *testing.B, url string, clients int, body []byte, warmup, duration time.Duration, cpu map[string][]int) {
	b.Helper()
	RunAt(b, url+"/v1/completions", clients, body, warmup, duration, cpu)
}

// RunAt is Run against endpoint itself (any POST that answers 200).
func RunAt(b *testing.B, endpoint string, clients int, body []byte, warmup, duration time.Duration, cpu map[string][]int) {
	b.Helper()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients, MaxConnsPerHost: clients}}
	one := func() (time.Duration, error) {
		start := time.Now()
		resp, err := client.Post(endpoint, "application/json", bytes.NewReader(body))
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
	run(warmup)
	before := map[string]time.Duration{}
	for name, pids := range cpu {
		before[name] = CPUTime(b, pids)
	}
	b.ResetTimer()
	start := time.Now()
	lat, errs := run(duration)
	elapsed := time.Since(start)
	b.StopTimer()
	if len(lat) == 0 {
		b.Fatalf("no request succeeded: %d failed, the first: %v", len(errs), errs[0])
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
		used := CPUTime(b, pids) - before[name]
		b.ReportMetric(float64(used.Microseconds())/1000/float64(len(lat)+len(errs)), name)
	}
	if len(errs) > 0 {
		b.Logf("%d requests failed, the first: %v", len(errs), errs[0])
	}
}

// CPUTime is the user and system CPU time the processes have used (/proc/<pid>/stat).
func CPUTime(b testing.TB, pids []int) time.Duration {
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
