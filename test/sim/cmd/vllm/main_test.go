package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	connsidecar "pdcluster.dev/pdcluster-operator/connector/sidecar"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmcli"
)

// podEnv is the environment the engine container gets, but on loopback: the transfer engine
// advertises VLLM_HOST_IP, and no sidecar listens at PDCLUSTER_CONNECTOR_URL (the engine moves
// its KV without one; only the gate's heartbeat goes there).
func podEnv(t *testing.T) map[string]string {
	t.Helper()
	return map[string]string{"VLLM_HOST_IP": "127.0.0.1", "PDCLUSTER_CONNECTOR_URL": "unix://" + filepath.Join(t.TempDir(), "agent.sock")}
}

// freePort is a free port below the kernel's ephemeral range: one that ":0" handed out was
// taken by another test process before the engine bound it ("address already in use").
func freePort(t *testing.T) int {
	t.Helper()
	ports, err := sandbox.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	return ports[0]
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

// As vLLM's prefill engine: the bootstrap server on VLLM_MOONCAKE_BOOTSTRAP_PORT, holding its
// own transfer engine's address (a port the kernel picked, on VLLM_HOST_IP) under a fresh engine
// id per run. A restarted engine is a new engine to decode: a new id and a new data address,
// so nothing of the earlier run's transfers can reach it.
func TestMooncakePrefillRegistersItsTransferEngine(t *testing.T) {
	env := podEnv(t)
	var runs []bootstrap.Engine
	for range 2 {
		api, boot := freePort(t), freePort(t)
		env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = fmt.Sprint(boot)
		stop, errc := serve(t, []string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", api), mooncakeProducer}, env)
		waitHealthy(t, fmt.Sprintf("http://127.0.0.1:%d", api), errc)
		got := query(t, fmt.Sprintf("http://127.0.0.1:%d/query", boot))["0"]
		addr, ok := strings.CutPrefix(got.WorkerAddr["0"]["0"], "tcp://")
		if got.EngineID == "" || !ok || !strings.HasPrefix(addr, "127.0.0.1:") {
			t.Fatalf("bootstrap /query = %+v, want an engine id and the transfer engine's tcp:// address on VLLM_HOST_IP", got)
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("the registered transfer engine %s does not answer: %v", addr, err)
		}
		c.Close()
		runs = append(runs, got)
		stop()
		err = <-errc
		errc <- err // for serve's cleanup
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			t.Fatalf("the transfer engine %s still answers after its engine stopped", addr)
		}
	}
	if runs[0].EngineID == runs[1].EngineID {
		t.Errorf("two runs registered the same engine id %s", runs[0].EngineID)
	}
}

func query(t *testing.T, url string) bootstrap.Topology {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var topo bootstrap.Topology
	if err := json.NewDecoder(resp.Body).Decode(&topo); err != nil {
		t.Fatal(err)
	}
	return topo
}

// The transfer engine's counts are on the API port's /metrics, as vLLM's metrics are; the KV
// capacity is --num-gpu-blocks-override.
func TestTransferMetricsOnTheAPIPort(t *testing.T) {
	api := freePort(t)
	_, errc := serve(t, []string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", api), "--num-gpu-blocks-override=64",
		`--kv-transfer-config={"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}`}, podEnv(t))
	url := fmt.Sprintf("http://127.0.0.1:%d", api)
	waitHealthy(t, url, errc)
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "pdcluster_connector_pulls_total") {
		t.Errorf("GET /metrics = %s, want the transfer engine's counters:\n%s", resp.Status, body)
	}
	// 64 blocks of 16 tokens hold 1024 tokens: a longer prompt cannot fit.
	long := strings.Repeat("word ", 64*16+8)
	r, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","max_tokens":1,"prompt":"`+long+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	msg, _ := io.ReadAll(r.Body)
	r.Body.Close()
	if r.StatusCode != http.StatusBadRequest {
		t.Errorf("a prompt past the 64-block capacity answered %s %s, want 400", r.Status, msg)
	}
}

// The seam the issue found: a sidecar on the bootstrap port makes the engine fail to start.
func TestBootstrapPortTakenFailsTheStart(t *testing.T) {
	env := podEnv(t)
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
	env := podEnv(t)
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
	env := podEnv(t)
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

// The engine's /metrics has vLLM's prompt tokens by source, as its scheduler counted them; with
// VLLM_SIM_DROP_KV_TRANSFER_PARAMS a decode engine ignores a request's kv_transfer_params
// (do_remote_prefill from a prefill that does not exist) and computes the prompt itself, so
// the request is answered and counted as local_compute, not external.
func TestPromptTokensBySourceAndDroppedKVParams(t *testing.T) {
	api := freePort(t)
	env := podEnv(t)
	env["VLLM_SIM_DROP_KV_TRANSFER_PARAMS"] = "1"
	_, errc := serve(t, []string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", api), "--block-size=16",
		`--kv-transfer-config={"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}`}, env)
	url := fmt.Sprintf("http://127.0.0.1:%d", api)
	waitHealthy(t, url, errc)
	body := `{"model":"m","max_tokens":1,"prompt":"` + strings.Repeat("word ", 40) + `","kv_transfer_params":{"do_remote_prefill":true,` +
		`"transfer_id":"t1","remote_engine_id":"gone","remote_bootstrap_addr":"http://127.0.0.1:1"}}`
	client := &http.Client{Timeout: 10 * time.Second}
	r, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	msg, _ := io.ReadAll(r.Body)
	r.Body.Close()
	if r.StatusCode != http.StatusOK {
		t.Fatalf("POST = %s %s, want 200 (computed locally)", r.Status, msg)
	}
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	scrape, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		`vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 40`,
		`vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 0`,
		`vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 0`,
	} {
		if !strings.Contains(string(scrape), want) {
			t.Errorf("GET /metrics lacks %s:\n%s", want, scrape)
		}
	}
}

