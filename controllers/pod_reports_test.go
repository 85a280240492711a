package controllers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// scriptedGates answers ReadGate from a table by pod name that a test changes between polls,
// and counts the reads.
type scriptedGates struct {
	mu    sync.Mutex
	by    map[string]vllm.State
	reads map[string]int
}

func (s *scriptedGates) set(pod string, st *vllm.State) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.by == nil {
		s.by = map[string]vllm.State{}
	}
	if st == nil {
		delete(s.by, pod)
		return
	}
	s.by[pod] = *st
}

func (s *scriptedGates) ReadGate(_ context.Context, pod *corev1.Pod) (vllm.State, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.reads == nil {
		s.reads = map[string]int{}
	}
	s.reads[pod.Name]++
	st, ok := s.by[pod.Name]
	if !ok {
		return vllm.State{}, errors.New("connection refused")
	}
	return st, nil
}

func (s *scriptedGates) readsOf(pod string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reads[pod]
}

// enqueued drains the PDClusters the reports enqueued so far.
func enqueued(p *PodReports) []string {
	var out []string
	for {
		select {
		case e := <-p.Events():
			out = append(out, e.Object.GetNamespace()+"/"+e.Object.GetName())
		default:
			return out
		}
	}
}

// Reconcile gets the last answer at once and the pod is read outside it: a pod asked about for
// the first time is read on the next poll, its answer dated by the read; the PDCluster is
// enqueued when what a reconcile acts on changes (an answer appears or goes, the gate loads or
// unloads), never for counts or ages that move with every request; a pod Reconcile stopped
// asking about is forgotten.
func TestPodReportsKeepTheLastAnswerAndEnqueueOnChange(t *testing.T) {
	clock := clocktesting.NewFakeClock(start)
	gates := &scriptedGates{}
	p := &PodReports{Gates: gates, Interval: time.Minute, Timeout: time.Second, Clock: clock}
	ctx := context.Background()
	d0 := wrappers.MakeEnginePod("ns", "d-0", "c", v1alpha1.RoleDecode, start).Obj()
	st := loaded(1, 2, 0)
	gates.set("d-0", &st)

	if _, _, err := p.ReadGateAt(d0); !errors.Is(err, errNotReadYet) {
		t.Fatalf("first ask: err = %v, want %v", err, errNotReadYet)
	}
	if gates.readsOf("d-0") != 0 {
		t.Fatal("Reconcile's ask read the pod itself")
	}
	select {
	case <-p.kick:
	default:
		t.Fatal("a pod asked about for the first time does not wake the poller")
	}

	clock.Step(3 * time.Second)
	readAt := clock.Now()
	p.poll(ctx, true)
	if d := cmp.Diff([]string{"ns/c"}, enqueued(p)); d != "" {
		t.Errorf("first answer: enqueued (-want +got):\n%s", d)
	}
	clock.Step(5 * time.Second) // a reconcile later than the read
	got, at, err := p.ReadGateAt(d0)
	if err != nil || !at.Equal(readAt) {
		t.Fatalf("after the poll: at %v, err %v; want the read's time %v", at, err, readAt)
	}
	if d := cmp.Diff(st, got); d != "" {
		t.Errorf("answer (-want +got):\n%s", d)
	}
	p.poll(ctx, true)
	if n := gates.readsOf("d-0"); n != 1 {
		t.Errorf("a poll of new pods read an already-read pod again: %d reads", n)
	}

	// Counts and ages move with every request: the next poll stores them and enqueues nothing.
	busier := loaded(50, 60, 0)
	busier.AgeSeconds = 3
	gates.set("d-0", &busier)
	clock.Step(10 * time.Second)
	p.poll(ctx, false)
	if got := enqueued(p); len(got) != 0 {
		t.Errorf("new counts enqueued %v", got)
	}
	if got, _, _ := p.ReadGateAt(d0); got.Report.Counts.Gated != 50 {
		t.Errorf("counts after a poll: %+v, want the new ones", got.Report.Counts)
	}

	// The gate's first report, a change of its ranks: each is a change (issue 57: status
	// waited up to a minute for them).
	silentGate := busier
	silentGate.Report = nil
	gates.set("d-0", &silentGate)
	p.poll(ctx, false)
	_ = enqueued(p) // the report gone: a change too
	gates.set("d-0", &busier)
	p.poll(ctx, false)
	if d := cmp.Diff([]string{"ns/c"}, enqueued(p)); d != "" {
		t.Errorf("first report: enqueued (-want +got):\n%s", d)
	}
	twoRanks := busier
	twoRanks.Ranks = 2
	gates.set("d-0", &twoRanks)
	p.poll(ctx, false)
	if d := cmp.Diff([]string{"ns/c"}, enqueued(p)); d != "" {
		t.Errorf("ranks changed: enqueued (-want +got):\n%s", d)
	}
	busier = twoRanks

	// The gate unloads; then the sidecar stops answering: each is a change.
	unloaded := busier
	unloaded.Loaded = false
	gates.set("d-0", &unloaded)
	p.poll(ctx, false)
	if d := cmp.Diff([]string{"ns/c"}, enqueued(p)); d != "" {
		t.Errorf("gate unloaded: enqueued (-want +got):\n%s", d)
	}
	gates.set("d-0", nil)
	p.poll(ctx, false)
	if d := cmp.Diff([]string{"ns/c"}, enqueued(p)); d != "" {
		t.Errorf("sidecar silent: enqueued (-want +got):\n%s", d)
	}
	if _, _, err := p.ReadGateAt(d0); err == nil || errors.Is(err, errNotReadYet) {
		t.Errorf("a sidecar that stopped answering: err = %v, want its read's error", err)
	}

	// Not asked about for longer than forgetAfter: no longer read.
	before := gates.readsOf("d-0")
	clock.Step(forgetAfter + time.Second)
	p.poll(ctx, false)
	if n := gates.readsOf("d-0"); n != before {
		t.Errorf("a pod Reconcile stopped asking about was read again (%d reads, was %d)", n, before)
	}
	if _, _, err := p.ReadGateAt(d0); !errors.Is(err, errNotReadYet) {
		t.Errorf("a forgotten pod asked about again: err = %v, want %v", err, errNotReadYet)
	}
}

