//go:build realengine

package realengine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/controllers"
	"pdcluster.dev/pdcluster-operator/controllers/kvverify"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
)

// Releases whose Mooncake worker reports a pull with no local block as finished receiving, so
// the gate keeps the report from the scheduler (the stock decode engine dies of it: test/e2e
// TestRealVLLMPods shows it in the operator's pods on 0.30.0); 0.32.0 added upstream's
// `and any(pull_meta.local_block_ids)`, and the gate's records of such pulls expire instead.
var reportsEmptyPulls = map[string]bool{"0.30.0": true, "0.32.0": false}

// Claims that test/e2e TestRealVLLMPods proves on a release too.
const (
	claimKVVerified        = "KVTransferVerified from the engines' own counts"
	claimRefusedLeg        = "a decode leg the API server refuses"
	claimAbortWhileWaiting = "a client that gives up while decode waits"
)

// provenInPods are the claims test/e2e TestRealVLLMPods proves on each release in the
// operator's pods, under the kubelet, and this suite leaves to it there (each costs a minute of
// the two cores): on 0.30.0 the gate keeps a refused decode leg's and an abort's reports and
// the decode engine serves on (the counts in status.decode.gate; here the same on 0.32.0, whose
// records expire instead); on 0.32.0 KVTransferVerified True from the engines' metrics (here
// True and False/DecodeRecomputing on 0.30.0).
var provenInPods = map[string]map[string]string{
	"0.30.0": {
		claimRefusedLeg:        "TestRealVLLMPods, gateKeepsTheEngine",
		claimAbortWhileWaiting: "TestRealVLLMPods, gateKeepsTheEngine",
	},
	"0.32.0": {claimKVVerified: "TestRealVLLMPods, KVTransferVerified from the real engines"},
}

// startup bounds an engine's start: measured 75-250 s on 2 cores, slower beside a build.
const startup = 10 * time.Minute

// deployment is one release's engines and router: one prefill pod and one decode pod, both
// gated as rendered, behind the router. (The stock decode engine, the control, runs in the
// operator's pods: test/e2e TestRealVLLMPods.)
type deployment struct {
	release  Release
	prefill  *Pod
	gated    *Pod
	gatedVia *Router
}

func TestRealEngines(t *testing.T) {
	releases, err := Releases()
	if err != nil {
		t.Fatal(err)
	}
	for _, rel := range releases {
		t.Run("vLLM "+rel.Version, func(t *testing.T) {
			if _, ok := reportsEmptyPulls[rel.Version]; !ok {
				t.Fatalf("vLLM %s is not measured in reportsEmptyPulls: run it and add whether its worker reports a pull with no local block", rel.Version)
			}
			d := deploy(t, rel)
			for _, c := range []struct {
				name string
				run  func(*testing.T)
			}{
				{"a request through the router decodes from prefill's KV", d.testNormal},
				{"the engine's log says the gate loaded", d.testLoadLine},
				{"the same prompt twice: decode's own prefix cache", d.testPrefixHit},
				{"KVEvents: the router's index holds what the engines cached", d.testKVEvents},
				{claimKVVerified, d.testKVVerification},
				{"a producer's held KV reaches the sidecar", d.testHeldSends},
				{claimRefusedLeg, d.testRejectedDecodeLeg},
				{claimAbortWhileWaiting, d.testAbortWhileWaiting},
				{"two clients with one X-Request-Id", d.testDuplicateRequestIDs},
				// Last: they kill and restart engines.
				{"prefill killed while its leg waits", d.testPrefillKilled},
				{"decode killed while it generates", d.testDecodeKilled},
			} {
				t.Run(c.name, func(t *testing.T) {
					if where := provenInPods[rel.Version][c.name]; where != "" {
						t.Skipf("proven on vLLM %s in the operator's pods: %s", rel.Version, where)
					}
					c.run(t)
				})
			}
		})
	}
}

