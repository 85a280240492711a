package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/sim/enginesim"
)

// The sample hack/run.sh puts on the real node (config/samples/local-node.yaml).
const (
	realName  = "tiny"
	realModel = "tiny"
	realBlock = 64 // engine.blockSize of that sample
)

// realNode talks to the tiny sample, whose pods run for real on the local node.
type realNode struct{ *env }

func (r realNode) pdc() *v1alpha1.PDCluster {
	r.t.Helper()
	var p v1alpha1.PDCluster
	if err := r.c.Get(r.ctx, client.ObjectKey{Namespace: sampleNS, Name: realName}, &p); err != nil {
		r.t.Fatal(err)
	}
	return &p
}

func (r realNode) pods(role v1alpha1.Role) []corev1.Pod {
	r.t.Helper()
	var list corev1.PodList
	if err := r.c.List(r.ctx, &list, client.InNamespace(sampleNS), client.MatchingLabels(render.Labels(realName, role))); err != nil {
		r.t.Fatal(err)
	}
	var out []corev1.Pod
	for _, p := range list.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out
}

// settled is nil once the sample is Ready at its generation, no pod of an earlier rollout is
// still draining (the router may send it requests until it is gone), and every container of
// each role's pods (as many as the spec asks) runs, ready, from the images this run built.
func (r realNode) settled() error {
	var all corev1.PodList
	if err := r.c.List(r.ctx, &all, client.InNamespace(sampleNS), client.MatchingLabels{v1alpha1.LabelCluster: realName}); err != nil {
		return err
	}
	for _, pod := range all.Items {
		if pod.DeletionTimestamp != nil {
			return fmt.Errorf("pod %s is still draining", pod.Name)
		}
	}
	p := r.pdc()
	c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
	if c == nil || c.Status != metav1.ConditionTrue || p.Status.ObservedGeneration != p.Generation {
		return fmt.Errorf("Ready = %+v at observed generation %d of %d", c, p.Status.ObservedGeneration, p.Generation)
	}
	want := map[v1alpha1.Role]int32{
		v1alpha1.RolePrefill: *p.Spec.Prefill.Replicas, v1alpha1.RoleDecode: *p.Spec.Decode.Replicas, v1alpha1.RoleRouter: *p.Spec.Router.Replicas,
	}
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode, v1alpha1.RoleRouter} {
		pods := r.pods(role)
		if len(pods) != int(want[role]) {
			return fmt.Errorf("%s: %d pods, want %d", role, len(pods), want[role])
		}
		for _, pod := range pods {
			if err := runsHere(role, pod); err != nil {
				return err
			}
		}
	}
	return nil
}

// runsHere is nil when every container of pod runs, ready, on the real node from the images
// this run built.
func runsHere(role v1alpha1.Role, pod corev1.Pod) error {
	if pod.Spec.NodeName != os.Getenv("PDCLUSTER_E2E_REAL_NODE") {
		return fmt.Errorf("%s pod %s is on node %q, want the real node", role, pod.Name, pod.Spec.NodeName)
	}
	if len(pod.Status.ContainerStatuses) != len(pod.Spec.Containers) {
		return fmt.Errorf("%s pod %s: %d container statuses", role, pod.Name, len(pod.Status.ContainerStatuses))
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.State.Running == nil || !cs.Ready {
			return fmt.Errorf("%s/%s: state %+v, ready %v", pod.Name, cs.Name, cs.State, cs.Ready)
		}
		if !strings.HasPrefix(cs.Image, os.Getenv("PDCLUSTER_E2E_REGISTRY")+"/pdcluster/") {
			return fmt.Errorf("%s/%s runs image %s, not one built by this run", pod.Name, cs.Name, cs.Image)
		}
	}
	return nil
}

func restarts(pod corev1.Pod, container string) int32 {
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == container {
			return cs.RestartCount
		}
	}
	return -1
}

// complete sends a completion of prompt through the router's Service and returns the HTTP
// status and the number of tokens generated: maxTokens unless the request failed (ignore_eos:
// the stand-in, like a model, may otherwise stop early on an end-of-sequence token, which a
// load loop would count as a failure).
func (r realNode) complete(prompt string, maxTokens int) (int, int, error) {
	return completeThrough(r.env, realName, prompt, maxTokens)
}

