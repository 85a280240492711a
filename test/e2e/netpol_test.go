package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// stranger starts a pod in the sample's namespace that belongs to no PDCluster (the netprobe
// image, on the real node) and returns its address.
func (r realNode) stranger(t *testing.T) string {
	t.Helper()
	return r.strangerBeside(t, sampleNS, r.pods(v1alpha1.RoleRouter)[0])
}

// strangerBeside starts a pod in ns that belongs to no PDCluster, from the netprobe image of
// the registry router (a running router pod) came from, and returns its address.
func (e *env) strangerBeside(t *testing.T, ns string, router corev1.Pod) string {
	t.Helper()
	r := realNode{e}
	image := strings.Replace(router.Spec.Containers[0].Image, "/pdcluster/router:", "/pdcluster/netprobe:", 1)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "stranger", Labels: map[string]string{"app": "stranger"}},
		Spec: corev1.PodSpec{
			NodeSelector: map[string]string{"pdcluster.dev/real-node": "true"},
			Containers: []corev1.Container{{
				Name: "netprobe", Image: image,
				ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromInt32(8080)}}, PeriodSeconds: 1},
				SecurityContext: &corev1.SecurityContext{AllowPrivilegeEscalation: ptr.To(false),
					Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}},
			}},
			TerminationGracePeriodSeconds: ptr.To[int64](0),
		},
	}
	if err := r.c.Create(r.ctx, pod); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.c.Delete(r.ctx, pod) })
	var ip string
	r.eventually("the stranger pod is ready", func() error {
		var p corev1.Pod
		if err := r.c.Get(r.ctx, client.ObjectKeyFromObject(pod), &p); err != nil {
			return err
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				ip = p.Status.PodIP
				return nil
			}
		}
		return fmt.Errorf("pod status %+v", p.Status)
	})
	return ip
}

// dial asks the stranger to open a TCP connection to addr: nil when it connected.
func dial(stranger, addr string) error {
	hc := &http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Get("http://" + net.JoinHostPort(stranger, "8080") + "/dial?addr=" + url.QueryEscape(addr))
	if err != nil {
		return fmt.Errorf("ask the stranger: %w", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(b)))
	}
	return nil
}