// A pull that cannot reach its prefill fails the request (kv_load_failure_policy fail) and is
// counted as vLLM's Mooncake connector counts it, so the operator's verdict can say
// TransferFailing from the engine's own counters.
func TestFailedPullCountedAsVLLMDoes(t *testing.T) {
	api := freePort(t)
	_, errc := serve(t, []string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", api), "--block-size=16",
		`--kv-transfer-config={"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}`}, podEnv(t))
	url := fmt.Sprintf("http://127.0.0.1:%d", api)
	waitHealthy(t, url, errc)
	body := `{"model":"m","max_tokens":1,"prompt":"` + strings.Repeat("word ", 40) + `","kv_transfer_params":{"do_remote_prefill":true,` +
		`"transfer_id":"t1","remote_engine_id":"gone","remote_bootstrap_addr":"http://127.0.0.1:1"}}`
	r, err := (&http.Client{Timeout: 20 * time.Second}).Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != http.StatusInternalServerError {
		t.Fatalf("POST = %s, want 500 (the pull failed, policy fail)", r.Status)
	}
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	scrape, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := `vllm:mooncake_num_failed_recvs_total{engine="0",model_name="m"} 1`; !strings.Contains(string(scrape), want) {
		t.Errorf("GET /metrics lacks %s:\n%s", want, scrape)
	}
}

// pdPair is a Mooncake prefill stand-in (prefillArgs added) and a decode one (decodeArgs
// added) on loopback.
type pdPair struct {
	prefill, decode, engineID string
	boot                      int
	stopPrefill               context.CancelFunc
	prefillErr                chan error
}

