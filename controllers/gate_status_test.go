package controllers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/connector/sidecar"
	vllmplugin "pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// fakeGates answers ReadGate from a table by pod name; a missing pod is an error.
type fakeGates map[string]vllmplugin.State

func (f fakeGates) ReadGate(_ context.Context, pod *corev1.Pod) (vllmplugin.State, error) {
	st, ok := f[pod.Name]
	if !ok {
		return vllmplugin.State{}, errors.New("connection refused")
	}
	return st, nil
}

func loaded(gated, passed, failed int64) vllmplugin.State {
	return vllmplugin.State{Loaded: true, Report: &vllmplugin.Report{Connector: "GatedMooncakeConnector",
		Counts: vllmplugin.Counts{Gated: gated, Passed: passed, Failed: failed}}}
}

func TestGateStatusSumsEachPool(t *testing.T) {
	pods := []client.Object{
		wrappers.MakeEnginePod("ns", "p-0", "c", v1alpha1.RolePrefill, start).Obj(),
		wrappers.MakeEnginePod("ns", "d-0", "c", v1alpha1.RoleDecode, start).Obj(),
		wrappers.MakeEnginePod("ns", "d-1", "c", v1alpha1.RoleDecode, start).Obj(),
		wrappers.MakeEnginePod("ns", "d-2", "c", v1alpha1.RoleDecode, start).Obj(),                          // sidecar answers, gate silent
		wrappers.MakeEnginePod("ns", "d-3", "c", v1alpha1.RoleDecode, start).Obj(),                          // sidecar unreachable
		wrappers.MakeEnginePod("ns", "d-5", "c", v1alpha1.RoleDecode, start).ConnectorUnready(start).Obj(),  // gate silent: the connector is unready for it
		wrappers.MakeEnginePod("ns", "d-6", "c", v1alpha1.RoleDecode, start).ConnectorUnready(start).Obj(),  // unready, gate reporting: not the gate
		wrappers.MakeEnginePod("ns", "d-4", "c", v1alpha1.RoleDecode, start).Phase(corev1.PodPending).Obj(), // not read
		wrappers.MakeEnginePod("ns", "r-0", "c", v1alpha1.RoleRouter, start).Obj(),                          // not an engine
	}
	gates := fakeGates{
		"p-0": loaded(0, 0, 0),
		"d-0": loaded(2, 10, 1),
		"d-1": loaded(3, 5, 0),
		"d-2": {Report: &vllmplugin.Report{Connector: "GatedMooncakeConnector", Counts: vllmplugin.Counts{Gated: 99}}},
		"d-5": {},
		"d-6": loaded(0, 0, 0),
		"d-4": loaded(100, 100, 100),
		"r-0": loaded(100, 100, 100),
	}
	cases := []struct {
		name        string
		gate        v1alpha1.CompletionGate
		reader      GateReader
		wantPrefill *v1alpha1.PoolGateStatus
		wantDecode  *v1alpha1.PoolGateStatus
		wantSilent  []string
		wantAfter   time.Duration
	}{
		{
			name: "counts of the reporting pods, silent and unreachable ones apart", reader: gates,
			wantPrefill: &v1alpha1.PoolGateStatus{ReportingPods: 1},
			wantDecode:  &v1alpha1.PoolGateStatus{ReportingPods: 3, SilentPods: 2, GatedCompletions: 5, PassedCompletions: 15, FailedPulls: 1},
			wantSilent:  []string{"d-5"},
			wantAfter:   gateRefresh,
		},
		{name: "no reader: no counts", reader: nil},
		{name: "gate disabled: no counts", reader: gates, gate: v1alpha1.CompletionGateDisabled},
		{name: "nothing answers: no counts, read again later", reader: fakeGates{}, wantAfter: gateRefresh},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newFakeClient(t).WithObjects(pods...).Build()
			r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), GateReader: tc.reader}
			p := pdc()
			p.Spec.KVTransfer.CompletionGate = tc.gate
			status := p.Status.DeepCopy()
			// A stale value from an earlier read must not survive a reconcile that reads nothing.
			status.Decode.Gate = &v1alpha1.PoolGateStatus{GatedCompletions: 1234}
			after, silent, err := r.reconcileGateStatus(context.Background(), p, status)
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tc.wantSilent, silent); d != "" {
				t.Errorf("pods unready for a silent gate (-want +got):\n%s", d)
			}
			if d := cmp.Diff(tc.wantPrefill, status.Prefill.Gate); d != "" {
				t.Errorf("prefill gate (-want +got):\n%s", d)
			}
			if d := cmp.Diff(tc.wantDecode, status.Decode.Gate); d != "" {
				t.Errorf("decode gate (-want +got):\n%s", d)
			}
			if after != tc.wantAfter {
				t.Errorf("requeue after %s, want %s", after, tc.wantAfter)
			}
		})
	}
}

