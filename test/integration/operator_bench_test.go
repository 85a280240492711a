package integration

import (
	"context"
	"fmt"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// benchFleet is how many PDClusters the operator benchmark creates at once.
const (
	benchFleet       = 1000
	benchConcurrency = 16 // the chart's maxConcurrentReconciles
)

// BenchmarkOperator creates 1,000 PDClusters at once on envtest and measures how fast the
// operator gives every one its children and status (project), against the same children and
// status written by a plain client with as many workers and no controller (reference: what
// the API server takes). It reports the writes per PDCluster, the writes of a full resync
// once everything is reconciled (a restarted manager: should be 0) and the manager's heap per
// PDCluster.
func BenchmarkOperator(b *testing.B) {
	b.Run("project", benchmarkOperatorFleet)
	b.Run("reference", benchmarkPlainClientFleet)
}

// writeCounter counts the requests that are not reads.
type writeCounter struct{ n atomic.Int64 }

func (w *writeCounter) wrap(cfg *rest.Config) *rest.Config {
	c := rest.CopyConfig(cfg)
	c.QPS = -1 // as ctrl.GetConfig: no client-side rate limit (the API server's priority and fairness rule)
	c.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			if req.Method != http.MethodGet {
				w.n.Add(1)
			}
			return rt.RoundTrip(req)
		})
	}
	return c
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func benchNamespace(b *testing.B, c client.Client) string {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "bench-"}}
	if err := c.Create(context.Background(), ns); err != nil {
		b.Fatal(err)
	}
	return ns.Name
}

func benchClient(b *testing.B) client.Client {
	c := rest.CopyConfig(cfg)
	c.QPS = -1
	cl, err := client.New(c, client.Options{Scheme: scheme})
	if err != nil {
		b.Fatal(err)
	}
	return cl
}

// forFleet runs do for every PDCluster of the fleet, by name, with benchConcurrency workers,
// and returns one of the errors.
func forFleet(do func(name string) error) error {
	work := make(chan int)
	var wg sync.WaitGroup
	var failed atomic.Value
	for range benchConcurrency {
		wg.Go(func() {
			for i := range work {
				if err := do(fmt.Sprintf("p%04d", i)); err != nil {
					failed.Store(err)
				}
			}
		})
	}
	for i := range benchFleet {
		work <- i
	}
	close(work)
	wg.Wait()
	err, _ := failed.Load().(error)
	return err
}

// createFleet creates the PDClusters.
func createFleet(b *testing.B, c client.Client, ns string) {
	if err := forFleet(func(name string) error {
		return c.Create(context.Background(), wrappers.MakePDCluster(ns, name).Obj())
	}); err != nil {
		b.Fatalf("create PDClusters: %v", err)
	}
}

// watchFleet returns a reader of ns's PDClusters from a watch: polling lists of 1,000 of them
// cost the API server (and this process, which runs the manager) more than the operator did.
func watchFleet(b *testing.B, ns string) client.Reader {
	b.Helper()
	cc, err := cache.New(cfg, cache.Options{Scheme: scheme, DefaultNamespaces: map[string]cache.Config{ns: {}}})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b.Cleanup(cancel)
	if _, err := cc.GetInformer(ctx, &v1alpha1.PDCluster{}); err != nil {
		b.Fatal(err)
	}
	go func() { _ = cc.Start(ctx) }()
	if !cc.WaitForCacheSync(ctx) {
		b.Fatal("fleet watch did not sync")
	}
	return cc
}

// fleetReconciled reports how many PDClusters in ns have their status for their generation
// with all children applied.
func fleetReconciled(b *testing.B, c client.Reader, ns string) int {
	var list v1alpha1.PDClusterList
	if err := c.List(context.Background(), &list, client.InNamespace(ns)); err != nil {
		b.Fatal(err)
	}
	n := 0
	for _, p := range list.Items {
		ready := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
		if p.Status.ObservedGeneration == p.Generation && ready != nil && ready.Reason != v1alpha1.ReasonApplyFailed {
			n++
		}
	}
	return n
}

func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

