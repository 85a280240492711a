package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/controllers"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/needs"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// eventually polls check until it returns nil or the deadline passes. The deadline only bounds
// a wait for the controller's watches; it is not a speed assertion.
func eventually(t *testing.T, what string, check func() error) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// startManager runs the reconciler in a manager with opts (plus this suite's scheme, leader
// election, no metrics listener) as the user of cfg, until the test ends; each with changes the
// reconciler before it is set up.
func startManager(t *testing.T, cfg *rest.Config, opts ctrl.Options, with ...func(*controllers.PDClusterReconciler)) {
	t.Helper()
	opts.Scheme, opts.LeaderElection = scheme, true
	opts.Metrics = metricsserver.Options{BindAddress: "0"}
	// Tests in this process run the same controller, in managers of their own.
	opts.Controller = config.Controller{SkipNameValidation: ptr.To(true)}
	mgr, err := ctrl.NewManager(cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	r := &controllers.PDClusterReconciler{
		Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Scheme: mgr.GetScheme(),
		Recorder: mgr.GetEventRecorder(v1alpha1.OperatorName), Options: render.DefaultOptions(),
	}
	for _, w := range with {
		w(r)
	}
	if err := r.SetupWithManager(mgr); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	})
}

// TestManagerWatchesRepairScaleAndStatus runs the reconciler inside a real manager (watches,
// leader election, metrics registry) instead of calling Reconcile by hand.
func TestManagerWatchesRepairScaleAndStatus(t *testing.T) {
	f := newFixture(t)
	startManager(t, cfg, ctrl.Options{
		Cache:                   controllers.CacheOptions(),
		LeaderElectionID:        "pdcluster-it-" + f.ns,
		LeaderElectionNamespace: f.ns,
	})

	if err := f.c.Create(f.ctx, wrappers.MakePDCluster(f.ns, "live").Obj()); err != nil {
		t.Fatal(err)
	}
	key := func(n string) client.ObjectKey { return client.ObjectKey{Namespace: f.ns, Name: n} }
	eventually(t, "children created", func() error {
		for _, n := range []string{"live-prefill", "live-decode", "live-router"} {
			if err := f.c.Get(f.ctx, key(n), &appsv1.Deployment{}); err != nil {
				return err
			}
		}
		return f.c.Get(f.ctx, key("live-router"), &corev1.ConfigMap{})
	})

	// A deleted child comes back through the watch on owned objects.
	var svc corev1.Service
	f.get(&svc, "live-decode")
	oldUID := svc.UID
	if err := f.c.Delete(f.ctx, &svc); err != nil {
		t.Fatal(err)
	}
	eventually(t, "deleted Service recreated", func() error {
		var s corev1.Service
		if err := f.c.Get(f.ctx, key("live-decode"), &s); err != nil {
			return err
		}
		if s.UID == oldUID {
			return errors.New("still the old Service")
		}
		return nil
	})

	// Scale: the spec change reaches the decode Deployment only.
	var pdc v1alpha1.PDCluster
	f.get(&pdc, "live")
	pdc.Spec.Decode.Replicas = ptr.To[int32](3)
	if err := f.c.Update(f.ctx, &pdc); err != nil {
		t.Fatal(err)
	}
	eventually(t, "decode scaled to 3", func() error {
		var d appsv1.Deployment
		if err := f.c.Get(f.ctx, key("live-decode"), &d); err != nil {
			return err
		}
		if *d.Spec.Replicas != 3 {
			return fmt.Errorf("replicas %d", *d.Spec.Replicas)
		}
		return nil
	})

	// Deployment status changes (a controller-manager's job; envtest has none) flow to the
	// PDCluster's conditions and the operator's metrics.
	f.setDeploymentStatus("live-prefill", 2, 2)
	f.setDeploymentStatus("live-decode", 3, 3)
	f.setDeploymentStatus("live-router", 1, 1)
	eventually(t, "Ready", func() error {
		var p v1alpha1.PDCluster
		if err := f.c.Get(f.ctx, key("live"), &p); err != nil {
			return err
		}
		if !meta.IsStatusConditionTrue(p.Status.Conditions, v1alpha1.ConditionReady) || p.Status.ObservedGeneration != p.Generation {
			return fmt.Errorf("status %+v", p.Status)
		}
		return nil
	})
	eventually(t, "ready metrics", func() error {
		want := `
# HELP pdcluster_ready 1 when the PDCluster's Ready condition is True, else 0.
# TYPE pdcluster_ready gauge
pdcluster_ready{name="live",namespace="` + f.ns + `"} 1
`
		return testutil.GatherAndCompare(metrics.Registry, strings.NewReader(want), "pdcluster_ready")
	})
	if n := metricSum(t, "pdcluster_child_applies_total", map[string]string{"action": "create", "result": "ok"}); n < 7 {
		t.Errorf("pdcluster_child_applies_total{action=create,result=ok} = %v, want at least 7", n)
	}

	// Deletion: children carry a blocking controller reference, so the garbage collector
	// (not running in envtest; the e2e suite checks it) removes them with the PDCluster.
	var d appsv1.Deployment
	f.get(&d, "live-router")
	if ref := metav1.GetControllerOf(&d); ref == nil || !ptr.Deref(ref.BlockOwnerDeletion, false) {
		t.Errorf("router Deployment owner reference = %+v, want a blocking controller reference", ref)
	}
	if err := f.c.Delete(f.ctx, &pdc); err != nil {
		t.Fatal(err)
	}
	eventually(t, "metrics of the deleted PDCluster dropped", func() error {
		if n := metricSeries(t, "pdcluster_ready", map[string]string{"namespace": f.ns}); n != 0 {
			return fmt.Errorf("%d pdcluster_ready series left for %s", n, f.ns)
		}
		return nil
	})
}

