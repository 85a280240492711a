package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/realengine"
)

// controlVersion is the vLLM release whose stock Mooncake worker reports a pull with no local
// block as finished receiving, which kills the stock decode engine (0.32.0 checks it itself):
// the control the gate is measured against (hack/e2e.sh pushes its image).
const controlVersion = "0.30.0"

// vllmCluster is the real-vLLM sample running in its namespace.
type vllmCluster struct {
	t           *testing.T
	e           *env
	name, model string
	router      string // http://<the router Service's ClusterIP>
}

func (v vllmCluster) get() v1alpha1.PDCluster {
	v.t.Helper()
	var p v1alpha1.PDCluster
	if err := v.e.c.Get(v.e.ctx, client.ObjectKey{Namespace: vllmNS, Name: v.name}, &p); err != nil {
		v.t.Fatal(err)
	}
	return p
}

func (v vllmCluster) pods(role v1alpha1.Role) []corev1.Pod { return v.e.podsOf(vllmNS, v.name, role) }

// engineURL is the vLLM API of an engine pod, at its pod IP.
func engineURL(pod corev1.Pod) string {
	return "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(vllm.APIPort)))
}

// settled is nil once the PDCluster is Ready at its generation with one pod per role, every
// engine pod of the update revision (a rollout done: status.revisions holds it alone).
func (v vllmCluster) settled() error {
	p := v.get()
	if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady); c == nil || c.Status != metav1.ConditionTrue || p.Status.ObservedGeneration != p.Generation {
		return fmt.Errorf("Ready %+v at observed generation %d of %d", c, p.Status.ObservedGeneration, p.Generation)
	}
	if p.Status.CurrentRevision != p.Status.UpdateRevision || len(p.Status.Revisions) != 1 {
		return fmt.Errorf("revisions %+v, update %s, current %s", p.Status.Revisions, p.Status.UpdateRevision, p.Status.CurrentRevision)
	}
	// The pods themselves: the status may not have caught up yet with a pod just replaced.
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode, v1alpha1.RoleRouter} {
		got := v.pods(role)
		if len(got) != 1 {
			return fmt.Errorf("%s: %d pods %v, want 1", role, len(got), podNames(got))
		}
		if !podReady(got[0]) {
			return fmt.Errorf("%s pod %s is not ready", role, got[0].Name)
		}
	}
	return nil
}

func podReady(p corev1.Pod) bool {
	return slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
		return c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue
	})
}

// vllmPrompt is a token-id prompt of n ids in the image's vocabulary (8000), different for
// each seed: decode cannot find it in its own prefix cache.
func vllmPrompt(seed, n int) []int {
	ids := make([]int, n)
	for i := range ids {
		ids[i] = 100 + (seed*7919+i*31)%7000
	}
	return ids
}

// complete sends a greedy completion of n tokens of a new prompt through the router Service.
func (v vllmCluster) complete(ctx context.Context, seed, maxTokens int) (vllmAnswer, error) {
	return openAIContext(ctx, v.router, "/v1/completions", map[string]any{
		"model": v.model, "prompt": vllmPrompt(seed, 70), "max_tokens": maxTokens, "temperature": 0, "ignore_eos": true})
}

// outcome is what a load loop's requests answered.
type outcome struct {
	ok     int
	failed []failure
}

// failure is a request of a load loop that was not served.
type failure struct {
	at     time.Time
	status int // 0: no answer
	why    string
}

func (f failure) String() string {
	return fmt.Sprintf("%s %d %.200s", f.at.Format(time.TimeOnly), f.status, f.why)
}

// String counts the failures by answer, with the first and last time of each.
func (o outcome) String() string {
	type seen struct {
		n           int
		first, last time.Time
	}
	by := map[string]*seen{}
	var keys []string
	for _, f := range o.failed {
		k := fmt.Sprintf("%d %.200s", f.status, f.why)
		if by[k] == nil {
			by[k] = &seen{first: f.at}
			keys = append(keys, k)
		}
		by[k].n++
		by[k].last = f.at
	}
	out := fmt.Sprintf("%d served, %d failed", o.ok, len(o.failed))
	for _, k := range keys {
		out += fmt.Sprintf("; %d x %s (%s to %s)", by[k].n, k, by[k].first.Format(time.TimeOnly), by[k].last.Format(time.TimeOnly))
	}
	return out
}

