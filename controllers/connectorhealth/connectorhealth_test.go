package connectorhealth

import (
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

var t0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

// policy: unready for 30s restarts; backoff 60s, 120s, 240s capped at 300s; 3 rounds an hour.
var policy = Policy{Period: 10 * time.Second, FailureThreshold: 3, InitialBackoff: time.Minute, MaxBackoff: 5 * time.Minute,
	Budget: 3, Window: time.Hour, RestartDecodeWithPrefill: true, CascadeBudget: 2}

func ready(name string, role v1alpha1.Role) Pod { return Pod{Name: name, Role: role, Ready: true} }

func unready(name string, role v1alpha1.Role) Pod { return Pod{Name: name, Role: role} }

func at(d time.Duration) metav1.Time { return metav1.NewTime(t0.Add(d)) }

// seen is the operator's record of a connector it first saw unready ago.
func seen(name string, ago time.Duration) v1alpha1.UnhealthyPod {
	return v1alpha1.UnhealthyPod{Name: name, Since: at(-ago)}
}

func records(r ...v1alpha1.UnhealthyPod) []v1alpha1.UnhealthyPod { return r }

func TestDecide(t *testing.T) {
	healthyFleet := []Pod{ready("p-0", v1alpha1.RolePrefill), ready("d-0", v1alpha1.RoleDecode), ready("d-1", v1alpha1.RoleDecode)}
	withPolicy := func(f func(*Policy)) Policy {
		p := policy
		f(&p)
		return p
	}
	cases := []struct {
		name        string
		policy      Policy
		prev        v1alpha1.ConnectorStatus
		pods        []Pod
		desired     int // 0: len(pods)
		wantRestart []string
		wantBlocked string
		wantRequeue time.Duration
		wantStatus  v1alpha1.ConnectorStatus
	}{
		{
			name: "all ready resets the consecutive rounds, forgets the unhealthy and keeps the budget record",
			prev: v1alpha1.ConnectorStatus{Restarts: 4, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(-10 * time.Minute)),
				RecentRounds: []metav1.Time{at(-2 * time.Hour), at(-10 * time.Minute)}, UnhealthyPods: records(seen("d-0", time.Minute))},
			pods:       healthyFleet,
			wantStatus: v1alpha1.ConnectorStatus{Restarts: 4, LastRestartTime: ptr.To(at(-10 * time.Minute)), RecentRounds: []metav1.Time{at(-10 * time.Minute)}},
		},
		{
			name: "all ready but pods still missing keeps the consecutive rounds (and the backoff)",
			prev: v1alpha1.ConnectorStatus{Restarts: 1, ConsecutiveRounds: 1, LastRestartTime: ptr.To(at(-10 * time.Second)),
				RecentRounds: []metav1.Time{at(-10 * time.Second)}},
			pods:    []Pod{ready("p-0", v1alpha1.RolePrefill)},
			desired: 2,
			wantStatus: v1alpha1.ConnectorStatus{Restarts: 1, ConsecutiveRounds: 1, LastRestartTime: ptr.To(at(-10 * time.Second)),
				RecentRounds: []metav1.Time{at(-10 * time.Second)}},
		},
		{
			name: "the kubelet's connector restarts are summed over the current pods",
			prev: v1alpha1.ConnectorStatus{ContainerRestarts: 9},
			pods: []Pod{{Name: "p-0", Role: v1alpha1.RolePrefill, Ready: true, ContainerRestarts: 2},
				{Name: "d-0", Role: v1alpha1.RoleDecode, Ready: true, ContainerRestarts: 1}},
			wantStatus: v1alpha1.ConnectorStatus{ContainerRestarts: 3},
		},
		{
			name:        "a connector first seen unready now is recorded and waits the whole threshold",
			pods:        []Pod{unready("d-0", v1alpha1.RoleDecode), ready("p-0", v1alpha1.RolePrefill)},
			wantRequeue: 30 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", 0))},
		},
		{
			name:        "unready below the threshold waits for the rest of it",
			prev:        v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", 12*time.Second))},
			pods:        []Pod{unready("d-0", v1alpha1.RoleDecode), ready("p-0", v1alpha1.RolePrefill)},
			wantRequeue: 18 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", 12*time.Second))},
		},
		{
			name:        "a connector the kubelet restarted since counts from its start",
			prev:        v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", time.Hour))},
			pods:        []Pod{{Name: "d-0", Role: v1alpha1.RoleDecode, StartedAt: t0.Add(-5 * time.Second)}},
			wantRequeue: 25 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", 5*time.Second))},
		},
		{
			name:        "a decode pod past the threshold is restarted alone",
			prev:        v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", 30*time.Second))},
			pods:        []Pod{unready("d-0", v1alpha1.RoleDecode), ready("d-1", v1alpha1.RoleDecode), ready("p-0", v1alpha1.RolePrefill)},
			wantRestart: []string{"d-0"},
			wantRequeue: 30 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", 30*time.Second))},
		},
		{
			name:        "a prefill restart takes the connected decode pods with it",
			prev:        v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-1", time.Minute))},
			pods:        []Pod{unready("p-1", v1alpha1.RolePrefill), ready("p-0", v1alpha1.RolePrefill), ready("d-1", v1alpha1.RoleDecode), ready("d-0", v1alpha1.RoleDecode)},
			wantRestart: []string{"p-1", "d-0", "d-1"},
			wantRequeue: 30 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-1", time.Minute))},
		},
		{
			// Groups of two pods (LeaderWorkerSet): one delete restarts each group.
			name: "a prefill group restart takes the connected decode groups, one pod each",
			prev: v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-0-0", time.Minute), seen("p-0-1", time.Minute))},
			pods: []Pod{
				{Name: "p-0-0", Role: v1alpha1.RolePrefill, Group: "gp0"}, {Name: "p-0-1", Role: v1alpha1.RolePrefill, Group: "gp0"},
				{Name: "p-1-0", Role: v1alpha1.RolePrefill, Group: "gp1", Ready: true}, {Name: "p-1-1", Role: v1alpha1.RolePrefill, Group: "gp1", Ready: true},
				{Name: "d-0-0", Role: v1alpha1.RoleDecode, Group: "gd0", Ready: true}, {Name: "d-0-1", Role: v1alpha1.RoleDecode, Group: "gd0", Ready: true},
				ready("d-x", v1alpha1.RoleDecode),
			},
			wantRestart: []string{"p-0-0", "d-0-0", "d-x"},
			wantRequeue: 30 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-0-0", time.Minute), seen("p-0-1", time.Minute))},
		},
		{
			name: "a spent cascade budget restarts the prefill pod alone",
			prev: v1alpha1.ConnectorStatus{Restarts: 6, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(-10 * time.Minute)),
				RecentRounds: []metav1.Time{at(-30 * time.Minute), at(-10 * time.Minute)}, DecodeCascadeRestarts: 4,
				RecentCascadeRounds: []metav1.Time{at(-30 * time.Minute), at(-10 * time.Minute)}, UnhealthyPods: records(seen("p-1", time.Minute))},
			pods:        []Pod{unready("p-1", v1alpha1.RolePrefill), ready("d-1", v1alpha1.RoleDecode), ready("d-0", v1alpha1.RoleDecode)},
			wantRestart: []string{"p-1"},
			wantRequeue: 30 * time.Second,
			wantStatus: v1alpha1.ConnectorStatus{Restarts: 6, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(-10 * time.Minute)),
				RecentRounds: []metav1.Time{at(-30 * time.Minute), at(-10 * time.Minute)}, DecodeCascadeRestarts: 4,
				RecentCascadeRounds: []metav1.Time{at(-30 * time.Minute), at(-10 * time.Minute)}, UnhealthyPods: records(seen("p-1", time.Minute))},
		},
		{
			name: "cascade rounds older than the window give the cascade budget back",
			prev: v1alpha1.ConnectorStatus{Restarts: 6, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(-10 * time.Minute)),
				RecentRounds: []metav1.Time{at(-30 * time.Minute), at(-10 * time.Minute)}, DecodeCascadeRestarts: 4,
				RecentCascadeRounds: []metav1.Time{at(-61 * time.Minute), at(-10 * time.Minute)}, UnhealthyPods: records(seen("p-1", time.Minute))},
			pods:        []Pod{unready("p-1", v1alpha1.RolePrefill), ready("d-0", v1alpha1.RoleDecode)},
			wantRestart: []string{"p-1", "d-0"},
			wantRequeue: 30 * time.Second,
			wantStatus: v1alpha1.ConnectorStatus{Restarts: 6, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(-10 * time.Minute)),
				RecentRounds: []metav1.Time{at(-30 * time.Minute), at(-10 * time.Minute)}, DecodeCascadeRestarts: 4,
				RecentCascadeRounds: []metav1.Time{at(-10 * time.Minute)}, UnhealthyPods: records(seen("p-1", time.Minute))},
		},
		{
			name:        "a zero cascade budget never takes decode pods along",
			policy:      withPolicy(func(p *Policy) { p.CascadeBudget = 0 }),
			prev:        v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-1", time.Minute))},
			pods:        []Pod{unready("p-1", v1alpha1.RolePrefill), ready("d-0", v1alpha1.RoleDecode)},
			wantRestart: []string{"p-1"},
			wantRequeue: 30 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-1", time.Minute))},
		},
		{
			name:        "a decode pod due on its own restarts whatever the cascade budget",
			policy:      withPolicy(func(p *Policy) { p.CascadeBudget = 0 }),
			prev:        v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-1", time.Minute), seen("d-0", time.Minute))},
			pods:        []Pod{unready("p-1", v1alpha1.RolePrefill), unready("d-0", v1alpha1.RoleDecode), ready("d-1", v1alpha1.RoleDecode)},
			wantRestart: []string{"d-0", "p-1"},
			wantRequeue: 30 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", time.Minute), seen("p-1", time.Minute))},
		},
		{
			name:        "during a rollout a prefill restart takes only its own revision's decode pods",
			prev:        v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-1", time.Minute))},
			pods:        []Pod{inRevision(unready("p-1", v1alpha1.RolePrefill), "new"), inRevision(ready("d-1", v1alpha1.RoleDecode), "new"), inRevision(ready("d-0", v1alpha1.RoleDecode), "old")},
			wantRestart: []string{"p-1", "d-1"},
			wantRequeue: 30 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-1", time.Minute))},
		},
		{
			name:        "without the cascade only the prefill pod restarts",
			policy:      withPolicy(func(p *Policy) { p.RestartDecodeWithPrefill = false }),
			prev:        v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-1", time.Minute))},
			pods:        []Pod{unready("p-1", v1alpha1.RolePrefill), ready("d-0", v1alpha1.RoleDecode)},
			wantRestart: []string{"p-1"},
			wantRequeue: 30 * time.Second,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-1", time.Minute))},
		},
		{
			name: "a second round waits out the backoff (60s after one round)",
			prev: v1alpha1.ConnectorStatus{Restarts: 1, ConsecutiveRounds: 1, LastRestartTime: ptr.To(at(-45 * time.Second)),
				RecentRounds: []metav1.Time{at(-45 * time.Second)}, UnhealthyPods: records(seen("d-0", 40*time.Second))},
			pods:        []Pod{unready("d-0", v1alpha1.RoleDecode)},
			wantBlocked: v1alpha1.ReasonRestartBackoff,
			wantRequeue: 15 * time.Second,
			wantStatus: v1alpha1.ConnectorStatus{Restarts: 1, ConsecutiveRounds: 1, LastRestartTime: ptr.To(at(-45 * time.Second)),
				RecentRounds: []metav1.Time{at(-45 * time.Second)}, UnhealthyPods: records(seen("d-0", 40*time.Second))},
		},
		{
			name: "the backoff doubles with each round (120s after two)",
			prev: v1alpha1.ConnectorStatus{Restarts: 2, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(-90 * time.Second)),
				RecentRounds: []metav1.Time{at(-5 * time.Minute), at(-90 * time.Second)}, UnhealthyPods: records(seen("d-0", 40*time.Second))},
			pods:        []Pod{unready("d-0", v1alpha1.RoleDecode)},
			wantBlocked: v1alpha1.ReasonRestartBackoff,
			wantRequeue: 30 * time.Second,
			wantStatus: v1alpha1.ConnectorStatus{Restarts: 2, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(-90 * time.Second)),
				RecentRounds: []metav1.Time{at(-5 * time.Minute), at(-90 * time.Second)}, UnhealthyPods: records(seen("d-0", 40*time.Second))},
		},
		{
			name: "past the backoff the next round goes ahead",
			prev: v1alpha1.ConnectorStatus{Restarts: 2, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(-2 * time.Minute)),
				RecentRounds: []metav1.Time{at(-5 * time.Minute), at(-2 * time.Minute)}, UnhealthyPods: records(seen("d-0", 40*time.Second))},
			pods:        []Pod{unready("d-0", v1alpha1.RoleDecode)},
			wantRestart: []string{"d-0"},
			wantRequeue: 30 * time.Second,
			wantStatus: v1alpha1.ConnectorStatus{Restarts: 2, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(-2 * time.Minute)),
				RecentRounds: []metav1.Time{at(-5 * time.Minute), at(-2 * time.Minute)}, UnhealthyPods: records(seen("d-0", 40*time.Second))},
		},
		{
			name: "a spent budget stops restarts until its oldest round leaves the window",
			prev: v1alpha1.ConnectorStatus{Restarts: 3, ConsecutiveRounds: 3, LastRestartTime: ptr.To(at(-20 * time.Minute)),
				RecentRounds: []metav1.Time{at(-50 * time.Minute), at(-30 * time.Minute), at(-20 * time.Minute)}, UnhealthyPods: records(seen("d-0", time.Hour))},
			pods:        []Pod{unready("d-0", v1alpha1.RoleDecode)},
			wantBlocked: v1alpha1.ReasonRestartBudgetExhausted,
			wantRequeue: 10 * time.Minute,
			wantStatus: v1alpha1.ConnectorStatus{Restarts: 3, ConsecutiveRounds: 3, LastRestartTime: ptr.To(at(-20 * time.Minute)),
				RecentRounds: []metav1.Time{at(-50 * time.Minute), at(-30 * time.Minute), at(-20 * time.Minute)}, UnhealthyPods: records(seen("d-0", time.Hour))},
		},
		{
			name: "rounds older than the window give the budget back",
			prev: v1alpha1.ConnectorStatus{Restarts: 3, ConsecutiveRounds: 3, LastRestartTime: ptr.To(at(-20 * time.Minute)),
				RecentRounds: []metav1.Time{at(-61 * time.Minute), at(-30 * time.Minute), at(-20 * time.Minute)}, UnhealthyPods: records(seen("d-0", time.Hour))},
			pods:        []Pod{unready("d-0", v1alpha1.RoleDecode)},
			wantRestart: []string{"d-0"},
			wantRequeue: 30 * time.Second,
			wantStatus: v1alpha1.ConnectorStatus{Restarts: 3, ConsecutiveRounds: 3, LastRestartTime: ptr.To(at(-20 * time.Minute)),
				RecentRounds: []metav1.Time{at(-30 * time.Minute), at(-20 * time.Minute)}, UnhealthyPods: records(seen("d-0", time.Hour))},
		},
		{
			name:        "a zero budget never restarts",
			policy:      withPolicy(func(p *Policy) { p.Budget = 0 }),
			prev:        v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", time.Hour))},
			pods:        []Pod{unready("d-0", v1alpha1.RoleDecode)},
			wantBlocked: v1alpha1.ReasonRestartBudgetExhausted,
			wantStatus:  v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("d-0", time.Hour))},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.policy
			if p == (Policy{}) {
				p = policy
			}
			desired := tc.desired
			if desired == 0 {
				desired = len(tc.pods)
			}
			d := Decide(t0, p, tc.prev, tc.pods, desired)
			if diff := cmp.Diff(tc.wantRestart, Names(d.Restart)); diff != "" {
				t.Errorf("restart (-want +got):\n%s", diff)
			}
			if d.Blocked != tc.wantBlocked {
				t.Errorf("blocked = %q, want %q", d.Blocked, tc.wantBlocked)
			}
			if d.RequeueAfter != tc.wantRequeue {
				t.Errorf("requeue after = %s, want %s", d.RequeueAfter, tc.wantRequeue)
			}
			if diff := cmp.Diff(tc.wantStatus, d.Status); diff != "" {
				t.Errorf("status (-want +got):\n%s", diff)
			}
		})
	}
}

