package controllers

import (
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers/kvverify"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/internal/scaling"
)

// eventReasons are the kinds and reasons of events, in order.
func eventReasons(events []event) []string {
	var out []string
	for _, e := range events {
		out = append(out, e.kind+" "+e.reason)
	}
	return out
}

// condOf is the condition typ of status as "Status/Reason", or "" when absent.
func condOf(status *v1alpha1.PDClusterStatus, typ string) string {
	if c := meta.FindStatusCondition(status.Conditions, typ); c != nil {
		return string(c.Status) + "/" + c.Reason
	}
	return ""
}

// kvStatus writes status.kvTransfer and KVTransferVerified from the verdict alone, with an event
// on each change to False and on the way back to True, and returns the condition it left.
func TestKVStatus(t *testing.T) {
	verdict := func(s metav1.ConditionStatus, reason string) *kvverify.Verdict {
		return &kvverify.Verdict{Status: s, Reason: reason, Message: "m", KV: v1alpha1.KVTransferStatus{ExternalTokens: 7}}
	}
	for _, tc := range []struct {
		name       string
		disabled   bool
		before     string // reason of a False condition before ("" none; "ok" a True one)
		v          *kvverify.Verdict
		wantCond   string
		wantEvents []string
		wantKV     bool
	}{
		{name: "disabled: removed", disabled: true, before: v1alpha1.ReasonDecodeRecomputing, v: verdict(metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved)},
		{name: "no verdict: kept", before: v1alpha1.ReasonDecodeRecomputing, wantCond: "False/" + v1alpha1.ReasonDecodeRecomputing},
		{name: "first verdict True: no event", v: verdict(metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved), wantCond: "True/" + v1alpha1.ReasonExternalKVObserved, wantKV: true},
		{name: "turns False: a Warning", before: "ok", v: verdict(metav1.ConditionFalse, v1alpha1.ReasonDecodeRecomputing),
			wantCond: "False/" + v1alpha1.ReasonDecodeRecomputing, wantEvents: []string{"Warning " + v1alpha1.ReasonDecodeRecomputing}, wantKV: true},
		{name: "still False, same reason: no event", before: v1alpha1.ReasonDecodeRecomputing, v: verdict(metav1.ConditionFalse, v1alpha1.ReasonDecodeRecomputing),
			wantCond: "False/" + v1alpha1.ReasonDecodeRecomputing, wantKV: true},
		{name: "False for another reason: a Warning", before: v1alpha1.ReasonDecodeRecomputing, v: verdict(metav1.ConditionFalse, v1alpha1.ReasonTransferFailing),
			wantCond: "False/" + v1alpha1.ReasonTransferFailing, wantEvents: []string{"Warning " + v1alpha1.ReasonTransferFailing}, wantKV: true},
		{name: "True again: a Normal event", before: v1alpha1.ReasonDecodeRecomputing, v: verdict(metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved),
			wantCond: "True/" + v1alpha1.ReasonExternalKVObserved, wantEvents: []string{"Normal " + v1alpha1.ReasonExternalKVObserved}, wantKV: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc()
			if tc.disabled {
				p.Spec.KVTransfer.Verification.Mode = v1alpha1.KVVerificationDisabled
			}
			switch tc.before {
			case "":
			case "ok":
				p.Status.Conditions = []metav1.Condition{{Type: v1alpha1.ConditionKVTransferVerified, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonExternalKVObserved}}
			default:
				p.Status.Conditions = []metav1.Condition{{Type: v1alpha1.ConditionKVTransferVerified, Status: metav1.ConditionFalse, Reason: tc.before}}
			}
			status := p.Status.DeepCopy()
			events, cond := kvStatus(status, p, tc.v)
			if got := condOf(status, v1alpha1.ConditionKVTransferVerified); got != tc.wantCond {
				t.Errorf("condition %q, want %q", got, tc.wantCond)
			}
			if returned := ""; cond != nil {
				if returned = string(cond.Status) + "/" + cond.Reason; returned != tc.wantCond {
					t.Errorf("returned condition %q, want the one written, %q", returned, tc.wantCond)
				}
			} else if tc.wantCond != "" {
				t.Errorf("returned no condition, want %q", tc.wantCond)
			}
			if d := cmp.Diff(tc.wantEvents, eventReasons(events)); d != "" {
				t.Errorf("events (-want +got):\n%s", d)
			}
			if (status.KVTransfer != nil) != tc.wantKV {
				t.Errorf("status.kvTransfer = %+v, want set %v", status.KVTransfer, tc.wantKV)
			}
		})
	}
}

