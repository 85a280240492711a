package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
)

// TestMain runs the router itself when a test starts this binary as one (runRouter).
func TestMain(m *testing.M) {
	if os.Getenv(routerMainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

const routerMainEnv = "PDCLUSTER_ROUTER_TEST_MAIN"

// A load test of the router's memory: 8 clients at once each send a 31 MiB body (what took a
// router without a body budget or memory limit from 13 to 660 MiB). With a 256 MiB container
// limit the router refuses what its body budget cannot hold (503, Retry-After), serves the
// rest, and its peak resident memory stays under the limit.
func TestMemoryStaysBoundedUnderLargeBodies(t *testing.T) {
	const (
		limit   = 256 << 20
		body    = 31 << 20
		clients = 8
	)
	prefill, boot, decode := loadEngines(t)
	url, pid := runRouter(t, "--prefill="+prefill+","+boot, "--decode="+decode,
		"--memory-limit="+strconv.Itoa(limit), "--max-body-bytes="+strconv.Itoa(32<<20))

	prompt := `{"prompt":"` + strings.Repeat("a", body) + `"}`
	byCode := load(t, url, prompt, clients)
	if byCode[http.StatusOK] == 0 || byCode[http.StatusServiceUnavailable] == 0 || byCode[http.StatusOK]+byCode[http.StatusServiceUnavailable] != clients {
		t.Errorf("answers by status %v: want some served and the rest refused with 503 (no failed connection)", byCode)
	}
	peak := peakRSS(t, pid)
	t.Logf("router peak resident memory %d MiB of a %d MiB limit; answers by status %v", peak>>20, limit>>20, byCode)
	if peak >= limit {
		t.Errorf("router peak resident memory %d MiB, want under its %d MiB limit", peak>>20, limit>>20)
	}
}

// load has clients post body to the router at url at once and counts their answers by
// status (0: no answer); a 503 must say when to retry.
func load(t *testing.T, url, body string, clients int) map[int]int {
	t.Helper()
	codes := make(chan int, clients)
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				codes <- 0
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") == "" {
				t.Error("a 503 without Retry-After")
			}
			codes <- resp.StatusCode
		})
	}
	wg.Wait()
	close(codes)
	byCode := map[int]int{}
	for c := range codes {
		byCode[c]++
	}
	return byCode
}

// loadEngines are a prefill engine (its URL and its bootstrap server's) and a decode engine
// for a load test: each reads the whole body, and decode holds each request a second, so that
// a load's requests overlap.
func loadEngines(t *testing.T) (prefill, boot, decode string) {
	t.Helper()
	reg := bootstrap.NewRegistry()
	_ = reg.Register(bootstrap.Registration{EngineID: "engine-p", Addr: "tcp://127.0.0.1:1"})
	b := httptest.NewServer(reg.Handler())
	engine := func(hold time.Duration) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			time.Sleep(hold)
			_, _ = io.WriteString(w, `{"choices":[{"text":"ok"}]}`)
		}))
	}
	p, d := engine(0), engine(time.Second)
	t.Cleanup(func() { b.Close(); p.Close(); d.Close() })
	return p.URL, b.URL, d.URL
}

// runRouter starts this test binary as the router (TestMain) with args, listening on a free
// port, and returns its URL once it is ready, and its pid.
func runRouter(t *testing.T, args ...string) (string, int) {
	t.Helper()
	ports, err := sandbox.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", ports[0])
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, os.Args[0], append([]string{"--listen=" + addr}, args...)...)
	cmd.Env = append(os.Environ(), routerMainEnv+"=1")
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); _ = cmd.Wait() })
	url := "http://" + addr
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if resp, err := http.Get(url + "/ready"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return url, cmd.Process.Pid
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the router did not get ready in 10 s")
		}
	}
}

// peakRSS is the process's peak resident memory in bytes (VmHWM).
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "VmHWM:"); ok {
			kib, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kib << 10
		}
	}
	t.Fatal("no VmHWM in /proc status")
	return 0
}
