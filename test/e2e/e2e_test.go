// Package e2e runs against the local cluster that hack/e2e.sh brings up with the README's main
// command (hack/run.sh): kube-apiserver, controller-manager, scheduler and kwok GPU/RDMA nodes,
// the operator installed by its Helm chart, and the sample PDCluster Ready. Each step builds on
// the previous one, as a user's session would.
package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// The sample hack/run.sh applies: 2 prefill and 2 decode replicas, TP=2, one rdma/hca each.
const (
	sampleNS   = "default"
	sampleName = "qwen3-32b"
	timeout    = 3 * time.Minute
)

type env struct {
	t          *testing.T
	ctx        context.Context
	c          client.Client
	kubeconfig string
	kubectl    string
	// metricsAddr is the manager's /metrics address: its pod's on the real node, else the
	// process hack/run.sh runs. metricsToken, when set, is a scraper's token: the chart's
	// manager serves /metrics over HTTPS to authorized clients only.
	metricsAddr, metricsToken string
}

// The client logs nothing the tests read; without a logger controller-runtime prints a stack.
func init() { ctrllog.SetLogger(logr.Discard()) }

func setup(t *testing.T) *env {
	kubeconfig := os.Getenv("PDCLUSTER_E2E_KUBECONFIG")
	if kubeconfig == "" {
		t.Skip("needs the local cluster: run hack/e2e.sh (make test does)")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := lwsv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := os.Getenv("PDCLUSTER_MANAGER_METRICS")
	if metricsAddr == "" {
		t.Fatal("PDCLUSTER_MANAGER_METRICS is unset: hack/e2e.sh sets it to the manager's metrics address")
	}
	return &env{t: t, ctx: context.Background(), c: c, kubeconfig: kubeconfig,
		kubectl: filepath.Join(os.Getenv("PDCLUSTER_E2E_BIN"), "kubectl"), metricsAddr: metricsAddr,
		metricsToken: os.Getenv("PDCLUSTER_MANAGER_METRICS_TOKEN")}
}

// eventually polls cond until it returns nil, failing with its last error after timeout.
func (e *env) eventually(what string, cond func() error) {
	e.t.Helper()
	e.eventuallyWithin(what, timeout, cond)
}

// eventuallyWithin is eventually with a deadline of its own.
func (e *env) eventuallyWithin(what string, within time.Duration, cond func() error) {
	e.t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%s: still not true after %s: %v", what, within, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func (e *env) run(args ...string) string {
	e.t.Helper()
	cmd := exec.Command(e.kubectl, append([]string{"--kubeconfig", e.kubeconfig}, args...)...)
	cmd.Dir = filepath.Join("..", "..")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		e.t.Fatalf("kubectl %v: %v\n%s%s", args, err, out.String(), errb.String())
	}
	return out.String()
}

func (e *env) get(url string) string {
	e.t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		e.t.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
	}
	return string(b)
}

func (e *env) pdc() *v1alpha1.PDCluster {
	e.t.Helper()
	var p v1alpha1.PDCluster
	if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: sampleNS, Name: sampleName}, &p); err != nil {
		e.t.Fatal(err)
	}
	return &p
}

func (e *env) patch(spec string) {
	e.t.Helper()
	p := &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: sampleNS, Name: sampleName}}
	if err := e.c.Patch(e.ctx, p, client.RawPatch(types.MergePatchType, []byte(`{"spec":`+spec+`}`))); err != nil {
		e.t.Fatalf("patch %s: %v", spec, err)
	}
}

// pods are the sample's running (not terminating) pods of role.
func (e *env) pods(role v1alpha1.Role) []corev1.Pod {
	e.t.Helper()
	return e.podsOf(sampleNS, sampleName, role)
}

// podsOf are the running (not terminating) pods of role of the PDCluster ns/cluster.
func (e *env) podsOf(ns, cluster string, role v1alpha1.Role) []corev1.Pod {
	e.t.Helper()
	var list corev1.PodList
	if err := e.c.List(e.ctx, &list, client.InNamespace(ns), client.MatchingLabels(render.Labels(cluster, role))); err != nil {
		e.t.Fatal(err)
	}
	return slices.DeleteFunc(list.Items, func(p corev1.Pod) bool { return p.DeletionTimestamp != nil })
}

// namespace creates ns, deleted when the test ends (kept after a failure when the cluster is
// kept too).
func (e *env) namespace(ns string) {
	e.t.Helper()
	e.run("create", "namespace", ns)
	e.t.Cleanup(func() {
		if e.t.Failed() && os.Getenv("PDCLUSTER_E2E_KEEP") != "" {
			e.t.Logf("namespace %s kept for a look (PDCLUSTER_E2E_KEEP)", ns)
			return
		}
		e.run("delete", "namespace", ns, "--wait=false")
	})
}

