package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/agent"
	"pdcluster.dev/pdcluster-operator/connector/bootstrap"
	"pdcluster.dev/pdcluster-operator/connector/kvfile"
	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmcli"
)

// sidecarFor runs a real connector agent for role on a Unix socket in dir, as the pod's sidecar,
// and returns the environment the engine container gets.
func sidecarFor(t *testing.T, role v1alpha1.KVRole, dir string) (map[string]string, *agent.Agent) {
	t.Helper()
	kv, err := kvfile.Open(filepath.Join(dir, "kv.blocks"), 256, 512)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kv.Close() })
	cfg := agent.Config{Role: role, KV: kv, EngineRegisters: role == v1alpha1.KVProducer,
		HoldTimeout: time.Minute, ReadyTimeout: time.Minute, TombstoneTTL: time.Minute, PullTimeout: time.Minute}
	var data net.Listener
	if role == v1alpha1.KVProducer {
		if data, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		cfg.DataAddr = data.Addr().String()
	}
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sock := "unix://" + filepath.Join(dir, "agent.sock")
	l, err := localapi.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(a.Handler(prometheus.NewRegistry()))
	srv.Listener = l
	srv.Start()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = a.Serve(ctx, data) }()
	t.Cleanup(func() { cancel(); srv.Close(); <-done })
	return map[string]string{"PDCLUSTER_CONNECTOR_URL": sock, "PDCLUSTER_KV_FILE": filepath.Join(dir, "kv.blocks")}, a
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func serve(t *testing.T, args []string, env map[string]string) (context.CancelFunc, chan error) {
	t.Helper()
	s, err := vllmcli.Parse(args)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- run(ctx, s, func(k string) string { return env[k] }, logr.Discard()) }()
	t.Cleanup(func() { cancel(); <-errc })
	return cancel, errc
}

func waitHealthy(t *testing.T, url string, errc chan error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-errc:
			errc <- err
			t.Fatalf("engine exited: %v", err)
		default:
		}
		if resp, err := http.Get(url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s/health never answered 200", url)
}

const mooncakeProducer = `--kv-transfer-config={"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}`

// As vLLM's prefill engine: the bootstrap server on VLLM_MOONCAKE_BOOTSTRAP_PORT, holding the
// sidecar's data address under the sidecar's engine id; healthy only once that is registered.
func TestMooncakePrefillServesBootstrapAndRegistersItsSidecar(t *testing.T) {
	env, sidecar := sidecarFor(t, v1alpha1.KVProducer, t.TempDir())
	api, boot := freePort(t), freePort(t)
	env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = fmt.Sprint(boot)
	_, errc := serve(t, []string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", api), mooncakeProducer}, env)
	waitHealthy(t, fmt.Sprintf("http://127.0.0.1:%d", api), errc)
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/query", boot))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var topo bootstrap.Topology
	if err := json.NewDecoder(resp.Body).Decode(&topo); err != nil {
		t.Fatal(err)
	}
	if got := topo["0"]; got.EngineID != sidecar.EngineID() || !strings.HasPrefix(got.WorkerAddr["0"]["0"], "tcp://127.0.0.1:") {
		t.Errorf("bootstrap /query = %+v, want the sidecar's engine id %s and data address", topo, sidecar.EngineID())
	}
}

// The seam the issue found: a sidecar on the bootstrap port makes the engine fail to start.
func TestBootstrapPortTakenFailsTheStart(t *testing.T) {
	env, _ := sidecarFor(t, v1alpha1.KVProducer, t.TempDir())
	taken, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = fmt.Sprint(taken.Addr().(*net.TCPAddr).Port)
	_, errc := serve(t, []string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", freePort(t)), mooncakeProducer}, env)
	select {
	case err := <-errc:
		errc <- err
		if err == nil || !strings.Contains(err.Error(), "Mooncake bootstrap server") || !strings.Contains(err.Error(), "address already in use") {
			t.Fatalf("err = %v, want the bootstrap server's bind to fail", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("engine started although its bootstrap port was taken")
	}
}

// NIXL: one side-channel listener per data-parallel rank on VLLM_NIXL_SIDE_CHANNEL_HOST, and
// that host is what prefill hands decode; unset, it is localhost, as in vLLM.
func TestNixlSideChannelPerRankOnTheAnnouncedHost(t *testing.T) {
	env, _ := sidecarFor(t, v1alpha1.KVProducer, t.TempDir())
	base := freePort(t)
	if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+1)); err != nil {
		t.Skipf("port %d is in use: %v", base+1, err)
	} else {
		l.Close()
	}
	env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
	env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = fmt.Sprint(base)
	api := freePort(t)
	_, errc := serve(t, []string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", api), "--data-parallel-size=2",
		`--kv-transfer-config={"kv_connector":"NixlConnector","kv_role":"kv_producer"}`}, env)
	waitHealthy(t, fmt.Sprintf("http://127.0.0.1:%d", api), errc)
	for rank := range 2 {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", base+rank))
		if err != nil {
			t.Errorf("side channel of dp rank %d: %v", rank, err)
			continue
		}
		c.Close()
	}
	body := `{"model":"m","prompt":"hello there","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}`
	resp, err := http.Post(fmt.Sprintf("http://127.0.0.1:%d/v1/completions", api), "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		KV struct {
			Addr string `json:"remote_bootstrap_addr"`
		} `json:"kv_transfer_params"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("http://127.0.0.1:%d", base); out.KV.Addr != want {
		t.Errorf("prefill handed decode %q, want the side-channel host and port %q", out.KV.Addr, want)
	}
}

func TestGatedConnectorNotOnPythonPathFailsTheStart(t *testing.T) {
	env, _ := sidecarFor(t, v1alpha1.KVConsumer, t.TempDir())
	s, err := vllmcli.Parse([]string{"serve", "m", fmt.Sprintf("--port=%d", freePort(t)),
		`--kv-transfer-config={"kv_connector":"GatedMooncakeConnector","kv_connector_module_path":"pdgate.mooncake","kv_role":"kv_consumer"}`})
	if err != nil {
		t.Fatal(err)
	}
	err = run(context.Background(), s, func(k string) string { return env[k] }, logr.Discard())
	if err == nil || !strings.Contains(err.Error(), "No module named 'pdgate.mooncake'") {
		t.Fatalf("err = %v, want the import to fail", err)
	}
}
