package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// scrapes is a fake scrape source: what each pod's sidecar answers on GET /gate, set by the
// test as its engine's counters grow.
type scrapes struct {
	mu sync.Mutex
	by map[string]vllm.State
}

func (s *scrapes) ReadGate(_ context.Context, pod *corev1.Pod) (vllm.State, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.by[pod.Name], nil
}

func (s *scrapes) set(pod string, external, compute float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.by[pod] = vllm.State{Loaded: true, Report: &vllm.Report{Connector: "GatedMooncakeConnector"},
		Engine: &vllm.EngineStats{HasPromptSources: true, ExternalKVTokens: external, LocalComputeTokens: compute}}
}

// KVTransferVerified follows the decode engines' counters through the API server: no verdict
// before a window of traffic, True while decode receives its prompts, False (the pod named, a
// Warning) when it recomputes, True again (a Normal event) once KV moves; and no write while
// the counters do not change.
func TestKVTransferVerifiedTransitions(t *testing.T) {
	f := newFixture(t)
	now := time.Now()
	clock := clocktesting.NewFakePassiveClock(now)
	src := &scrapes{by: map[string]vllm.State{}}
	f.r.Clock, f.r.GateReader = clock, src
	pdc := wrappers.MakePDCluster(f.ns, "kv").Verification(v1alpha1.KVVerification{WindowSeconds: ptr.To[int32](60)}).Obj()
	if err := f.c.Create(f.ctx, pdc); err != nil {
		t.Fatal(err)
	}
	// Deleted at the end, so its series leave the operator's metrics that other tests read.
	t.Cleanup(func() {
		if err := f.c.Delete(f.ctx, pdc); err == nil {
			f.reconcile("kv")
		}
	})
	f.enginePodWithConnector("kv", "kv-prefill-a", v1alpha1.RolePrefill, true, now.Add(-time.Hour))
	f.enginePodWithConnector("kv", "kv-decode-a", v1alpha1.RoleDecode, true, now.Add(-time.Hour))
	src.set("kv-prefill-a", 0, 50000)

	step := func(at time.Duration, external, compute float64) v1alpha1.PDCluster {
		t.Helper()
		clock.SetTime(now.Add(at))
		src.set("kv-decode-a", external, compute)
		f.reconcile("kv")
		var got v1alpha1.PDCluster
		f.get(&got, "kv")
		return got
	}
	expect := func(got v1alpha1.PDCluster, status metav1.ConditionStatus, reason string) {
		t.Helper()
		if c := condition(&got, v1alpha1.ConditionKVTransferVerified); c.Status != status || c.Reason != reason {
			t.Fatalf("KVTransferVerified = %s/%s (%s), want %s/%s", c.Status, c.Reason, c.Message, status, reason)
		}
	}

	expect(step(0, 0, 0), metav1.ConditionUnknown, v1alpha1.ReasonNoTraffic)
	got := step(20*time.Second, 19900, 100)
	expect(got, metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved)
	if kv := got.Status.KVTransfer; kv == nil || ptr.Deref(kv.ExternalSharePercent, -1) != 99 || kv.ExternalTokens != 19900 {
		t.Errorf("status.kvTransfer = %+v, want 99%% of 20000 tokens external", kv)
	}
	f.events()
	if got := kvMetric(t, f.ns, "kv"); got != "ExternalKVObserved=1" {
		t.Errorf("pdcluster_kv_transfer_verified = %q, want ExternalKVObserved=1", got)
	}

	// Nothing changes (the same counters, read again later): no write at all.
	writes.Store(0)
	step(40*time.Second, 19900, 100)
	if n := writes.Load(); n != 0 {
		t.Errorf("a reconcile with unchanged counters made %d writes, want 0", n)
	}

	// Decode starts computing its prompts: False, the pod named, one Warning.
	got = step(60*time.Second, 19900, 40100)
	expect(got, metav1.ConditionFalse, v1alpha1.ReasonDecodeRecomputing)
	if c := condition(&got, v1alpha1.ConditionKVTransferVerified); !strings.Contains(c.Message, "kv-decode-a") {
		t.Errorf("message %q does not name the recomputing pod", c.Message)
	}
	if pods := got.Status.KVTransfer.RecomputingPods; len(pods) != 1 || pods[0] != "kv-decode-a" {
		t.Errorf("status.kvTransfer.recomputingPods = %q, want kv-decode-a", pods)
	}
	if ev := strings.Join(f.events(), "\n"); !strings.Contains(ev, "Warning "+v1alpha1.ReasonDecodeRecomputing) {
		t.Errorf("events %q lack the Warning", ev)
	}
	if got := kvMetric(t, f.ns, "kv"); got != "DecodeRecomputing=0" {
		t.Errorf("pdcluster_kv_transfer_verified = %q, want DecodeRecomputing=0 alone", got)
	}

	// KV moves again: once the window holds only the new traffic, True and a Normal event.
	step(80*time.Second, 19900, 40100)
	got = step(150*time.Second, 219900, 41100)
	expect(got, metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved)
	if ev := strings.Join(f.events(), "\n"); !strings.Contains(ev, "Normal "+v1alpha1.ReasonExternalKVObserved) {
		t.Errorf("events %q lack the Normal event of the recovery", ev)
	}

	// Verification turned off: the condition and status.kvTransfer go.
	got.Spec.KVTransfer.Verification.Mode = v1alpha1.KVVerificationDisabled
	if err := f.c.Update(f.ctx, &got); err != nil {
		t.Fatal(err)
	}
	got = step(160*time.Second, 219900, 41100)
	if c := condition(&got, v1alpha1.ConditionKVTransferVerified); c.Type != "" || got.Status.KVTransfer != nil {
		t.Errorf("with verification disabled: condition %+v, status.kvTransfer %+v, want neither", c, got.Status.KVTransfer)
	}
	if got := kvMetric(t, f.ns, "kv"); got != "" {
		t.Errorf("pdcluster_kv_transfer_verified = %q with verification disabled, want no series", got)
	}
}

// kvMetric is the operator's pdcluster_kv_transfer_verified series of one PDCluster, as
// reason=value ("" for none; several joined with commas).
func kvMetric(t *testing.T, ns, name string) string {
	t.Helper()
	mfs, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, mf := range mfs {
		if mf.GetName() != "pdcluster_kv_transfer_verified" {
			continue
		}
		for _, m := range mf.Metric {
			l := map[string]string{}
			for _, p := range m.Label {
				l[p.GetName()] = p.GetValue()
			}
			if l["namespace"] == ns && l["name"] == name {
				out = append(out, fmt.Sprintf("%s=%v", l["reason"], m.GetGauge().GetValue()))
			}
		}
	}
	return strings.Join(out, ",")
}