func uids(pods []corev1.Pod) []types.UID {
	var out []types.UID
	for _, p := range pods {
		out = append(out, p.UID)
	}
	return out
}

// ready is nil once the sample is Ready for its current generation with want replicas per pool
// running and ready.
func (e *env) ready(prefill, decode int) error {
	p := e.pdc()
	c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
	if c == nil || c.Status != metav1.ConditionTrue || p.Status.ObservedGeneration != p.Generation {
		return fmt.Errorf("Ready = %+v at observed generation %d of %d", c, p.Status.ObservedGeneration, p.Generation)
	}
	for role, want := range map[v1alpha1.Role]int{v1alpha1.RolePrefill: prefill, v1alpha1.RoleDecode: decode} {
		pods := e.pods(role)
		running := 0
		for _, pod := range pods {
			if pod.Status.Phase == corev1.PodRunning {
				running++
			}
		}
		if len(pods) != want || running != want {
			return fmt.Errorf("%s: %d pods, %d running, want %d", role, len(pods), running, want)
		}
	}
	return nil
}

func TestLocalCluster(t *testing.T) {
	e := setup(t)

	t.Run("the chart installed the operator", func(t *testing.T) {
		var releases corev1.SecretList
		if err := e.c.List(e.ctx, &releases, client.InNamespace("pdcluster-system"),
			client.MatchingLabels{"owner": "helm", "name": "pdcluster-operator", "status": "deployed"}); err != nil {
			t.Fatal(err)
		}
		if len(releases.Items) == 0 {
			t.Fatal("no deployed helm release pdcluster-operator in pdcluster-system")
		}
	})

	t.Run("sample pods run on GPU nodes with GPU, RDMA and the connector", func(t *testing.T) {
		e.eventually("sample Ready with 2 prefill and 2 decode pods", func() error { return e.ready(2, 2) })
		for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
			for _, pod := range e.pods(role) {
				var node corev1.Node
				if err := e.c.Get(e.ctx, client.ObjectKey{Name: pod.Spec.NodeName}, &node); err != nil {
					t.Fatalf("%s on node %q: %v", pod.Name, pod.Spec.NodeName, err)
				}
				if node.Labels["pdcluster.dev/gpu-pool"] != "true" {
					t.Errorf("%s runs on %s, not a GPU pool node", pod.Name, node.Name)
				}
				engine := pod.Spec.Containers[0]
				if got := engine.Resources.Requests[v1alpha1.GPUResourceName]; got.Value() != 2 {
					t.Errorf("%s requests %s GPUs, want 2 (TP=2)", pod.Name, got.String())
				}
				if got := engine.Resources.Requests["rdma/hca"]; got.Value() != 1 {
					t.Errorf("%s requests %s rdma/hca, want 1", pod.Name, got.String())
				}
				i := slices.IndexFunc(pod.Status.ContainerStatuses, func(cs corev1.ContainerStatus) bool { return cs.Name == v1alpha1.ConnectorContainerName })
				if i < 0 || !pod.Status.ContainerStatuses[i].Ready {
					t.Errorf("%s has no ready connector: %+v", pod.Name, pod.Status.ContainerStatuses)
				}
			}
		}
	})

	t.Run("scale decode to 3", func(t *testing.T) {
		e.patch(`{"decode":{"replicas":3}}`)
		e.eventually("3 decode pods ready", func() error { return e.ready(2, 3) })
		if got := e.pdc().Status.Decode.Ready; got != "3/3" {
			t.Errorf("status.decode.ready = %q, want 3/3", got)
		}
	})

	t.Run("a decode env change (outside the KV revision) rolls only decode", func(t *testing.T) {
		prefill := uids(e.pods(v1alpha1.RolePrefill))
		revision := e.pdc().Status.CurrentRevision
		var router appsv1.Deployment
		if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: sampleNS, Name: sampleName + "-router"}, &router); err != nil {
			t.Fatal(err)
		}
		e.patch(`{"decode":{"pod":{"env":[{"name":"VLLM_LOGGING_LEVEL","value":"DEBUG"}]}}}`)
		e.eventually("decode rolled with the new env", func() error {
			if err := e.ready(2, 3); err != nil {
				return err
			}
			for _, p := range e.pods(v1alpha1.RoleDecode) {
				if !slices.ContainsFunc(p.Spec.Containers[0].Env, func(v corev1.EnvVar) bool { return v.Name == "VLLM_LOGGING_LEVEL" && v.Value == "DEBUG" }) {
					return fmt.Errorf("decode pod %s has no VLLM_LOGGING_LEVEL=DEBUG", p.Name)
				}
			}
			return nil
		})
		if got := uids(e.pods(v1alpha1.RolePrefill)); !slices.Equal(prefill, got) {
			t.Errorf("prefill pods changed: %v -> %v", prefill, got)
		}
		if got := e.pdc().Status.CurrentRevision; got != revision || revision == "" {
			t.Errorf("status.currentRevision %q -> %q: an env change is not a new KV revision", revision, got)
		}
		var after appsv1.Deployment
		if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: sampleNS, Name: sampleName + "-router"}, &after); err != nil {
			t.Fatal(err)
		}
		if after.Generation != router.Generation {
			t.Errorf("router Deployment generation %d -> %d: it was rolled", router.Generation, after.Generation)
		}
	})

	t.Run("a decode image change is a new KV revision: both pools roll to it", func(t *testing.T) {
		prefill := uids(e.pods(v1alpha1.RolePrefill))
		revision := e.pdc().Status.CurrentRevision
		e.patch(`{"decode":{"image":"vllm/vllm-openai:v0.12.0"}}`)
		e.eventually("both pools on the new revision", func() error {
			if err := e.ready(2, 3); err != nil {
				return err
			}
			p := e.pdc()
			if p.Status.CurrentRevision == revision || p.Status.CurrentRevision != p.Status.UpdateRevision {
				return fmt.Errorf("currentRevision %q, updateRevision %q (was %q)", p.Status.CurrentRevision, p.Status.UpdateRevision, revision)
			}
			for _, p := range e.pods(v1alpha1.RoleDecode) {
				if p.Spec.Containers[0].Image != "vllm/vllm-openai:v0.12.0" {
					return fmt.Errorf("decode pod %s still runs %s", p.Name, p.Spec.Containers[0].Image)
				}
			}
			return nil
		})
		// Prefill's KV must be read by decode of the same revision: its pods are new too.
		for _, uid := range uids(e.pods(v1alpha1.RolePrefill)) {
			if slices.Contains(prefill, uid) {
				t.Errorf("prefill pod %s of revision %s still runs", uid, revision)
			}
		}
	})

	t.Run("pairing by rack: each engine pod labelled with its node's rack, a Service per pool and rack, router.json pairs by rack", func(t *testing.T) {
		e.pairsByRack(t)
	})

	t.Run("an unhealthy prefill connector (unready status written by the test: kwok runs no probes) restarts its pod and the connected decode pods", func(t *testing.T) {
		before := e.pdc().Status.Connector.Restarts
		sick := e.pods(v1alpha1.RolePrefill)[0]
		healthyPrefill := e.pods(v1alpha1.RolePrefill)[1].UID
		decode := uids(e.pods(v1alpha1.RoleDecode))
		// What the kubelet writes when the connector's readiness probe fails (kwok runs no probes).
		// The operator restarts the pod once it has seen this for the 30s default threshold.
		patched := sick.DeepCopy()
		long := metav1.NewTime(time.Now().Add(-5 * time.Minute))
		for i := range patched.Status.Conditions {
			if c := &patched.Status.Conditions[i]; c.Type == corev1.ContainersReady || c.Type == corev1.PodReady {
				c.Status, c.LastTransitionTime = corev1.ConditionFalse, long
			}
		}
		for i := range patched.Status.ContainerStatuses {
			if cs := &patched.Status.ContainerStatuses[i]; cs.Name == v1alpha1.ConnectorContainerName {
				cs.Ready = false
			}
		}
		if err := e.c.Status().Patch(e.ctx, patched, client.MergeFrom(&sick)); err != nil {
			t.Fatal(err)
		}
		e.eventually("the sick prefill pod and every decode pod replaced", func() error {
			for _, p := range e.pods(v1alpha1.RolePrefill) {
				if p.UID == sick.UID {
					return fmt.Errorf("prefill pod %s is still there", sick.Name)
				}
			}
			for _, p := range e.pods(v1alpha1.RoleDecode) {
				if slices.Contains(decode, p.UID) {
					return fmt.Errorf("decode pod %s was not restarted", p.Name)
				}
			}
			return nil
		})
		if !slices.Contains(uids(e.pods(v1alpha1.RolePrefill)), healthyPrefill) {
			t.Error("the healthy prefill pod was restarted too")
		}
		// The pods go first; the status write and the event follow at the end of that reconcile.
		e.eventually("the round in status.connector.restarts", func() error {
			if got := e.pdc().Status.Connector.Restarts - before; got != 4 {
				return fmt.Errorf("status.connector.restarts went up by %d, want 4 (1 prefill + 3 decode)", got)
			}
			return nil
		})
		e.eventually("a ConnectorRestarted event naming the sick pod", func() error {
			var evs eventsv1.EventList
			if err := e.c.List(e.ctx, &evs, client.InNamespace(sampleNS)); err != nil {
				return err
			}
			if !slices.ContainsFunc(evs.Items, func(ev eventsv1.Event) bool {
				return ev.Reason == "ConnectorRestarted" && ev.Regarding.Name == sampleName && strings.Contains(ev.Note, sick.Name)
			}) {
				return fmt.Errorf("no ConnectorRestarted event naming %s", sick.Name)
			}
			return nil
		})
		metrics := e.managerMetrics()
		for pool, want := range map[string]int{"prefill": 1, "decode": 3} {
			line := fmt.Sprintf(`pdcluster_connector_restarts_total{name=%q,namespace=%q,pool=%q} %d`, sampleName, sampleNS, pool, want)
			if !strings.Contains(metrics, line) {
				t.Errorf("manager metrics lack %s", line)
			}
		}
		e.eventually("Ready again with fresh pods", func() error { return e.ready(2, 3) })
		e.eventually("ConnectorHealthy again", func() error {
			c := meta.FindStatusCondition(e.pdc().Status.Conditions, v1alpha1.ConditionConnectorHealthy)
			if c == nil || c.Status != metav1.ConditionTrue {
				return fmt.Errorf("ConnectorHealthy = %+v", c)
			}
			return nil
		})
	})

	t.Run("delete garbage-collects every child", func(t *testing.T) {
		if err := e.c.Delete(e.ctx, e.pdc()); err != nil {
			t.Fatal(err)
		}
		sel := client.MatchingLabels{v1alpha1.LabelCluster: sampleName}
		e.eventually("children gone", func() error {
			lists := map[string]client.ObjectList{
				"deployments": &appsv1.DeploymentList{}, "services": &corev1.ServiceList{},
				"configmaps": &corev1.ConfigMapList{}, "pods": &corev1.PodList{},
			}
			for kind, l := range lists {
				if err := e.c.List(e.ctx, l, client.InNamespace(sampleNS), sel); err != nil {
					return err
				}
				if n := meta.LenList(l); n > 0 {
					return fmt.Errorf("%d %s left", n, kind)
				}
			}
			err := e.c.Get(e.ctx, client.ObjectKey{Namespace: sampleNS, Name: sampleName}, &v1alpha1.PDCluster{})
			if !apierrors.IsNotFound(err) {
				return fmt.Errorf("PDCluster still there: %v", err)
			}
			return nil
		})
	})

	t.Run("a second kubectl apply --server-side -k config/default changes nothing", func(t *testing.T) {
		// Server-side: the CRD's schema (core/v1 volumes and affinity in the pod settings) is
		// past the 256 kB annotation a client-side apply would store.
		e.run("apply", "--server-side", "-k", "config/default")
		e.run("diff", "--server-side", "-k", "config/default") // exits 1 on any difference
	})
}