// completeThrough is complete through the router Service of the real-node sample cluster
// (whose model is realModel).
func completeThrough(e *env, cluster, prompt string, maxTokens int) (int, int, error) {
	var svc corev1.Service
	if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: sampleNS, Name: cluster + "-router"}, &svc); err != nil {
		return 0, 0, err
	}
	body, _ := json.Marshal(map[string]any{"model": realModel, "prompt": prompt, "max_tokens": maxTokens, "ignore_eos": true})
	hc := &http.Client{Timeout: 30 * time.Second}
	resp, err := hc.Post("http://"+svc.Spec.ClusterIP+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out struct {
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	_ = json.Unmarshal(b, &out)
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, 0, fmt.Errorf("%s: %s", resp.Status, b)
	}
	return resp.StatusCode, out.Usage.CompletionTokens, nil
}

// engineState is the decode engine simulator's /debug/state, read over the pod's IP.
func (r realNode) blocksVerified(pod corev1.Pod) (int, error) {
	resp, err := http.Get("http://" + pod.Status.PodIP + ":8000/debug/state")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var st struct {
		Engine struct{ BlocksVerified int } `json:"engine"`
	}
	return st.Engine.BlocksVerified, json.NewDecoder(resp.Body).Decode(&st)
}

var prompts atomic.Int64

// words is a prompt of n words no earlier request shares a prefix with, so decode cannot take
// its KV from its own prefix cache.
func words(n int) string {
	id := prompts.Add(1)
	w := make([]string, n)
	for i := range w {
		w[i] = fmt.Sprintf("p%dw%d", id, i)
	}
	return strings.Join(w, " ")
}

// serves checks one long request (its KV pulled from prefill into decode, byte-verified by the
// decode engine) and a 13-token one, whose pull is its one partial block (as on vLLM itself:
// test/realengine testNormal).
func (r realNode) serves(t *testing.T) {
	t.Helper()
	decode := r.pods(v1alpha1.RoleDecode)[0]
	before, err := r.blocksVerified(decode)
	if err != nil {
		t.Fatal(err)
	}
	r.eventually("a long completion through the router returns 200 with its tokens", func() error {
		code, n, err := r.complete(words(3*realBlock+5), 7)
		if err != nil {
			return err
		}
		if code != http.StatusOK || n != 7 {
			return fmt.Errorf("status %d with %d tokens, want 200 with 7", code, n)
		}
		return nil
	})
	after, err := r.blocksVerified(decode)
	if err != nil {
		t.Fatal(err)
	}
	if after-before < 3 {
		t.Errorf("decode verified %d pulled blocks for a prompt of 3 full blocks: the KV did not come from prefill", after-before)
	}
	code, n, err := r.complete(words(13), 4)
	if err != nil || code != http.StatusOK || n != 4 {
		t.Fatalf("13-token request with %d-token blocks: status %d, %d tokens, %v", realBlock, code, n, err)
	}
	if short, err := r.blocksVerified(decode); err != nil || short-after != 1 {
		t.Errorf("decode verified %d pulled blocks for a 13-token prompt (%v), want its partial block", short-after, err)
	}
	pod := r.pods(v1alpha1.RoleDecode)[0]
	if n := restarts(pod, v1alpha1.EngineContainerName); n != 0 {
		t.Errorf("decode engine restarted %d times", n)
	}
	resp, err := http.Get("http://" + pod.Status.PodIP + ":8000/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("decode engine /health = %d after the 13-token request", resp.StatusCode)
	}
}

// gateCounts is what the decode sidecar last heard from the engine's gate (GET :8190/gate).
func gateCounts(pod corev1.Pod) (vllm.Counts, error) {
	resp, err := http.Get("http://" + pod.Status.PodIP + ":8190" + vllm.StatePath)
	if err != nil {
		return vllm.Counts{}, err
	}
	defer resp.Body.Close()
	var st vllm.State
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		return vllm.Counts{}, err
	}
	if !st.Loaded || st.Report == nil {
		return vllm.Counts{}, fmt.Errorf("the decode engine's gate is not loaded: %+v", st)
	}
	return st.Report.Counts, nil
}

// refused sends a request whose decode leg the engine's API server refuses (max_tokens past the
// model length) after a normal prefill leg: a cleanup pull with no local block on decode, sent
// whose report reaches the scheduler at decode's next step (test/realengine
// testRejectedDecodeLeg on vLLM itself).
func (r realNode) refused(t *testing.T) {
	t.Helper()
	if code, _, _ := r.complete(words(40), 1<<20); code != http.StatusBadRequest {
		t.Fatalf("a decode leg past the model length: status %d, want the engine's 400", code)
	}
}

