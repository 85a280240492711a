// Package kvverify decides, from what the engines counted, whether decode receives its prompts'
// KV from prefill: the verdict behind the KVTransferVerified condition and status.kvTransfer.
// The evidence is each decode engine's vllm:prompt_tokens_by_source_total (external KV against
// local compute; a local prefix hit needs no transfer and is left out), over a window, not as an
// equality: a connector or KV layout that moves whole blocks only leaves the partial last block
// to decode (vLLM's Mooncake connector on a full-attention model counts every token external). Failed pulls and whether the completion gate reports tell why decode recomputes.
//
// History keeps the samples (the reconciler owns one); Evaluate is pure.
package kvverify

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// MinTokens is the fewest prompt tokens (external plus computed) a window must hold for a
// verdict, and a pod for its own share to be judged: a handful of short prompts, whose last
// tokens decode always computes, would otherwise read as recomputing.
const MinTokens = 256

// Sample is one read of one engine pod's counters (totals since the engine started).
type Sample struct {
	At time.Time
	// HasSources: the engine exports vllm:prompt_tokens_by_source_total.
	HasSources             bool
	External, LocalCompute float64
	// Failed are pulls that failed: the gate's failed pulls with local blocks plus the
	// connector's failed transfers and receives.
	Failed float64
	// Expired are prefill requests whose held KV expired (prefill pods).
	Expired float64
	// Bytes and Seconds are the KV the engine moved and the time its transfers took.
	Bytes, Seconds float64
}

// SampleOf is the sample in an engine pod's GET /gate answer, read at at; false when the
// sidecar has no engine counts. Failed pulls are the completion gate's when it reports (it sees
// every failed pull with local blocks), else the connector's failed transfers and receives.
func SampleOf(at time.Time, st vllm.State) (Sample, bool) {
	e := st.Engine
	if e == nil || (e.Error != "" && !e.HasPromptSources && e.ExternalKVTokens == 0 && e.LocalComputeTokens == 0) {
		return Sample{}, false
	}
	s := Sample{At: at, HasSources: e.HasPromptSources, External: e.ExternalKVTokens, LocalCompute: e.LocalComputeTokens,
		Failed: e.FailedTransfers + e.FailedReceives, Expired: e.ExpiredRequests, Bytes: e.TransferBytes, Seconds: e.TransferSeconds}
	if st.Report != nil {
		s.Failed = float64(st.Report.Counts.Failed)
	}
	return s, true
}

// Pod is one engine pod's evidence for Evaluate.
type Pod struct {
	Name string
	Role v1alpha1.Role
	// GateReported: the pod's completion gate has heartbeat at least once.
	GateReported bool
	// Samples are the pod's samples in the window, oldest first.
	Samples []Sample
}

// delta is what a pod counted between its first and last sample.
func (p Pod) delta() (d Sample, ok bool) {
	if len(p.Samples) < 2 {
		return Sample{}, false
	}
	a, b := p.Samples[0], p.Samples[len(p.Samples)-1]
	return Sample{At: b.At, HasSources: b.HasSources, External: b.External - a.External, LocalCompute: b.LocalCompute - a.LocalCompute,
		Failed: b.Failed - a.Failed, Expired: b.Expired - a.Expired, Bytes: b.Bytes - a.Bytes, Seconds: b.Seconds - a.Seconds}, true
}

// Policy is spec.kvTransfer.verification, defaulted.
type Policy struct {
	Window      time.Duration
	MinSharePct int32
	// GateEnabled: the engines should run the completion gate (so a gate that never reported
	// means vLLM runs without the operator's connector).
	GateEnabled bool
	// MinMBps is the transfer rate floor (0: none).
	MinMBps int64
	// CanaryInterval is how often the routers send a canary (0: mode is not Canary).
	CanaryInterval time.Duration
}

// Canary is the routers' newest canary for Evaluate.
type Canary struct {
	Result v1alpha1.CanaryResult
	// Fresh: it came within three intervals, so it says how the path is now.
	Fresh bool
}

// CanaryOf is the evidence of the newest canary at now (nil without one).
func CanaryOf(c *v1alpha1.CanaryResult, p Policy, now time.Time) *Canary {
	if c == nil || p.CanaryInterval == 0 {
		return nil
	}
	return &Canary{Result: *c, Fresh: now.Sub(c.Time.Time) <= 3*p.CanaryInterval}
}

// PolicyOf reads the verification policy of a defaulted PDCluster.
func PolicyOf(pdc *v1alpha1.PDCluster) Policy {
	v := pdc.Spec.KVTransfer.Verification
	p := Policy{Window: time.Duration(ptr.Deref(v.WindowSeconds, v1alpha1.DefaultVerificationWindowSeconds)) * time.Second,
		MinSharePct: ptr.Deref(v.MinExternalSharePercent, v1alpha1.DefaultMinExternalSharePercent),
		GateEnabled: pdc.Spec.KVTransfer.CompletionGate != v1alpha1.CompletionGateDisabled,
		MinMBps:     int64(ptr.Deref(v.MinTransferMBps, 0))}
	if v.Mode == v1alpha1.KVVerificationCanary {
		p.CanaryInterval = time.Duration(ptr.Deref(v.CanaryIntervalSeconds, v1alpha1.DefaultCanaryIntervalSeconds)) * time.Second
	}
	return p
}