// The reader's side of GET /gate, against a server that answers as the sidecar does.
func TestHTTPGateReader(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != vllmplugin.StatePath {
			http.NotFound(w, r)
			return
		}
		_ = json.NewEncoder(w).Encode(loaded(2, 3, 0))
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	h := NewHTTPGateReader()
	h.Addr = func(*corev1.Pod) string { return host }
	st, err := h.ReadGate(context.Background(), &corev1.Pod{})
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(loaded(2, 3, 0), st); d != "" {
		t.Errorf("state (-want +got):\n%s", d)
	}
	if _, err := NewHTTPGateReader().ReadGate(context.Background(), &corev1.Pod{}); err == nil || !strings.Contains(err.Error(), "no IP") {
		t.Errorf("pod without IP: err = %v", err)
	}
	h.Addr = func(*corev1.Pod) string { return host + "/nope" } // a sidecar without /gate
	if _, err := h.ReadGate(context.Background(), &corev1.Pod{}); err == nil {
		t.Error("a 404 was read as a state")
	}
}

// Both sides of the seam: the real connector sidecar takes the plugin's heartbeat on its local
// API, and the operator's reader gets it from the sidecar's public port.
func TestHTTPGateReaderReadsTheSidecar(t *testing.T) {
	sc, err := sidecar.New(sidecar.Config{Log: logr.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	local := httptest.NewServer(sc.LocalHandler(prometheus.NewRegistry()))
	defer local.Close()
	public := httptest.NewServer(sc.PublicHandler(prometheus.NewRegistry()))
	defer public.Close()

	report, _ := json.Marshal(loaded(6, 8, 0).Report)
	resp, err := http.Post(local.URL+localapi.PathGate, "application/json", bytes.NewReader(report))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("heartbeat: %s", resp.Status)
	}
	h := NewHTTPGateReader()
	h.Addr = func(*corev1.Pod) string { return strings.TrimPrefix(public.URL, "http://") }
	st, err := h.ReadGate(context.Background(), &corev1.Pod{})
	if err != nil {
		t.Fatal(err)
	}
	if !st.Loaded || st.Report == nil || st.Report.Counts.Gated != 6 || st.Report.Counts.Passed != 8 {
		t.Errorf("state %+v, want the heartbeat's counts, loaded", st)
	}
}

func TestGateConditionNamesSilentPods(t *testing.T) {
	cond := func(s metav1.ConditionStatus, reason string) *metav1.Condition {
		return &metav1.Condition{Type: v1alpha1.ConditionCompletionGated, Status: s, Reason: reason}
	}
	cases := []struct {
		name       string
		disabled   bool
		before     *metav1.Condition
		silent     []string
		wantStatus metav1.ConditionStatus
		wantReason string
		wantInMsg  string
		wantEvents []string // reasons
	}{
		{name: "enabled, every gate reports", wantStatus: metav1.ConditionTrue, wantReason: v1alpha1.ReasonGateEnabled},
		{name: "a pod unready for its silent gate is named, once", before: cond(metav1.ConditionTrue, v1alpha1.ReasonGateEnabled), silent: []string{"d-0", "d-1"},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonGateSilent, wantInMsg: "d-0, d-1", wantEvents: []string{v1alpha1.ReasonGateSilent}},
		{name: "still silent: no new event", before: cond(metav1.ConditionFalse, v1alpha1.ReasonGateSilent), silent: []string{"d-0"},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonGateSilent, wantInMsg: "pdgate"},
		{name: "reports again", before: cond(metav1.ConditionFalse, v1alpha1.ReasonGateSilent),
			wantStatus: metav1.ConditionTrue, wantReason: v1alpha1.ReasonGateEnabled, wantEvents: []string{v1alpha1.ReasonGateEnabled}},
		{name: "disabled: silence does not apply", disabled: true, before: cond(metav1.ConditionFalse, v1alpha1.ReasonGateDisabled), silent: []string{"d-0"},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonGateDisabled},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := wrappers.MakePDCluster("ns", "c").Obj()
			if tc.disabled {
				p.Spec.KVTransfer.CompletionGate = v1alpha1.CompletionGateDisabled
			}
			if tc.before != nil {
				p.Status.Conditions = []metav1.Condition{*tc.before}
			}
			status := p.Status.DeepCopy()
			var pending []event
			reconcileGateCondition(p, status, tc.silent, &pending)
			c := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionCompletionGated)
			if c == nil || c.Status != tc.wantStatus || c.Reason != tc.wantReason || !strings.Contains(c.Message, tc.wantInMsg) {
				t.Errorf("condition = %+v, want %s/%s with %q", c, tc.wantStatus, tc.wantReason, tc.wantInMsg)
			}
			var reasons []string
			for _, e := range pending {
				reasons = append(reasons, e.reason)
			}
			if d := cmp.Diff(tc.wantEvents, reasons); d != "" {
				t.Errorf("events (-want +got):\n%s", d)
			}
		})
	}
}