// gatesIdleEngine runs the pulls with no local block a decode engine meets: a decode leg the
// API server refused behind the router, and one refused at the engine itself. Their reports
// wait in the worker until a step delivers them: a one-token request straight to decode's, if
// they are back by then, else the first after an idle period longer than the gate's TTL (set
// short here), which a gate that dropped its records on time alone would let kill the engine.
func (r realNode) gatesIdleEngine(t *testing.T) {
	const ttl = 2 * time.Second
	p := &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: sampleNS, Name: realName}}
	patch := fmt.Sprintf(`{"spec":{"decode":{"pod":{"env":[{"name":%q,"value":"%d"}]}}}}`, enginesim.GateTTLEnv, int(ttl.Seconds()))
	if err := r.c.Patch(r.ctx, p, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
		t.Fatal(err)
	}
	r.eventually("decode rolled with the short gate TTL and settled", func() error {
		for _, pod := range r.pods(v1alpha1.RoleDecode) {
			if !slices.ContainsFunc(pod.Spec.Containers[0].Env, func(e corev1.EnvVar) bool { return e.Name == enginesim.GateTTLEnv }) {
				return fmt.Errorf("decode pod %s has no %s", pod.Name, enginesim.GateTTLEnv)
			}
		}
		return r.settled()
	})
	decode, prefill := r.pods(v1alpha1.RoleDecode)[0], r.pods(v1alpha1.RolePrefill)[0]
	var before vllm.Counts
	r.eventually("the decode engine's gate heartbeats", func() (err error) { before, err = gateCounts(decode); return err })
	statusBefore := r.pdc().Status.Decode.Gate

	r.refused(t)
	// A request the decode API rejects (max_tokens 0) still frees prefill's blocks, as vLLM's
	// notify_kv_transfer_request_rejected does: a cleanup pull with no local block.
	boot := "http://" + net.JoinHostPort(prefill.Status.PodIP, strconv.Itoa(int(vllm.MooncakeBootstrapPort)))
	topo, err := bootstrap.NewClient().Query(r.ctx, boot)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(map[string]any{"model": realModel, "prompt": words(3), "max_tokens": 0, "kv_transfer_params": map[string]any{
		"do_remote_prefill": true, "transfer_id": fmt.Sprintf("xfer-e2e-rejected-%d", time.Now().UnixNano()),
		"remote_engine_id": topo["0"].EngineID, "remote_bootstrap_addr": boot,
	}})
	resp, err := http.Post("http://"+decode.Status.PodIP+":8000/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("rejected request: status %d, want 400", resp.StatusCode)
	}
	// One step: the cleanup pulls go out, the one-token request ends in it, and the engine
	// idles with their reports still in the worker.
	body, _ = json.Marshal(map[string]any{"model": realModel, "prompt": words(3), "max_tokens": 1})
	resp, err = http.Post("http://"+decode.Status.PodIP+":8000/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("a one-token request straight to decode: status %d, want 200", resp.StatusCode)
	}
	time.Sleep(3 * ttl) // idle: no request reaches decode, so it does not step
	if code, n, err := r.complete(words(3*realBlock+5), 4); err != nil || code != http.StatusOK || n != 4 {
		t.Fatalf("the request after the idle period: status %d, %d tokens, %v", code, n, err)
	}
	r.eventually("the sidecar heard both pulls gated", func() error {
		c, err := gateCounts(decode)
		if err != nil {
			return err
		}
		if c.Gated < before.Gated+2 {
			return fmt.Errorf("gated %d, want at least %d", c.Gated, before.Gated+2)
		}
		return nil
	})
	pod := r.pods(v1alpha1.RoleDecode)[0]
	if n := restarts(pod, v1alpha1.EngineContainerName); n != 0 || pod.UID != decode.UID {
		t.Errorf("decode engine restarted %d times (pod %s, was %s)", n, pod.UID, decode.UID)
	}
	r.eventually("status.decode.gate.gatedCompletions rose", func() error {
		g := r.pdc().Status.Decode.Gate
		if g == nil || statusBefore != nil && g.GatedCompletions < statusBefore.GatedCompletions+2 || statusBefore == nil && g.GatedCompletions < 2 {
			return fmt.Errorf("status.decode.gate = %+v, was %+v", g, statusBefore)
		}
		return nil
	})
}