func TestBackoffDoublesUpToTheCap(t *testing.T) {
	var got []time.Duration
	for n := int32(1); n <= 6; n++ {
		got = append(got, policy.Backoff(n))
	}
	want := []time.Duration{time.Minute, 2 * time.Minute, 4 * time.Minute, 5 * time.Minute, 5 * time.Minute, 5 * time.Minute}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("backoff (-want +got):\n%s", diff)
	}
}

func TestRecordRound(t *testing.T) {
	p0, d0, d1 := unready("p-0", v1alpha1.RolePrefill), ready("d-0", v1alpha1.RoleDecode), ready("d-1", v1alpha1.RoleDecode)
	alone := Decision{Due: []Pod{d0}, Restart: []Pod{d0}}
	cascade := Decision{Due: []Pod{p0}, Cascade: []Pod{d0, d1}, Restart: []Pod{p0, d0, d1}}
	for _, tc := range []struct {
		name      string
		d         Decision
		restarted []Pod
		want      v1alpha1.ConnectorStatus
	}{
		{"a round", alone, []Pod{d0}, v1alpha1.ConnectorStatus{Restarts: 2, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(0)),
			RecentRounds: []metav1.Time{at(-time.Minute), at(0)}}},
		{"nothing restarted: no round", alone, nil, v1alpha1.ConnectorStatus{Restarts: 1, ConsecutiveRounds: 1, RecentRounds: []metav1.Time{at(-time.Minute)}}},
		{"a cascade round counts its decode pods", cascade, []Pod{p0, d0, d1}, v1alpha1.ConnectorStatus{Restarts: 4, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(0)),
			RecentRounds: []metav1.Time{at(-time.Minute), at(0)}, DecodeCascadeRestarts: 2, RecentCascadeRounds: []metav1.Time{at(0)}}},
		{"only the cascade pods deleted count", cascade, []Pod{p0, d1}, v1alpha1.ConnectorStatus{Restarts: 3, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(0)),
			RecentRounds: []metav1.Time{at(-time.Minute), at(0)}, DecodeCascadeRestarts: 1, RecentCascadeRounds: []metav1.Time{at(0)}}},
		{"a cascade whose decode deletes all failed is no cascade round", cascade, []Pod{p0}, v1alpha1.ConnectorStatus{Restarts: 2, ConsecutiveRounds: 2, LastRestartTime: ptr.To(at(0)),
			RecentRounds: []metav1.Time{at(-time.Minute), at(0)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := v1alpha1.ConnectorStatus{Restarts: 1, ConsecutiveRounds: 1, RecentRounds: []metav1.Time{at(-time.Minute)}}
			RecordRound(&st, t0, tc.d, tc.restarted)
			if diff := cmp.Diff(tc.want, st); diff != "" {
				t.Errorf("status (-want +got):\n%s", diff)
			}
		})
	}
}

