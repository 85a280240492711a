package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
)

// heldKV is a prefill leg a prefill engine answered whose KV decode has not pulled yet.
type heldKV struct {
	transfer, engineID, boot, prompt string
}

// holdKV sends n prefill legs straight to pod (the Mooncake flow's prefill body, as the router
// sends it) and pulls nothing: the engine holds their blocks, as it does for a decode that is
// slow to pull, until the pulls come or vLLM's abort timeout.
func (r realNode) holdKV(t *testing.T, pod corev1.Pod, n int) []heldKV {
	t.Helper()
	boot := "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(vllm.MooncakeBootstrapPort)))
	topo, err := bootstrap.NewClient().Query(r.ctx, boot)
	if err != nil {
		t.Fatal(err)
	}
	var out []heldKV
	for i := range n {
		h := heldKV{transfer: fmt.Sprintf("xfer-e2e-held-%d-%d", time.Now().UnixNano(), i), engineID: topo["0"].EngineID, boot: boot, prompt: words(3*realBlock + 5)}
		code, body := post("http://"+net.JoinHostPort(pod.Status.PodIP, "8000"), h.prompt, map[string]any{
			"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": h.transfer,
		})
		if code != http.StatusOK {
			t.Fatalf("prefill leg on %s: %d %s", pod.Name, code, body)
		}
		out = append(out, h)
	}
	return out
}

// pull sends h's decode leg straight to the decode pod: it pulls the held KV.
func (r realNode) pull(h heldKV) (int, string) {
	decode := r.pods(v1alpha1.RoleDecode)[0]
	return post("http://"+net.JoinHostPort(decode.Status.PodIP, "8000"), h.prompt, map[string]any{
		"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": h.transfer,
		"remote_engine_id": h.engineID, "remote_bootstrap_addr": h.boot,
	})
}

func post(url, prompt string, params map[string]any) (int, string) {
	body, _ := json.Marshal(map[string]any{"model": realModel, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": params})
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Post(url+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func deletionCost(pod corev1.Pod) string {
	return pod.Annotations["controller.kubernetes.io/pod-deletion-cost"]
}

// drainsPrefill is the scale-down run: prefill 2 -> 1 under load from a bounded client
// loop fails no request, and the pod removed is the idle one (the operator's deletion cost
// from the held KV sends); a prefill pod deleted while it holds KV keeps it for decode's late
// pulls (vLLM's --shutdown-timeout, the sidecar's preStop); with drain.timeoutSeconds 0 the
// same pulls fail, so the test can fail.
func (r realNode) drainsPrefill(t *testing.T) {
	// A 30 s drain: long enough for the late pulls below, and it bounds how long a deleted pod
	// waits for KV that earlier tests left held for pulls that never come.
	r.patchReal(t, `{"prefill":{"replicas":2,"drain":{"timeoutSeconds":30}}}`)
	defer r.patchReal(t, `{"prefill":{"replicas":1,"drain":{"timeoutSeconds":120}}}`)
	r.eventually("the router knows both prefill pods", r.routerKnows(2))

	// Earlier tests may have left KV held on either pod (a failed decode leg's prefill keeps
	// its blocks until vLLM's abort timeout): the pod that holds more is made busier still.
	costs := func() (map[string]int, error) {
		out := map[string]int{}
		for _, p := range r.pods(v1alpha1.RolePrefill) {
			n, err := strconv.Atoi(deletionCost(p))
			if err != nil {
				return nil, fmt.Errorf("pod %s deletion cost %q: %v", p.Name, deletionCost(p), err)
			}
			out[p.Name] = n
		}
		if len(out) != 2 {
			return nil, fmt.Errorf("%d prefill pods", len(out))
		}
		return out, nil
	}
	var before map[string]int
	r.eventually("the operator costs both prefill pods by their held sends", func() (err error) { before, err = costs(); return err })
	pods := r.pods(v1alpha1.RolePrefill)
	busy, idle := pods[0], pods[1]
	if before[idle.Name] > before[busy.Name] {
		busy, idle = idle, busy
	}
	held := r.holdKV(t, busy, before[idle.Name]-before[busy.Name]+3)
	r.eventually("the busy prefill pod costs more than the idle one", func() error {
		c, err := costs()
		if err != nil {
			return err
		}
		if c[busy.Name] < c[idle.Name]+3 {
			return fmt.Errorf("deletion costs %v: want %s at least 3 above %s", c, busy.Name, idle.Name)
		}
		return nil
	})
	end := time.Now().Add(25 * time.Second)
	ok, failed := r.loadDuring(func() {
		time.Sleep(2 * time.Second)
		p := &v1alpha1.PDCluster{}
		p.Namespace, p.Name = sampleNS, realName
		if err := r.c.Patch(r.ctx, p, client.RawPatch("application/merge-patch+json", []byte(`{"spec":{"prefill":{"replicas":1}}}`))); err != nil {
			t.Error(err)
		}
		time.Sleep(time.Until(end)) // the load goes on 25 s in all
	})
	t.Logf("scale-down 2 -> 1 under load: %d ok, %d failed %v", ok, len(failed), failed)
	if len(failed) > 0 || ok == 0 {
		t.Errorf("prefill 2 -> 1 under load: %d requests failed (%d ok)", len(failed), ok)
	}
	r.eventually("one prefill pod left", r.settled)
	if left := r.pods(v1alpha1.RolePrefill); len(left) != 1 || left[0].UID != busy.UID {
		t.Fatalf("prefill pods left %v, want the busy one %s (the idle %s deleted)", podNames(left), busy.Name, idle.Name)
	}
	for _, h := range held {
		if code, body := r.pull(h); code != http.StatusOK {
			t.Errorf("pull of KV the kept pod held: %d %s", code, body)
		}
	}

	// A pod deleted while it holds KV: its late pulls succeed with the drain, fail without.
	for _, tc := range []struct {
		timeout  int
		wantCode int
	}{{30, http.StatusOK}, {0, http.StatusInternalServerError}} {
		if tc.timeout != 30 {
			r.patchReal(t, fmt.Sprintf(`{"prefill":{"drain":{"timeoutSeconds":%d}}}`, tc.timeout))
		}
		pod := r.pods(v1alpha1.RolePrefill)[0]
		held := r.holdKV(t, pod, 2)
		r.run("delete", "pod", "-n", sampleNS, pod.Name, "--wait=false")
		// Past the engine's preStop window: SIGTERM has reached it; the router no longer
		// lists the pod.
		time.Sleep(20 * time.Second)
		for _, h := range held {
			code, body := r.pull(h)
			if code != tc.wantCode {
				t.Errorf("drain.timeoutSeconds %d: a late pull of KV the deleted pod held: %d %s, want %d", tc.timeout, code, body, tc.wantCode)
			}
		}
		r.eventually("a new prefill pod", r.settled)
	}
}

func podNames(pods []corev1.Pod) []string {
	var out []string
	for _, p := range pods {
		out = append(out, p.Name)
	}
	return out
}