// A router's newer canary enqueues its PDCluster; pair and routing counts, which move with
// every request, do not.
func TestPodReportsEnqueueNewCanariesNotPairCounts(t *testing.T) {
	clock := clocktesting.NewFakeClock(start)
	canaries := fakeCanaries{"r-0": {Time: start, Result: routerconfig.CanaryExternal}}
	pairs := fakePairs{"r-0": {SameDomain: 1}}
	routing := fakeRouting{"r-0": {Prefill: routerconfig.PoolRoutingCounts{PromptChunks: 2, HeldChunks: 1}}}
	p := &PodReports{Canaries: canaries, Pairs: pairs, Routing: routing, Interval: time.Minute, Timeout: time.Second, Clock: clock}
	ctx := context.Background()
	router := wrappers.MakeEnginePod("ns", "r-0", "c", v1alpha1.RoleRouter, start).Obj()
	_, _ = p.ReadCanary(ctx, router)
	_, _ = p.ReadPairs(ctx, router)
	_, _ = p.ReadRouting(ctx, router)
	p.poll(ctx, true)
	if d := cmp.Diff([]string{"ns/c"}, enqueued(p)); d != "" {
		t.Errorf("first answers: enqueued (-want +got):\n%s", d)
	}
	pairs["r-0"] = routerconfig.PairCounts{SameDomain: 9, CrossDomain: 2}
	p.poll(ctx, false)
	if got := enqueued(p); len(got) != 0 {
		t.Errorf("new pair counts enqueued %v", got)
	}
	if pc, err := p.ReadPairs(ctx, router); err != nil || pc.SameDomain != 9 {
		t.Errorf("pairs after a poll: %+v, %v", pc, err)
	}
	routing["r-0"] = routerconfig.RoutingCounts{Prefill: routerconfig.PoolRoutingCounts{PromptChunks: 20, HeldChunks: 15}}
	p.poll(ctx, false)
	if got := enqueued(p); len(got) != 0 {
		t.Errorf("new routing counts enqueued %v", got)
	}
	if rc, err := p.ReadRouting(ctx, router); err != nil || rc.Prefill.HeldChunks != 15 {
		t.Errorf("routing counts after a poll: %+v, %v", rc, err)
	}
	canaries["r-0"] = routerconfig.CanaryResult{Time: start.Add(time.Minute), Result: routerconfig.CanaryExternal}
	p.poll(ctx, false)
	if d := cmp.Diff([]string{"ns/c"}, enqueued(p)); d != "" {
		t.Errorf("a newer canary: enqueued (-want +got):\n%s", d)
	}
}

// blockingGates never answers before its context ends, and counts the reads under way.
type blockingGates struct{ inFlight, most atomic.Int32 }

func (b *blockingGates) ReadGate(ctx context.Context, _ *corev1.Pod) (vllm.State, error) {
	n := b.inFlight.Add(1)
	defer b.inFlight.Add(-1)
	for {
		m := b.most.Load()
		if n <= m || b.most.CompareAndSwap(m, n) {
			break
		}
	}
	<-ctx.Done()
	return vllm.State{}, ctx.Err()
}

