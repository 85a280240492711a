//go:build realengine

package realengine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/loadgen"
)

// routingStrategies are the routers BenchmarkRoutingRealEngines compares, each rendered from
// the same PDCluster with its spec.router set so.
var routingStrategies = []struct {
	name    string
	balance v1alpha1.RouterBalance
	routing v1alpha1.RoutingStrategy
}{
	{"KVEvents", v1alpha1.RouterBalanceLeastInFlight, v1alpha1.RoutingKVEvents},
	{"PrefixAware", v1alpha1.RouterBalanceLeastInFlight, v1alpha1.RoutingPrefixAware},
	{"LeastInFlight", v1alpha1.RouterBalanceLeastInFlight, v1alpha1.RoutingLeastInFlight},
	{"RoundRobin", v1alpha1.RouterBalanceRoundRobin, v1alpha1.RoutingLeastInFlight},
}

// BenchmarkRoutingRealEngines (make bench, suite routing) runs prefill and decode engines of
// real vLLM (the newest CPU release, testdata/pdcluster.yaml; two per pool, or replicasEnv's
// count) behind four routers rendered with spec.router.routing KVEvents, PrefixAware,
// LeastInFlight and round-robin balance (the engines publish their KV events for the first),
// and sends each the same kind of traffic, prompts of its own so that no router profits from
// another's cache, routingClients at a time (runRouting):
//   - shared-prefix: 8 chats of 5 turns, each turn's prompt the chat so far (a 192-token system
//     prompt, one of two, then 64 tokens a turn);
//   - documents: 8 documents of 448 tokens, each asked 5 questions of 32 tokens (retrieval,
//     few-shot templates, agents re-sending their context);
//   - distinct: 40 prompts of 256 tokens that share nothing.
//
// Twice: with caches that hold every prompt of a run, and with caches of 48 blocks, which hold
// the documents once but not once per engine. It reports vLLM's own counts
// (prompt_tokens_by_source): the share of prompt tokens prefill and decode served from their
// prefix caches, the tokens decode pulled per request, and the requests' latency, throughput
// and router CPU.
func BenchmarkRoutingRealEngines(b *testing.B) {
	releases, err := Releases()
	if err != nil {
		b.Fatal(err)
	}
	rel := releases[len(releases)-1]
	bin, err := filepath.Abs(filepath.Join("..", "..", "bin"))
	if err != nil {
		b.Fatal(err)
	}
	shim, _ := filepath.Abs(filepath.Join("testdata", "shim"))
	work, err := os.MkdirTemp("", "rt-"+rel.Version+"-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = os.RemoveAll(work) })
	o := Options{Release: rel, BinDir: bin, Shim: shim, WorkDir: work}
	pdc, err := LoadPDCluster(filepath.Join("testdata", "pdcluster.yaml"), filepath.Join("testdata", "tiny-llama"))
	if err != nil {
		b.Fatal(err)
	}
	// The engines' caches hold every prompt of a run, or 48 blocks of 64 tokens (3072 tokens:
	// the documents' working set, 8 x 7 blocks, fits once, not twice).
	for _, cache := range []struct {
		name string
		args []string
	}{{"all", nil}, {"48-blocks", []string{"--num-gpu-blocks-override=48"}}} {
		b.Run("cache="+cache.name, func(b *testing.B) {
			spec := pdc.DeepCopy()
			spec.Spec.Engine.Args = append(spec.Spec.Engine.Args, cache.args...)
			prefill, decode, routers := startRouting(b, o, spec, cache.name)
			runWorkloads(b, prefill, decode, routers)
		})
	}
}

// replicasEnv sets how many prefill and how many decode pods BenchmarkRoutingRealEngines runs
// (default 2: with more, least-in-flight lands on the engine holding a prompt less often, and
// the engines take longer on 2 cores).
const replicasEnv = "PDCLUSTER_ROUTING_REPLICAS"

// startRouting starts the prefill and decode pods of pdc (two of each, or replicasEnv's count)
// and a router of each strategy in front of all of them; name keeps their directories apart.
func startRouting(b *testing.B, o Options, pdc *v1alpha1.PDCluster, name string) (prefill, decode []*Pod, routers map[string]*Router) {
	// The engines publish their KV cache events, which only the KVEvents router reads.
	engines := pdc.DeepCopy()
	engines.Spec.Router.Routing.Strategy = v1alpha1.RoutingKVEvents
	r, err := Render(engines)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		for _, p := range append(slices.Clone(prefill), decode...) {
			p.Stop()
		}
	})
	replicas := 2
	if v := os.Getenv(replicasEnv); v != "" {
		if replicas, err = strconv.Atoi(v); err != nil || replicas < 1 {
			b.Fatalf("%s=%q: want a count of pods per pool", replicasEnv, v)
		}
	}
	for i := range replicas {
		p, err := StartPod(o, fmt.Sprintf("%s-prefill-%d", name, i), r.Prefill, r.ConfigMaps)
		if err != nil {
			b.Fatal(err)
		}
		prefill = append(prefill, p)
		d, err := StartPod(o, fmt.Sprintf("%s-decode-%d", name, i), r.Decode, r.ConfigMaps)
		if err != nil {
			b.Fatal(err)
		}
		decode = append(decode, d)
	}
	ctx := context.Background()
	for _, p := range append(slices.Clone(prefill), decode...) {
		if err := WaitOK(ctx, p.Engine+"/health", p.EngineProc, startup); err != nil {
			b.Fatal(err)
		}
		if err := WaitOK(ctx, p.Sidecar+"/readyz", p.SidecarProc, time.Minute); err != nil {
			b.Fatal(err)
		}
	}
	routers = map[string]*Router{}
	for _, s := range routingStrategies {
		spec := pdc.DeepCopy()
		spec.Spec.Router.Balance, spec.Spec.Router.Routing.Strategy = s.balance, s.routing
		rs, err := Render(spec)
		if err != nil {
			b.Fatal(err)
		}
		cm, err := rs.RouterConfigMap()
		if err != nil {
			b.Fatal(err)
		}
		router, err := StartRouter(o, name+"-router-"+s.name, rs.Router, cm, prefill, decode)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { router.Proc.Stop(5 * time.Second) })
		if err := WaitOK(ctx, router.URL+"/ready", router.Proc, time.Minute); err != nil {
			b.Fatal(err)
		}
		routers[s.name] = router
	}
	return prefill, decode, routers
}