// loadDuring runs clients in loops of short completions through the router Service until
// during returns, each waiting pause after a request (half a second at least after a failed
// one), and returns what they were answered.
func (v vllmCluster) loadDuring(clients int, pause time.Duration, during func()) outcome {
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		out  outcome
		stop = make(chan struct{})
	)
	for client := range clients {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				a, err := v.complete(ctx, 1000+client*100000+i, 4)
				cancel()
				good := err == nil && a.Status == http.StatusOK && a.Tokens == 4
				mu.Lock()
				if good {
					out.ok++
				} else {
					f := failure{at: time.Now(), status: a.Status, why: a.Body}
					if err != nil {
						f.why = err.Error()
					}
					out.failed = append(out.failed, f)
				}
				mu.Unlock()
				if !good {
					time.Sleep(max(pause, 500*time.Millisecond))
				} else {
					time.Sleep(pause)
				}
			}
		})
	}
	during()
	close(stop)
	wg.Wait()
	return out
}

// servesFromPrefill checks that a new prompt through the router is served and decode took
// every prompt token from prefill's KV (vLLM's own count of external-KV prompt tokens).
func (v vllmCluster) servesFromPrefill(what string) {
	v.t.Helper()
	decode := v.pods(v1alpha1.RoleDecode)[0]
	v.e.eventuallyWithin(what+": a new prompt served from prefill's KV", 2*time.Minute, func() error {
		before, err := realengine.EngineStats(context.Background(), engineURL(decode))
		if err != nil {
			return err
		}
		a, err := v.complete(context.Background(), int(time.Now().UnixNano()%100000), 4)
		if err != nil || a.Status != http.StatusOK {
			return fmt.Errorf("%+v %v", a, err)
		}
		after, err := realengine.EngineStats(context.Background(), engineURL(decode))
		if err != nil {
			return err
		}
		if ext := after.ExternalKVTokens - before.ExternalKVTokens; ext != float64(a.Prompt) {
			return fmt.Errorf("decode took %v of %d prompt tokens from external KV", ext, a.Prompt)
		}
		return nil
	})
}

// prefillDeletedUnderLoad deletes the only prefill pod (gracefully, as a node drain or an
// eviction does) under load through the router: no request is left waiting (those without a
// prefill are refused at once), the operator reports PrefillReady False meanwhile, the decode
// engine serves on and never restarts, the Deployment's new prefill pod takes over under its
// new IP, and decode pulls from it.
func (v vllmCluster) prefillDeletedUnderLoad(t *testing.T) {
	old := v.pods(v1alpha1.RolePrefill)[0]
	decode := v.pods(v1alpha1.RoleDecode)[0]
	var replacement corev1.Pod
	var sawUnready bool
	load := v.loadDuring(2, 0, func() {
		time.Sleep(3 * time.Second)
		v.e.run("delete", "pod", "-n", vllmNS, old.Name, "--wait=false")
		v.e.eventuallyWithin("a new prefill pod Ready and the PDCluster settled", 10*time.Minute, func() error {
			if c := meta.FindStatusCondition(v.get().Status.Conditions, v1alpha1.ConditionPrefillReady); c != nil && c.Status != metav1.ConditionTrue {
				sawUnready = true
			}
			if err := v.settled(); err != nil {
				return err
			}
			p := v.pods(v1alpha1.RolePrefill)[0]
			if p.UID == old.UID {
				return fmt.Errorf("the deleted prefill pod %s still runs", old.Name)
			}
			replacement = p
			return nil
		})
		// Requests after it: the router resolves its pools every 5 s.
		time.Sleep(15 * time.Second)
	})
	t.Logf("prefill pod deleted under load: %s", load)
	for _, f := range load.failed {
		// Refused at once, never left waiting: the router's 5xx (no prefill to send to), or no
		// router to connect to (the router is not ready while a pool is empty).
		if (f.status < 500 || f.status > 599) && !strings.Contains(f.why, "connection refused") {
			t.Errorf("a request while prefill was replaced: %s, want the router's 5xx or a refused connection", f)
		}
	}
	if load.ok == 0 {
		t.Error("no request was served around the prefill pod's deletion")
	}
	if !sawUnready {
		t.Error("PrefillReady never left True while the only prefill pod was replaced")
	}
	t.Logf("prefill pod %s (%s) replaced by %s (%s)", old.Name, old.Status.PodIP, replacement.Name, replacement.Status.PodIP)
	v.servesFromPrefill("after the prefill pod was replaced")
	now := v.pods(v1alpha1.RoleDecode)[0]
	if now.UID != decode.UID || restarts(now, "engine") != restarts(decode, "engine") {
		t.Errorf("the decode pod was replaced or its engine restarted while prefill was: %s restarts %d, was %s %d",
			now.Name, restarts(now, "engine"), decode.Name, restarts(decode, "engine"))
	}
}

