// Package integration runs the PDCluster reconciler against a real kube-apiserver and etcd
// (envtest, with the binaries built by hack/envtest-assets.sh).
package integration

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

var (
	scheme  = runtime.NewScheme()
	cfg     *rest.Config
	testEnv *envtest.Environment
	writes  atomic.Int64 // non-GET requests made by the reconciler's client
)

type countingTransport struct{ next http.RoundTripper }

func (c countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method != http.MethodGet {
		writes.Add(1)
	}
	return c.next.RoundTrip(req)
}

func TestMain(m *testing.M) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		if os.Getenv("CI") != "" {
			fmt.Fprintln(os.Stderr, "KUBEBUILDER_ASSETS is not set: run `make test` (it builds the assets)")
			os.Exit(1)
		}
		fmt.Fprintln(os.Stderr, "skipping envtest suite: KUBEBUILDER_ASSETS is not set (make test sets it)")
		os.Exit(0)
	}
	_ = clientgoscheme.AddToScheme(scheme)
	_ = v1alpha1.AddToScheme(scheme)
	_ = lwsv1.AddToScheme(scheme)
	testEnv = &envtest.Environment{
		CRDDirectoryPaths: []string{
			filepath.Join("..", "..", "config", "crd", "bases", "serving.pdcluster.dev_pdclusters.yaml"),
			filepath.Join("..", "..", "config", "crd", "bases", "serving.pdcluster.dev_poolscales.yaml"),
		},
		ErrorIfCRDPathMissing: true,
	}
	// envtest's default Service range, a /24, runs out near 250 router Services: the operator
	// benchmark creates 1,000 PDClusters and the tests more.
	testEnv.ControlPlane.GetAPIServer().Configure().Set("service-cluster-ip-range", "10.96.0.0/16")
	var err error
	if cfg, err = testEnv.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "start envtest:", err)
		// Start fails after the control plane is up when the CRDs are refused (a CEL rule over
		// its cost budget, say): stop it, or etcd and kube-apiserver outlive the test.
		_ = testEnv.Stop()
		os.Exit(1)
	}
	code := m.Run()
	if err := testEnv.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "stop envtest:", err)
	}
	stopGroupSetEnv()
	os.Exit(code)
}

type fixture struct {
	t        *testing.T
	ctx      context.Context
	c        client.Client // the test's own client
	r        *controllers.PDClusterReconciler
	recorder *events.FakeRecorder
	ns       string
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	return newFixtureOn(t, cfg)
}

// newFixtureOn is a fixture on the API server at cfg.
func newFixtureOn(t *testing.T, cfg *rest.Config) *fixture {
	t.Helper()
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	counted := rest.CopyConfig(cfg)
	counted.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return countingTransport{next: rt} }
	rc, err := client.New(counted, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "it-"}}
	if err := c.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	rec := events.NewFakeRecorder(100)
	return &fixture{
		t: t, ctx: context.Background(), c: c, ns: ns.Name, recorder: rec,
		r: &controllers.PDClusterReconciler{Client: rc, Scheme: scheme, Recorder: rec, Options: render.DefaultOptions()},
	}
}

func (f *fixture) reconcile(name string) {
	f.t.Helper()
	if _, err := f.r.Reconcile(f.ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: f.ns, Name: name}}); err != nil {
		f.t.Fatalf("reconcile: %v", err)
	}
}

func (f *fixture) get(obj client.Object, name string) {
	f.t.Helper()
	if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: f.ns, Name: name}, obj); err != nil {
		f.t.Fatalf("get %s: %v", name, err)
	}
}