// ratioStatus writes RatioConstrained from the scale decision: absent when nothing bounds the
// pools, False when they run what was asked, True with an event (a Warning when no counts meet
// the ratio) when the reason changes.
func TestRatioStatus(t *testing.T) {
	asked := map[v1alpha1.Role]int32{v1alpha1.RolePrefill: 1, v1alpha1.RoleDecode: 4}
	for _, tc := range []struct {
		name       string
		bounded    bool
		before     string
		d          *scaleDecision
		wantCond   string
		wantEvents []string
	}{
		{name: "undecided: unchanged", bounded: true, before: v1alpha1.ReasonRatioBounds, wantCond: "True/" + v1alpha1.ReasonRatioBounds},
		{name: "nothing bounds the pools: removed", before: v1alpha1.ReasonRatioBounds, d: &scaleDecision{requested: asked, effective: scaling.Effective{Prefill: 1, Decode: 4, Why: scaling.AsRequested}}},
		{name: "as asked: False, no event", bounded: true, d: &scaleDecision{requested: asked, effective: scaling.Effective{Prefill: 1, Decode: 4, Why: scaling.AsRequested}},
			wantCond: "False/" + string(scaling.AsRequested)},
		{name: "raised into the ratio: True, a Normal event", bounded: true, d: &scaleDecision{requested: asked, effective: scaling.Effective{Prefill: 2, Decode: 4, Why: scaling.RatioBounds}},
			wantCond: "True/" + v1alpha1.ReasonRatioBounds, wantEvents: []string{"Normal " + v1alpha1.ReasonRatioBounds}},
		{name: "still in the ratio: no event", bounded: true, before: v1alpha1.ReasonRatioBounds, d: &scaleDecision{requested: asked, effective: scaling.Effective{Prefill: 2, Decode: 4, Why: scaling.RatioBounds}},
			wantCond: "True/" + v1alpha1.ReasonRatioBounds},
		{name: "unsatisfiable: a Warning", bounded: true, before: v1alpha1.ReasonRatioBounds, d: &scaleDecision{requested: asked, effective: scaling.Effective{Prefill: 1, Decode: 4, Why: scaling.RatioUnsatisfiable}},
			wantCond: "True/" + v1alpha1.ReasonRatioUnsatisfiable, wantEvents: []string{"Warning " + v1alpha1.ReasonRatioUnsatisfiable}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc()
			if tc.bounded {
				p.Spec.Scaling.Ratio = &v1alpha1.ReplicaRatio{Min: "0.5"}
			}
			if tc.before != "" {
				p.Status.Conditions = []metav1.Condition{{Type: v1alpha1.ConditionRatioConstrained, Status: metav1.ConditionTrue, Reason: tc.before}}
			}
			status := p.Status.DeepCopy()
			events := ratioStatus(status, p, tc.d)
			if got := condOf(status, v1alpha1.ConditionRatioConstrained); got != tc.wantCond {
				t.Errorf("condition %q, want %q", got, tc.wantCond)
			}
			if d := cmp.Diff(tc.wantEvents, eventReasons(events)); d != "" {
				t.Errorf("events (-want +got):\n%s", d)
			}
		})
	}
}