func startPair(t *testing.T, prefillArgs, decodeArgs []string) pdPair {
	t.Helper()
	env := podEnv(t)
	api, boot := freePort(t), freePort(t)
	env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = fmt.Sprint(boot)
	stop, errc := serve(t, append([]string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", api), "--block-size=16", mooncakeProducer}, prefillArgs...), env)
	p := pdPair{prefill: fmt.Sprintf("http://127.0.0.1:%d", api), boot: boot, stopPrefill: stop, prefillErr: errc}
	waitHealthy(t, p.prefill, errc)
	p.engineID = query(t, fmt.Sprintf("http://127.0.0.1:%d/query", boot))["0"].EngineID
	dapi := freePort(t)
	_, derrc := serve(t, append([]string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", dapi), "--block-size=16",
		`--kv-transfer-config={"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}`}, decodeArgs...), podEnv(t))
	p.decode = fmt.Sprintf("http://127.0.0.1:%d", dapi)
	waitHealthy(t, p.decode, derrc)
	return p
}

// complete posts a 40-word completion with params as kv_transfer_params to url.
func complete(url, params string) (int, string) {
	body := `{"model":"m","max_tokens":1,"prompt":"` + strings.Repeat("word ", 40) + `","kv_transfer_params":` + params + `}`
	r, err := (&http.Client{Timeout: 20 * time.Second}).Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		return 0, err.Error()
	}
	defer r.Body.Close()
	b, _ := io.ReadAll(r.Body)
	return r.StatusCode, string(b)
}

// prefillLeg and decodeLeg are the Mooncake flow's two legs of transfer.
func (p pdPair) prefillLeg(transfer string) (int, string) {
	return complete(p.prefill, fmt.Sprintf(`{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":%q}`, transfer))
}

func (p pdPair) decodeLeg(transfer string) (int, string) {
	return complete(p.decode, fmt.Sprintf(`{"do_remote_prefill":true,"do_remote_decode":false,"transfer_id":%q,"remote_engine_id":%q,"remote_bootstrap_addr":"http://127.0.0.1:%d"}`, transfer, p.engineID, p.boot))
}

