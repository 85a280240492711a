package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/realengine"
)

// The sample `make run` applies by default: real vLLM from the engine image hack/vllm-image.sh
// builds (config/samples/local-node-vllm.yaml).
const (
	vllmSample  = "config/samples/local-node-vllm.yaml"
	vllmNS      = "vllm"
	vllmVersion = "0.32.0"
)

// vllmAnswer is what the tests read of an OpenAI completion or chat completion.
type vllmAnswer struct {
	Status  int
	Body    string
	Text    string
	IDs     []int // choices[0].token_ids (return_token_ids)
	Prompt  int   // usage.prompt_tokens
	Tokens  int   // usage.completion_tokens
	Chatted bool
}

// openAI posts req to base+path and reads the answer (within 2 minutes).
func openAI(base, path string, req map[string]any) (vllmAnswer, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return openAIContext(ctx, base, path, req)
}

// openAIContext is openAI until ctx ends (a client that gives up).
func openAIContext(ctx context.Context, base, path string, req map[string]any) (vllmAnswer, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return vllmAnswer{}, err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(body))
	if err != nil {
		return vllmAnswer{}, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(hreq)
	if err != nil {
		return vllmAnswer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return vllmAnswer{}, err
	}
	a := vllmAnswer{Status: resp.StatusCode, Body: string(b)}
	var out struct {
		Choices []struct {
			Text     string `json:"text"`
			TokenIDs []int  `json:"token_ids"`
			Message  *struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err == nil && len(out.Choices) == 1 {
		a.Text, a.IDs = out.Choices[0].Text, out.Choices[0].TokenIDs
		if m := out.Choices[0].Message; m != nil {
			a.Text, a.Chatted = m.Content, true
		}
		a.Prompt, a.Tokens = out.Usage.PromptTokens, out.Usage.CompletionTokens
	}
	return a, nil
}

// TestRealVLLMPods runs `make run`'s default sample, real vLLM, in the operator's own pods on
// the real node: the engine image's vLLM (its CPU build) with the plugin from the operator's
// ConfigMap, the sidecars, the router, every NetworkPolicy enforced. It proves in pods what
// test/realengine proves on loopback: the engines are vLLM and load the gate, a chat and a
// text completion through the router Service are served from KV decode pulled from prefill
// (decode's external-KV prompt tokens are the prompt's), with the tokens one engine alone
// computes, and the operator's KVTransferVerified and gate counts come from the real engines.
func TestRealVLLMPods(t *testing.T) {
	image, controlImage := os.Getenv("PDCLUSTER_E2E_VLLM_IMAGE"), os.Getenv("PDCLUSTER_E2E_VLLM_CONTROL_IMAGE")
	if os.Getenv("PDCLUSTER_E2E_REAL_NODE") == "" || image == "" {
		t.Skip("needs the local cluster's real node and vLLM's engine image: run hack/e2e.sh (make test does)")
	}
	if !strings.HasSuffix(controlImage, ":"+controlVersion) {
		t.Fatalf("PDCLUSTER_E2E_VLLM_CONTROL_IMAGE %q: want vLLM %s's CPU image (hack/e2e.sh pushes it)", controlImage, controlVersion)
	}
	e := setup(t)
	raw, err := os.ReadFile(filepath.Join("..", "..", vllmSample))
	if err != nil {
		t.Fatal(err)
	}
	var pdc v1alpha1.PDCluster
	if err := yaml.UnmarshalStrict(raw, &pdc); err != nil {
		t.Fatalf("%s: %v", vllmSample, err)
	}
	if !strings.HasSuffix(pdc.Spec.Engine.Image, "/pdcluster/vllm-cpu:"+vllmVersion) {
		t.Fatalf("%s runs %s: this test expects vLLM %s's CPU image", vllmSample, pdc.Spec.Engine.Image, vllmVersion)
	}
	// Beside the stand-in sample of the same name: a namespace of its own, the image from the
	// registry e2e.sh pushed it to. Routed by the engines' KV events from the start (the KVEvents
	// claims below; a text prompt or a chat is routed by the estimate, P/D all the same): a
	// rollout of both real engines to turn it on later cost minutes of the two cores.
	pdc.Namespace, pdc.Spec.Engine.Image = vllmNS, image
	pdc.Spec.Router.Routing.Strategy = v1alpha1.RoutingKVEvents
	e.namespace(vllmNS)
	if err := e.c.Create(e.ctx, &pdc); err != nil {
		t.Fatal(err)
	}
	name, model := pdc.Name, pdc.Spec.Model.ServedModelName
	v := vllmCluster{t: t, e: e, name: name, model: model}
	get, pods := v.get, v.pods
	start := time.Now()
	// Pulling a 3 GB image and starting vLLM on a CPU: minutes.
	e.eventuallyWithin("the real-vLLM sample Ready", 15*time.Minute, v.settled)
	t.Logf("Ready %s after the PDCluster was created", time.Since(start).Round(time.Second))
	prefill, decode := pods(v1alpha1.RolePrefill)[0], pods(v1alpha1.RoleDecode)[0]

	var svc corev1.Service
	if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: vllmNS, Name: name + "-router"}, &svc); err != nil {
		t.Fatal(err)
	}
	router := "http://" + svc.Spec.ClusterIP
	v.router = router

	// The engines are vLLM itself, and each loaded the operator's plugin.
	v.runsVLLM(t, vllmVersion, true)
	v.samples(t)

	// A chat completion through the router Service: the chat template and tokenizer the image
	// ships, both legs on real engines.
	chat := map[string]any{"model": model, "messages": []map[string]string{{"role": "user", "content": "Where does decode find its KV cache?"}},
		"max_tokens": 8, "temperature": 0, "ignore_eos": true}
	var got vllmAnswer
	// The router resolves the pools every 5 s: it may not know the new pods yet.
	e.eventuallyWithin("a chat completion through the router Service", time.Minute, func() error {
		var err error
		if got, err = openAI(router, "/v1/chat/completions", chat); err != nil {
			return err
		}
		if got.Status != http.StatusOK || !got.Chatted || got.Tokens != 8 {
			return fmt.Errorf("%d %s", got.Status, got.Body)
		}
		return nil
	})
	t.Logf("chat answered %q", got.Text)

	// A text prompt of several blocks (the image's tokenizer makes about 5 tokens of each of
	// these words; the model takes 1024): decode takes every prompt token from prefill's KV, and
	// the answer is the one engine alone gives for it.
	before, err := realengine.EngineStats(context.Background(), engineURL(decode))
	if err != nil {
		t.Fatal(err)
	}
	text := map[string]any{"model": model, "prompt": words(40), "max_tokens": 8, "temperature": 0, "ignore_eos": true, "return_token_ids": true}
	pd, err := openAI(router, "/v1/completions", text)
	if err != nil || pd.Status != http.StatusOK || pd.Tokens != 8 {
		t.Fatalf("a text completion through the router: %+v %v", pd, err)
	}
	after, err := realengine.EngineStats(context.Background(), engineURL(decode))
	if err != nil {
		t.Fatal(err)
	}
	if ext := after.ExternalKVTokens - before.ExternalKVTokens; ext != float64(pd.Prompt) || pd.Prompt <= 2*realBlock {
		t.Errorf("decode counted %v prompt tokens from external KV for a prompt of %d tokens (local compute %v), want all of them (and more than two blocks)",
			ext, pd.Prompt, after.LocalComputeTokens-before.LocalComputeTokens)
	}
	alone, err := openAI(engineURL(prefill), "/v1/completions", text)
	if err != nil || alone.Status != http.StatusOK {
		t.Fatalf("the same prompt on prefill's engine alone: %+v %v", alone, err)
	}
	if len(pd.IDs) != 8 || fmt.Sprint(pd.IDs) != fmt.Sprint(alone.IDs) {
		t.Errorf("P/D answered tokens %v (%q), one engine alone %v (%q)", pd.IDs, pd.Text, alone.IDs, alone.Text)
	}

	// The operator judges KV transfer from decode's own metrics, and reads the gate's counts.
	e.eventuallyWithin("KVTransferVerified from the real engines", 3*time.Minute, func() error {
		p := get()
		c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionKVTransferVerified)
		if c == nil || c.Status != metav1.ConditionTrue {
			// Traffic inside the verification window keeps the evidence current: new prompts,
			// which decode cannot find in its own prefix cache.
			_, _ = openAI(router, "/v1/completions", map[string]any{"model": model, "prompt": words(40), "max_tokens": 4})
			return fmt.Errorf("KVTransferVerified %+v", c)
		}
		if g := p.Status.Decode.Gate; g == nil || g.ReportingPods != 1 || g.PassedCompletions < 2 {
			return fmt.Errorf("status.decode.gate %+v: want the one decode pod reporting the completions it passed", g)
		}
		return nil
	})
	noRestarts := func() {
		t.Helper()
		for _, pod := range append(pods(v1alpha1.RolePrefill), pods(v1alpha1.RoleDecode)...) {
			for _, c := range pod.Status.ContainerStatuses {
				if c.RestartCount != 0 {
					t.Errorf("%s's %s restarted %d times", pod.Name, c.Name, c.RestartCount)
				}
			}
		}
	}
	noRestarts()

	// KVEvents routing: the router follows each engine's publisher across pod IPs (the
	// engines bind --kv-events-config's wildcard in their pods), so a token-id prompt served
	// once is found whole in both pools' indexes the second time; a pod that is no engine or
	// router of this PDCluster cannot reach the publishers.
	for _, pod := range []corev1.Pod{prefill, decode} {
		if !slices.Contains(pod.Spec.Containers[0].Args, "--kv-events-config") {
			t.Fatalf("the engine %s runs without --kv-events-config", pod.Name)
		}
	}
	routerPod := pods(v1alpha1.RoleRouter)[0]
	routerMetrics := "http://" + net.JoinHostPort(routerPod.Status.PodIP, strconv.Itoa(int(render.RouterMetricsPort))) + "/metrics"
	matched := func() map[string]float64 {
		t.Helper()
		return counterByPool(t, routerMetrics, "pdcluster_router_kv_events_matched_blocks_total")
	}
	seed := 0
	e.eventuallyWithin("a token-id prompt served twice matches its 3 whole blocks in both pools' indexes", 2*time.Minute, func() error {
		seed++
		// 200 tokens of the image's 8000-token vocabulary: 3 whole blocks of 64 and a partial.
		req := map[string]any{"model": model, "prompt": vllmPrompt(seed, 200), "max_tokens": 4}
		if a, err := openAI(router, "/v1/completions", req); err != nil || a.Status != http.StatusOK {
			return fmt.Errorf("first: %+v %v", a, err)
		}
		before := matched()
		if a, err := openAI(router, "/v1/completions", req); err != nil || a.Status != http.StatusOK {
			return fmt.Errorf("second: %+v %v", a, err)
		}
		after := matched()
		for _, pool := range []string{"prefill", "decode"} {
			if d := after[pool] - before[pool]; d != 3 {
				return fmt.Errorf("%s: the second request matched %v blocks, want 3 (the router may not follow the new engines yet)", pool, d)
			}
		}
		return nil
	})
	stranger := e.strangerBeside(t, vllmNS, routerPod)
	for _, pod := range []corev1.Pod{prefill, decode} {
		for _, port := range []int32{vllm.KVEventsPort, vllm.KVEventsReplayPort} {
			addr := net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(port)))
			if err := dial(stranger, addr); err == nil {
				t.Errorf("a pod of no PDCluster connected to %s's KV events at %s", pod.Name, addr)
			}
		}
	}
	noRestarts()

	// Failures under load, and the stock-crash control (realvllm_control_test.go).
	v.prefillDeletedUnderLoad(t)
	// A new vLLM release is a new KV revision: the 0.30.0 pods come up beside the 0.32.0 ones.
	v.rollsOut(t, `{"engine":{"image":"`+controlImage+`"}}`, true)
	v.runsVLLM(t, controlVersion, true)
	v.samples(t)
	v.gateKeepsTheEngine(t)
	// The control: the same release without the gate (a KV revision too), idle to start sooner.
	v.rollsOut(t, `{"kvTransfer":{"completionGate":"`+string(v1alpha1.CompletionGateDisabled)+`"}}`, false)
	v.runsVLLM(t, controlVersion, false)
	v.stockEngineDies(t, "a refused decode leg", func(t *testing.T) { v.refusedLegs(t, 1) })
	v.stockEngineDies(t, "a client that gave up while decode waited", v.abortWhileDecodeWaits)
}

// counterByPool reads a router's /metrics: the counter family's values by their pool label.
func counterByPool(t *testing.T, url, family string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, m := range scrape(t, url, family).GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "pool" {
				out[l.GetValue()] += m.GetCounter().GetValue()
			}
		}
	}
	return out
}