// rollsOut applies spec (a merge patch of the PDCluster's spec) that changes the KV revision,
// under load through the router if asked, and returns once the new revision alone runs: the
// new pods come up beside the old ones, the router sends each request to one revision's pair,
// and nothing fails.
func (v vllmCluster) rollsOut(t *testing.T, spec string, underLoad bool) {
	before := v.get().Status.UpdateRevision
	var sawBoth bool
	rollout := func() {
		time.Sleep(3 * time.Second)
		v.e.patchNamed(vllmNS, v.name, spec)
		v.e.eventuallyWithin("the new KV revision rolled out", 15*time.Minute, func() error {
			sawBoth = sawBoth || v.e.pairedRevisions(vllmNS, v.name) == 2
			if p := v.get(); p.Status.UpdateRevision == before {
				return fmt.Errorf("the update revision is still %s", before)
			}
			return v.settled()
		})
		time.Sleep(3 * time.Second)
	}
	if underLoad {
		// One client at a request a second: the new revision's engines start on the same
		// two cores as the old ones serving it.
		load := v.loadDuring(1, time.Second, rollout)
		t.Logf("KV-revision rollout (%s) under load: %s", spec, load)
		if len(load.failed) > 0 || load.ok == 0 {
			t.Errorf("KV-revision rollout under load: %d requests failed (%d served)", len(load.failed), load.ok)
		}
	} else {
		rollout()
	}
	if !sawBoth {
		t.Error("the two revisions never had Deployments in both pools at once")
	}
	update := v.get().Status.UpdateRevision
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		if p := v.pods(role)[0]; p.Labels[v1alpha1.LabelKVRevision] != update {
			t.Errorf("%s pod %s runs revision %s after the rollout, want %s", role, p.Name, p.Labels[v1alpha1.LabelKVRevision], update)
		}
	}
}

// runsVLLM checks that both engines run vLLM release version and (gated) logged the plugin's
// load line.
func (v vllmCluster) runsVLLM(t *testing.T, version string, gated bool) {
	t.Helper()
	for _, pod := range []corev1.Pod{v.pods(v1alpha1.RolePrefill)[0], v.pods(v1alpha1.RoleDecode)[0]} {
		got := strings.TrimSpace(v.e.run("exec", "-n", vllmNS, pod.Name, "-c", "engine", "--", "python", "-c", "import vllm; print(vllm.__version__)"))
		if !strings.HasPrefix(got, version) {
			t.Errorf("%s's engine runs vLLM %q, want %s", pod.Name, got, version)
		}
		logs := v.e.run("logs", "-n", vllmNS, pod.Name, "-c", "engine")
		if loaded := strings.Contains(logs, "pdgate: GatedMooncakeConnector loaded on vLLM "+version); loaded != gated {
			t.Errorf("%s's engine log has the plugin's load line: %v, want %v", pod.Name, loaded, gated)
		}
	}
}