// managerMetrics scrapes the manager's /metrics: over HTTPS with the scraper's token when the
// manager serves them securely (the chart's default), after checking that a client without
// a token, with a bad one, or with one the API server does not allow /metrics, is turned away.
func (e *env) managerMetrics() string {
	e.t.Helper()
	if e.metricsToken == "" {
		return e.get("http://" + e.metricsAddr + "/metrics")
	}
	// The manager's certificate is self-signed.
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // self-signed, a test
	scrape := func(token string) (int, string) {
		req, _ := http.NewRequestWithContext(e.ctx, http.MethodGet, "https://"+e.metricsAddr+"/metrics", nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := hc.Do(req)
		if err != nil {
			e.t.Fatalf("scrape the manager: %v", err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := scrape(""); code != http.StatusUnauthorized {
		e.t.Errorf("GET /metrics without a token = %d, want 401", code)
	}
	// The API server rejects a malformed token in its TokenReview's status, which
	// controller-runtime's filter answers 500 ("Authentication failed"): refused either way.
	if code, body := scrape("not-a-token"); code < 400 || strings.Contains(body, "pdcluster_") {
		e.t.Errorf("GET /metrics with a bad token = %d, want it refused", code)
	}
	if code, _ := scrape(strings.TrimSpace(e.run("create", "token", "default", "-n", sampleNS))); code != http.StatusForbidden {
		e.t.Errorf("GET /metrics as a ServiceAccount not bound to metrics-reader = %d, want 403", code)
	}
	code, body := scrape(e.metricsToken)
	if code != http.StatusOK {
		e.t.Fatalf("GET /metrics as the scraper = %d: %s", code, body)
	}
	return body
}