// MinTimedBytes is the fewest bytes the window's timed transfers must hold for a rate to be
// reported and judged: a few small transfers are all latency.
const MinTimedBytes = 256 << 10

// Verdict is KVTransferVerified and status.kvTransfer.
type Verdict struct {
	Status  metav1.ConditionStatus
	Reason  string
	Message string
	KV      v1alpha1.KVTransferStatus
}

// Evaluate judges the decode pods' evidence over the window. The canary (nil without one) is
// reported, and decides when the window holds too little traffic to judge: an idle cluster
// is verified by its canaries alone.
func Evaluate(pods []Pod, p Policy, canary *Canary) Verdict {
	v := evaluatePassive(pods, p)
	if canary == nil {
		return v
	}
	c := canary.Result
	v.KV.LastCanary = &c
	if !canary.Fresh || v.Status != metav1.ConditionUnknown || v.Reason != v1alpha1.ReasonNoTraffic {
		return v
	}
	what := fmt.Sprintf("the canary request of %s at %s", c.Router, c.Time.UTC().Format(time.RFC3339))
	switch c.Result {
	case v1alpha1.CanaryExternal:
		v.Status, v.Reason = metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved
		v.Message = fmt.Sprintf("%s received %d of its %d prompt tokens from prefill (too little other traffic in the last %s to judge a share)", what, c.ExternalTokens, c.PromptTokens, p.Window)
	case v1alpha1.CanaryRecomputed:
		v.Status, v.Reason = metav1.ConditionFalse, v1alpha1.ReasonDecodeRecomputing
		v.Message = fmt.Sprintf("%s was computed on decode: %s; are kv_transfer_params reaching decode?", what, c.Message)
	default:
		v.Status, v.Reason = metav1.ConditionFalse, v1alpha1.ReasonTransferFailing
		v.Message = fmt.Sprintf("%s failed: %s", what, c.Message)
	}
	return v
}

func evaluatePassive(pods []Pod, p Policy) Verdict {
	var v Verdict
	readable, decodes := 0, 0
	var ext, comp, failed, bytes, secs float64
	type judged struct {
		name      string
		sharePct  int32
		failed    float64
		gateQuiet bool
	}
	var low []judged
	for _, pod := range pods {
		d, ok := pod.delta()
		if ok { // either pool may time the transfers (Mooncake's prefill writes, NIXL's decode reads)
			bytes, secs = bytes+d.Bytes, secs+d.Seconds
		}
		if pod.Role == v1alpha1.RolePrefill {
			if ok {
				v.KV.ExpiredRequests += int64(d.Expired)
			}
			continue
		}
		decodes++
		if len(pod.Samples) > 0 && pod.Samples[len(pod.Samples)-1].HasSources {
			readable++
		}
		if !ok || !d.HasSources {
			continue
		}
		ext, comp, failed = ext+d.External, comp+d.LocalCompute, failed+d.Failed
		if total := d.External + d.LocalCompute; total >= MinTokens {
			if s := sharePct(d.External, total); s < p.MinSharePct {
				low = append(low, judged{pod.Name, s, d.Failed, p.GateEnabled && !pod.GateReported})
			}
		}
	}
	v.KV.ExternalTokens, v.KV.LocalComputeTokens, v.KV.FailedPulls = int64(ext), int64(comp), int64(failed)
	var mbps int64
	timed := bytes >= MinTimedBytes && secs > 0
	if timed {
		mbps = int64(bytes / secs / 1e6)
		v.KV.TransferMBps = ptr.To(mbps)
	}
	window := p.Window.String()
	switch {
	case readable == 0:
		v.Status, v.Reason = metav1.ConditionUnknown, v1alpha1.ReasonMetricsUnavailable
		v.Message = fmt.Sprintf("no decode engine's prompt token counts could be read (%d decode pods): the sidecars did not answer, "+
			"or the engines do not export vllm:prompt_tokens_by_source_total", decodes)
		return v
	case ext+comp < MinTokens:
		v.Status, v.Reason = metav1.ConditionUnknown, v1alpha1.ReasonNoTraffic
		v.Message = fmt.Sprintf("decode received or computed fewer than %d prompt tokens in the last %s: nothing to judge", MinTokens, window)
		return v
	}
	share := sharePct(ext, ext+comp)
	v.KV.ExternalSharePercent = ptr.To(share)
	if len(low) == 0 && share >= p.MinSharePct && timed && p.MinMBps > 0 && mbps < p.MinMBps {
		v.Status, v.Reason = metav1.ConditionFalse, v1alpha1.ReasonSlowTransport
		v.Message = fmt.Sprintf("decode receives its prompts' KV from prefill (%d%% in the last %s), but at %d MB/s, below the %d MB/s floor "+
			"(verification.minTransferMBps): has the RDMA path fallen back to TCP (the engines' transfer engine log, the pods' RDMA devices)?",
			share, window, mbps, p.MinMBps)
		return v
	}
	if len(low) == 0 && share >= p.MinSharePct {
		v.Status, v.Reason = metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved
		v.Message = fmt.Sprintf("decode received %d%% of its prompt tokens from prefill in the last %s (at least %d%% required)", share, window, p.MinSharePct)
		if timed {
			v.Message += fmt.Sprintf(", at %d MB/s", mbps)
		}
		if failed > 0 {
			v.Message += fmt.Sprintf("; %d pulls failed", int64(failed))
		}
		return v
	}
	slices.SortFunc(low, func(a, b judged) int { return strings.Compare(a.name, b.name) })
	var names []string
	var why []string
	quiet, failing := 0, 0
	for _, j := range low {
		names = append(names, j.name)
		why = append(why, fmt.Sprintf("%s %d%%", j.name, j.sharePct))
		if j.gateQuiet {
			quiet++
		}
		if j.failed > 0 {
			failing++
		}
	}
	if len(names) > 64 {
		names = names[:64]
	}
	v.KV.RecomputingPods = names
	v.Status = metav1.ConditionFalse
	named := strings.Join(why, ", ")
	if len(low) == 0 { // no pod judged alone, but all together, below the minimum
		named = fmt.Sprintf("%d%% over all decode pods", share)
	}
	switch {
	case quiet > 0:
		v.Reason = v1alpha1.ReasonConnectorNotLoaded
		v.Message = fmt.Sprintf("decode computes its prompts instead of receiving them (%s external in the last %s) and its completion gate never reported: "+
			"vLLM runs without the operator's connector (check the engine log for the kv_connector_module_path import)", named, window)
	case failed > 0 && (failing > 0 || len(low) == 0):
		v.Reason = v1alpha1.ReasonTransferFailing
		v.Message = fmt.Sprintf("decode recomputes prompts because KV pulls fail (%d failed in the last %s; %s external, at least %d%% required): "+
			"check that decode reaches prefill's bootstrap and transfer ports", int64(failed), window, named, p.MinSharePct)
	default:
		v.Reason = v1alpha1.ReasonDecodeRecomputing
		v.Message = fmt.Sprintf("decode computes its prompts instead of receiving them from prefill (%s external in the last %s, at least %d%% required) "+
			"and no pull failed: are kv_transfer_params reaching decode (the router, a gateway in front of it)?", named, window, p.MinSharePct)
	}
	return v
}