// runWorkloads runs each workload through each router, with prompts of its own.
func runWorkloads(b *testing.B, prefill, decode []*Pod, routers map[string]*Router) {
	workloads := []struct {
		name  string
		turns func(seed int) [][][]int // per session, its prompts in order
	}{
		{"shared-prefix", chats},
		{"documents", documents},
		{"distinct", distinct},
	}
	for wi, w := range workloads {
		// A warm-up of the workload's shapes first, through the last router, with prompts
		// of its own: a CPU engine's first prompts of new lengths are slower, and the first
		// router measured would pay for them.
		b.Run(w.name+"/warm-up", func(b *testing.B) {
			runRouting(b, routers[routingStrategies[len(routingStrategies)-1].name], prefill, decode, w.turns(100000*(wi+1)), wi)
		})
		for si, s := range routingStrategies {
			b.Run(w.name+"/"+s.name, func(b *testing.B) {
				// Prompts of this run's own: another run's cached blocks match none of them.
				runRouting(b, routers[s.name], prefill, decode, w.turns(1000*(wi*len(routingStrategies)+si+1)), wi)
			})
		}
	}
}

// chats are 8 chats of 5 turns: a chat's prompt is one of two 192-token system prompts, then
// 64 tokens per turn so far.
func chats(seed int) [][][]int {
	var out [][][]int
	for chat := range 8 {
		history := Prompt(seed+chat%2, 192)
		var turns [][]int
		for turn := range 5 {
			history = append(history, Prompt(seed+100+10*chat+turn, 64)...)
			turns = append(turns, slices.Clone(history))
		}
		out = append(out, turns)
	}
	return out
}

// documents are 8 documents of 448 tokens, each asked 5 questions of 32 tokens, one after the
// other.
func documents(seed int) [][][]int {
	var out [][][]int
	for doc := range 8 {
		var questions [][]int
		for q := range 5 {
			questions = append(questions, append(Prompt(seed+doc, 448), Prompt(seed+100+10*doc+q, 32)...))
		}
		out = append(out, questions)
	}
	return out
}