// deploy starts rel's engines and router.
func deploy(t testing.TB, rel Release) *deployment {
	t.Helper()
	ctx := context.Background()
	bin, err := filepath.Abs(filepath.Join("..", "..", "bin"))
	if err != nil {
		t.Fatal(err)
	}
	shim, _ := filepath.Abs(filepath.Join("testdata", "shim"))
	// Unix socket paths hold 108 bytes: a short directory, kept when a test fails.
	work, err := os.MkdirTemp("", "re-"+rel.Version+"-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("logs kept in %s", work)
			return
		}
		_ = os.RemoveAll(work)
	})
	o := Options{Release: rel, BinDir: bin, Shim: shim, WorkDir: work}
	pdc, err := LoadPDCluster(filepath.Join("testdata", "pdcluster.yaml"), filepath.Join("testdata", "tiny-llama"))
	if err != nil {
		t.Fatal(err)
	}
	// The routers follow the engines' KV cache events (testKVEvents): the rendered
	// --kv-events-config on vLLM itself, and the router on the other side.
	pdc.Spec.Router.Routing.Strategy = v1alpha1.RoutingKVEvents
	gated, err := Render(pdc)
	if err != nil {
		t.Fatal(err)
	}
	d := &deployment{release: rel}
	var pods []*Pod
	t.Cleanup(func() {
		for _, p := range pods {
			p.Stop()
		}
	})
	for _, p := range []struct {
		name string
		r    Rendered
		into **Pod
	}{
		{"prefill", gated, &d.prefill},
		{"decode-gated", gated, &d.gated},
	} {
		dep := p.r.Decode
		if p.name == "prefill" {
			dep = p.r.Prefill
		}
		pod, err := StartPod(o, p.name, dep, p.r.ConfigMaps)
		if err != nil {
			t.Fatal(err)
		}
		pods = append(pods, pod)
		*p.into = pod
	}
	for _, p := range pods {
		if err := WaitOK(ctx, p.Engine+"/health", p.EngineProc, startup); err != nil {
			t.Fatal(err)
		}
		if err := WaitOK(ctx, p.Sidecar+"/readyz", p.SidecarProc, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	cm, err := gated.RouterConfigMap()
	if err != nil {
		t.Fatal(err)
	}
	router, err := StartRouter(o, "router-gated", gated.Router, cm, []*Pod{d.prefill}, []*Pod{d.gated})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { router.Proc.Stop(5 * time.Second) })
	if err := WaitOK(ctx, router.URL+"/ready", router.Proc, time.Minute); err != nil {
		t.Fatal(err)
	}
	d.gatedVia = router
	return d
}

// The P/D path on real engines, through the product's router: decode reads every prompt token's
// KV from prefill (vLLM's own count), and its tokens are the ones a single engine computes.
func (d *deployment) testNormal(t *testing.T) {
	ctx := context.Background()
	// 100 tokens with 64-token blocks: a whole block and a partial one, both transferred.
	c := Completion{Prompt: Prompt(1, 100), MaxTokens: 8}
	before, err := EngineStats(ctx, d.gated.Engine)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Complete(ctx, d.gatedVia.URL, c)
	if err != nil || got.Status != 200 {
		t.Fatalf("through the router: %d %s %v", got.Status, got.Body, err)
	}
	after, err := EngineStats(ctx, d.gated.Engine)
	if err != nil {
		t.Fatal(err)
	}
	if ext := after.ExternalKVTokens - before.ExternalKVTokens; ext != float64(len(c.Prompt)) {
		t.Errorf("decode counted %v prompt tokens from external KV, want the prompt's %d (local compute %v)", ext, len(c.Prompt), after.LocalComputeTokens-before.LocalComputeTokens)
	}
	// The same prompt on one engine alone (prefill computes and decodes it itself).
	alone, err := Complete(ctx, d.prefill.Engine, c)
	if err != nil || alone.Status != 200 {
		t.Fatalf("one engine alone: %d %s %v", alone.Status, alone.Body, err)
	}
	if len(got.TokenIDs) != c.MaxTokens || fmt.Sprint(got.TokenIDs) != fmt.Sprint(alone.TokenIDs) {
		t.Errorf("P/D answered tokens %v, one engine alone %v", got.TokenIDs, alone.TokenIDs)
	}
}

func (d *deployment) testLoadLine(t *testing.T) {
	log, err := os.ReadFile(d.gated.EngineProc.Log)
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("pdgate: GatedMooncakeConnector loaded on vLLM %s", d.release.Version)
	if !strings.Contains(string(log), want) {
		t.Errorf("the decode engine's log does not say %q", want)
	}
}