func (f *fixture) events() []string {
	var out []string
	for {
		select {
		case e := <-f.recorder.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

func (f *fixture) setDeploymentStatus(name string, ready, updated int32) {
	f.t.Helper()
	var d appsv1.Deployment
	f.get(&d, name)
	d.Status = appsv1.DeploymentStatus{
		ObservedGeneration: d.Generation, Replicas: *d.Spec.Replicas,
		ReadyReplicas: ready, UpdatedReplicas: updated, AvailableReplicas: ready,
	}
	if err := f.c.Status().Update(f.ctx, &d); err != nil {
		f.t.Fatalf("set status of %s: %v", name, err)
	}
}

func condition(pdc *v1alpha1.PDCluster, typ string) metav1.Condition {
	if c := meta.FindStatusCondition(pdc.Status.Conditions, typ); c != nil {
		return *c
	}
	return metav1.Condition{}
}

func TestCreateSteadyStateStatusAndEvents(t *testing.T) {
	f := newFixture(t)
	if err := f.c.Create(f.ctx, wrappers.MakePDCluster(f.ns, "demo").Obj()); err != nil {
		t.Fatal(err)
	}
	f.reconcile("demo")

	for _, name := range []string{"demo-prefill", "demo-decode", "demo-router"} {
		var d appsv1.Deployment
		f.get(&d, name)
		if ref := metav1.GetControllerOf(&d); ref == nil || ref.Kind != "PDCluster" || ref.Name != "demo" {
			t.Errorf("%s controller reference = %v, want PDCluster demo", name, ref)
		}
		var s corev1.Service
		f.get(&s, name)
	}
	var cm corev1.ConfigMap
	f.get(&cm, "demo-router")
	for _, name := range []string{"demo-prefill", "demo-decode", "demo-router"} {
		var np networkingv1.NetworkPolicy
		f.get(&np, name)
		if ref := metav1.GetControllerOf(&np); ref == nil || ref.Name != "demo" {
			t.Errorf("NetworkPolicy %s controller reference = %v, want PDCluster demo", name, ref)
		}
	}
	// One Created event names every child (7 objects, the gate plugin's ConfigMap and the
	// NetworkPolicies).
	want := "Normal Created created Deployment demo-prefill, Service demo-prefill, Deployment demo-decode, Service demo-decode, " +
		"ConfigMap demo-router, Deployment demo-router, Service demo-router, ConfigMap demo-pdgate, " +
		"NetworkPolicy demo-prefill, NetworkPolicy demo-decode, NetworkPolicy demo-router"
	if got := f.events(); len(got) != 1 || !sameNames(got[0], want) {
		t.Errorf("events = %q, want one event %q", got, want)
	}

	var pdc v1alpha1.PDCluster
	f.get(&pdc, "demo")
	if c := condition(&pdc, v1alpha1.ConditionPrefillReady); c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonRollingOut || c.ObservedGeneration != pdc.Generation {
		t.Errorf("PrefillReady = %+v, want False/RollingOut at generation %d", c, pdc.Generation)
	}
	if pdc.Status.ObservedGeneration != pdc.Generation {
		t.Errorf("observedGeneration = %d, want %d", pdc.Status.ObservedGeneration, pdc.Generation)
	}

	// A resync with nothing changed makes no write at all: no apply, no status update.
	writes.Store(0)
	f.reconcile("demo")
	if n := writes.Load(); n != 0 {
		t.Errorf("steady-state reconcile made %d write requests, want 0", n)
	}

	// Pods become ready: each component, then the cluster, reports Ready, with one event.
	f.setDeploymentStatus("demo-prefill", 2, 2)
	f.setDeploymentStatus("demo-decode", 1, 1)
	f.setDeploymentStatus("demo-router", 1, 1)
	f.reconcile("demo")
	f.get(&pdc, "demo")
	for _, typ := range []string{v1alpha1.ConditionPrefillReady, v1alpha1.ConditionDecodeReady, v1alpha1.ConditionRouterReady, v1alpha1.ConditionReady} {
		if c := condition(&pdc, typ); c.Status != metav1.ConditionTrue {
			t.Errorf("%s = %+v, want True", typ, c)
		}
	}
	if pdc.Status.Prefill.Ready != "2/2" || pdc.Status.Decode.ReadyReplicas != 1 {
		t.Errorf("pool status = %+v / %+v", pdc.Status.Prefill, pdc.Status.Decode)
	}
	if got := f.events(); len(got) != 1 || !strings.HasPrefix(got[0], "Normal Ready") {
		t.Errorf("events = %q, want one Ready event", got)
	}

	// A decode pod goes unready: Degraded, with the reason on the condition.
	f.setDeploymentStatus("demo-decode", 0, 1)
	f.reconcile("demo")
	f.get(&pdc, "demo")
	if c := condition(&pdc, v1alpha1.ConditionDecodeReady); c.Reason != v1alpha1.ReasonReplicasNotReady || c.Message != "0/1 replicas ready" {
		t.Errorf("DecodeReady = %+v", c)
	}
	if got := f.events(); len(got) != 1 || !strings.HasPrefix(got[0], "Warning Degraded") {
		t.Errorf("events = %q, want one Degraded event", got)
	}
}

func TestDriftIsRepaired(t *testing.T) {
	f := newFixture(t)
	if err := f.c.Create(f.ctx, wrappers.MakePDCluster(f.ns, "drift").Obj()); err != nil {
		t.Fatal(err)
	}
	f.reconcile("drift")
	f.events()

	var d appsv1.Deployment
	f.get(&d, "drift-prefill")
	d.Spec.Replicas = ptr.To[int32](7)
	d.Spec.Template.Spec.Containers[0].Image = "evil:latest"
	if err := f.c.Update(f.ctx, &d); err != nil {
		t.Fatal(err)
	}
	var svc corev1.Service
	f.get(&svc, "drift-decode")
	if err := f.c.Delete(f.ctx, &svc); err != nil {
		t.Fatal(err)
	}
	// A removed label is drift too, though nothing else about the object changed.
	var router corev1.Service
	f.get(&router, "drift-router")
	delete(router.Labels, v1alpha1.LabelRole)
	if err := f.c.Update(f.ctx, &router); err != nil {
		t.Fatal(err)
	}

	f.reconcile("drift")
	f.get(&d, "drift-prefill")
	if *d.Spec.Replicas != 2 || d.Spec.Template.Spec.Containers[0].Image != "vllm/vllm-openai:v0.11.0" {
		t.Errorf("prefill not put back: replicas %d image %s", *d.Spec.Replicas, d.Spec.Template.Spec.Containers[0].Image)
	}
	f.get(&svc, "drift-decode")
	f.get(&router, "drift-router")
	if router.Labels[v1alpha1.LabelRole] != "router" {
		t.Errorf("router Service labels not put back: %v", router.Labels)
	}
	got := strings.Join(f.events(), "\n")
	for _, want := range []string{"Updated updated Deployment drift-prefill", "Created created Service drift-decode"} {
		if !strings.Contains(got, want) {
			t.Errorf("events %q lack %q", got, want)
		}
	}
}

func TestSpecChangesRollOnlyTheirPool(t *testing.T) {
	f := newFixture(t)
	if err := f.c.Create(f.ctx, wrappers.MakePDCluster(f.ns, "roll").Obj()); err != nil {
		t.Fatal(err)
	}
	f.reconcile("roll")
	hashes := func() map[string]string {
		out := map[string]string{}
		for _, n := range []string{"roll-prefill", "roll-decode", "roll-router"} {
			var d appsv1.Deployment
			f.get(&d, n)
			out[n] = d.Spec.Template.Annotations[v1alpha1.AnnotationConfigHash] + fmt.Sprintf("/%d", *d.Spec.Replicas)
		}
		return out
	}
	before := hashes()

	var pdc v1alpha1.PDCluster
	f.get(&pdc, "roll")
	pdc.Spec.Decode.Args = []string{"--max-num-seqs=64"}
	pdc.Spec.Prefill.Replicas = ptr.To[int32](4)
	if err := f.c.Update(f.ctx, &pdc); err != nil {
		t.Fatal(err)
	}
	f.reconcile("roll")
	after := hashes()
	if after["roll-router"] != before["roll-router"] {
		t.Errorf("router changed: %s -> %s", before["roll-router"], after["roll-router"])
	}
	bh, ah := strings.Split(before["roll-prefill"], "/"), strings.Split(after["roll-prefill"], "/")
	if bh[0] != ah[0] || ah[1] != "4" {
		t.Errorf("prefill: %s -> %s, want same template hash and 4 replicas", before["roll-prefill"], after["roll-prefill"])
	}
	if strings.Split(before["roll-decode"], "/")[0] == strings.Split(after["roll-decode"], "/")[0] {
		t.Errorf("decode template hash did not change: %s", after["roll-decode"])
	}
}

func TestInvalidSpecRejectedAtAdmission(t *testing.T) {
	f := newFixture(t)
	cases := []struct {
		name string
		pdc  *v1alpha1.PDCluster
		want string
	}{
		{"rdma without devices", wrappers.MakePDCluster(f.ns, "a").Protocol(v1alpha1.ProtocolRDMA).Obj(), "rdmaDevices must list at least one RDMA device"},
		{"rdma devices with tcp", wrappers.MakePDCluster(f.ns, "a2").Protocol(v1alpha1.ProtocolTCP, "mlx5_0").Obj(), "rdmaDevices is only used with protocol rdma"},
		{"owned flag", func() *v1alpha1.PDCluster {
			p := wrappers.MakePDCluster(f.ns, "b").Obj()
			p.Spec.Prefill.Args = []string{"--tensor-parallel-size=8"}
			return p
		}(), "flag --tensor-parallel-size=8 is set by the operator"},
		{"owned flag abbreviated", func() *v1alpha1.PDCluster {
			p := wrappers.MakePDCluster(f.ns, "b2").Obj()
			p.Spec.Decode.Args = []string{"--max-model-len=4096", "--kv-transfer-conf={}"}
			return p
		}(), "flag --kv-transfer-conf={} is set by the operator"},
		{"the sidecar's control socket in the engine", func() *v1alpha1.PDCluster {
			p := wrappers.MakePDCluster(f.ns, "b3").Obj()
			p.Spec.Decode.Pod = &v1alpha1.PodSettings{VolumeMounts: []corev1.VolumeMount{{Name: "connector-ctl", MountPath: "/ctl"}}}
			return p
		}(), "volumeMounts may not mount connector-ctl"},
		{"negative replicas", func() *v1alpha1.PDCluster {
			p := wrappers.MakePDCluster(f.ns, "c").Obj()
			p.Spec.Decode.Replicas = ptr.To[int32](-1)
			return p
		}(), "spec.decode.replicas"},
	}
	// The routing rules, each as pdctl validate's tests have it (internal/validation).
	routing := func(name string, mutate func(*v1alpha1.PDCluster)) *v1alpha1.PDCluster {
		p := wrappers.MakePDCluster(f.ns, name).Obj()
		p.Spec.Router.Routing.Strategy = v1alpha1.RoutingKVEvents
		mutate(p)
		return p
	}
	cases = append(cases, []struct {
		name string
		pdc  *v1alpha1.PDCluster
		want string
	}{
		{"kv-events routing with round robin", routing("r1", func(p *v1alpha1.PDCluster) { p.Spec.Router.Balance = v1alpha1.RouterBalanceRoundRobin }),
			"it needs balance least-in-flight"},
		{"kv-events routing without prefix caching", routing("r2", func(p *v1alpha1.PDCluster) { p.Spec.Engine.EnablePrefixCaching = ptr.To(false) }),
			"it needs engine.enablePrefixCaching true"},
		{"kv-events routing for prefill replicas across pods", routing("r3", func(p *v1alpha1.PDCluster) {
			p.Spec.Prefill.Parallelism.Tensor, p.Spec.Prefill.Parallelism.Nodes = ptr.To[int32](2), ptr.To[int32](2)
		}),
			"a replica across pods (parallelism.nodes above 1) numbers from its first pod: use PrefixAware for such pools"},
		{"kv-events routing for decode replicas across pods", routing("r4", func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.Parallelism.Tensor, p.Spec.Decode.Parallelism.Nodes = ptr.To[int32](2), ptr.To[int32](2)
		}),
			"a replica across pods (parallelism.nodes above 1) numbers from its first pod: use PrefixAware for such pools"},
		{"kv-events settings without the strategy", routing("r5", func(p *v1alpha1.PDCluster) {
			p.Spec.Router.Routing.Strategy = v1alpha1.RoutingPrefixAware
			p.Spec.Router.Routing.KVEvents = &v1alpha1.KVEventsRouting{BlocksPerEngine: ptr.To[int32](4096)}
		}), "kvEvents tunes strategy KVEvents"},
		{"prefix-aware settings without the strategy", routing("r6", func(p *v1alpha1.PDCluster) {
			p.Spec.Router.Routing.Strategy = v1alpha1.RoutingLeastInFlight
			p.Spec.Router.Routing.PrefixAware = &v1alpha1.PrefixAwareRouting{LoadSlack: ptr.To[int32](4)}
		}), "prefixAware tunes strategies PrefixAware and KVEvents"},
	}...)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := f.c.Create(f.ctx, tc.pdc)
			if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("create error = %v, want Invalid containing %q", err, tc.want)
			}
		})
	}
}