// samples sends a request that samples (temperature 1, vLLM's default) through the router
// Service: it is served and no engine restarts. vLLM's CPU sampler compiles itself at the
// first such request (torch.compile), which needs the C++ compiler and Python headers the
// image carries: without them vLLM 0.30.0's engine died of the first sampled request.
func (v vllmCluster) samples(t *testing.T) {
	t.Helper()
	before := map[string]int32{}
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		p := v.pods(role)[0]
		before[p.Name] = restarts(p, "engine")
	}
	// The first sampled request compiles the sampler (torch.compile, a C++ build): minutes on
	// two busy cores, past openAI's two.
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	a, err := openAIContext(ctx, v.router, "/v1/completions", map[string]any{"model": v.model, "prompt": vllmPrompt(42, 70), "max_tokens": 8, "temperature": 1.0})
	if err != nil || a.Status != http.StatusOK || a.Tokens == 0 {
		t.Errorf("a sampled completion (temperature 1) through the router: %+v %v", a, err)
	}
	time.Sleep(5 * time.Second) // an engine that dies of it exits within seconds
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		p := v.pods(role)[0]
		exited := p.Status.ContainerStatuses != nil && !slices.ContainsFunc(p.Status.ContainerStatuses, func(c corev1.ContainerStatus) bool {
			return c.Name == "engine" && c.State.Running != nil
		})
		if n, ok := before[p.Name]; !ok || restarts(p, "engine") != n || exited {
			t.Errorf("%s's engine restarted or stopped after a sampled request (restarts %d, was %d)", p.Name, restarts(p, "engine"), n)
		}
	}
}

// refusedLegs sends n requests whose decode leg vLLM's API server refuses (max_tokens past the
// model length) after a normal prefill leg: each leaves a pull with no local block on decode,
// to tell prefill to free its KV, which reaches decode's scheduler at its next step.
func (v vllmCluster) refusedLegs(t *testing.T, n int) {
	t.Helper()
	for i := range n {
		a, err := v.complete(context.Background(), 500+i, 5000)
		if err != nil || a.Status != http.StatusBadRequest {
			t.Fatalf("a decode leg past the model length: %+v %v, want vLLM's 400", a, err)
		}
	}
}

// abortWhileDecodeWaits fills the decode engine's sequence slots (--max-num-seqs=4) with long
// requests of its own, sends a request through the router, and gives up once its decode leg
// waits in decode's queue: vLLM aborts the waiting request, whose connector tells prefill to
// free its KV with a pull of no local block.
func (v vllmCluster) abortWhileDecodeWaits(t *testing.T) {
	t.Helper()
	decode := engineURL(v.pods(v1alpha1.RoleDecode)[0])
	var busy sync.WaitGroup
	for i := range 4 {
		busy.Go(func() {
			_, _ = openAI(decode, "/v1/completions", map[string]any{"model": v.model, "prompt": vllmPrompt(900+i, 8), "max_tokens": 1000, "temperature": 0, "ignore_eos": true})
		})
	}
	defer busy.Wait()
	waitGauge := func(name string, want float64) {
		t.Helper()
		v.e.eventuallyWithin("decode's "+name+" at "+fmt.Sprint(want), 30*time.Second, func() error {
			got, err := realengine.Gauge(context.Background(), decode, name)
			if err == nil && got < want {
				err = fmt.Errorf("%v", got)
			}
			return err
		})
	}
	waitGauge(vllm.MetricNumRequestsRunning, 4)
	ctx, cancel := context.WithCancel(context.Background())
	answered := make(chan error, 1)
	go func() {
		a, err := v.complete(ctx, 950, 4)
		if err == nil {
			err = fmt.Errorf("answered %d %s before the client gave up", a.Status, a.Body)
		} else {
			err = nil
		}
		answered <- err
	}()
	waitGauge(vllm.MetricNumRequestsWaiting, 1)
	cancel()
	if err := <-answered; err != nil {
		t.Fatalf("the request behind the full decode engine %v", err)
	}
}