// seen is how many requests reached the stranger other than the test's own.
func seen(stranger string) (int, error) {
	hc := &http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Get("http://" + net.JoinHostPort(stranger, "8080") + "/seen")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// forgedPull sends decode a request whose kv_transfer_params name the stranger as prefill's
// bootstrap server, as a compromised pod of the PDCluster could (the router refuses a client's
// kv_transfer_params; the node's own processes reach decode's API unjudged): decode asks the
// stranger for the engine's topology when it schedules the pull. It returns once decode has
// answered or given up.
func (r realNode) forgedPull(t *testing.T, stranger string) {
	t.Helper()
	decode := r.pods(v1alpha1.RoleDecode)[0].Status.PodIP
	body, _ := json.Marshal(map[string]any{"model": realModel, "prompt": words(20), "max_tokens": 1, "kv_transfer_params": map[string]any{
		vllm.DoRemotePrefill: true, vllm.TransferID: "forged-" + strconv.FormatInt(time.Now().UnixNano(), 36),
		vllm.RemoteEngineID: "forged", vllm.RemoteBootstrapAddr: "http://" + net.JoinHostPort(stranger, "8080"),
	}})
	hc := &http.Client{Timeout: 60 * time.Second}
	resp, err := hc.Post("http://"+net.JoinHostPort(decode, "8000")+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Logf("forged pull: %v", err)
		return
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("forged pull: decode answered %s %s", resp.Status, bytes.TrimSpace(b))
}

// closedTargets are the ports nobody outside the PDCluster may reach: each engine's API and
// sidecar, prefill's bootstrap server, the port its transfer engine registered there (picked at
// run time), and the router's metrics port (its counts are the operator's and monitoring's,
// though its clients' port is open to all).
func (r realNode) closedTargets(t *testing.T) map[string]string {
	t.Helper()
	prefill, decode := r.pods(v1alpha1.RolePrefill)[0].Status.PodIP, r.pods(v1alpha1.RoleDecode)[0].Status.PodIP
	targets := map[string]string{
		"prefill API": net.JoinHostPort(prefill, "8000"), "prefill bootstrap": net.JoinHostPort(prefill, strconv.Itoa(int(vllm.MooncakeBootstrapPort))),
		"prefill sidecar": net.JoinHostPort(prefill, strconv.Itoa(int(render.ConnectorPort))),
		"decode API":      net.JoinHostPort(decode, "8000"), "decode sidecar": net.JoinHostPort(decode, strconv.Itoa(int(render.ConnectorPort))),
		"router metrics": net.JoinHostPort(r.pods(v1alpha1.RoleRouter)[0].Status.PodIP, strconv.Itoa(int(render.RouterMetricsPort))),
	}
	// The node's root processes are not judged (hack/local-node.sh), so the test reads the
	// bootstrap server itself.
	topo, err := bootstrap.NewClient().Query(r.ctx, "http://"+net.JoinHostPort(prefill, strconv.Itoa(int(vllm.MooncakeBootstrapPort))))
	if err != nil {
		t.Fatalf("query prefill's bootstrap server: %v", err)
	}
	addr, ok := strings.CutPrefix(topo["0"].WorkerAddr["0"]["0"], "tcp://")
	if !ok {
		t.Fatalf("bootstrap /query = %+v, want the transfer engine's tcp:// address", topo)
	}
	targets["prefill transfer engine"] = addr
	return targets
}

// The node enforces the rendered NetworkPolicies (kube-network-policies, hack/local-node.sh
// netpol): a pod outside the PDCluster, in its namespace, reaches none of its engines' ports
// nor the router's metrics port, while the router's clients' port is open to it; the router, decode and the operator still reach what they
// need (requests complete, the gate status is read). With spec.networkPolicy.enabled false
// the same stranger gets through, so what stopped it was the policy.
func (r realNode) enforcesNetworkPolicy(t *testing.T) {
	t.Helper()
	stranger := r.stranger(t)
	var svc corev1.Service
	if err := r.c.Get(r.ctx, client.ObjectKey{Namespace: sampleNS, Name: realName + "-router"}, &svc); err != nil {
		t.Fatal(err)
	}
	router := net.JoinHostPort(svc.Spec.ClusterIP, "80")
	blocked := func() error {
		if err := dial(stranger, router); err != nil {
			return fmt.Errorf("the router (open to every client) refused the stranger: %w", err)
		}
		for what, addr := range r.closedTargets(t) {
			if err := dial(stranger, addr); err == nil {
				return fmt.Errorf("the stranger reached the %s at %s", what, addr)
			}
		}
		return nil
	}
	r.eventually("the stranger reaches the router and none of the engines' ports, nor the router's metrics", blocked)
	// Egress: a forged remote_bootstrap_addr cannot send decode out of the PDCluster.
	before, err := seen(stranger)
	if err != nil {
		t.Fatal(err)
	}
	r.forgedPull(t, stranger)
	if after, err := seen(stranger); err != nil || after != before {
		t.Fatalf("decode, sent to the stranger by a forged remote_bootstrap_addr, reached it: %d requests seen, %d before (%v)", after, before, err)
	}
	var gated int64
	if g := r.pdc().Status.Decode.Gate; g != nil {
		gated = g.GatedCompletions
	}
	r.serves(t)
	r.refused(t) // a cleanup pull with no local block, which decode's gate keeps back
	r.eventually("the operator still reads the sidecars' gate status", func() error {
		// Decode's next step delivers the cleanup pull's report: an idle engine does not step.
		if code, _, err := r.complete(words(20), 2); code != http.StatusOK {
			return fmt.Errorf("a request after the refused one: %d %v", code, err)
		}
		if g := r.pdc().Status.Decode.Gate; g == nil || g.ReportingPods != 1 || g.GatedCompletions <= gated {
			return fmt.Errorf("decode gate status %+v, want one reporting pod and more than %d gated completions", g, gated)
		}
		return nil
	})

	setEnabled := func(on bool) {
		p := &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: sampleNS, Name: realName}}
		patch := fmt.Sprintf(`{"spec":{"networkPolicy":{"enabled":%t}}}`, on)
		if err := r.c.Patch(r.ctx, p, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
			t.Fatal(err)
		}
	}
	setEnabled(false)
	r.eventually("without the policies the stranger reaches every engine port and the router's metrics", func() error {
		for what, addr := range r.closedTargets(t) {
			if err := dial(stranger, addr); err != nil {
				return fmt.Errorf("%s at %s: %w", what, addr, err)
			}
		}
		return nil
	})
	// The same forged pull reaches the stranger now: what stopped it was the egress policy.
	r.eventually("without the policies a forged remote_bootstrap_addr sends decode to the stranger", func() error {
		before, err := seen(stranger)
		if err != nil {
			return err
		}
		r.forgedPull(t, stranger)
		if after, err := seen(stranger); err != nil || after == before {
			return fmt.Errorf("the stranger saw %d requests, %d before (%v)", after, before, err)
		}
		return nil
	})
	setEnabled(true)
	r.eventually("with the policies back the stranger is stopped again", blocked)
	r.eventually("every container running and ready", r.settled)
	r.serves(t)
}
