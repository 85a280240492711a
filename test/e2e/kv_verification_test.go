package e2e

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// dropKVParamsEnv is the stand-in engine's knob for a decode engine that never sees its
// requests' kv_transfer_params (test/sim/cmd/vllm): it recomputes every prompt and answers 200.
const dropKVParamsEnv = "VLLM_SIM_DROP_KV_TRANSFER_PARAMS"

// kvVerified waits, sending a long request through the router every second, until
// KVTransferVerified has status and reason, and returns the condition. Every request must
// succeed: a decode that recomputes still answers.
func (r realNode) kvVerified(t *testing.T, status metav1.ConditionStatus, reason string) metav1.Condition {
	t.Helper()
	var got metav1.Condition
	last := time.Time{}
	r.eventually(fmt.Sprintf("KVTransferVerified %s/%s under traffic", status, reason), func() error {
		if time.Since(last) >= time.Second {
			last = time.Now()
			if code, _, err := r.complete(words(8*realBlock+5), 2); err != nil || code != http.StatusOK {
				t.Fatalf("a request through the router failed: %d %v", code, err)
			}
		}
		c := meta.FindStatusCondition(r.pdc().Status.Conditions, v1alpha1.ConditionKVTransferVerified)
		if c == nil || c.Status != status || c.Reason != reason {
			return fmt.Errorf("KVTransferVerified = %+v", c)
		}
		got = *c
		return nil
	})
	return got
}

// verifiesKV: the sample (verification window 30 s) says KV moves under traffic; a decode engine
// that drops kv_transfer_params (answering 200 all the same) turns the condition False,
// DecodeRecomputing, with the pod named, and a Warning event; put back, it is True again; a
// transfer-rate floor above what the node moves makes it False, SlowTransport.
func (r realNode) verifiesKV(t *testing.T) {
	c := r.kvVerified(t, metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved)
	kv := r.pdc().Status.KVTransfer
	if kv == nil || kv.ExternalSharePercent == nil || *kv.ExternalSharePercent < 90 || kv.ExternalTokens == 0 {
		t.Fatalf("status.kvTransfer = %+v (%s), want at least 90%% external", kv, c.Message)
	}
	t.Logf("verified: %s", c.Message)

	r.patchReal(t, `{"decode":{"pod":{"env":[{"name":"`+dropKVParamsEnv+`","value":"1"}]}}}`)
	decode := r.pods(v1alpha1.RoleDecode)[0]
	if !slices.ContainsFunc(decode.Spec.Containers[0].Env, func(e corev1.EnvVar) bool { return e.Name == dropKVParamsEnv }) {
		t.Fatalf("decode pod %s runs without %s", decode.Name, dropKVParamsEnv)
	}
	c = r.kvVerified(t, metav1.ConditionFalse, v1alpha1.ReasonDecodeRecomputing)
	if !strings.Contains(c.Message, decode.Name) {
		t.Errorf("KVTransferVerified message %q does not name the recomputing decode pod %s", c.Message, decode.Name)
	}
	if pods := r.pdc().Status.KVTransfer.RecomputingPods; !slices.Equal(pods, []string{decode.Name}) {
		t.Errorf("status.kvTransfer.recomputingPods = %q, want %s", pods, decode.Name)
	}
	ev := r.run("get", "events", "-n", sampleNS, "--field-selector", "reason="+v1alpha1.ReasonDecodeRecomputing, "-o", "name")
	if strings.TrimSpace(ev) == "" {
		t.Error("no DecodeRecomputing event")
	}
	t.Logf("recomputing: %s", c.Message)

	r.patchReal(t, `{"decode":{"pod":null}}`)
	c = r.kvVerified(t, metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved)
	t.Logf("verified again: %s", c.Message)

	// A floor above what the node's TCP moves: the KV still arrives, but too slowly, as on an
	// RDMA path that fell back to TCP.
	r.patchReal(t, `{"kvTransfer":{"verification":{"minTransferMBps":1000000}}}`)
	c = r.kvVerified(t, metav1.ConditionFalse, v1alpha1.ReasonSlowTransport)
	if kv := r.pdc().Status.KVTransfer; kv == nil || kv.TransferMBps == nil || !strings.Contains(c.Message, "below the 1000000 MB/s floor") {
		t.Errorf("SlowTransport: status.kvTransfer %+v, message %q", kv, c.Message)
	}
	t.Logf("slow: %s", c.Message)
	r.patchReal(t, `{"kvTransfer":{"verification":{"minTransferMBps":null}}}`)
	c = r.kvVerified(t, metav1.ConditionTrue, v1alpha1.ReasonExternalKVObserved)
	t.Logf("verified without a floor: %s", c.Message)
}

// canaryVerifies: with verification mode Canary and no client traffic at all, the router's
// canary requests prove the path (status.kvTransfer.lastCanary External, KVTransferVerified
// True); a decode engine that drops kv_transfer_params makes the canary Recomputed and the
// condition False, still without a client request.
func (r realNode) canaryVerifies(t *testing.T) {
	canary := func(result v1alpha1.CanaryOutcome, reason string) *v1alpha1.CanaryResult {
		var last *v1alpha1.CanaryResult
		r.eventually(fmt.Sprintf("the routers' canary %s and KVTransferVerified %s, without client traffic", result, reason), func() error {
			p := r.pdc()
			c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionKVTransferVerified)
			if p.Status.KVTransfer == nil || p.Status.KVTransfer.LastCanary == nil {
				return fmt.Errorf("no lastCanary in status.kvTransfer (%+v)", p.Status.KVTransfer)
			}
			last = p.Status.KVTransfer.LastCanary
			if last.Result != result || c == nil || c.Reason != reason {
				return fmt.Errorf("lastCanary %+v, KVTransferVerified %+v", last, c)
			}
			return nil
		})
		return last
	}
	r.patchReal(t, `{"kvTransfer":{"verification":{"mode":"Canary","canaryIntervalSeconds":5}}}`)
	defer r.patchReal(t, `{"kvTransfer":{"verification":{"mode":"Passive","canaryIntervalSeconds":null}},"decode":{"pod":null}}`)
	got := canary(v1alpha1.CanaryExternal, v1alpha1.ReasonExternalKVObserved)
	if got.ExternalTokens == 0 || got.PromptTokens < 4*realBlock || !strings.HasPrefix(got.Router, realName+"-router-") {
		t.Errorf("lastCanary %+v: want external tokens of a four-block prompt from a router pod", got)
	}
	t.Logf("canary: %+v", *got)
	r.patchReal(t, `{"decode":{"pod":{"env":[{"name":"`+dropKVParamsEnv+`","value":"1"}]}}}`)
	got = canary(v1alpha1.CanaryRecomputed, v1alpha1.ReasonDecodeRecomputing)
	t.Logf("canary recomputed: %+v", *got)
}