// The same prompt twice through the router: the second time decode holds the prompt's whole
// blocks in its own prefix cache and loads the rest from prefill (vLLM never serves the last
// prompt token from its cache, so a prompt of whole blocks still leaves one block to pull), and
// answers the same tokens. Both classes serve it: a prefix hit on a full-attention model is not
// a pull without local blocks.
func (d *deployment) testPrefixHit(t *testing.T) {
	ctx := context.Background()
	c := Completion{Prompt: Prompt(5, 192), MaxTokens: 6} // three whole 64-token blocks
	first, err := Complete(ctx, d.gatedVia.URL, c)
	if err != nil || first.Status != 200 {
		t.Fatalf("first: %d %s %v", first.Status, first.Body, err)
	}
	before, err := EngineStats(ctx, d.gated.Engine)
	if err != nil {
		t.Fatal(err)
	}
	gateBefore := gateCounts(t, d.gated)
	second, err := Complete(ctx, d.gatedVia.URL, c)
	if err != nil || second.Status != 200 {
		t.Fatalf("second: %d %s %v", second.Status, second.Body, err)
	}
	after, err := EngineStats(ctx, d.gated.Engine)
	if err != nil {
		t.Fatal(err)
	}
	ext, hit := after.ExternalKVTokens-before.ExternalKVTokens, after.LocalCacheHitTokens-before.LocalCacheHitTokens
	local := after.LocalComputeTokens - before.LocalComputeTokens
	t.Logf("second request on decode: %v tokens from its prefix cache, %v from prefill, %v computed", hit, ext, local)
	if hit != 128 || ext != 64 || local != 0 {
		t.Errorf("second request: %v cached, %v external, %v computed; want the first two blocks cached and the last pulled (128, 64, 0)", hit, ext, local)
	}
	if fmt.Sprint(first.TokenIDs) != fmt.Sprint(second.TokenIDs) {
		t.Errorf("the same prompt answered %v, then %v", first.TokenIDs, second.TokenIDs)
	}
	if !Healthy(ctx, d.gated.Engine) {
		t.Errorf("decode engine unhealthy after a prefix hit")
	}
	// The pull had a local block: the gate passed it and kept nothing.
	time.Sleep(6 * time.Second) // the next heartbeat (every 5 s)
	if now := gateCounts(t, d.gated); now.Gated != gateBefore.Gated {
		t.Errorf("the gate kept %d reports of a prefix hit's pull from the scheduler, want 0", now.Gated-gateBefore.Gated)
	}
}

