//go:build realengine

package realengine

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"pdcluster.dev/pdcluster-operator/test/loadgen"
	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
)

// BenchmarkRouterRealEngines (make bench, suite realengine) sends completions through the router
// in front of real vLLM engines (the Mooncake P/D path: both legs, the bootstrap lookup, vLLM's
// KV pull) and the same requests through a plain Go reverse proxy straight to the same decode
// engine (reference), on the newest CPU release. What the router adds is its own CPU per
// request against the proxy's; the latency beside it is the whole P/D path's against one
// engine's.
func BenchmarkRouterRealEngines(b *testing.B) {
	releases, err := Releases()
	if err != nil {
		b.Fatal(err)
	}
	d := deploy(b, releases[len(releases)-1])
	proxy, proxyPID := startPlainProxy(b, d.gated.Engine)
	routerPID := d.gatedVia.Proc.cmd.Process.Pid
	// A 100-token prompt (a whole block and a partial one move) and 4 tokens out.
	body, err := json.Marshal(map[string]any{"model": "tiny", "prompt": Prompt(7, 100), "max_tokens": 4, "ignore_eos": true, "temperature": 0})
	if err != nil {
		b.Fatal(err)
	}
	const warmup, duration = 2 * time.Second, 10 * time.Second
	for _, clients := range []int{1, 4} {
		b.Run(fmt.Sprintf("clients=%d/project", clients), func(b *testing.B) {
			loadgen.Run(b, d.gatedVia.URL, clients, body, warmup, duration, map[string][]int{"cpu-ms/req": {routerPID}})
		})
		b.Run(fmt.Sprintf("clients=%d/reference", clients), func(b *testing.B) {
			loadgen.Run(b, proxy, clients, body, warmup, duration, map[string][]int{"cpu-ms/req": {proxyPID}})
		})
	}
}

// startPlainProxy runs bin/plainproxy in front of backend.
func startPlainProxy(b *testing.B, backend string) (string, int) {
	free, err := sandbox.FreePorts(1)
	if err != nil {
		b.Fatal(err)
	}
	addr := net.JoinHostPort(podIP, fmt.Sprint(free[0]))
	bin, err := filepath.Abs(filepath.Join("..", "..", "bin", "plainproxy"))
	if err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(bin, "--listen", addr, "--backend", backend)
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if resp, err := http.Get("http://" + addr + "/health"); err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("plain proxy did not start")
		}
	}
	return "http://" + addr, cmd.Process.Pid
}