// gateKeepsTheEngine: on the control release, the pulls with no local block that kill a stock
// decode engine (three refused decode legs, a client that gives up while decode waits) leave
// the gated one serving with no restart, and the reports the gate kept from the scheduler
// reach status.decode.gate.
func (v vllmCluster) gateKeepsTheEngine(t *testing.T) {
	decode := v.pods(v1alpha1.RoleDecode)[0]
	before := v.get().Status.Decode.Gate
	if before == nil {
		t.Fatal("status.decode.gate is empty on a gated PDCluster")
	}
	v.refusedLegs(t, 3)
	v.abortWhileDecodeWaits(t)
	// Their reports reach decode's scheduler at its next step.
	v.servesFromPrefill("after the pulls with no local block")
	v.e.eventuallyWithin("the gate's kept reports in status.decode.gate", 2*time.Minute, func() error {
		g := v.get().Status.Decode.Gate
		if g == nil || g.GatedCompletions < before.GatedCompletions+4 {
			return fmt.Errorf("status.decode.gate %+v (before %+v): want at least 4 more gated completions", g, before)
		}
		return nil
	})
	now := v.pods(v1alpha1.RoleDecode)[0]
	if now.UID != decode.UID || restarts(now, "engine") != restarts(decode, "engine") {
		t.Errorf("the gated decode engine restarted: %s restarts %d", now.Name, restarts(now, "engine"))
	}
}

// stockEngineDies is the control, with the completion gate Disabled on the same release: what
// the gated engine survived (cause, named what) kills the stock decode engine at its next step
// (the scheduler's assertion, in the log of the container that died); the kubelet restarts the
// container; while it is down the pod is not ready, the operator reports DecodeReady False,
// and a request is refused at once (the router's 5xx); once it is back the router serves from
// prefill's KV again.
func (v vllmCluster) stockEngineDies(t *testing.T, what string, cause func(*testing.T)) {
	decode := v.pods(v1alpha1.RoleDecode)[0]
	was := restarts(decode, "engine")
	cause(t)
	// The next request's step delivers the report.
	next, err := v.complete(context.Background(), 600, 4)
	t.Logf("the request after %s: %d %.200s %v", what, next.Status, next.Body, err)
	var sawUnready, sawDecodeNotReady bool
	var whileDown []failure
	v.e.eventuallyWithin("the stock decode engine died of "+what+", restarted and serves", 10*time.Minute, func() error {
		var pod corev1.Pod
		if err := v.e.c.Get(v.e.ctx, client.ObjectKeyFromObject(&decode), &pod); err != nil {
			return err
		}
		ready := podReady(pod)
		if c := meta.FindStatusCondition(v.get().Status.Conditions, v1alpha1.ConditionDecodeReady); c != nil && c.Status == metav1.ConditionFalse {
			sawDecodeNotReady = true
		}
		if !ready {
			if !sawUnready {
				// The router, with no decode ready: it answers at once.
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				a, err := v.complete(ctx, 700, 4)
				cancel()
				f := failure{at: time.Now(), status: a.Status, why: a.Body}
				if err != nil {
					f.why = err.Error()
				}
				whileDown = append(whileDown, f)
			}
			sawUnready = true
		}
		if restarts(pod, "engine") == was {
			return fmt.Errorf("the stock decode engine has not restarted (the request after %s: %d)", what, next.Status)
		}
		if !ready {
			return fmt.Errorf("the restarted decode pod is not ready yet")
		}
		return v.settled()
	})
	prev := v.e.run("logs", "-n", vllmNS, decode.Name, "-c", "engine", "--previous")
	if !strings.Contains(prev, "assert req_id in self.requests") {
		t.Errorf("the stock decode engine restarted after %s, but its log does not show the scheduler's assertion; it ends:\n%s", what, tail(prev, 3000))
	}
	if !sawUnready {
		t.Error("the decode pod stayed ready while its engine was down")
	}
	if !sawDecodeNotReady {
		t.Error("the operator never reported DecodeReady False while the only decode engine was down")
	}
	for _, f := range whileDown {
		t.Logf("a request while the decode engine was down: %s", f)
		if f.status < 500 && !strings.Contains(f.why, "connection refused") {
			t.Errorf("a request while the only decode engine was down: %s, want the router's 5xx or a refused connection", f)
		}
	}
	v.servesFromPrefill("after the stock engine's restart")
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