func startBenchManager(b *testing.B, counter *writeCounter) context.CancelFunc {
	b.Helper()
	mgr, err := ctrl.NewManager(counter.wrap(cfg), ctrl.Options{
		Scheme:     scheme,
		Cache:      controllers.CacheOptions(),
		Metrics:    metricsserver.Options{BindAddress: "0"},
		Controller: config.Controller{SkipNameValidation: ptr.To(true)}, // a second manager in one process
	})
	if err != nil {
		b.Fatal(err)
	}
	if err := (&controllers.PDClusterReconciler{
		Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Scheme: mgr.GetScheme(),
		Recorder: mgr.GetEventRecorder(v1alpha1.OperatorName), Options: render.DefaultOptions(),
		MaxConcurrentReconciles: benchConcurrency,
	}).SetupWithManager(mgr); err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	if !mgr.GetCache().WaitForCacheSync(ctx) {
		b.Fatal("manager cache did not sync")
	}
	return func() {
		cancel()
		if err := <-done; err != nil {
			b.Errorf("manager: %v", err)
		}
	}
}

func benchmarkOperatorFleet(b *testing.B) {
	c := benchClient(b)
	ns := benchNamespace(b, c)
	var writes writeCounter
	fleet := watchFleet(b, ns)
	heapBefore := heapInUse()
	stop := startBenchManager(b, &writes)

	b.ResetTimer()
	start := time.Now()
	createFleet(b, c, ns)
	for fleetReconciled(b, fleet, ns) < benchFleet {
		if time.Since(start) > 10*time.Minute {
			b.Fatalf("%d of %d PDClusters reconciled after 10 minutes", fleetReconciled(b, fleet, ns), benchFleet)
		}
		time.Sleep(100 * time.Millisecond)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	var deps appsv1.DeploymentList
	if err := c.List(context.Background(), &deps, client.InNamespace(ns)); err != nil || len(deps.Items) != 3*benchFleet {
		b.Fatalf("%d Deployments (err %v), want %d", len(deps.Items), err, 3*benchFleet)
	}
	// Late reconciles of the fleet (child watch events) settle before the counts are read.
	settle(&writes)
	heapAfter := heapInUse()
	created := writes.n.Load()

	// A restarted manager reconciles every PDCluster again from a fresh cache: nothing to write.
	stop()
	var resync writeCounter
	stop = startBenchManager(b, &resync)
	time.Sleep(2 * time.Second) // the initial list queues all 1,000; at ~0 writes each they are quick
	settle(&resync)
	stop()

	b.ReportMetric(float64(benchFleet)/elapsed.Seconds(), "PDClusters/s")
	b.ReportMetric(elapsed.Seconds(), "s")
	b.ReportMetric(float64(created)/benchFleet, "writes/PDCluster")
	b.ReportMetric(float64(resync.n.Load()), "resync-writes")
	b.ReportMetric(float64(int64(heapAfter)-int64(heapBefore))/benchFleet, "heap-B/PDCluster")
}

// settle waits until counter has not moved for a second.
func settle(counter *writeCounter) {
	for last := int64(-1); ; time.Sleep(time.Second) {
		n := counter.n.Load()
		if n == last {
			return
		}
		last = n
	}
}

func benchmarkPlainClientFleet(b *testing.B) {
	c := benchClient(b)
	ns := benchNamespace(b, c)
	var writes writeCounter
	wc, err := client.New(writes.wrap(cfg), client.Options{Scheme: scheme})
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	start := time.Now()
	createFleet(b, c, ns)
	b.ReportMetric(time.Since(start).Seconds(), "create-s")
	// What a controller must write per PDCluster, written straight: every rendered child by
	// server-side apply, then the status.
	err = forFleet(func(name string) error { return writeChildrenAndStatus(wc, ns, name) })
	elapsed := time.Since(start)
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(benchFleet)/elapsed.Seconds(), "PDClusters/s")
	b.ReportMetric(elapsed.Seconds(), "s")
	b.ReportMetric(float64(writes.n.Load())/benchFleet, "writes/PDCluster")
}

func writeChildrenAndStatus(c client.Client, ns, name string) error {
	ctx := context.Background()
	var pdc v1alpha1.PDCluster
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &pdc); err != nil {
		return err
	}
	objs, err := render.Render(&pdc, render.DefaultOptions())
	if err != nil {
		return err
	}
	for _, obj := range objs {
		if err := controllerutil.SetControllerReference(&pdc, obj, scheme); err != nil {
			return err
		}
		m, err := render.ToUnstructured(obj)
		if err != nil {
			return err
		}
		u := &unstructured.Unstructured{Object: m}
		if err := c.Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner("bench"), client.ForceOwnership); err != nil {
			return err
		}
	}
	meta.SetStatusCondition(&pdc.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionFalse, Reason: "Progressing", Message: "bench"})
	pdc.Status.ObservedGeneration = pdc.Generation
	return c.Status().Update(ctx, &pdc)
}