// enginePod is pod p of role, its connector ready, started an hour before t0 and restarted 4
// times by the kubelet.
func enginePod(role v1alpha1.Role) *wrappers.PodWrapper {
	w := wrappers.MakeEnginePod("ns", "p", "c", role, t0.Add(-time.Hour)).ConnectorRestarts(4)
	w.UID = "uid-1"
	return w
}

// inGroup labels w as LeaderWorkerSet's pod webhook labels a group's pods.
func inGroup(w *wrappers.PodWrapper, key string) *wrappers.PodWrapper {
	w.Labels[lwsv1.GroupUniqueHashLabelKey] = key
	return w
}

func TestObserve(t *testing.T) {
	started := t0.Add(-time.Hour)
	cases := []struct {
		name   string
		pod    *wrappers.PodWrapper
		want   Pod
		wantOK bool
	}{
		{"ready connector", enginePod(v1alpha1.RoleDecode), Pod{Name: "p", UID: "uid-1", Role: v1alpha1.RoleDecode, Ready: true, StartedAt: started, ContainerRestarts: 4}, true},
		{"unready connector", enginePod(v1alpha1.RolePrefill).ConnectorUnready(t0.Add(-40 * time.Second)),
			Pod{Name: "p", UID: "uid-1", Role: v1alpha1.RolePrefill, StartedAt: started, ContainerRestarts: 4}, true},
		{"restarted connector", enginePod(v1alpha1.RolePrefill).ConnectorUnready(t0.Add(-40 * time.Second)).ConnectorStartedAt(t0.Add(-5 * time.Second)),
			Pod{Name: "p", UID: "uid-1", Role: v1alpha1.RolePrefill, StartedAt: t0.Add(-5 * time.Second), ContainerRestarts: 4}, true},
		{"a pod of a LeaderWorkerSet group", inGroup(enginePod(v1alpha1.RoleDecode), "g1"),
			Pod{Name: "p", UID: "uid-1", Role: v1alpha1.RoleDecode, Group: "g1", Ready: true, StartedAt: started, ContainerRestarts: 4}, true},
		{"pending pods are not judged", enginePod(v1alpha1.RoleDecode).ConnectorUnready(t0.Add(-time.Hour)).Phase(corev1.PodPending), Pod{}, false},
		{"terminating pods are not judged", enginePod(v1alpha1.RoleDecode).ConnectorUnready(t0.Add(-time.Hour)).Deleting(t0), Pod{}, false},
		{"pods without a connector status are not judged", enginePod(v1alpha1.RoleDecode).WithoutConnector(), Pod{}, false},
		{"router pods are not judged", enginePod(v1alpha1.RoleRouter), Pod{}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := Observe(&tc.pod.Pod)
			if ok != tc.wantOK {
				t.Fatalf("ok = %v, want %v", ok, tc.wantOK)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("pod (-want +got):\n%s", diff)
			}
		})
	}
}