// Mistakes the API server admits (no CEL or schema rule can see them) are reported in Ready
// as InvalidSpec, naming the PDCluster field, and nothing is applied: before, the core/v1 ones
// surfaced as ApplyFailed in the Deployment's words.
func TestInvalidRenderReportsCondition(t *testing.T) {
	f := newFixture(t)
	for _, tc := range []struct {
		name, want string
		mutate     func(*v1alpha1.PDCluster)
	}{
		{"reserved extraConfig key", "spec.kvTransfer.extraConfig[device_name]", func(p *v1alpha1.PDCluster) {
			p.Spec.KVTransfer.ExtraConfig = &apiextensionsv1.JSON{Raw: []byte(`{"device_name":"x"}`)}
		}},
		{"toleration effect", `spec.decode.tolerations[0].effect: Unsupported value: "Sometimes"`, func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.Tolerations = []corev1.Toleration{{Key: "gpu", Operator: corev1.TolerationOpExists, Effect: "Sometimes"}}
		}},
		{"a mount naming no volume", "spec.prefill.pod.volumeMounts[0].name: Not found", func(p *v1alpha1.PDCluster) {
			p.Spec.Prefill.Pod = &v1alpha1.PodSettings{VolumeMounts: []corev1.VolumeMount{{Name: "scratch", MountPath: "/scratch"}}}
		}},
		{"negative shmSize", "spec.decode.pod.shmSize", func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.Pod = &v1alpha1.PodSettings{ShmSize: ptr.To(resource.MustParse("-1Gi"))}
		}},
		{"affinity operator", `matchExpressions[0].operator: Unsupported value: "Near"`, func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.Pod = &v1alpha1.PodSettings{Affinity: &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
				NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "rack", Operator: "Near", Values: []string{"r1"}}}}}}}}}
		}},
		{"disruption budget past 100%", "spec.decode.disruptionBudget.maxUnavailable", func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.DisruptionBudget = &v1alpha1.DisruptionBudget{MaxUnavailable: ptr.To(intstr.FromString("150%"))}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := "bad-" + strings.ToLower(strings.ReplaceAll(strings.ReplaceAll(tc.name, " ", "-"), "%", ""))
			p := wrappers.MakePDCluster(f.ns, name).Obj()
			tc.mutate(p)
			if err := f.c.Create(f.ctx, p); err != nil {
				t.Fatalf("the API server refused it (the test needs a mistake admission passes): %v", err)
			}
			f.reconcile(name)
			var pdc v1alpha1.PDCluster
			f.get(&pdc, name)
			if c := condition(&pdc, v1alpha1.ConditionReady); c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonInvalidSpec || !strings.Contains(c.Message, tc.want) {
				t.Errorf("Ready = %+v, want False/InvalidSpec naming %q", c, tc.want)
			}
			var d appsv1.Deployment
			if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: f.ns, Name: name + "-prefill"}, &d); !apierrors.IsNotFound(err) {
				t.Errorf("a deployment was created for an invalid spec: %v", err)
			}
		})
	}
}

