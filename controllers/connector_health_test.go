package controllers

import (
	"context"
	"errors"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

type healthFixture struct {
	r       *PDClusterReconciler
	clock   *clocktesting.FakePassiveClock
	pdc     *v1alpha1.PDCluster
	status  *v1alpha1.PDClusterStatus
	deletes []string
}

func newHealthFixture(t *testing.T, funcs interceptor.Funcs, pods ...*corev1.Pod) *healthFixture {
	t.Helper()
	f := &healthFixture{clock: clocktesting.NewFakePassiveClock(start), pdc: pdc()}
	for _, p := range pods {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.ContainersReady && c.Status == corev1.ConditionFalse {
				f.pdc.Status.Connector.UnhealthyPods = append(f.pdc.Status.Connector.UnhealthyPods, v1alpha1.UnhealthyPod{Name: p.Name, Since: c.LastTransitionTime})
			}
		}
	}
	objs := []client.Object{f.pdc.DeepCopy()}
	for _, p := range pods {
		objs = append(objs, p)
	}
	// Record every delete that reached the client (after any failure the test injects).
	next := funcs.Delete
	funcs.Delete = func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.DeleteOption) error {
		if next != nil {
			if err := next(ctx, c, obj, opts...); err != nil {
				return err
			}
		}
		f.deletes = append(f.deletes, obj.GetName())
		return c.Delete(ctx, obj, opts...)
	}
	c := newFakeClient(t).WithObjects(objs...).WithInterceptorFuncs(funcs).Build()
	f.r = &PDClusterReconciler{Client: c, Scheme: c.Scheme(), Clock: f.clock}
	f.status = f.pdc.Status.DeepCopy()
	return f
}

// run observes, decides and acts on connector health once, and carries the computed status
// over, as a status write would.
func (f *healthFixture) run(t *testing.T) (time.Duration, []event, error) {
	t.Helper()
	ctx := context.Background()
	in := statusInputs{pdc: f.pdc, now: f.clock.Now()}
	in.obs = f.r.observe(ctx, f.pdc, nil, f.r.now())
	in.health = f.r.decideConnectorHealth(ctx, f.pdc, in.obs, in.now, int(*f.pdc.Spec.Prefill.Replicas+*f.pdc.Spec.Decode.Replicas))
	status, events := computeStatus(in)
	f.status = &status
	f.pdc.Status = *status.DeepCopy()
	return in.health.requeueAfter(), events, in.health.err
}

func (f *healthFixture) condition(t *testing.T) metav1.Condition {
	t.Helper()
	c := meta.FindStatusCondition(f.status.Conditions, v1alpha1.ConditionConnectorHealthy)
	if c == nil {
		t.Fatal("no ConnectorHealthy condition")
	}
	return *c
}

func reasons(events []event) []string {
	var out []string
	for _, e := range events {
		out = append(out, e.kind+" "+e.reason)
	}
	return out
}

func TestHealthyConnectorsRestartNothing(t *testing.T) {
	f := newHealthFixture(t, interceptor.Funcs{}, pod("p-0", v1alpha1.RolePrefill, 0), pod("d-0", v1alpha1.RoleDecode, 0), pod("d-1", v1alpha1.RoleDecode, 0))
	after, evs, err := f.run(t)
	if err != nil || after != 0 || len(f.deletes) != 0 || len(evs) != 0 {
		t.Fatalf("after=%s events=%v deletes=%v err=%v, want nothing to do", after, reasons(evs), f.deletes, err)
	}
	if c := f.condition(t); c.Status != metav1.ConditionTrue || c.Reason != v1alpha1.ReasonConnectorsReady || c.ObservedGeneration != 1 {
		t.Errorf("condition = %+v", c)
	}
}

