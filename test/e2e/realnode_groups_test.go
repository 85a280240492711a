package e2e

import (
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
)

// The sample of a replica across pods on the real node (what `make run` shows with
// PDCLUSTER_SAMPLE set to it): prefill data 4 over 2 pods, decode data 2 on one.
const (
	groupsSample = "config/samples/local-node-multinode.yaml"
	groupsName   = "tiny-dp"
)

// One data-parallel prefill replica as two pods on the real node, run by the real
// LeaderWorkerSet controller, `connector launch` and the stand-in engine (which joins its group
// as vLLM's engines do): both pods serve their own two ranks, completions through the router
// reach every rank of both pods pinned by X-data-parallel-rank (a rank the pod does not run
// is refused by the engine, failing the request), decode pulls their KV; deleting the worker
// pod recreates the whole group, and the same decode pod then pulls from the new one.
func TestRealNodeReplicaAcrossPods(t *testing.T) {
	if os.Getenv("PDCLUSTER_E2E_REAL_NODE") == "" {
		t.Skip("needs the local cluster's real node: run hack/e2e.sh (make test does)")
	}
	e := setup(t)
	e.run("apply", "-f", groupsSample)
	// Its GPUs go back to the node for the tiny sample's tests.
	t.Cleanup(func() { e.run("delete", "-f", groupsSample, "--wait=false") })
	pods := func(role v1alpha1.Role) []corev1.Pod { return e.podsOf(sampleNS, groupsName, role) }
	settled := func() error {
		var p v1alpha1.PDCluster
		if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: sampleNS, Name: groupsName}, &p); err != nil {
			return err
		}
		if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady); c == nil || c.Status != metav1.ConditionTrue || p.Status.ObservedGeneration != p.Generation {
			return fmt.Errorf("Ready %+v at observed generation %d of %d", c, p.Status.ObservedGeneration, p.Generation)
		}
		if p.Status.Prefill.Ready != "1/1" {
			return fmt.Errorf("prefill %q ready, want its one group", p.Status.Prefill.Ready)
		}
		for role, want := range map[v1alpha1.Role]int{v1alpha1.RolePrefill: 2, v1alpha1.RoleDecode: 1, v1alpha1.RoleRouter: 1} {
			got := pods(role)
			if len(got) != want {
				return fmt.Errorf("%s: %d pods %v, want %d", role, len(got), podNames(got), want)
			}
			for _, pod := range got {
				if err := runsHere(role, pod); err != nil {
					return err
				}
			}
		}
		return nil
	}
	e.eventuallyWithin("the sample Ready, its prefill replica one group of 2 pods running on the real node", 5*time.Minute, settled)

	// Each pod's registry: its own two ranks, counted from 0 as vLLM's hybrid load balancing
	// counts them, each worker at the pod's own IP; four engines in all.
	registries := func() map[string]bootstrap.Topology {
		t.Helper()
		out := map[string]bootstrap.Topology{}
		for _, pod := range pods(v1alpha1.RolePrefill) {
			boot := "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(vllm.MooncakeBootstrapPort)))
			topo, err := bootstrap.NewClient().Query(e.ctx, boot)
			if err != nil {
				t.Fatalf("%s: %v", pod.Name, err)
			}
			out[pod.Name] = topo
		}
		return out
	}
	engineIDs := map[string]bool{}
	for pod, topo := range registries() {
		var ip string
		for _, p := range pods(v1alpha1.RolePrefill) {
			if p.Name == pod {
				ip = p.Status.PodIP
			}
		}
		if len(topo) != 2 || topo["0"].EngineID == "" || topo["1"].EngineID == "" {
			t.Fatalf("%s's bootstrap registry %+v: want its ranks 0 and 1", pod, topo)
		}
		for rank, eng := range topo {
			engineIDs[eng.EngineID] = true
			if u, err := url.Parse(eng.WorkerAddr["0"]["0"]); err != nil || u.Hostname() != ip {
				t.Errorf("%s rank %s: worker at %q, want the pod's IP %s", pod, rank, eng.WorkerAddr["0"]["0"], ip)
			}
		}
	}
	if len(engineIDs) != 4 {
		t.Errorf("engine ids %v: want 4, one per rank of the replica", engineIDs)
	}

	// traffic sends n completions through the router and returns, per prefill pod, the prompt
	// tokens each of its ranks computed, and decode's pulled tokens, as they rose.
	traffic := func(n int) (map[string]map[string]float64, float64) {
		t.Helper()
		before := rankTokens(t, pods(v1alpha1.RolePrefill), vllm.SourceLocalCompute)
		decodeBefore := rankTokens(t, pods(v1alpha1.RoleDecode), vllm.SourceExternalKV)
		for i := range n {
			code, got, err := completeThrough(e, groupsName, words(3*realBlock+5), 4)
			if err != nil || code != http.StatusOK || got != 4 {
				t.Fatalf("completion %d through the router: status %d, %d tokens, %v", i, code, got, err)
			}
		}
		after := rankTokens(t, pods(v1alpha1.RolePrefill), vllm.SourceLocalCompute)
		decodeAfter := rankTokens(t, pods(v1alpha1.RoleDecode), vllm.SourceExternalKV)
		rose := map[string]map[string]float64{}
		for pod, ranks := range after {
			rose[pod] = map[string]float64{}
			for rank, v := range ranks {
				rose[pod][rank] = v - before[pod][rank]
			}
		}
		var pulled float64
		for pod, ranks := range decodeAfter {
			for rank, v := range ranks {
				pulled += v - decodeBefore[pod][rank]
			}
		}
		return rose, pulled
	}
	// The router resolves its pools every 5 s: wait for both pods before counting.
	e.eventually("a completion through the router", func() error {
		_, _, err := completeThrough(e, groupsName, words(3), 1)
		return err
	})
	everyRank := func(what string, n int) {
		t.Helper()
		rose, pulled := traffic(n)
		if len(rose) != 2 {
			t.Fatalf("%s: prefill pods %v, want the group's 2", what, rose)
		}
		for pod, ranks := range rose {
			for _, rank := range []string{"0", "1"} {
				if ranks[rank] <= 0 {
					t.Errorf("%s: %s rank %s computed no prompt tokens of %d requests (by rank: %v): the router did not pin it", what, pod, rank, n, ranks)
				}
			}
		}
		if pulled < float64(n*3*realBlock) {
			t.Errorf("%s: decode pulled %.0f prompt tokens for %d prompts of over 3 blocks: the KV did not come from prefill", what, pulled, n)
		}
	}
	everyRank("the group", 40)

	// A pod lost is the replica lost: LeaderWorkerSet recreates the group, and the stand-in's
	// other pod, whose group broke, ends as vLLM's engine would.
	before := map[types.UID]bool{}
	for _, pod := range pods(v1alpha1.RolePrefill) {
		before[pod.UID] = true
		if pod.Labels[lwsv1.WorkerIndexLabelKey] == "1" {
			e.run("delete", "pod", "-n", sampleNS, pod.Name, "--wait=false")
		}
	}
	decode := pods(v1alpha1.RoleDecode)[0]
	e.eventuallyWithin("the group recreated: two new prefill pods, Ready again", 5*time.Minute, func() error {
		for _, pod := range pods(v1alpha1.RolePrefill) {
			if before[pod.UID] {
				return fmt.Errorf("%s is a pod from before the worker was deleted", pod.Name)
			}
		}
		return settled()
	})
	if now := pods(v1alpha1.RoleDecode)[0]; now.UID != decode.UID || restarts(now, v1alpha1.EngineContainerName) != 0 {
		t.Errorf("decode pod %s (restarts %d), was %s: want the same pod, its engine never restarted", now.UID, restarts(now, v1alpha1.EngineContainerName), decode.UID)
	}
	for pod, topo := range registries() {
		for rank, eng := range topo {
			if engineIDs[eng.EngineID] {
				t.Errorf("%s rank %s registers engine %s of the group from before", pod, rank, eng.EngineID)
			}
		}
	}
	e.eventually("a completion through the router to the new group", func() error {
		_, _, err := completeThrough(e, groupsName, words(3), 1)
		return err
	})
	everyRank("the recreated group", 40)
}

// rankTokens reads each pod's engine /metrics: the prompt tokens of source by rank (vLLM's
// engine label).
func rankTokens(t *testing.T, pods []corev1.Pod, source string) map[string]map[string]float64 {
	t.Helper()
	out := map[string]map[string]float64{}
	for _, pod := range pods {
		f := scrape(t, "http://"+net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(vllm.APIPort)))+"/metrics", vllm.MetricPromptTokensBySource)
		out[pod.Name] = map[string]float64{}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels[vllm.MetricSourceLabel] == source {
				out[pod.Name][labels["engine"]] += m.GetCounter().GetValue()
			}
		}
	}
	return out
}

// scrape reads the Prometheus text at url and returns the family named (a counter's by its
// name with or without _total: newer parsers drop it), failing the test if it is absent.
func scrape(t *testing.T, url, family string) *dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("%s: %v", url, err)
	}
	f := families[family]
	if f == nil {
		f = families[strings.TrimSuffix(family, "_total")]
	}
	if f == nil {
		t.Fatalf("%s has no %s", url, family)
	}
	return f
}