// enginePodWithConnector creates a running engine pod of cluster in the test namespace, as the
// Deployment would, with its connector's readiness set by the test (nothing runs pods here).
func (f *fixture) enginePodWithConnector(cluster, name string, role v1alpha1.Role, connectorReady bool, unreadySince time.Time) {
	f.t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: f.ns, Name: name, Labels: render.Labels(cluster, role)},
		Spec: corev1.PodSpec{Containers: []corev1.Container{
			{Name: "engine", Image: "vllm/vllm-openai:v0.11.0"},
			{Name: v1alpha1.ConnectorContainerName, Image: render.DefaultOptions().ConnectorImage},
		}},
	}
	if err := f.c.Create(f.ctx, p); err != nil {
		f.t.Fatal(err)
	}
	containersReady := corev1.ConditionTrue
	if !connectorReady {
		containersReady = corev1.ConditionFalse
	}
	p.Status = corev1.PodStatus{
		Phase:      corev1.PodRunning,
		Conditions: []corev1.PodCondition{{Type: corev1.ContainersReady, Status: containersReady, LastTransitionTime: metav1.NewTime(unreadySince)}},
		ContainerStatuses: []corev1.ContainerStatus{
			{Name: "engine", Ready: true, Image: "vllm/vllm-openai:v0.11.0", ImageID: "x"},
			{Name: v1alpha1.ConnectorContainerName, Ready: connectorReady, Image: render.DefaultOptions().ConnectorImage, ImageID: "x",
				State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(unreadySince.Add(-time.Hour))}}},
		},
	}
	if err := f.c.Status().Update(f.ctx, p); err != nil {
		f.t.Fatalf("set status of pod %s: %v", name, err)
	}
}