// metricSum adds up the series of a metric in the controller-runtime registry whose labels
// include want.
func metricSum(t *testing.T, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.Metric {
			labels := map[string]string{}
			for _, l := range m.Label {
				labels[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if labels[k] != v {
					continue series
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

// metricSeries counts the series of a metric whose labels include want.
func metricSeries(t *testing.T, name string, want map[string]string) int {
	t.Helper()
	mfs, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.Metric {
			for _, l := range m.Label {
				if v, ok := want[l.GetName()]; ok && v != l.GetValue() {
					continue series
				}
			}
			n++
		}
	}
	return n
}

// TestKustomizeDefaultAppliesAndIsStable applies config/default with the kubectl built by
// hack/envtest-assets.sh; after a second apply, a server-side diff shows nothing.
func TestKustomizeDefaultAppliesAndIsStable(t *testing.T) {
	kubectl := filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "kubectl")
	if _, err := os.Stat(kubectl); err != nil {
		needs.Skip(t, "kubectl not in KUBEBUILDER_ASSETS: %v", err)
	}
	kubeconfig := adminKubeconfig(t)
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(kubectl, append([]string{"--kubeconfig", kubeconfig}, args...)...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("kubectl %v: %v\n%s%s", args, err, out.String(), errb.String())
		}
		return out.String()
	}
	root := filepath.Join("..", "..", "config", "default")
	// Server-side, as the README says: the CRD's schema is past the 256 kB annotation a
	// client-side apply stores.
	first := run("apply", "--server-side", "-k", root)
	for _, want := range []string{
		"namespace/pdcluster-system", "serviceaccount/pdcluster-manager",
		"clusterrole.rbac.authorization.k8s.io/pdcluster-manager-role",
		"deployment.apps/pdcluster-manager",
	} {
		if !strings.Contains(first, want) {
			t.Errorf("first apply output lacks %q:\n%s", want, first)
		}
	}
	run("apply", "--server-side", "-k", root)
	run("diff", "--server-side", "-k", root) // exits 1, failing the test, on any difference
	var dep unstructured.Unstructured
	dep.SetAPIVersion("apps/v1")
	dep.SetKind("Deployment")
	f := newFixture(t)
	if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: "pdcluster-system", Name: "pdcluster-manager"}, &dep); err != nil {
		t.Fatal(err)
	}
	if sa, _, _ := unstructured.NestedString(dep.Object, "spec", "template", "spec", "serviceAccountName"); sa != "pdcluster-manager" {
		t.Errorf("manager serviceAccountName = %q, want pdcluster-manager", sa)
	}
}

// heldGate answers every pod as a loaded gate, but holds its first read until released.
type heldGate struct {
	asked   chan struct{}
	release chan struct{}
	once    sync.Once
}

func (h *heldGate) ReadGate(ctx context.Context, _ *corev1.Pod) (vllm.State, error) {
	h.once.Do(func() { close(h.asked) })
	select {
	case <-h.release:
	case <-ctx.Done():
		return vllm.State{}, ctx.Err()
	}
	return vllm.State{Loaded: true, Report: &vllm.Report{Connector: "GatedMooncakeConnector"}}, nil
}

// The pods are read outside Reconcile, and an answer that changes what a reconcile acts on
// enqueues the PDCluster through the manager (PodReports' events, a channel source): with the
// first read held until every reconcile it caused is over, the gate's answer still reaches
// status long before the reconciler's own refresh (60 s with verification Disabled).
func TestPodReportsEnqueueThroughTheManager(t *testing.T) {
	f := newFixture(t)
	gate := &heldGate{asked: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(func() {
		select {
		case <-gate.release:
		default:
			close(gate.release)
		}
	})
	startManager(t, cfg, ctrl.Options{
		Cache:                   controllers.CacheOptions(),
		LeaderElectionID:        "pdcluster-it-" + f.ns,
		LeaderElectionNamespace: f.ns,
	}, func(r *controllers.PDClusterReconciler) {
		reports := controllers.NewPodReports(gate, nil, nil, nil)
		reports.Interval, reports.Timeout = time.Hour, time.Hour // only the first read, on the first ask
		r.Reports, r.GateReader = reports, reports
	})
	pdc := wrappers.MakePDCluster(f.ns, "rep").Verification(v1alpha1.KVVerification{Mode: v1alpha1.KVVerificationDisabled}).Obj()
	if err := f.c.Create(f.ctx, pdc); err != nil {
		t.Fatal(err)
	}
	f.enginePodWithConnector("rep", "rep-decode-a", v1alpha1.RoleDecode, true, time.Now().Add(-time.Hour))
	select {
	case <-gate.asked:
	case <-time.After(30 * time.Second):
		t.Fatal("the sidecar was never read after a reconcile asked for it")
	}
	// Every reconcile the pod and the status writes caused is over once the PDCluster stops
	// changing.
	var last string
	stable := 0
	for stable < 20 {
		var p v1alpha1.PDCluster
		f.get(&p, "rep")
		if p.ResourceVersion == last {
			stable++
		} else {
			last, stable = p.ResourceVersion, 0
		}
		time.Sleep(100 * time.Millisecond)
	}
	close(gate.release)
	eventually(t, "the gate's answer in status", func() error {
		var p v1alpha1.PDCluster
		f.get(&p, "rep")
		if g := p.Status.Decode.Gate; g == nil || g.ReportingPods != 1 {
			return fmt.Errorf("status.decode.gate = %+v, want 1 reporting pod", g)
		}
		return nil
	})
}