// A decode connector unready for 10s waits (the clock decides when), then its pod alone is
// restarted and the round is recorded in status, in a Warning event and in the pool count.
func TestUnreadyDecodeConnectorIsRestartedAfterTheThreshold(t *testing.T) {
	f := newHealthFixture(t, interceptor.Funcs{}, pod("p-0", v1alpha1.RolePrefill, 0), pod("d-0", v1alpha1.RoleDecode, 10*time.Second), pod("d-1", v1alpha1.RoleDecode, 0))
	after, evs, err := f.run(t)
	if err != nil {
		t.Fatal(err)
	}
	if after != 20*time.Second || len(f.deletes) != 0 {
		t.Fatalf("requeue after %s, deletes %v; want 20s and none", after, f.deletes)
	}
	if c := f.condition(t); c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonConnectorNotReady {
		t.Errorf("condition = %+v, want ConnectorNotReady", c)
	}
	if d := cmp.Diff([]string{"Warning ConnectorNotReady"}, reasons(evs)); d != "" {
		t.Errorf("events (-want +got):\n%s", d)
	}

	f.clock.SetTime(start.Add(after))
	if _, evs, err = f.run(t); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff([]string{"d-0"}, f.deletes); d != "" {
		t.Errorf("deleted pods (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]string{"Warning ConnectorRestarted"}, reasons(evs)); d != "" {
		t.Errorf("events (-want +got):\n%s", d)
	}
	st := f.status
	if st.Connector.Restarts != 1 || st.Decode.ConnectorRestarts != 1 || st.Prefill.ConnectorRestarts != 0 || st.Connector.ConsecutiveRounds != 1 {
		t.Errorf("restart counts = %+v, decode %d, prefill %d", st.Connector, st.Decode.ConnectorRestarts, st.Prefill.ConnectorRestarts)
	}
	if c := f.condition(t); c.Reason != v1alpha1.ReasonConnectorRestarted {
		t.Errorf("condition = %+v, want ConnectorRestarted", c)
	}
}

// A prefill restart takes the decode pods connected to it along, in one round.
func TestPrefillRestartRestartsConnectedDecodePods(t *testing.T) {
	f := newHealthFixture(t, interceptor.Funcs{}, pod("p-0", v1alpha1.RolePrefill, time.Minute), pod("d-0", v1alpha1.RoleDecode, 0), pod("d-1", v1alpha1.RoleDecode, 0))
	if _, _, err := f.run(t); err != nil {
		t.Fatal(err)
	}
	sort.Strings(f.deletes)
	if d := cmp.Diff([]string{"d-0", "d-1", "p-0"}, f.deletes); d != "" {
		t.Errorf("deleted pods (-want +got):\n%s", d)
	}
	st := f.status
	if st.Connector.Restarts != 3 || st.Prefill.ConnectorRestarts != 1 || st.Decode.ConnectorRestarts != 2 || len(st.Connector.RecentRounds) != 1 ||
		st.Connector.DecodeCascadeRestarts != 2 || len(st.Connector.RecentCascadeRounds) != 1 {
		t.Errorf("status = %+v, prefill %d, decode %d; want 3 restarts in one round, 2 of them a cascade", st.Connector, st.Prefill.ConnectorRestarts, st.Decode.ConnectorRestarts)
	}
}

// A prefill pod that keeps failing (a stuck drain, say) takes the decode pods along only
// decodeCascadeBudget rounds a window; past it the prefill pod restarts alone, and the
// condition says why the decode pods were left running.
func TestDecodeCascadeHasABudgetOfItsOwn(t *testing.T) {
	f := newHealthFixture(t, interceptor.Funcs{}, pod("p-0", v1alpha1.RolePrefill, time.Minute), pod("d-0", v1alpha1.RoleDecode, 0), pod("d-1", v1alpha1.RoleDecode, 0))
	f.pdc.Spec.Connector.Health.DecodeCascadeBudget = ptr.To[int32](1)
	if _, _, err := f.run(t); err != nil {
		t.Fatal(err)
	}
	// The replacement prefill pod's connector never turns ready; the decode replacements do.
	for _, p := range []*corev1.Pod{pod("p-1", v1alpha1.RolePrefill, 0), pod("d-2", v1alpha1.RoleDecode, 0), pod("d-3", v1alpha1.RoleDecode, 0)} {
		if p.Name == "p-1" {
			p.Status.ContainerStatuses[1].Ready = false
			p.Status.ContainerStatuses[1].State.Running.StartedAt = metav1.NewTime(start)
		}
		if err := f.r.Create(context.Background(), p); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := f.run(t); err != nil { // the operator sees p-1 unready at once
		t.Fatal(err)
	}
	f.clock.SetTime(start.Add(2 * time.Minute)) // past the threshold and the 60s backoff
	if _, _, err := f.run(t); err != nil {
		t.Fatal(err)
	}
	sort.Strings(f.deletes)
	if d := cmp.Diff([]string{"d-0", "d-1", "p-0", "p-1"}, f.deletes); d != "" {
		t.Errorf("deleted pods (-want +got):\n%s", d)
	}
	st := f.status
	if st.Connector.Restarts != 4 || st.Decode.ConnectorRestarts != 2 || st.Connector.DecodeCascadeRestarts != 2 || len(st.Connector.RecentCascadeRounds) != 1 || len(st.Connector.RecentRounds) != 2 {
		t.Errorf("status = %+v, decode %d; want 4 restarts in 2 rounds, one of them a cascade of 2", st.Connector, st.Decode.ConnectorRestarts)
	}
	if c := f.condition(t); c.Reason != v1alpha1.ReasonConnectorRestarted || !strings.Contains(c.Message, "decodeCascadeBudget is spent") {
		t.Errorf("condition = %+v, want ConnectorRestarted naming the spent decodeCascadeBudget", c)
	}
}

// A delete the API refuses is reported (condition, event, error for a retry) and not counted.
func TestFailedRestartIsReportedAndNotCounted(t *testing.T) {
	refuse := interceptor.Funcs{Delete: func(context.Context, client.WithWatch, client.Object, ...client.DeleteOption) error {
		return apierrors.NewForbidden(corev1.Resource("pods"), "d-0", errors.New("RBAC says no"))
	}}
	f := newHealthFixture(t, refuse, pod("d-0", v1alpha1.RoleDecode, time.Minute), pod("d-1", v1alpha1.RoleDecode, 0))
	_, evs, err := f.run(t)
	if !apierrors.IsForbidden(err) {
		t.Fatalf("err = %v, want the Forbidden delete", err)
	}
	if c := f.condition(t); c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonRestartFailed {
		t.Errorf("condition = %+v, want RestartFailed", c)
	}
	if d := cmp.Diff([]string{"Warning RestartFailed"}, reasons(evs)); d != "" {
		t.Errorf("events (-want +got):\n%s", d)
	}
	if f.status.Connector.Restarts != 0 || f.status.Connector.ConsecutiveRounds != 0 || f.status.Decode.ConnectorRestarts != 0 {
		t.Errorf("a failed restart was counted: %+v", f.status.Connector)
	}
}

// A pod that vanished before the delete counts as restarted: its Deployment replaces it anyway.
func TestPodAlreadyGoneCountsAsRestarted(t *testing.T) {
	gone := interceptor.Funcs{Delete: func(context.Context, client.WithWatch, client.Object, ...client.DeleteOption) error {
		return apierrors.NewNotFound(corev1.Resource("pods"), "d-0")
	}}
	f := newHealthFixture(t, gone, pod("d-0", v1alpha1.RoleDecode, time.Minute))
	if _, _, err := f.run(t); err != nil {
		t.Fatal(err)
	}
	if f.status.Connector.Restarts != 1 {
		t.Errorf("restarts = %d, want 1", f.status.Connector.Restarts)
	}
}

// Rounds back off, and a spent budget stops restarts with one Warning event, whatever the
// number of reconciles in between.
func TestBackoffThenBudget(t *testing.T) {
	f := newHealthFixture(t, interceptor.Funcs{}, pod("d-0", v1alpha1.RoleDecode, time.Minute))
	if _, _, err := f.run(t); err != nil { // round 1 at start
		t.Fatal(err)
	}
	c := f.r.Client
	ctx := context.Background()
	// The replacement's connector never turns ready either; the operator sees it at once.
	recreate := func(name string, at time.Time) {
		p := pod(name, v1alpha1.RoleDecode, 0)
		p.Status.ContainerStatuses[1].Ready = false
		p.Status.ContainerStatuses[1].State.Running.StartedAt = metav1.NewTime(at)
		if err := c.Create(ctx, p); err != nil {
			t.Fatal(err)
		}
		if _, _, err := f.run(t); err != nil {
			t.Fatal(err)
		}
	}
	recreate("d-1", start)

	f.clock.SetTime(start.Add(40 * time.Second)) // past the threshold, inside the 60s backoff
	after, _, err := f.run(t)
	if err != nil {
		t.Fatal(err)
	}
	if c := f.condition(t); c.Reason != v1alpha1.ReasonRestartBackoff || after != 20*time.Second || len(f.deletes) != 1 {
		t.Fatalf("condition %s, requeue %s, deletes %v; want backoff for 20s more", c.Reason, after, f.deletes)
	}

	f.clock.SetTime(start.Add(60 * time.Second)) // round 2
	if _, _, err := f.run(t); err != nil {
		t.Fatal(err)
	}
	recreate("d-2", start.Add(60*time.Second))
	f.clock.SetTime(start.Add(10 * time.Minute)) // past the 120s backoff, but the budget of 2 is spent
	var all []event
	for range 3 {
		after, evs, err := f.run(t)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, evs...)
		if after != 50*time.Minute { // when round 1 leaves the hour window
			t.Errorf("requeue after %s, want 50m", after)
		}
	}
	if d := cmp.Diff([]string{"d-0", "d-1"}, f.deletes); d != "" {
		t.Errorf("deleted pods (-want +got):\n%s", d)
	}
	if c := f.condition(t); c.Reason != v1alpha1.ReasonRestartBudgetExhausted {
		t.Errorf("condition = %+v, want RestartBudgetExhausted", c)
	}
	if d := cmp.Diff([]string{"Warning RestartBudgetExhausted"}, reasons(all)); d != "" {
		t.Errorf("events over three reconciles (-want +got):\n%s", d)
	}

	f.clock.SetTime(start.Add(61 * time.Minute)) // round 1 left the window
	if _, _, err := f.run(t); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff([]string{"d-0", "d-1", "d-2"}, f.deletes); d != "" {
		t.Errorf("deleted pods after the window moved (-want +got):\n%s", d)
	}
}

// A round is decided on the cached restart record; when the API server holds a newer
// PDCluster, the round waits instead of deleting on stale backoff and budget.
func TestRestartRoundWaitsForACurrentRecord(t *testing.T) {
	f := newHealthFixture(t, interceptor.Funcs{}, pod("d-0", v1alpha1.RoleDecode, time.Minute))
	f.r.APIReader = f.r.Client
	var live v1alpha1.PDCluster
	if err := f.r.Get(context.Background(), client.ObjectKeyFromObject(f.pdc), &live); err != nil {
		t.Fatal(err)
	}
	f.pdc.ResourceVersion = "1" // the cache is behind the API server
	after, _, err := f.run(t)
	if err != nil || len(f.deletes) != 0 || after != time.Second {
		t.Fatalf("stale record: deletes %v, requeue %s, err %v; want no delete and a retry in 1s", f.deletes, after, err)
	}
	f.pdc.ResourceVersion = live.ResourceVersion
	if _, _, err := f.run(t); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff([]string{"d-0"}, f.deletes); d != "" {
		t.Errorf("deleted with a current record (-want +got):\n%s", d)
	}
}

func TestPodEventsMapToTheirPDCluster(t *testing.T) {
	cases := []struct {
		name   string
		labels map[string]string
		want   []string
	}{
		{"engine pod", render.Labels("c", v1alpha1.RoleDecode), []string{"ns/c"}},
		{"pod of another manager", map[string]string{v1alpha1.LabelCluster: "c", v1alpha1.LabelManagedBy: "helm"}, nil},
		{"unrelated pod", map[string]string{"app": "x"}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", Labels: tc.labels}}
			var got []string
			for _, r := range podToPDCluster(context.Background(), p) {
				got = append(got, r.String())
			}
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Errorf("requests (-want +got):\n%s", d)
			}
		})
	}
}