// A prefill pod whose connector has been unready past the threshold is restarted through the
// API server, with the decode pods connected to it; status and events report the round.
func TestUnhealthyConnectorRestartsPodAndConnectedDecode(t *testing.T) {
	f := newFixture(t)
	now := time.Now()
	clock := clocktesting.NewFakePassiveClock(now)
	f.r.Clock = clock
	if err := f.c.Create(f.ctx, wrappers.MakePDCluster(f.ns, "sick").Obj()); err != nil {
		t.Fatal(err)
	}
	f.enginePodWithConnector("sick", "sick-prefill-a", v1alpha1.RolePrefill, false, now.Add(-10*time.Second))
	f.enginePodWithConnector("sick", "sick-prefill-b", v1alpha1.RolePrefill, true, now.Add(-time.Hour))
	f.enginePodWithConnector("sick", "sick-decode-a", v1alpha1.RoleDecode, true, now.Add(-time.Hour))
	f.enginePodWithConnector("other", "other-decode-a", v1alpha1.RoleDecode, true, now.Add(-time.Hour))
	f.reconcile("sick")
	f.events()
	var pdc v1alpha1.PDCluster
	f.get(&pdc, "sick")
	if c := condition(&pdc, v1alpha1.ConditionConnectorHealthy); c.Reason != v1alpha1.ReasonConnectorNotReady {
		t.Fatalf("ConnectorHealthy = %+v, want ConnectorNotReady below the 30s default threshold", c)
	}
	if u := pdc.Status.Connector.UnhealthyPods; len(u) != 1 || u[0].Name != "sick-prefill-a" {
		t.Errorf("status.connector.unhealthyPods = %+v, want sick-prefill-a alone", pdc.Status.Connector.UnhealthyPods)
	}

	clock.SetTime(now.Add(30 * time.Second)) // the operator has seen it unready for the 30s threshold
	f.reconcile("sick")
	var pods corev1.PodList
	if err := f.c.List(f.ctx, &pods, client.InNamespace(f.ns)); err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, p := range pods.Items {
		left = append(left, p.Name)
	}
	if d := cmp.Diff([]string{"other-decode-a", "sick-prefill-b"}, left); d != "" {
		t.Errorf("pods left (-want +got):\n%s", d)
	}
	f.get(&pdc, "sick")
	if c := condition(&pdc, v1alpha1.ConditionConnectorHealthy); c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonConnectorRestarted {
		t.Errorf("ConnectorHealthy = %+v, want ConnectorRestarted", c)
	}
	if pdc.Status.Connector.Restarts != 2 || pdc.Status.Prefill.ConnectorRestarts != 1 || pdc.Status.Decode.ConnectorRestarts != 1 {
		t.Errorf("restart counts: %+v, prefill %d, decode %d", pdc.Status.Connector, pdc.Status.Prefill.ConnectorRestarts, pdc.Status.Decode.ConnectorRestarts)
	}
	if got := f.events(); !slices.ContainsFunc(got, func(e string) bool {
		return strings.HasPrefix(e, "Warning ConnectorRestarted restarted sick-prefill-a")
	}) {
		t.Errorf("events = %q, want a ConnectorRestarted warning naming the pod", got)
	}
}