// As vLLM with --shutdown-timeout: on SIGTERM the API stops taking requests, and a prefill
// engine keeps the KV it holds (transfer engine and bootstrap serving) until decode pulled it,
// then exits. With 0 (vLLM's default) it exits at once and decode's pull of that KV fails, so
// a test of an undrained scale-down can fail.
func TestShutdownTimeoutKeepsHeldKVForItsPull(t *testing.T) {
	for _, tc := range []struct {
		timeout    int
		wantDecode int
	}{{30, http.StatusOK}, {0, http.StatusInternalServerError}} {
		t.Run(fmt.Sprintf("--shutdown-timeout=%d", tc.timeout), func(t *testing.T) {
			p := startPair(t, []string{fmt.Sprintf("--shutdown-timeout=%d", tc.timeout)}, nil)
			decode, errc := p.decode, p.prefillErr
			if code, body := p.prefillLeg("t1"); code != http.StatusOK {
				t.Fatalf("prefill: %d %s", code, body)
			}
			stop := p.stopPrefill
			stop() // SIGTERM
			exited := func(within time.Duration) bool {
				select {
				case err := <-errc:
					errc <- err
					return true
				case <-time.After(within):
					return false
				}
			}
			if tc.timeout == 0 {
				if !exited(5 * time.Second) {
					t.Fatal("the engine did not exit at once with --shutdown-timeout=0")
				}
			} else {
				if exited(500 * time.Millisecond) {
					t.Fatal("the engine exited while it held KV for a pull not made yet")
				}
				if code, _ := p.prefillLeg("t2"); code != 0 {
					t.Errorf("a draining engine took a new request: %d", code)
				}
			}
			code, body := p.decodeLeg("t1")
			if code != tc.wantDecode {
				t.Errorf("decode after the prefill engine's SIGTERM: %d %s, want %d", code, body, tc.wantDecode)
			}
			if tc.timeout > 0 && !exited(5*time.Second) {
				t.Error("the engine did not exit once its held KV was pulled")
			}
			// The pull that moved blocks is in vLLM's per-transfer histograms (the sidecar reads
			// their sums for the transfer rate); a failed one is not.
			resp, err := http.Get(decode + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			scrape, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			want := map[bool]string{true: "1", false: "0"}[tc.wantDecode == http.StatusOK]
			for _, name := range []string{"vllm:mooncake_xfer_time_seconds_count", "vllm:mooncake_bytes_transferred_count"} {
				line := name + `{engine="0",model_name="m"} ` + want + "\n"
				if !strings.Contains(string(scrape), line) {
					t.Errorf("decode /metrics lacks %s:\n%s", line, scrape)
				}
			}
		})
	}
}

// Engines of two KV formats (here --dtype; a model revision, block size, sharding or release
// layout alike) never read each other's KV: the pull is refused, decode fails the request
// (kv_load_failure_policy fail) instead of continuing from foreign KV, and the producer counts
// it. Engines of one format pull as before. The failed request's error answer makes vLLM's API
// server send a cleanup pull too (_with_kv_transfer_rejection_cleanup), refused alike: two.
func TestPullAcrossKVFormatsFailsLoudly(t *testing.T) {
	for _, tc := range []struct {
		name         string
		prefill, dec string
		want         int
		wantMismatch string
	}{
		{"same format", "--dtype=float16", "--dtype=float16", http.StatusOK, "0"},
		{"another dtype", "--dtype=float16", "--dtype=bfloat16", http.StatusInternalServerError, "2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startPair(t, []string{tc.prefill}, []string{tc.dec})
			if code, body := p.prefillLeg("t1"); code != http.StatusOK {
				t.Fatalf("prefill: %d %s", code, body)
			}
			if code, body := p.decodeLeg("t1"); code != tc.want {
				t.Errorf("decode: %d %s, want %d", code, body, tc.want)
			}
			// The cleanup pull goes out beside the error answer: wait for the count to settle.
			want := "vllm_sim_kv_format_mismatches_total " + tc.wantMismatch + "\n"
			var scrape []byte
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				resp, err := http.Get(p.prefill + "/metrics")
				if err != nil {
					t.Fatal(err)
				}
				scrape, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
				if strings.Contains(string(scrape), want) || time.Now().After(deadline) {
					break
				}
			}
			if !strings.Contains(string(scrape), want) {
				t.Errorf("prefill /metrics lacks %q:\n%s", want, scrape)
			}
		})
	}
}