func sharePct(ext, total float64) int32 {
	if total <= 0 {
		return 0
	}
	return int32(math.Floor(100 * ext / total))
}

// History keeps each engine pod's samples over the window. It is safe for concurrent use.
type History struct {
	mu   sync.Mutex
	pods map[types.UID]*series
}

type series struct {
	restarts int32
	samples  []Sample
}

// Add records a sample of the pod (uid), whose engine container has restarted restarts times:
// a restart, or a counter that went down, starts the pod's series again (the engine's counters
// began at 0). Samples older than window are dropped, but the newest of them is kept as the
// window's start. A sample no newer than the pod's last is the same read seen again (the
// reconciler reads the pods' last answers, which several reconciles may share) and is ignored.
func (h *History) Add(uid types.UID, restarts int32, s Sample, window time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.pods == nil {
		h.pods = map[types.UID]*series{}
	}
	ser := h.pods[uid]
	if ser != nil && ser.restarts == restarts && len(ser.samples) > 0 && !s.At.After(ser.samples[len(ser.samples)-1].At) {
		return
	}
	if ser == nil || ser.restarts != restarts || (len(ser.samples) > 0 && wentDown(ser.samples[len(ser.samples)-1], s)) {
		ser = &series{restarts: restarts}
		h.pods[uid] = ser
	}
	ser.samples = append(ser.samples, s)
	cut := s.At.Add(-window)
	first := 0
	for i, old := range ser.samples {
		if !old.At.After(cut) {
			first = i // the newest at or before the window's start
		}
	}
	ser.samples = slices.Clone(ser.samples[first:])
}

func wentDown(prev, next Sample) bool {
	return next.External < prev.External || next.LocalCompute < prev.LocalCompute || next.Failed < prev.Failed || next.Expired < prev.Expired ||
		next.Bytes < prev.Bytes || next.Seconds < prev.Seconds
}

// Samples are the pod's samples, oldest first.
func (h *History) Samples(uid types.UID) []Sample {
	h.mu.Lock()
	defer h.mu.Unlock()
	if ser := h.pods[uid]; ser != nil {
		return slices.Clone(ser.samples)
	}
	return nil
}

// Keep forgets every pod not in live (deleted pods).
func (h *History) Keep(live map[types.UID]bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for uid := range h.pods {
		if !live[uid] {
			delete(h.pods, uid)
		}
	}
}
