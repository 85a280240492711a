package kvverify

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

var t0 = time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)

// scrape is a decode engine's /metrics as vLLM's prometheus_client writes it (one DP rank),
// with the Mooncake connector's failure counters.
func scrape(external, compute, hit, failedRecvs float64) string {
	return fmt.Sprintf(`# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} %v
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"} %v
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} %v
# HELP vllm:mooncake_num_failed_recvs_total Number of failed Mooncake KV Cache receives.
# TYPE vllm:mooncake_num_failed_recvs_total counter
vllm:mooncake_num_failed_recvs_total{engine="0",model_name="tiny"} %v
`, compute, hit, external, failedRecvs)
}

// sampleOf parses a recorded scrape the way the sidecar does, with the gate's failed pulls
// when gateFailed >= 0 (-1: the gate does not report), into the sample the reconciler takes.
func sampleOf(t *testing.T, at time.Duration, text string, gateFailed float64) Sample {
	t.Helper()
	eng, err := vllm.ParseEngineMetrics(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	st := vllm.State{Engine: &eng}
	if gateFailed >= 0 {
		st.Report = &vllm.Report{Counts: vllm.Counts{Failed: int64(gateFailed)}}
	}
	s, ok := SampleOf(t0.Add(at), st)
	if !ok {
		t.Fatal("no sample")
	}
	return s
}

func decode(name string, gate bool, samples ...Sample) Pod {
	return Pod{Name: name, Role: v1alpha1.RoleDecode, GateReported: gate, Samples: samples}
}

func TestEvaluate(t *testing.T) {
	policy := Policy{Window: 5 * time.Minute, MinSharePct: 90, GateEnabled: true}
	// 100 requests of 200 tokens in the window, 16-token blocks.
	cases := []struct {
		name       string
		pods       []Pod
		wantStatus metav1.ConditionStatus
		wantReason string
		wantKV     v1alpha1.KVTransferStatus
		wantInMsg  string
	}{
		{
			// vLLM computes the last prompt token on decode: 199 external, 1 local per request.
			name:       "healthy, last token computed on decode",
			pods:       []Pod{decode("d-0", true, sampleOf(t, 0, scrape(1000, 10, 0, 0), 0), sampleOf(t, time.Minute, scrape(1000+19900, 10+100, 0, 0), 0))},
			wantStatus: metav1.ConditionTrue, wantReason: v1alpha1.ReasonExternalKVObserved,
			wantKV: v1alpha1.KVTransferStatus{ExternalSharePercent: ptr.To[int32](99), ExternalTokens: 19900, LocalComputeTokens: 100},
		},
		{
			// A connector that transfers whole blocks only: the partial last block (8 of 200
			// tokens) is recomputed; a prefix hit is neither.
			name:       "healthy, partial last block recomputed, prefix hits left out",
			pods:       []Pod{decode("d-0", true, sampleOf(t, 0, scrape(0, 0, 0, 0), 0), sampleOf(t, time.Minute, scrape(19200, 800, 5000, 0), 0))},
			wantStatus: metav1.ConditionTrue, wantReason: v1alpha1.ReasonExternalKVObserved,
			wantKV: v1alpha1.KVTransferStatus{ExternalSharePercent: ptr.To[int32](96), ExternalTokens: 19200, LocalComputeTokens: 800},
		},
		{
			name: "one decode pod recomputes: named, no pull failed",
			pods: []Pod{
				decode("d-0", true, sampleOf(t, 0, scrape(0, 0, 0, 0), 0), sampleOf(t, time.Minute, scrape(19900, 100, 0, 0), 0)),
				decode("d-1", true, sampleOf(t, 0, scrape(500, 10, 0, 0), 0), sampleOf(t, time.Minute, scrape(500, 20010, 0, 0), 0)),
			},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonDecodeRecomputing, wantInMsg: "d-1 0%",
			wantKV: v1alpha1.KVTransferStatus{ExternalSharePercent: ptr.To[int32](49), ExternalTokens: 19900, LocalComputeTokens: 20100, RecomputingPods: []string{"d-1"}},
		},
		{
			name:       "recomputing with failed pulls, as the gate counts them",
			pods:       []Pod{decode("d-0", true, sampleOf(t, 0, scrape(0, 0, 0, 0), 0), sampleOf(t, time.Minute, scrape(0, 20000, 0, 60), 40))},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonTransferFailing, wantInMsg: "40 failed",
			wantKV: v1alpha1.KVTransferStatus{ExternalSharePercent: ptr.To[int32](0), LocalComputeTokens: 20000, FailedPulls: 40, RecomputingPods: []string{"d-0"}},
		},
		{
			name:       "recomputing with failed pulls, as the connector counts them (no gate)",
			pods:       []Pod{decode("d-0", true, sampleOf(t, 0, scrape(0, 0, 0, 0), -1), sampleOf(t, time.Minute, scrape(0, 20000, 0, 60), -1))},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonTransferFailing, wantInMsg: "60 failed",
			wantKV: v1alpha1.KVTransferStatus{ExternalSharePercent: ptr.To[int32](0), LocalComputeTokens: 20000, FailedPulls: 60, RecomputingPods: []string{"d-0"}},
		},
		{
			name:       "connector absent: recomputing and the gate never reported",
			pods:       []Pod{decode("d-0", false, sampleOf(t, 0, scrape(0, 0, 0, 0), 0), sampleOf(t, time.Minute, scrape(0, 20000, 0, 0), 0))},
			wantStatus: metav1.ConditionFalse, wantReason: v1alpha1.ReasonConnectorNotLoaded, wantInMsg: "never reported",
			wantKV: v1alpha1.KVTransferStatus{ExternalSharePercent: ptr.To[int32](0), LocalComputeTokens: 20000, RecomputingPods: []string{"d-0"}},
		},
		{
			name:       "no traffic",
			pods:       []Pod{decode("d-0", true, sampleOf(t, 0, scrape(500, 5, 0, 0), 0), sampleOf(t, time.Minute, scrape(500, 5, 0, 0), 0))},
			wantStatus: metav1.ConditionUnknown, wantReason: v1alpha1.ReasonNoTraffic,
		},
		{
			name:       "a few short prompts are too little to judge",
			pods:       []Pod{decode("d-0", true, sampleOf(t, 0, scrape(0, 0, 0, 0), 0), sampleOf(t, time.Minute, scrape(36, 4, 0, 0), 0))},
			wantStatus: metav1.ConditionUnknown, wantReason: v1alpha1.ReasonNoTraffic,
			wantKV: v1alpha1.KVTransferStatus{ExternalTokens: 36, LocalComputeTokens: 4},
		},
		{
			name:       "one sample only: no window yet",
			pods:       []Pod{decode("d-0", true, sampleOf(t, 0, scrape(9000, 5, 0, 0), 0))},
			wantStatus: metav1.ConditionUnknown, wantReason: v1alpha1.ReasonNoTraffic,
		},
		{
			name: "an engine without the metric",
			pods: []Pod{decode("d-0", true, sampleOf(t, 0, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n", 0),
				sampleOf(t, time.Minute, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n", 0))},
			wantStatus: metav1.ConditionUnknown, wantReason: v1alpha1.ReasonMetricsUnavailable,
		},
		{
			name:       "no decode pod answered",
			pods:       []Pod{{Name: "p-0", Role: v1alpha1.RolePrefill}, decode("d-0", true)},
			wantStatus: metav1.ConditionUnknown, wantReason: v1alpha1.ReasonMetricsUnavailable, wantInMsg: "1 decode pods",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			v := Evaluate(tc.pods, policy, nil)
			if v.Status != tc.wantStatus || v.Reason != tc.wantReason {
				t.Errorf("verdict %s/%s (%s), want %s/%s", v.Status, v.Reason, v.Message, tc.wantStatus, tc.wantReason)
			}
			if !strings.Contains(v.Message, tc.wantInMsg) {
				t.Errorf("message %q, want it to contain %q", v.Message, tc.wantInMsg)
			}
			if d := cmp.Diff(tc.wantKV, v.KV); d != "" {
				t.Errorf("status.kvTransfer (-want +got):\n%s", d)
			}
		})
	}
}

// transferScrape is an engine's /metrics with the connector's per-transfer histograms (their
// sums: bytes moved and seconds spent), as vLLM's prometheus_client writes them, for flow.
func transferScrape(flow string, bytes, seconds float64) string {
	return fmt.Sprintf(`# HELP vllm:%[1]s_bytes_transferred Histogram of bytes transferred per KV Cache transfer.
# TYPE vllm:%[1]s_bytes_transferred histogram
vllm:%[1]s_bytes_transferred_bucket{engine="0",le="+Inf",model_name="tiny"} 1
vllm:%[1]s_bytes_transferred_count{engine="0",model_name="tiny"} 1
vllm:%[1]s_bytes_transferred_sum{engine="0",model_name="tiny"} %[2]v
# HELP vllm:%[1]s_xfer_time_seconds Histogram of transfer duration for KV Cache transfers.
# TYPE vllm:%[1]s_xfer_time_seconds histogram
vllm:%[1]s_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 1
vllm:%[1]s_xfer_time_seconds_count{engine="0",model_name="tiny"} 1
vllm:%[1]s_xfer_time_seconds_sum{engine="0",model_name="tiny"} %[3]v
`, flow, bytes, seconds)
}

// The transfer rate is bytes over transfer time, summed over both pools (Mooncake's prefill
// times its writes, NIXL's decode its reads), over the window. Below the floor the verdict is
// SlowTransport even though the KV arrives; without a floor, or with too few bytes timed, the
// rate is not judged.
func TestEvaluateTransferRate(t *testing.T) {
	healthy := func(t *testing.T) (Sample, Sample) {
		return sampleOf(t, 0, scrape(0, 0, 0, 0), 0), sampleOf(t, time.Minute, scrape(19900, 100, 0, 0), 0)
	}
	mooncakePrefill := func(t *testing.T, bytes, secs float64) Pod {
		return Pod{Name: "p-0", Role: v1alpha1.RolePrefill, Samples: []Sample{sampleOf(t, 0, transferScrape("mooncake", 1e9, 1), 0),
			sampleOf(t, time.Minute, transferScrape("mooncake", 1e9+bytes, 1+secs), 0)}}
	}
	cases := []struct {
		name       string
		pods       func(t *testing.T) []Pod
		floor      int64
		wantStatus metav1.ConditionStatus
		wantReason string
		wantMBps   *int64
		wantInMsg  string
	}{
		{"mooncake on prefill, above the floor", func(t *testing.T) []Pod {
			a, b := healthy(t)
			return []Pod{mooncakePrefill(t, 4e9, 0.5), decode("d-0", true, a, b)}
		}, 5000, metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved, ptr.To[int64](8000), "at 8000 MB/s"},
		{"mooncake on prefill, a TCP fallback below the floor", func(t *testing.T) []Pod {
			a, b := healthy(t)
			return []Pod{mooncakePrefill(t, 4e9, 4), decode("d-0", true, a, b)}
		}, 5000, metav1.ConditionFalse, v1alpha1.ReasonSlowTransport, ptr.To[int64](1000), "at 1000 MB/s, below the 5000 MB/s floor"},
		{"nixl on decode, below the floor", func(t *testing.T) []Pod {
			a := sampleOf(t, 0, scrape(0, 0, 0, 0)+transferScrape("nixl", 0, 0), 0)
			b := sampleOf(t, time.Minute, scrape(19900, 100, 0, 0)+transferScrape("nixl", 3e8, 1), 0)
			return []Pod{decode("d-0", true, a, b)}
		}, 1000, metav1.ConditionFalse, v1alpha1.ReasonSlowTransport, ptr.To[int64](300), "300 MB/s"},
		{"no floor: the rate is reported, not judged", func(t *testing.T) []Pod {
			a, b := healthy(t)
			return []Pod{mooncakePrefill(t, 4e9, 4), decode("d-0", true, a, b)}
		}, 0, metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved, ptr.To[int64](1000), ""},
		{"too few bytes timed to judge", func(t *testing.T) []Pod {
			a, b := healthy(t)
			return []Pod{mooncakePrefill(t, 1000, 1), decode("d-0", true, a, b)}
		}, 5000, metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved, nil, ""},
		{"recomputing wins over slow", func(t *testing.T) []Pod {
			return []Pod{mooncakePrefill(t, 4e9, 4), decode("d-0", true, sampleOf(t, 0, scrape(0, 0, 0, 0), 0), sampleOf(t, time.Minute, scrape(0, 20000, 0, 0), 0))}
		}, 5000, metav1.ConditionFalse, v1alpha1.ReasonDecodeRecomputing, ptr.To[int64](1000), ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			v := Evaluate(tc.pods(t), Policy{Window: 5 * time.Minute, MinSharePct: 90, GateEnabled: true, MinMBps: tc.floor}, nil)
			if v.Status != tc.wantStatus || v.Reason != tc.wantReason {
				t.Errorf("verdict %s/%s (%s), want %s/%s", v.Status, v.Reason, v.Message, tc.wantStatus, tc.wantReason)
			}
			if d := cmp.Diff(tc.wantMBps, v.KV.TransferMBps); d != "" {
				t.Errorf("transferMBps (-want +got):\n%s", d)
			}
			if !strings.Contains(v.Message, tc.wantInMsg) {
				t.Errorf("message %q, want it to contain %q", v.Message, tc.wantInMsg)
			}
		})
	}
}

// Prefill pods count the requests whose held KV expired.
func TestEvaluateCountsExpiredOnPrefill(t *testing.T) {
	pods := []Pod{
		{Name: "p-0", Role: v1alpha1.RolePrefill, Samples: []Sample{{At: t0, Expired: 3}, {At: t0.Add(time.Minute), Expired: 7}}},
		decode("d-0", true, Sample{At: t0, HasSources: true}, Sample{At: t0.Add(time.Minute), HasSources: true, External: 1000, LocalCompute: 10}),
	}
	if v := Evaluate(pods, Policy{Window: time.Minute, MinSharePct: 90}, nil); v.KV.ExpiredRequests != 4 || v.Status != metav1.ConditionTrue {
		t.Errorf("verdict %+v, want True with 4 expired requests", v)
	}
}

// A restarted engine starts its counters at 0: the history starts the pod's series again
// rather than reading the drop as negative traffic, whether the restart is seen in the
// container's restart count or only in the counters.
func TestHistoryRestartsTheSeries(t *testing.T) {
	const window = 5 * time.Minute
	at := func(d time.Duration, ext, comp float64) Sample {
		return Sample{At: t0.Add(d), HasSources: true, External: ext, LocalCompute: comp}
	}
	var h History
	h.Add("u", 0, at(0, 10000, 100), window)
	h.Add("u", 0, at(time.Minute, 20000, 200), window)
	h.Add("u", 0, at(2*time.Minute, 50, 5000), window) // counters went down: the engine restarted
	h.Add("u", 0, at(3*time.Minute, 60, 9000), window)
	v := Evaluate([]Pod{decode("d-0", true, h.Samples("u")...)}, Policy{Window: window, MinSharePct: 90}, nil)
	if v.KV.ExternalTokens != 10 || v.KV.LocalComputeTokens != 4000 || v.Reason != v1alpha1.ReasonDecodeRecomputing {
		t.Errorf("after a counter reset: %+v, want the new run's 10 external and 4000 computed tokens, recomputing", v)
	}
	h.Add("u", 1, at(4*time.Minute, 100000, 10), window) // a container restart seen in the pod
	if got := h.Samples("u"); len(got) != 1 {
		t.Errorf("after a container restart: %d samples, want the series started again", len(got))
	}
}

// Several reconciles may read one cached answer: a sample no newer than the last is the same
// read again and must not count as another (two reads are what a verdict waits for).
func TestHistoryIgnoresTheSameReadTwice(t *testing.T) {
	var h History
	s := Sample{At: t0, HasSources: true, External: 100}
	h.Add("u", 0, s, time.Hour)
	h.Add("u", 0, s, time.Hour)
	h.Add("u", 0, Sample{At: t0.Add(-time.Second), HasSources: true, External: 90}, time.Hour)
	if got := h.Samples("u"); len(got) != 1 {
		t.Errorf("one read added three times: %d samples, want 1", len(got))
	}
	h.Add("u", 1, Sample{At: t0, HasSources: true, External: 5}, time.Hour) // the engine restarted
	if got := h.Samples("u"); len(got) != 1 || got[0].External != 5 {
		t.Errorf("after a restart: %+v, want the restarted engine's sample alone", got)
	}
}

// The window keeps its newest sample at or before its start as the baseline, and forgets
// pods that are gone.
func TestHistoryWindow(t *testing.T) {
	var h History
	for i := range 10 {
		h.Add("u", 0, Sample{At: t0.Add(time.Duration(i) * time.Minute), External: float64(i)}, 3*time.Minute)
	}
	got := h.Samples("u")
	var mins []float64
	for _, s := range got {
		mins = append(mins, s.External)
	}
	if d := cmp.Diff([]float64{6, 7, 8, 9}, mins); d != "" {
		t.Errorf("samples kept (-want +got):\n%s", d)
	}
	h.Keep(map[types.UID]bool{})
	if h.Samples("u") != nil {
		t.Error("a pod no longer live is still kept")
	}
}

// The routers' canary decides when the window holds too little traffic to judge: a canary whose
// prompt decode took from prefill verifies the path, one decode computed or one that failed says
// it is broken, and a stale one, or one beside enough traffic, decides nothing.
func TestEvaluateCanary(t *testing.T) {
	policy := Policy{Window: 5 * time.Minute, MinSharePct: 90, GateEnabled: true, CanaryInterval: time.Minute}
	idle := []Pod{decode("d-0", true, sampleOf(t, 0, scrape(0, 0, 0, 0), 0), sampleOf(t, time.Minute, scrape(0, 0, 0, 0), 0))}
	busy := []Pod{decode("d-0", true, sampleOf(t, 0, scrape(0, 0, 0, 0), 0), sampleOf(t, time.Minute, scrape(0, 1000, 0, 0), 0))}
	canary := func(r v1alpha1.CanaryOutcome, age time.Duration) *Canary {
		c := v1alpha1.CanaryResult{Time: metav1.NewTime(t0.Add(-age)), Router: "r-0", Result: r, PromptTokens: 256, ExternalTokens: 256, Message: "why"}
		return CanaryOf(&c, policy, t0)
	}
	cases := []struct {
		name       string
		pods       []Pod
		canary     *Canary
		wantStatus metav1.ConditionStatus
		wantReason string
	}{
		{"idle, external canary", idle, canary(v1alpha1.CanaryExternal, time.Minute), metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved},
		{"idle, canary computed on decode", idle, canary(v1alpha1.CanaryRecomputed, time.Minute), metav1.ConditionFalse, v1alpha1.ReasonDecodeRecomputing},
		{"idle, canary failed", idle, canary(v1alpha1.CanaryFailed, time.Minute), metav1.ConditionFalse, v1alpha1.ReasonTransferFailing},
		{"idle, stale external canary", idle, canary(v1alpha1.CanaryExternal, 4*time.Minute), metav1.ConditionUnknown, v1alpha1.ReasonNoTraffic},
		{"idle, no canary", idle, nil, metav1.ConditionUnknown, v1alpha1.ReasonNoTraffic},
		{"traffic computed on decode beside an external canary", busy, canary(v1alpha1.CanaryExternal, time.Minute), metav1.ConditionFalse, v1alpha1.ReasonDecodeRecomputing},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			v := Evaluate(tc.pods, policy, tc.canary)
			if v.Status != tc.wantStatus || v.Reason != tc.wantReason {
				t.Errorf("got %s/%s %q, want %s/%s", v.Status, v.Reason, v.Message, tc.wantStatus, tc.wantReason)
			}
			if tc.canary != nil && (v.KV.LastCanary == nil || v.KV.LastCanary.Result != tc.canary.Result.Result) {
				t.Errorf("status.kvTransfer.lastCanary = %+v, want the canary", v.KV.LastCanary)
			}
		})
	}
}