// A pool's disruptionBudget becomes its PodDisruptionBudget on a real API server: created with
// an owner, left alone on resync (no write), deleted when the field is unset.
func TestDisruptionBudgetLifecycle(t *testing.T) {
	f := newFixture(t)
	p := wrappers.MakePDCluster(f.ns, "pdb").Obj()
	p.Spec.Decode.DisruptionBudget = &v1alpha1.DisruptionBudget{MaxUnavailable: ptr.To(intstr.FromString("25%"))}
	if err := f.c.Create(f.ctx, p); err != nil {
		t.Fatal(err)
	}
	f.reconcile("pdb")
	var pdb policyv1.PodDisruptionBudget
	f.get(&pdb, "pdb-decode")
	if ref := metav1.GetControllerOf(&pdb); ref == nil || ref.Name != "pdb" || pdb.Spec.MaxUnavailable.String() != "25%" ||
		pdb.Spec.Selector.MatchLabels[v1alpha1.LabelRole] != "decode" {
		t.Errorf("PDB = %+v (owner %v), want decode's, maxUnavailable 25%%, owned", pdb.Spec, ref)
	}
	if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: f.ns, Name: "pdb-prefill"}, &policyv1.PodDisruptionBudget{}); !apierrors.IsNotFound(err) {
		t.Errorf("prefill PDB: %v, want none (prefill sets no budget)", err)
	}
	writes.Store(0)
	f.reconcile("pdb")
	if n := writes.Load(); n != 0 {
		t.Errorf("resync made %d writes, want 0", n)
	}
	f.get(p, "pdb")
	p.Spec.Decode.DisruptionBudget = nil
	if err := f.c.Update(f.ctx, p); err != nil {
		t.Fatal(err)
	}
	f.reconcile("pdb")
	if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: f.ns, Name: "pdb-decode"}, &policyv1.PodDisruptionBudget{}); !apierrors.IsNotFound(err) {
		t.Errorf("decode PDB after unsetting the budget: %v, want deleted", err)
	}
}