// KVEvents on real vLLM: both engines publish on the rendered --kv-events-config (its ports
// renumbered on loopback as the pod's others are) and the router follows them. A prompt of
// three whole blocks, once served, is in the router's index for both pools, from the engines'
// own events: prefill computed the blocks, decode pulled them; the same prompt again is routed
// on the three blocks each engine holds, by the router's hash of the prompt's token ids
// matching what it learned from the events' (vLLM's block boundaries, its parent chain).
func (d *deployment) testKVEvents(t *testing.T) {
	ctx := context.Background()
	via := d.gatedVia.URL
	metric := func(name, pool string) float64 {
		t.Helper()
		v, err := Metric(ctx, d.gatedVia.MetricsURL, name, "pool", pool)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	// Until an engine's events state its block size the router cannot cut a prompt into
	// blocks: one request of another prompt first, as the earlier subtests send.
	if a, err := Complete(ctx, via, Completion{Prompt: Prompt(18, 100), MaxTokens: 1}); err != nil || a.Status != 200 {
		t.Fatalf("warm-up: %d %s %v", a.Status, a.Body, err)
	}
	time.Sleep(2 * time.Second)
	counters := []string{"pdcluster_router_kv_events_matched_blocks_total", "pdcluster_router_kv_events_prompt_blocks_total", "pdcluster_router_kv_events_estimated_total"}
	before := map[string][]float64{}
	for _, pool := range []string{"prefill", "decode"} {
		for _, name := range counters {
			before[pool] = append(before[pool], metric(name, pool))
		}
	}
	c := Completion{Prompt: Prompt(17, 192), MaxTokens: 2} // three whole 64-token blocks
	if a, err := Complete(ctx, via, c); err != nil || a.Status != 200 {
		t.Fatalf("first: %d %s %v", a.Status, a.Body, err)
	}
	// The engines publish after their scheduler step; give the events a moment.
	time.Sleep(2 * time.Second)
	if a, err := Complete(ctx, via, c); err != nil || a.Status != 200 {
		t.Fatalf("second: %d %s %v", a.Status, a.Body, err)
	}
	for _, pool := range []string{"prefill", "decode"} {
		matched := metric(counters[0], pool) - before[pool][0]
		prompt := metric(counters[1], pool) - before[pool][1]
		estimated := metric(counters[2], pool) - before[pool][2]
		index := metric("pdcluster_router_kv_events_index_blocks", pool)
		t.Logf("%s: %v of %v prompt blocks matched over both requests, %v estimated, %v blocks in the index", pool, matched, prompt, estimated, index)
		if prompt != 6 || matched != 3 || estimated != 0 {
			t.Errorf("%s: %v of %v blocks matched, %v requests estimated; want 3 of 6 (the second request's three), none estimated", pool, matched, prompt, estimated)
		}
	}
	if lost := metric("pdcluster_router_kv_events_lost_total", "prefill") + metric("pdcluster_router_kv_events_lost_total", "decode"); lost != 0 {
		t.Errorf("%v losses of KV events on loopback", lost)
	}
}

// The operator's KV verification on real engines: the sidecar's engine counts (scraped from
// vLLM's /metrics), read as the manager reads them, judge ExternalKVObserved for traffic through
// the router and DecodeRecomputing for prompts that reach decode without kv_transfer_params.
func (d *deployment) testKVVerification(t *testing.T) {
	ctx := context.Background()
	pdc, err := LoadPDCluster(filepath.Join("testdata", "pdcluster.yaml"), filepath.Join("testdata", "tiny-llama"))
	if err != nil {
		t.Fatal(err)
	}
	pdc.SetDefaults()
	policy := kvverify.PolicyOf(pdc)
	verdict := func(send func(i int) (Answer, error)) kvverify.Verdict {
		t.Helper()
		first := engineSample(t, d.gated, nil, 0)
		// More than kvverify.MinTokens prompt tokens, as a window must hold to be judged.
		for i := range 4 {
			if a, err := send(i); err != nil || a.Status != 200 {
				t.Fatalf("request %d: %d %s %v", i, a.Status, a.Body, err)
			}
		}
		last := engineSample(t, d.gated, &first, 4*100)
		return kvverify.Evaluate([]kvverify.Pod{{Name: d.gated.Name, Role: v1alpha1.RoleDecode, GateReported: true,
			Samples: []kvverify.Sample{first, last}}}, policy, nil)
	}
	through := verdict(func(i int) (Answer, error) {
		return Complete(ctx, d.gatedVia.URL, Completion{Prompt: Prompt(200+i, 100), MaxTokens: 2})
	})
	if through.Status != metav1.ConditionTrue || through.Reason != v1alpha1.ReasonExternalKVObserved {
		t.Errorf("traffic through the router: %s/%s %q, want True/%s", through.Status, through.Reason, through.Message, v1alpha1.ReasonExternalKVObserved)
	}
	// What a router that drops kv_transfer_params would send: the plain request, to decode.
	dropped := verdict(func(i int) (Answer, error) {
		return Complete(ctx, d.gated.Engine, Completion{Prompt: Prompt(300+i, 100), MaxTokens: 2})
	})
	if dropped.Status != metav1.ConditionFalse || dropped.Reason != v1alpha1.ReasonDecodeRecomputing {
		t.Errorf("prompts without kv_transfer_params: %s/%s %q, want False/%s", dropped.Status, dropped.Reason, dropped.Message, v1alpha1.ReasonDecodeRecomputing)
	}
}

// engineSample is the KV evidence in the pod's GET /gate, once the sidecar's scrapes of the
// engine (every --engine-metrics-interval) count tokens more prompt tokens than after's; nil:
// the current one.
func engineSample(t *testing.T, p *Pod, after *kvverify.Sample, tokens int) kvverify.Sample {
	t.Helper()
	for end := time.Now().Add(time.Minute); time.Now().Before(end); time.Sleep(time.Second) {
		s, ok := kvverify.SampleOf(time.Now(), gateState(t, p))
		if ok && (after == nil || s.External+s.LocalCompute >= after.External+after.LocalCompute+float64(tokens)) {
			return s
		}
	}
	t.Fatalf("%s's sidecar has not counted %d more prompt tokens after a minute", p.Name, tokens)
	return kvverify.Sample{}
}

// A prefill leg whose decode has not pulled yet: vLLM's producer holds the request's KV
// (request_finished delays the free), the gate counts it in held_sends, and the operator's
// reader sees it (the drain waits on it, the pod-deletion cost follows it). The decode leg's
// pull releases it.
func (d *deployment) testHeldSends(t *testing.T) {
	ctx := context.Background()
	held := func() int64 {
		st := gateState(t, d.prefill)
		if st.Report == nil || st.Report.HeldSends == nil {
			t.Fatalf("the prefill gate reports no held_sends: %+v", st)
		}
		return *st.Report.HeldSends
	}
	waitHeld := func(want int64) {
		t.Helper()
		var got int64
		for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(time.Second) {
			if got = held(); got == want {
				return
			}
		}
		t.Fatalf("prefill holds %d sends, want %d", got, want)
	}
	waitHeld(0)
	transfer := fmt.Sprintf("xfer-held-%d", time.Now().UnixNano())
	prompt := Prompt(6, 100)
	leg, err := Complete(ctx, d.prefill.Engine, Completion{Prompt: prompt, MaxTokens: 1,
		KVTransferParams: map[string]any{vllm.DoRemoteDecode: true, vllm.DoRemotePrefill: false, vllm.TransferID: transfer}})
	if err != nil || leg.Status != 200 {
		t.Fatalf("prefill leg: %d %s %v", leg.Status, leg.Body, err)
	}
	waitHeld(1)
	topo, err := bootstrap.NewClient().Query(ctx, d.prefill.Bootstrap)
	if err != nil || len(topo) == 0 {
		t.Fatalf("prefill's bootstrap registry: %v %v", topo, err)
	}
	var engineID string
	for _, e := range topo {
		engineID = e.EngineID
	}
	pulled, err := Complete(ctx, d.gated.Engine, Completion{Prompt: prompt, MaxTokens: 2, KVTransferParams: map[string]any{
		vllm.DoRemotePrefill: true, vllm.DoRemoteDecode: false, vllm.TransferID: transfer,
		vllm.RemoteBootstrapAddr: d.prefill.Bootstrap, vllm.RemoteEngineID: engineID}})
	if err != nil || pulled.Status != 200 {
		t.Fatalf("decode leg: %d %s %v", pulled.Status, pulled.Body, err)
	}
	waitHeld(0)
}

// A decode leg vLLM's API server refuses (max_tokens past --max-model-len: HTTP 400) after a
// normal prefill leg: vLLM 0.30 submits a pre-aborted request so that the connector tells
// prefill to free its KV, a pull with no local block, sent with the engine's next step (an idle
// engine sends nothing). The stock decode engine of a release whose worker reports such a pull
// as finished dies on that step; the gated one keeps it from the scheduler, counts it, and
// serves on.
func (d *deployment) testRejectedDecodeLeg(t *testing.T) {
	refused := Completion{Prompt: Prompt(2, 40), MaxTokens: 5000}
	d.afterEmptyPulls(t, 3, 3, func(t *testing.T, via *Router) {
		for i := range 3 {
			got, err := Complete(context.Background(), via.URL, refused)
			if err != nil {
				t.Fatal(err)
			}
			if got.Status != 400 {
				t.Fatalf("request %d: max_tokens %d past the model length answered %d %s, want vLLM's 400", i, refused.MaxTokens, got.Status, got.Body)
			}
		}
	})
}

// A client that gives up while its decode leg waits (decode's --max-num-seqs are taken by long
// requests): vLLM aborts the waiting request, whose connector then tells prefill to free its
// KV with a pull of no local block; vLLM 0.30's API server also submits a pre-aborted request
// for the cancelled one, a second such pull for the same transfer.
func (d *deployment) testAbortWhileWaiting(t *testing.T) {
	// Its two pulls name one request: one record or two, and vLLM 0.30 reports it once.
	d.afterEmptyPulls(t, 1, 2, func(t *testing.T, via *Router) {
		decode := d.gated
		busy := d.fill(t, decode)
		ctx, cancel := context.WithCancel(context.Background())
		answered := make(chan error, 1)
		go func() {
			got, err := Complete(ctx, via.URL, Completion{Prompt: Prompt(4, 90), MaxTokens: 4})
			if err == nil {
				err = fmt.Errorf("answered %d before the client gave up", got.Status)
			} else {
				err = nil
			}
			answered <- err
		}()
		// The client gives up once its decode leg waits in decode's queue.
		waitQueued(t, decode)
		cancel()
		if err := <-answered; err != nil {
			t.Fatalf("the request behind the full decode engine %v", err)
		}
		<-busy
	})
}

// Two clients that send the same X-Request-Id (the router hands a client's id to both legs, as
// the engines' request id): vLLM adds a random suffix to every request id it is given (its
// InputProcessor.assign_request_id), so both complete with their own prompt's tokens, and one
// client giving up aborts its own request only (vLLM aborts a disconnected request by its
// internal id), on both engines. The router therefore keeps the client's id.
func (d *deployment) testDuplicateRequestIDs(t *testing.T) {
	ctx := context.Background()
	const id = "one-id-two-clients"
	alone := func(c Completion) []int {
		t.Helper()
		a, err := Complete(ctx, d.prefill.Engine, Completion{Prompt: c.Prompt, MaxTokens: c.MaxTokens})
		if err != nil || a.Status != 200 {
			t.Fatalf("one engine alone: %d %s %v", a.Status, a.Body, err)
		}
		return a.TokenIDs
	}
	type result struct {
		a   Answer
		err error
	}
	start := func(ctx context.Context, c Completion) <-chan result {
		out := make(chan result, 1)
		go func() {
			a, err := Complete(ctx, d.gatedVia.URL, c)
			out <- result{a, err}
		}()
		return out
	}
	// Both run in decode at once and answer their own tokens.
	first := Completion{Prompt: Prompt(11, 100), MaxTokens: 300, RequestID: id}
	second := Completion{Prompt: Prompt(12, 100), MaxTokens: 8, RequestID: id}
	firstDone := start(ctx, first)
	if !waitGauge(d.gated, vllm.MetricNumRequestsRunning, 1) {
		t.Fatal("decode does not run the first request")
	}
	secondDone := start(ctx, second)
	for _, r := range []struct {
		c    Completion
		done <-chan result
	}{{first, firstDone}, {second, secondDone}} {
		got := <-r.done
		if got.err != nil || got.a.Status != 200 {
			t.Fatalf("a request sharing its X-Request-Id: %d %s %v", got.a.Status, got.a.Body, got.err)
		}
		if want := alone(r.c); fmt.Sprint(got.a.TokenIDs) != fmt.Sprint(want) {
			t.Errorf("a request sharing its X-Request-Id answered %v, the same prompt alone %v", got.a.TokenIDs, want)
		}
	}

	// One client gives up while the other's request, same id, runs: the other completes.
	gone, giveUp := context.WithCancel(ctx)
	goneDone := start(gone, Completion{Prompt: Prompt(13, 100), MaxTokens: 900, RequestID: id}) // up to the model length, 1024
	if !waitGauge(d.gated, vllm.MetricNumRequestsRunning, 1) {
		t.Fatal("decode does not run the request that will be given up")
	}
	stays := Completion{Prompt: Prompt(14, 100), MaxTokens: 200, RequestID: id}
	staysDone := start(ctx, stays)
	if !waitGauge(d.gated, vllm.MetricNumRequestsRunning, 2) {
		t.Fatal("decode does not run both requests")
	}
	giveUp()
	if r := <-goneDone; r.err == nil {
		t.Logf("the given-up request answered %d before the client left", r.a.Status)
	}
	got := <-staysDone
	if got.err != nil || got.a.Status != 200 {
		t.Fatalf("the request whose twin's client gave up: %d %s %v", got.a.Status, got.a.Body, got.err)
	}
	if want := alone(stays); fmt.Sprint(got.a.TokenIDs) != fmt.Sprint(want) {
		t.Errorf("the request whose twin's client gave up answered %v, the same prompt alone %v", got.a.TokenIDs, want)
	}
	for _, p := range []*Pod{d.prefill, d.gated} {
		if !Healthy(ctx, p.Engine) {
			t.Errorf("%s unhealthy after two requests shared an id; its log ends:\n%s", p.Name, p.EngineProc.Tail(3000))
		}
	}
}

// The router's failure policy with a real prefill engine killed while a request's prefill leg
// waits behind others (its --max-num-seqs taken): with no other prefill the client gets an
// error, not a hang; decode, whose pull fails, serves on; and once the prefill engine is back
// (a new engine id in its bootstrap registry) requests through the router succeed again.
func (d *deployment) testPrefillKilled(t *testing.T) {
	ctx := context.Background()
	busy := d.fill(t, d.prefill)
	answer := make(chan Answer, 1)
	go func() {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		a, err := Complete(ctx, d.gatedVia.URL, Completion{Prompt: Prompt(8, 100), MaxTokens: 4})
		if err != nil {
			a.Body = err.Error()
		}
		answer <- a
	}()
	waitQueued(t, d.prefill) // its prefill leg waits behind the fillers
	d.prefill.EngineProc.Kill()
	if a := <-answer; a.Status == 200 || a.Status == 0 {
		t.Errorf("a request whose only prefill died answered %d %s, want the router's error", a.Status, a.Body)
	}
	<-busy
	if !Healthy(ctx, d.gated.Engine) {
		t.Fatalf("decode engine unhealthy after its prefill died; its log ends:\n%s", d.gated.EngineProc.Tail(3000))
	}
	if err := d.prefill.RestartEngine(); err != nil {
		t.Fatal(err)
	}
	if err := WaitOK(ctx, d.prefill.Engine+"/health", d.prefill.EngineProc, startup); err != nil {
		t.Fatal(err)
	}
	d.servesAgain(t, d.gatedVia)
}

// A real decode engine killed while it generates: the answer broke before the client got a
// byte, and with no other decode the router answers an error at once; once the engine is back
// the router serves again (a pool of one is asked whether its engine returned).
func (d *deployment) testDecodeKilled(t *testing.T) {
	ctx := context.Background()
	answer := make(chan Answer, 1)
	go func() {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		a, err := Complete(ctx, d.gatedVia.URL, Completion{Prompt: Prompt(9, 100), MaxTokens: 600})
		if err != nil {
			a.Body = err.Error()
		}
		answer <- a
	}()
	// Killed while it runs the request (600 tokens: about a second even on an idle machine).
	if !waitGauge(d.gated, vllm.MetricNumRequestsRunning, 1) {
		t.Fatal("decode does not run the request")
	}
	d.gated.EngineProc.Kill()
	if a := <-answer; a.Status < 500 {
		t.Errorf("a request whose decode engine died answered %d %s, want the router's 5xx", a.Status, a.Body)
	}
	if err := d.gated.RestartEngine(); err != nil {
		t.Fatal(err)
	}
	if err := WaitOK(ctx, d.gated.Engine+"/health", d.gated.EngineProc, startup); err != nil {
		t.Fatal(err)
	}
	d.servesAgain(t, d.gatedVia)
}

// fill takes every sequence slot of p (fixture: --max-num-seqs=4) with long plain requests,
// and returns once they all run; the channel closes when they have ended (or failed). They run
// for seconds even on an idle machine: 1,000 tokens each, up to the model length.
func (d *deployment) fill(t *testing.T, p *Pod) <-chan struct{} {
	t.Helper()
	done := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			_, _ = Complete(context.Background(), p.Engine, Completion{Prompt: Prompt(100+i, 8), MaxTokens: 1000})
		})
	}
	go func() { wg.Wait(); close(done) }()
	if !waitGauge(p, vllm.MetricNumRequestsRunning, 4) {
		t.Fatalf("%s does not run the 4 long requests", p.Name)
	}
	return done
}