// distinct are 40 prompts of 256 tokens sharing nothing.
func distinct(seed int) [][][]int {
	out := make([][][]int, 40)
	for i := range out {
		out[i] = [][]int{Prompt(seed+i, 256)}
	}
	return out
}

// routingClients send the sessions' prompts at once.
const routingClients = 4

// runRouting sends sessions' prompts through router, a session's in order, each once the one
// before it was answered, by routingClients clients that take whichever session's next prompt
// waits longest (first in a random order): as many users' turns reach a router, and not one
// client's sessions after each other. A client that sent its own sessions in turn would stick
// to an engine by accident under least-in-flight (it frees the engine it just used, which is
// then the least loaded for its next prompt), and least-in-flight would look cache-aware.
// It reports what the engines' counts and the clock say of them.
// order seeds the sessions' first order (the same for every router of a workload).
func runRouting(b *testing.B, router *Router, prefill, decode []*Pod, sessions [][][]int, order int) {
	ctx := context.Background()
	stats := func(pods []*Pod) vllm.EngineStats {
		var sum vllm.EngineStats
		for _, p := range pods {
			st, err := EngineStats(ctx, p.Engine)
			if err != nil {
				b.Fatal(err)
			}
			sum.LocalComputeTokens += st.LocalComputeTokens
			sum.LocalCacheHitTokens += st.LocalCacheHitTokens
			sum.ExternalKVTokens += st.ExternalKVTokens
		}
		return sum
	}
	pid := []int{router.Proc.cmd.Process.Pid}
	p0, d0, cpu0 := stats(prefill), stats(decode), loadgen.CPUTime(b, pid)
	var mu sync.Mutex
	var latencies []time.Duration
	var failed error
	// ready are the sessions whose next prompt can be sent, longest waiting first; next[i] is
	// session i's next prompt.
	ready := make(chan int, len(sessions))
	for _, i := range rand.New(rand.NewPCG(uint64(order), 3)).Perm(len(sessions)) {
		ready <- i
	}
	next := make([]int, len(sessions))
	left := 0
	for _, s := range sessions {
		left += len(s)
	}
	var wg sync.WaitGroup
	start := time.Now()
	for range routingClients {
		wg.Go(func() {
			for i := range ready {
				mu.Lock()
				prompt := sessions[i][next[i]]
				mu.Unlock()
				t := time.Now()
				a, err := Complete(ctx, router.URL, Completion{Prompt: prompt, MaxTokens: 4})
				if err == nil && a.Status != 200 {
					err = fmt.Errorf("status %d: %s", a.Status, a.Body)
				}
				mu.Lock()
				latencies = append(latencies, time.Since(t))
				if err != nil && failed == nil {
					failed = err
				}
				next[i]++
				if next[i] < len(sessions[i]) {
					ready <- i
				}
				if left--; left == 0 {
					close(ready)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if failed != nil {
		b.Fatal(failed)
	}
	p1, d1, cpu1 := stats(prefill), stats(decode), loadgen.CPUTime(b, pid)
	n := float64(len(latencies))
	share := func(hit, rest float64) float64 {
		if hit+rest == 0 {
			return 0
		}
		return 100 * hit / (hit + rest)
	}
	slices.Sort(latencies)
	b.ReportMetric(share(p1.LocalCacheHitTokens-p0.LocalCacheHitTokens, p1.LocalComputeTokens-p0.LocalComputeTokens), "prefill-hit-%")
	b.ReportMetric(share(d1.LocalCacheHitTokens-d0.LocalCacheHitTokens, (d1.ExternalKVTokens-d0.ExternalKVTokens)+(d1.LocalComputeTokens-d0.LocalComputeTokens)), "decode-hit-%")
	b.ReportMetric((d1.ExternalKVTokens-d0.ExternalKVTokens)/n, "pulled-tok/req")
	b.ReportMetric(float64(latencies[len(latencies)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(n/elapsed.Seconds(), "req/s")
	b.ReportMetric(float64((cpu1-cpu0).Microseconds())/1000/n, "cpu-ms/req")
	b.ReportMetric(0, "ns/op")
}