// Pod settings reach the pods on a real API server, and a resync of what it defaulted (the
// scheduler name, say) writes nothing.
func TestPodSettingsResyncWritesNothing(t *testing.T) {
	f := newFixture(t)
	p := wrappers.MakePDCluster(f.ns, "tuned").Obj()
	p.Spec.Engine.Pod = &v1alpha1.PodSettings{
		Env:                           []corev1.EnvVar{{Name: "NCCL_DEBUG", Value: "WARN"}},
		Labels:                        v1alpha1.NodeSelector{"team": "inference"},
		Annotations:                   map[string]string{"k8s.v1.cni.cncf.io/networks": "rdma-net"},
		TerminationGracePeriodSeconds: ptr.To[int64](60),
		Volumes: []corev1.Volume{{Name: "nccl-topo", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: "nccl-topology"}}}}},
		VolumeMounts: []corev1.VolumeMount{{Name: "nccl-topo", MountPath: "/etc/nccl", ReadOnly: true}},
		Affinity: &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{PreferredDuringSchedulingIgnoredDuringExecution: []corev1.WeightedPodAffinityTerm{{
			Weight: 100, PodAffinityTerm: corev1.PodAffinityTerm{TopologyKey: "kubernetes.io/hostname",
				LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{v1alpha1.LabelRole: "decode"}}},
		}}}},
		TopologySpreadConstraints: []corev1.TopologySpreadConstraint{{MaxSkew: 1, TopologyKey: "topology.kubernetes.io/zone", WhenUnsatisfiable: corev1.ScheduleAnyway,
			LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{v1alpha1.LabelCluster: "tuned"}}}},
	}
	p.Spec.Decode.Pod = &v1alpha1.PodSettings{Env: []corev1.EnvVar{{Name: "NCCL_DEBUG", Value: "INFO"}}}
	if err := f.c.Create(f.ctx, p); err != nil {
		t.Fatal(err)
	}
	f.reconcile("tuned")
	var d appsv1.Deployment
	f.get(&d, "tuned-decode")
	if d.Spec.Template.Labels["team"] != "inference" || d.Spec.Template.Annotations["k8s.v1.cni.cncf.io/networks"] != "rdma-net" ||
		*d.Spec.Template.Spec.TerminationGracePeriodSeconds != 60 {
		t.Errorf("decode template %+v", d.Spec.Template.ObjectMeta)
	}
	writes.Store(0)
	f.reconcile("tuned")
	if n := writes.Load(); n != 0 {
		t.Errorf("resync made %d writes, want 0", n)
	}
}