func TestDescribeNamesWhatHappened(t *testing.T) {
	noBudget := policy
	noBudget.Budget = 0
	sick := v1alpha1.ConnectorStatus{UnhealthyPods: records(seen("p-0", time.Minute))}
	spent := *sick.DeepCopy()
	spent.RecentRounds = []metav1.Time{at(-3 * time.Minute), at(-2 * time.Minute), at(-time.Minute)}
	cascadesSpent := *sick.DeepCopy()
	cascadesSpent.RecentCascadeRounds = []metav1.Time{at(-3 * time.Minute), at(-2 * time.Minute)}
	pods := []Pod{unready("p-0", v1alpha1.RolePrefill), ready("d-0", v1alpha1.RoleDecode)}
	cases := []struct {
		name   string
		policy Policy
		prev   v1alpha1.ConnectorStatus
		want   string
	}{
		{"healthy", policy, v1alpha1.ConnectorStatus{}, "1 running connectors ready"},
		{"restart with cascade", policy, sick, "restarted p-0: connector not ready for 30s or more; restarted the decode pods connected to it too: d-0"},
		{"cascade budget spent", policy, cascadesSpent, "restarted p-0: connector not ready for 30s or more; the decode pods connected to it (d-0) keep running: the decodeCascadeBudget is spent (2 rounds in the last 1h0m0s took decode pods along)"},
		{"budget spent", policy, spent, "connector not ready in p-0; 3 restart rounds in the last 1h0m0s spent the budget, so restarts stop until the window frees one: check the connector logs"},
		{"restarts off", noBudget, sick, "connector not ready in p-0; operator restarts are off (restartBudget: 0)"},
		// d-1 turned unready 25s ago and is due in 5s, sooner than the backoff lifts: the
		// message still names the backoff's own wait.
		{"backoff", policy, v1alpha1.ConnectorStatus{ConsecutiveRounds: 1, LastRestartTime: ptr.To(at(-10 * time.Second)),
			UnhealthyPods: records(seen("p-0", time.Minute), seen("d-1", 25*time.Second))},
			"connector not ready in d-1, p-0; next restart in 50s (backoff after 1 rounds)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := pods
			switch len(tc.prev.UnhealthyPods) {
			case 0:
				in = pods[1:]
			case 2:
				in = append(slices.Clone(pods), unready("d-1", v1alpha1.RoleDecode))
			}
			if got := Describe(tc.policy, Decide(t0, tc.policy, tc.prev, in, len(in))); got != tc.want {
				t.Errorf("Describe = %q, want %q", got, tc.want)
			}
		})
	}
}

func inRevision(p Pod, rev string) Pod { p.Revision = rev; return p }