// silentGate runs the decode engine with a gate that never reports (the stand-in's
// VLLM_SIM_SILENT_GATE) and a 5 s gate start-up grace: the decode connector must turn unready
// and CompletionGated name the pod; then the decode pool is put back.
func (r realNode) silentGate(t *testing.T) {
	p := &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: sampleNS, Name: realName}}
	apply := func(patch string) {
		t.Helper()
		if err := r.c.Patch(r.ctx, p, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
			t.Fatal(err)
		}
	}
	ttlEnv := fmt.Sprintf(`{"name":%q,"value":"2"}`, enginesim.GateTTLEnv)
	apply(`{"spec":{"connector":{"health":{"gateStartupGraceSeconds":5}},"decode":{"pod":{"env":[` + ttlEnv + `,{"name":"VLLM_SIM_SILENT_GATE","value":"1"}]}}}}`)
	r.eventually("CompletionGated names the decode pod whose connector is unready for its silent gate", func() error {
		c := meta.FindStatusCondition(r.pdc().Status.Conditions, v1alpha1.ConditionCompletionGated)
		if c == nil || c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonGateSilent {
			return fmt.Errorf("CompletionGated = %+v", c)
		}
		for _, pod := range r.pods(v1alpha1.RoleDecode) {
			if slices.ContainsFunc(pod.Spec.Containers[0].Env, func(e corev1.EnvVar) bool { return e.Name == "VLLM_SIM_SILENT_GATE" }) &&
				strings.Contains(c.Message, pod.Name) {
				for _, cs := range pod.Status.ContainerStatuses {
					if cs.Name == v1alpha1.ConnectorContainerName && cs.Ready {
						return fmt.Errorf("connector of %s is ready with a silent gate", pod.Name)
					}
				}
				return nil
			}
		}
		return fmt.Errorf("CompletionGated names no silent decode pod: %s", c.Message)
	})
	apply(`{"spec":{"connector":{"health":{"gateStartupGraceSeconds":null}},"decode":{"pod":{"env":[` + ttlEnv + `]}}}}`)
	r.eventually("the decode pool rolled back and settled, its gate reporting", func() error {
		if err := r.settled(); err != nil {
			return err
		}
		if c := meta.FindStatusCondition(r.pdc().Status.Conditions, v1alpha1.ConditionCompletionGated); c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("CompletionGated = %+v", c)
		}
		return nil
	})
}

// connectorPID finds the prefill pod's connector process on this host: the pod's containers
// are processes of the real node, which is this machine.
func connectorPID(t *testing.T) int {
	t.Helper()
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if filepath.Base(args[0]) == "connector" && strings.Contains(string(b), "--role=kv_producer") {
			var pid int
			if _, err := fmt.Sscanf(filepath.Base(filepath.Dir(p)), "%d", &pid); err == nil {
				return pid
			}
		}
	}
	t.Fatal("no prefill connector process on this host")
	return 0
}