// waitQueued returns once p holds a request in its waiting queue (behind fill's requests).
func waitQueued(t *testing.T, p *Pod) {
	t.Helper()
	if !waitGauge(p, vllm.MetricNumRequestsWaiting, 1) {
		t.Fatalf("no request waits in %s's queue", p.Name)
	}
}

// waitGauge polls p's /metrics until the gauge, summed over its series, reaches at least want
// (false after 30 s).
func waitGauge(p *Pod, gauge string, want float64) bool {
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if v, err := Gauge(context.Background(), p.Engine, gauge); err == nil && v >= want {
			return true
		}
	}
	return false
}

// servesAgain waits for a request through via to succeed.
func (d *deployment) servesAgain(t *testing.T, via *Router) {
	t.Helper()
	var last Answer
	for end := time.Now().Add(2 * time.Minute); time.Now().Before(end); time.Sleep(2 * time.Second) {
		a, err := Complete(context.Background(), via.URL, Completion{Prompt: Prompt(10, 70), MaxTokens: 2})
		if err == nil && a.Status == 200 {
			return
		}
		last = a
	}
	t.Fatalf("the router does not serve again 2 minutes after the engine came back: %d %s", last.Status, last.Body)
}

// afterEmptyPulls runs cause through the router and checks what follows: the next request's
// step carries the pulls with no local block (wantGated to maxGated of them in the gate's
// records); the gated decode engine serves it and stays healthy, and the gate's records go
// with their reports (kept from the scheduler, which a stock engine of such a release dies of)
// or by the deadline-and-steps rule.
func (d *deployment) afterEmptyPulls(t *testing.T, wantGated, maxGated int64, cause func(*testing.T, *Router)) {
	ctx := context.Background()
	reports := reportsEmptyPulls[d.release.Version]
	before := gateCounts(t, d.gated)
	cause(t, d.gatedVia)
	next, err := Complete(ctx, d.gatedVia.URL, Completion{Prompt: Prompt(3, 70), MaxTokens: 4})
	if err != nil {
		t.Fatal(err)
	}
	if waitUnhealthy(ctx, d.gated, 15*time.Second) {
		t.Fatalf("the gated decode engine died (the next request answered %d %s); its log ends:\n%s", next.Status, next.Body, d.gated.EngineProc.Tail(3000))
	}
	if next.Status != 200 {
		t.Fatalf("the request after: %d %s", next.Status, next.Body)
	}
	// The gate records every pull with no local block (wantGated to maxGated of them). Where
	// vLLM reports them the gate keeps the reports from the scheduler and drops each record
	// with its report; a record no report comes for (vLLM 0.30 reports an abort's two pulls,
	// which name one request, once: measured, one kept and one expired) and, where vLLM no
	// longer reports them, every record goes by the deadline-and-steps rule instead (the
	// fixture's decode pods: PDGATE_TTL_SECONDS=20, then 64 scheduler steps).
	if reports {
		waitGate(t, d.gated, func(c vllm.Counts) bool { return c.Passed > before.Passed && c.Gated-before.Gated >= min(wantGated, 1) })
	}
	after := d.stepPastRecords(t, d.gatedVia, d.gated)
	gated, expired := after.Gated-before.Gated, after.Expired-before.Expired
	t.Logf("the gate kept %d reports from the scheduler; %d of its records expired", gated, expired)
	if reports && gated < wantGated || !reports && gated != 0 {
		t.Errorf("the gate kept %d completions from the scheduler, want at least %d where vLLM reports them, else 0", gated, wantGated)
	}
	if gated+expired < wantGated || gated+expired > maxGated {
		t.Errorf("the gate's records: %d reported, %d expired; want %d to %d in all", gated, expired, wantGated, maxGated)
	}
}