// pairingStatus writes status.pairing from the domains and the routers' counts; counts the
// routers did not answer keep what status said.
func TestPairingStatus(t *testing.T) {
	before := &v1alpha1.PairingStatus{Domains: 1, SameDomainPairs: 5, CrossDomainPairs: 5, SameDomainPercent: ptr.To[int32](50)}
	for _, tc := range []struct {
		name    string
		pairing bool
		pairs   *routerconfig.PairCounts
		want    *v1alpha1.PairingStatus
	}{
		{name: "no pairing: none", pairs: &routerconfig.PairCounts{SameDomain: 1}},
		{name: "no answer: the counts kept, the domains new", pairing: true,
			want: &v1alpha1.PairingStatus{Domains: 2, SameDomainPairs: 5, CrossDomainPairs: 5, SameDomainPercent: ptr.To[int32](50)}},
		{name: "answered: the share", pairing: true, pairs: &routerconfig.PairCounts{SameDomain: 3, CrossDomain: 1},
			want: &v1alpha1.PairingStatus{Domains: 2, SameDomainPairs: 3, CrossDomainPairs: 1, SameDomainPercent: ptr.To[int32](75)}},
		{name: "answered, no pairs yet: no share", pairing: true, pairs: &routerconfig.PairCounts{},
			want: &v1alpha1.PairingStatus{Domains: 2}},
		// The readers saturate each count at MaxInt64: neither the sum nor the product may wrap.
		{name: "saturated same domain: all", pairing: true, pairs: &routerconfig.PairCounts{SameDomain: math.MaxInt64},
			want: &v1alpha1.PairingStatus{Domains: 2, SameDomainPairs: math.MaxInt64, SameDomainPercent: ptr.To[int32](100)}},
		{name: "both saturated: half", pairing: true, pairs: &routerconfig.PairCounts{SameDomain: math.MaxInt64, CrossDomain: math.MaxInt64},
			want: &v1alpha1.PairingStatus{Domains: 2, SameDomainPairs: math.MaxInt64, CrossDomainPairs: math.MaxInt64, SameDomainPercent: ptr.To[int32](50)}},
		{name: "saturated, one cross: not quite all", pairing: true, pairs: &routerconfig.PairCounts{SameDomain: math.MaxInt64 - 1, CrossDomain: 1},
			want: &v1alpha1.PairingStatus{Domains: 2, SameDomainPairs: math.MaxInt64 - 1, CrossDomainPairs: 1, SameDomainPercent: ptr.To[int32](99)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc()
			if tc.pairing {
				p.Spec.Scheduling.Pairing = &v1alpha1.PairingSpec{TopologyKey: "rack"}
			}
			p.Status.Pairing = before.DeepCopy()
			status := p.Status.DeepCopy()
			pairingStatus(status, statusInputs{pdc: p, topo: topology{domains: []string{"a", "b"}}, obs: observed{pairs: tc.pairs}})
			if d := cmp.Diff(tc.want, status.Pairing); d != "" {
				t.Errorf("status.pairing (-want +got):\n%s", d)
			}
		})
	}
}

// percentOf is exact over every count the readers pass, saturated ones included, and has no
// share for nothing or for nonsense.
func TestPercentOf(t *testing.T) {
	for _, tc := range []struct {
		part, rest int64
		want       *int32
	}{
		{part: 0, rest: 0},
		{part: -1, rest: 5},
		{part: 5, rest: -1},
		{part: 0, rest: 3, want: ptr.To[int32](0)},
		{part: 3, rest: 1, want: ptr.To[int32](75)},
		{part: 2, rest: 1, want: ptr.To[int32](66)},
		{part: math.MaxInt64, rest: 0, want: ptr.To[int32](100)},
		{part: math.MaxInt64, rest: math.MaxInt64, want: ptr.To[int32](50)},
		{part: math.MaxInt64 - 1, rest: 1, want: ptr.To[int32](99)},
		{part: 1, rest: math.MaxInt64, want: ptr.To[int32](0)},
		{part: math.MaxInt64 / 64, rest: 0, want: ptr.To[int32](100)},
	} {
		if d := cmp.Diff(tc.want, percentOf(tc.part, tc.rest)); d != "" {
			t.Errorf("percentOf(%d, %d) (-want +got):\n%s", tc.part, tc.rest, d)
		}
	}
}

// readinessEvents: Ready on the way to True, Degraded on the way from True, nothing otherwise.
func TestReadinessEvents(t *testing.T) {
	ready := func(s metav1.ConditionStatus) []metav1.Condition {
		return []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: s, Reason: "r", Message: "m"}}
	}
	for _, tc := range []struct {
		name          string
		before, after []metav1.Condition
		want          []string
	}{
		{"first Ready", nil, ready(metav1.ConditionTrue), []string{"Normal Ready"}},
		{"first not ready", nil, ready(metav1.ConditionFalse), nil},
		{"recovered", ready(metav1.ConditionFalse), ready(metav1.ConditionTrue), []string{"Normal Ready"}},
		{"degraded", ready(metav1.ConditionTrue), ready(metav1.ConditionFalse), []string{"Warning Degraded"}},
		{"still ready", ready(metav1.ConditionTrue), ready(metav1.ConditionTrue), nil},
		{"unknown to false", ready(metav1.ConditionUnknown), ready(metav1.ConditionFalse), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := readinessEvents(tc.before, &v1alpha1.PDClusterStatus{Conditions: tc.after})
			if d := cmp.Diff(tc.want, eventReasons(got)); d != "" {
				t.Errorf("events (-want +got):\n%s", d)
			}
		})
	}
}