// As vLLM with --data-parallel-size: one engine per rank behind one API server, each with its
// own engine id and transfer engine in the pod's one Mooncake bootstrap server; a request
// pinned with X-data-parallel-rank runs on that rank's engine (its prompt counted under its
// engine label) and its KV is pulled through that rank's engine id; a rank out of range is
// refused with vLLM's 400.
func TestDataParallelRanksAreEnginesOfTheirOwn(t *testing.T) {
	p := startPair(t, []string{"--data-parallel-size=2"}, nil)
	topo := query(t, fmt.Sprintf("http://127.0.0.1:%d/query", p.boot))
	if len(topo) != 2 || topo["0"].EngineID == topo["1"].EngineID || topo["0"].WorkerAddr["0"]["0"] == topo["1"].WorkerAddr["0"]["0"] {
		t.Fatalf("bootstrap /query = %+v, want dp ranks 0 and 1, each with its own engine id and transfer engine", topo)
	}
	pinned := func(rank, transfer string) (int, string) {
		body := `{"model":"m","max_tokens":1,"prompt":"` + strings.Repeat("word ", 40) + `","kv_transfer_params":` +
			fmt.Sprintf(`{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":%q}`, transfer) + `}`
		req, _ := http.NewRequest(http.MethodPost, p.prefill+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-data-parallel-rank", rank)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	localTokens := func(rank string) string {
		resp, err := http.Get(p.prefill + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		for line := range strings.Lines(string(b)) {
			if strings.HasPrefix(line, "vllm:prompt_tokens_by_source_total{") && strings.Contains(line, `engine="`+rank+`"`) && strings.Contains(line, `source="local_compute"`) {
				return strings.TrimSpace(line[strings.LastIndex(line, " "):])
			}
		}
		return ""
	}
	if code, body := pinned("1", "xfer-r1"); code != http.StatusOK {
		t.Fatalf("prefill pinned to dp rank 1: %d %s", code, body)
	}
	if r0, r1 := localTokens("0"), localTokens("1"); r0 != "0" || r1 == "0" || r1 == "" {
		t.Errorf("prompt tokens computed: engine 0 %q, engine 1 %q; want the pinned rank 1's only", r0, r1)
	}
	p.engineID = topo["1"].EngineID
	if code, body := p.decodeLeg("xfer-r1"); code != http.StatusOK || !strings.Contains(body, `"choices"`) {
		t.Errorf("decode pulling rank 1's KV through rank 1's engine id: %d %s", code, body)
	}
	if code, body := pinned("2", "xfer-r2"); code != http.StatusBadRequest || !strings.Contains(body, "data_parallel_rank 2 is out of range [0, 2).") {
		t.Errorf("prefill pinned to dp rank 2 of 2: %d %s, want vLLM's 400", code, body)
	}
}

// The seam of one gate per data-parallel rank, from the engine's side: the stand-in, as vLLM,
// runs an EngineCore and so a gate per rank, and a sidecar waiting for two ranks (what render
// passes for parallelism.data 2) hears both and is loaded. Before, the sidecar kept the last
// heartbeat only, and the pod's counts were one rank's, flipping with every beat.
func TestEachRanksGateReachesTheSidecar(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := localapi.Listen("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	sc, err := connsidecar.New(connsidecar.Config{Gate: connsidecar.GateConfig{Required: true, Ranks: 2}, Log: logr.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: sc.LocalHandler(prometheus.NewRegistry()), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	plugin, err := filepath.Abs(filepath.Join("..", "..", "..", "..", "connector", "vllm"))
	if err != nil {
		t.Fatal(err)
	}
	env := podEnv(t)
	env["PDCLUSTER_CONNECTOR_URL"], env["PYTHONPATH"] = "unix://"+sock, plugin
	env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = fmt.Sprint(freePort(t))
	api := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	_, errc := serve(t, []string{"serve", "m", "--host=127.0.0.1", "--port=" + api[strings.LastIndex(api, ":")+1:], "--data-parallel-size=2",
		`--kv-transfer-config={"kv_connector":"GatedMooncakeConnector","kv_connector_module_path":"pdgate.mooncake","kv_role":"kv_producer"}`}, env)
	waitHealthy(t, api, errc)
	public := sc.PublicHandler(prometheus.NewRegistry())
	var st vllm.State
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		rec := httptest.NewRecorder()
		public.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, vllm.StatePath, nil))
		if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
			t.Fatalf("GET %s: %v: %s", vllm.StatePath, err, rec.Body)
		}
		if st.Loaded {
			break
		}
	}
	if !st.Loaded || st.Ranks != 2 || st.Report == nil || st.Report.Connector != "GatedMooncakeConnector" {
		t.Errorf("sidecar's gate state %+v, want loaded from both ranks' gates", st)
	}
}