func TestRealNode(t *testing.T) {
	if os.Getenv("PDCLUSTER_E2E_REAL_NODE") == "" {
		t.Skip("needs the local cluster's real node: run hack/e2e.sh (make test does)")
	}
	r := realNode{setup(t)}

	t.Run("the sample runs on the real node from the built images", func(t *testing.T) {
		r.eventually("every container running and ready", r.settled)
		for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode, v1alpha1.RoleRouter} {
			for _, cs := range r.pods(role)[0].Status.ContainerStatuses {
				if cs.RestartCount != 0 {
					t.Errorf("%s/%s restarted %d times", role, cs.Name, cs.RestartCount)
				}
			}
		}
	})

	t.Run("a TCP PDCluster runs where the baseline Pod Security Standard is enforced", func(t *testing.T) {
		// kube-apiserver's PodSecurity admission checks the running pods when the level is set
		// (a warning names those that violate it) and refuses new ones: every later rollout of
		// this test (decode twice, then every pool for NIXL) is admitted under it.
		cmd := exec.Command(r.kubectl, "--kubeconfig", r.kubeconfig, "label", "--overwrite", "namespace", sampleNS,
			"pod-security.kubernetes.io/enforce=baseline", "pod-security.kubernetes.io/enforce-version=latest")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("label namespace %s: %v\n%s", sampleNS, err, out)
		}
		if strings.Contains(string(out), "violate") {
			t.Errorf("the sample's pods violate baseline Pod Security:\n%s", out)
		}
	})

	t.Run("mooncake: completions through the router, prefill to decode through the connector", func(t *testing.T) {
		r.serves(t)
	})

	t.Run("the node enforces the NetworkPolicies: strangers reach no engine port nor the router's metrics, the router, decode and the operator still do", func(t *testing.T) {
		r.enforcesNetworkPolicy(t)
	})

	t.Run("the operator reads each engine's completion gate", func(t *testing.T) {
		r.eventually("status.prefill.gate and status.decode.gate report the pods", func() error {
			p := r.pdc()
			for role, g := range map[string]*v1alpha1.PoolGateStatus{"prefill": p.Status.Prefill.Gate, "decode": p.Status.Decode.Gate} {
				if g == nil || g.ReportingPods != 1 {
					return fmt.Errorf("%s gate = %+v, want 1 reporting pod", role, g)
				}
			}
			return nil
		})
	})

	t.Run("KV verified: True under traffic, False (DecodeRecomputing, the pod named) when decode drops kv_transfer_params, True again", func(t *testing.T) {
		r.verifiesKV(t)
	})

	t.Run("canary: an idle cluster is verified by the router's canary requests, and a recomputing decode is caught without client traffic", func(t *testing.T) {
		r.canaryVerifies(t)
	})

	t.Run("a killed prefill connector is restarted by the kubelet and requests succeed again", func(t *testing.T) {
		prefill := r.pods(v1alpha1.RolePrefill)[0]
		decode := r.pods(v1alpha1.RoleDecode)[0]
		before := restarts(prefill, v1alpha1.ConnectorContainerName)
		if err := syscall.Kill(connectorPID(t), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		r.eventually("the connector container restarted", func() error {
			var pod corev1.Pod
			if err := r.c.Get(r.ctx, types.NamespacedName{Namespace: prefill.Namespace, Name: prefill.Name}, &pod); err != nil {
				return err
			}
			if n := restarts(pod, v1alpha1.ConnectorContainerName); n <= before {
				return fmt.Errorf("connector restarts %d", n)
			}
			return nil
		})
		r.eventually("every container running and ready again", r.settled)
		r.serves(t)
		// The operator's health loop restarts pods only when a connector stays unready past
		// spec.connector.health (3 x 10 s by default); a process the kubelet restarted at once
		// is not that, so both pods are the ones from before.
		if got := r.pods(v1alpha1.RolePrefill)[0].UID; got != prefill.UID {
			t.Errorf("prefill pod replaced (%s -> %s) for a connector the kubelet restarted", prefill.UID, got)
		}
		if got := r.pods(v1alpha1.RoleDecode)[0].UID; got != decode.UID {
			t.Errorf("decode pod replaced (%s -> %s) for a prefill connector the kubelet restarted", decode.UID, got)
		}
	})

	t.Run("GitOps: the applied file has no drift after the operator reconciled", func(t *testing.T) {
		// kubectl diff exits 1 on any difference: no defaulting drift, nothing the operator
		// writes into the spec. Once client-side and once as a GitOps tool's server-side apply.
		r.run("diff", "-f", "config/samples/local-node.yaml")
		r.run("diff", "--server-side", "--field-manager=argocd-controller", "--force-conflicts", "-f", "config/samples/local-node.yaml")
		r.run("diff", "--server-side", "--field-manager=kustomize-controller", "--force-conflicts", "-f", "config/samples/local-node.yaml")
	})

	t.Run("a force-deleted prefill pod under load fails only requests in flight on it; with onPrefillFailure Fail more fail", func(t *testing.T) {
		r.prefillKilledUnderLoad(t)
	})

	t.Run("prefill 2 -> 1 under load fails nothing and removes the idle pod; a deleted prefill keeps its KV for late pulls, and loses it with drain.timeoutSeconds 0", func(t *testing.T) {
		r.drainsPrefill(t)
	})
	t.Run("pairing by node: the router pairs within the node and status.pairing counts it", func(t *testing.T) {
		r.pairsOnOneNode(t)
	})

	t.Run("a KV-revision rollout of both pools under load fails nothing and pairs no request across revisions", func(t *testing.T) {
		r.rollsOutKVRevision(t)
	})

	t.Run("the decode engine's gate: refused legs' cleanup pulls gated, an idle engine's held reports too", func(t *testing.T) {
		r.gatesIdleEngine(t)
	})

	t.Run("an engine whose gate never reports keeps its pod unready, and the operator names it", func(t *testing.T) {
		r.silentGate(t)
	})

	t.Run("nixl: the same requests after switching the connector", func(t *testing.T) {
		p := &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: sampleNS, Name: realName}}
		patch := `{"spec":{"kvTransfer":{"connector":"NixlConnector"}}}`
		if err := r.c.Patch(r.ctx, p, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
			t.Fatal(err)
		}
		r.eventually("the pods rolled to NIXL and settled", func() error {
			for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
				for _, pod := range r.pods(role) {
					if !strings.Contains(strings.Join(pod.Spec.Containers[0].Args, " "), "GatedNixlConnector") {
						return fmt.Errorf("%s pod %s still runs the Mooncake connector", role, pod.Name)
					}
					for _, e := range pod.Spec.Containers[0].Env {
						if e.Name == vllm.EnvNixlSideChannelHost && e.Value != "$(POD_IP)" {
							return fmt.Errorf("side-channel host %q", e.Value)
						}
					}
				}
			}
			return r.settled()
		})
		r.serves(t)
	})
}