// A pod that never answers is given up at Timeout, a few pods are read at once, and a
// reconcile whose pods all hang finishes without waiting for them (the old reconcile read the
// pods itself and waited on each).
func TestPodReportsNeverHoldAReconcile(t *testing.T) {
	hung := &blockingGates{}
	reports := &PodReports{Gates: hung, Interval: time.Minute, Timeout: 50 * time.Millisecond}
	objs := []client.Object{pdc()}
	for i := range 3 * podReportReads {
		objs = append(objs, wrappers.MakeEnginePod("ns", fmt.Sprintf("d-%d", i), "c", v1alpha1.RoleDecode, start).Obj())
	}
	f := newRolloutFixture(t, pdc())
	f.c = newFakeClient(t).WithObjects(objs...).WithStatusSubresource(&v1alpha1.PDCluster{}).Build()
	f.r.Client, f.r.Reports, f.r.GateReader = f.c, reports, reports

	finished := make(chan error, 1)
	go func() {
		_, err := f.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "c"}})
		finished <- err
	}()
	select {
	case err := <-finished:
		if err != nil {
			t.Fatalf("reconcile: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a reconcile waited on pods that never answer")
	}

	polled := make(chan struct{})
	go func() { reports.poll(context.Background(), true); close(polled) }()
	select {
	case <-polled:
	case <-time.After(30 * time.Second):
		t.Fatal("a poll waited on pods that never answer past its Timeout")
	}
	if m := hung.most.Load(); m < 2 || m > podReportReads {
		t.Errorf("%d reads at once, want between 2 and %d", m, podReportReads)
	}
	pod := wrappers.MakeEnginePod("ns", "d-0", "c", v1alpha1.RoleDecode, start).Obj()
	if _, err := reports.ReadGate(context.Background(), pod); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a pod that never answered: err = %v, want the timeout", err)
	}
}

// A cached answer is KV evidence of when it was read, not of when a reconcile looked at it:
// the sample is dated by the read less the sidecar's scrape age, and a second reconcile of the
// same answer adds no second sample.
func TestKVSamplesAreDatedByTheirRead(t *testing.T) {
	p := pdc()
	r := &PDClusterReconciler{}
	d0 := wrappers.MakeEnginePod("ns", "d-0", "c", v1alpha1.RoleDecode, start.Add(-time.Hour)).Obj()
	st := loaded(0, 0, 0)
	st.Engine = &vllm.EngineStats{HasPromptSources: true, ExternalKVTokens: 100, AgeSeconds: 2}
	o := observed{pods: []corev1.Pod{*d0}, gatesRead: true, gates: []gateRead{{v1alpha1.RoleDecode, d0, st, start.Add(-8 * time.Second)}}}
	r.verifyKV(p, o, start)
	r.verifyKV(p, o, start.Add(5*time.Second))
	var at []time.Time
	for _, s := range r.kv.of(p).Samples(d0.UID) {
		at = append(at, s.At)
	}
	if d := cmp.Diff([]time.Time{start.Add(-10 * time.Second)}, at); d != "" {
		t.Errorf("samples' times (-want +got):\n%s", d)
	}
}

// hangingGates never answers for the pods of PDCluster "a" (each read waits for its context,
// as a silent sidecar's waits out the timeout) and answers the others at once; it counts the
// reads and the most of "a"'s at once.
type hangingGates struct {
	mu                  sync.Mutex
	reads               map[string]int
	hanging, mostAtOnce int
}

func (h *hangingGates) ReadGate(ctx context.Context, pod *corev1.Pod) (vllm.State, error) {
	h.mu.Lock()
	h.reads[pod.Name]++
	silent := pod.Labels[v1alpha1.LabelCluster] == "a"
	if silent {
		h.hanging++
		h.mostAtOnce = max(h.mostAtOnce, h.hanging)
	}
	h.mu.Unlock()
	if !silent {
		return loaded(1, 1, 0), nil
	}
	<-ctx.Done()
	h.mu.Lock()
	h.hanging--
	h.mu.Unlock()
	return vllm.State{}, ctx.Err()
}

// One PDCluster's silent pods hold up no other PDCluster's reads (issue 56: 160 silent pods
// made every poll 20 s, for every tenant): polls overlap, a pod being read is left to the poll
// reading it, and one PDCluster takes at most podReportReadsPerCluster reads at once.
func TestPodReportsSilentPodsHoldUpNoOtherPDCluster(t *testing.T) {
	gates := &hangingGates{reads: map[string]int{}}
	p := &PodReports{Gates: gates, Interval: time.Hour, Timeout: time.Hour}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- p.Start(ctx) }()
	silent := make([]*corev1.Pod, 40)
	for i := range silent {
		silent[i] = wrappers.MakeEnginePod("ns", "a-"+strconv.Itoa(i), "a", v1alpha1.RoleDecode, start).Obj()
		silent[i].UID = types.UID(silent[i].Name)
		_, _, _ = p.ReadGateAt(silent[i])
	}
	b := wrappers.MakeEnginePod("ns", "b-0", "b", v1alpha1.RoleDecode, start).Obj()
	b.UID = "b-0"
	var err error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		// Asking again as Reconcile does (each first ask wakes the poller).
		for _, pod := range silent[:4] {
			_, _, _ = p.ReadGateAt(pod)
		}
		if _, _, err = p.ReadGateAt(b); err == nil {
			break
		}
	}
	if err != nil {
		t.Errorf("PDCluster b's pod not read while a's hang: %v", err)
	}
	gates.mu.Lock()
	most, reads := gates.mostAtOnce, maps.Clone(gates.reads)
	gates.mu.Unlock()
	if most > podReportReadsPerCluster {
		t.Errorf("PDCluster a had %d reads at once, want at most %d", most, podReportReadsPerCluster)
	}
	for name, n := range reads {
		if n > 1 {
			t.Errorf("%s read %d times while its first read hung", name, n)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