// recordTTL is PDGATE_TTL_SECONDS on the fixture's decode pods.
const recordTTL = 20 * time.Second

// stepPastRecords waits out the gate's record deadline, then sends requests through via (each
// a few dozen decode steps) until p's gate has seen more than its grace steps (64) since, and
// returns the counts p's sidecar reports then.
func (d *deployment) stepPastRecords(t *testing.T, via *Router, p *Pod) vllm.Counts {
	t.Helper()
	time.Sleep(recordTTL + time.Second)
	for i := range 4 { // 4 x 32 tokens: well past 64 steps
		a, err := Complete(context.Background(), via.URL, Completion{Prompt: Prompt(20+i, 70), MaxTokens: 32})
		if err != nil || a.Status != 200 {
			t.Fatalf("a request to step the engine: %d %s %v", a.Status, a.Body, err)
		}
	}
	time.Sleep(6 * time.Second) // the next heartbeat (every 5 s)
	return gateCounts(t, p)
}

// waitUnhealthy watches the engine for window: true once it dies or /health fails.
func waitUnhealthy(ctx context.Context, p *Pod, window time.Duration) bool {
	for end := time.Now().Add(window); time.Now().Before(end); time.Sleep(time.Second) {
		if exited, _ := p.EngineProc.Exited(); exited || !Healthy(ctx, p.Engine) {
			return true
		}
	}
	return false
}

// gateCounts is what the operator reads from the pod's sidecar (GET /gate, as the manager's
// gate reader does), now.
func gateCounts(t *testing.T, p *Pod) vllm.Counts {
	t.Helper()
	st := gateState(t, p)
	if st.Report == nil {
		return vllm.Counts{}
	}
	return st.Report.Counts
}

func gateState(t *testing.T, p *Pod) vllm.State {
	t.Helper()
	reader := controllers.NewHTTPGateReader()
	reader.Addr = func(*corev1.Pod) string { return strings.TrimPrefix(p.Sidecar, "http://") }
	st, err := reader.ReadGate(context.Background(), &corev1.Pod{})
	if err != nil {
		t.Fatalf("the operator's gate reader on %s: %v", p.Name, err)
	}
	return st
}

// waitGate waits for the gate's heartbeat (every 5 s) to satisfy ok.
func waitGate(t *testing.T, p *Pod, ok func(vllm.Counts) bool) vllm.Counts {
	t.Helper()
	var c vllm.Counts
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(time.Second) {
		if c = gateCounts(t, p); ok(c) {
			return c
		}
	}
	t.Fatalf("%s's gate counts %+v after 30 s", p.Name, c)
	return c
}