// Two pods of one data-parallel replica (4 ranks, 2 per pod), with the flags `connector
// launch` gives them: as vLLM's hybrid load balancing, neither serves until both joined the
// group at the leader's coordinator; each runs its own bootstrap registry listing its own
// ranks from 0, takes X-data-parallel-rank in [0, 2) and refuses 2 as vLLM does; and when one
// pod goes, the other's engine dies (its collectives would fail), so LeaderWorkerSet's
// RecreateGroupOnPodRestart brings the replica back whole.
func TestHybridLoadBalancedPodsServeAsOneGroup(t *testing.T) {
	rpc := freePort(t)
	type pod struct {
		api, boot int
		stop      context.CancelFunc
		errc      chan error
	}
	start := func(startRank int) pod {
		env := podEnv(t)
		p := pod{api: freePort(t), boot: freePort(t)}
		env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = fmt.Sprint(p.boot)
		p.stop, p.errc = serve(t, []string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", p.api), "--block-size=16",
			"--data-parallel-size", "4", "--enable-expert-parallel", mooncakeProducer,
			"--data-parallel-hybrid-lb", "--data-parallel-size-local", "2", "--data-parallel-start-rank", fmt.Sprint(startRank),
			"--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", fmt.Sprint(rpc)}, env)
		return p
	}
	leader := start(0)
	// The leader binds its coordinator and waits: no API server yet.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", rpc)); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the leader never listened on its data-parallel RPC port")
		}
	}
	time.Sleep(300 * time.Millisecond)
	if resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/health", leader.api)); err == nil {
		resp.Body.Close()
		t.Fatalf("the leader serves (%s) before the other pod of its group joined", resp.Status)
	}
	worker := start(2)
	for _, p := range []pod{leader, worker} {
		waitHealthy(t, fmt.Sprintf("http://127.0.0.1:%d", p.api), p.errc)
	}
	ids := map[string]bool{}
	for _, p := range []pod{leader, worker} {
		topo := query(t, fmt.Sprintf("http://127.0.0.1:%d/query", p.boot))
		if len(topo) != 2 || topo["0"].EngineID == "" || topo["1"].EngineID == "" {
			t.Fatalf("bootstrap /query of the pod on %d = %+v, want its own ranks 0 and 1", p.api, topo)
		}
		ids[topo["0"].EngineID], ids[topo["1"].EngineID] = true, true
		for rank, want := range map[string]int{"1": http.StatusOK, "2": http.StatusBadRequest} {
			req, _ := http.NewRequest(http.MethodPost, fmt.Sprintf("http://127.0.0.1:%d/v1/completions", p.api),
				strings.NewReader(`{"model":"m","max_tokens":1,"prompt":"hello there"}`))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set(vllm.DataParallelRankHeader, rank)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != want || (want == http.StatusBadRequest && !strings.Contains(string(b), "data_parallel_rank 2 is out of range [0, 2).")) {
				t.Errorf("pod on %d, rank %s: %d %s, want %d", p.api, rank, resp.StatusCode, b, want)
			}
		}
	}
	if len(ids) != 4 {
		t.Errorf("engine ids %v: want 4, one per rank of the replica", ids)
	}
	worker.stop()
	err := <-worker.errc
	worker.errc <- err // for serve's cleanup
	select {
	case err := <-leader.errc:
		leader.errc <- err
		if !errors.Is(err, errGroupLost) {
			t.Errorf("the leader ended with %v, want %v", err, errGroupLost)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the leader still runs 10 s after the other pod of its group went")
	}
}

// A pod whose leader address is not its own cannot host the coordinator: the start fails,
// as vLLM's bind of an address the host does not have fails.
func TestGroupLeaderBindsTheAddressItWasGiven(t *testing.T) {
	s, err := vllmcli.Parse([]string{"serve", "m", "--host=127.0.0.1", fmt.Sprintf("--port=%d", freePort(t)), "-dp", "4",
		"--data-parallel-size-local", "2", "--data-parallel-start-rank", "0", "--data-parallel-address", "192.0.2.1",
		"--data-parallel-rpc-port", fmt.Sprint(freePort(t))})
	if err != nil {
		t.Fatal(err)
	}
	env := podEnv(t)
	err = run(t.Context(), s, func(k string) string { return env[k] }, logr.Discard())
	if err == nil || !strings.Contains(err.Error(), "data-parallel coordinator on 192.0.2.1") {
		t.Errorf("run = %v, want the coordinator's bind to fail", err)
	}
}