// sameNames reports whether two "reason created A, B, C" notes name the same children, in
// whatever order render lists them.
func sameNames(got, want string) bool {
	split := func(s string) []string {
		head, list, _ := strings.Cut(s, "created ")
		names := strings.Split(list, ", ")
		slices.Sort(names)
		return append([]string{head}, names...)
	}
	return slices.Equal(split(got), split(want))
}

// Prune deletes the child it observed, never a newer object of the same name (issue 57: the
// fake client ignores delete preconditions, so only the API server can test it): an unused
// ConfigMap is deleted and made again between the reconcile's observation and its delete; the
// new one stays, and the reconcile returns the conflict naming it.
func TestPruneNeverDeletesANewerObjectOfTheSameName(t *testing.T) {
	f := newFixture(t)
	p := wrappers.MakePDCluster(f.ns, "pr").Protocol(v1alpha1.ProtocolTCP).Obj()
	if err := f.c.Create(f.ctx, p); err != nil {
		t.Fatal(err)
	}
	f.reconcile("pr")
	f.get(p, "pr")
	owned := func() *corev1.ConfigMap {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: f.ns, Name: "pr-legacy", Labels: render.Labels("pr", v1alpha1.RolePrefill),
			OwnerReferences: []metav1.OwnerReference{{APIVersion: v1alpha1.GroupVersion.String(), Kind: "PDCluster", Name: "pr", UID: p.UID, Controller: ptr.To(true)}}}}
	}
	if err := f.c.Create(f.ctx, owned()); err != nil {
		t.Fatal(err)
	}
	wc, err := client.NewWithWatch(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	var newer types.UID
	r := &controllers.PDClusterReconciler{Scheme: scheme, Recorder: f.recorder, Options: render.DefaultOptions(), Client: interceptor.NewClient(wc, interceptor.Funcs{
		Delete: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.DeleteOption) error {
			if obj.GetName() == "pr-legacy" && newer == "" {
				// Someone deletes the observed one and makes another of its name meanwhile.
				if err := f.c.Delete(ctx, owned()); err != nil {
					t.Fatal(err)
				}
				again := owned()
				if err := f.c.Create(ctx, again); err != nil {
					t.Fatal(err)
				}
				newer = again.UID
			}
			return c.Delete(ctx, obj, opts...)
		},
	})}
	_, err = r.Reconcile(f.ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: f.ns, Name: "pr"}})
	if err == nil || !strings.Contains(err.Error(), "pr-legacy") || !apierrors.IsConflict(err) {
		t.Errorf("reconcile error %v, want the delete's conflict (its UID precondition) naming pr-legacy", err)
	}
	var got corev1.ConfigMap
	f.get(&got, "pr-legacy")
	if newer == "" || got.UID != newer {
		t.Errorf("pr-legacy is %s, want the newer object %s", got.UID, newer)
	}
}
