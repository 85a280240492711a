package controllers

// The fixtures the controllers' unit tests share.

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/managedfields"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// start is the tests' clock at its start.
var start = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

// newFakeClient is a fake client builder over testScheme whose server-side apply deduces every
// object's schema: with client-go's schemas first (the builder's default) it refuses
// NetworkPolicies (".status: field not declared in schema", controller-runtime v0.25.3). The
// envtest suite applies them to a real API server.
func newFakeClient(t *testing.T) *fake.ClientBuilder {
	t.Helper()
	return fake.NewClientBuilder().WithScheme(testScheme(t)).WithTypeConverters(managedfields.NewDeducedTypeConverter())
}

func testScheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := lwsv1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	return s
}

// pdc is a PDCluster with one prefill and two decode replicas and a 30s threshold
// (3 checks of 10s), 60s initial backoff and a budget of 2 rounds an hour.
func pdc() *v1alpha1.PDCluster {
	return wrappers.MakePDCluster("ns", "c").Generation(1).Replicas(1, 2).Health(v1alpha1.ConnectorHealthPolicy{
		PeriodSeconds: ptr.To[int32](10), FailureThreshold: ptr.To[int32](3),
		InitialBackoffSeconds: ptr.To[int32](60), MaxBackoffSeconds: ptr.To[int32](600),
		RestartBudget: ptr.To[int32](2), BudgetWindowSeconds: ptr.To[int32](3600),
	}).Obj()
}

// pod is an engine pod of cluster c whose connector turned unready unreadyFor before start
// (0: ready); newHealthFixture records that the operator saw it then.
func pod(name string, role v1alpha1.Role, unreadyFor time.Duration) *corev1.Pod {
	w := wrappers.MakeEnginePod("ns", name, "c", role, start.Add(-time.Hour))
	if unreadyFor > 0 {
		w.ConnectorUnready(start.Add(-unreadyFor))
	}
	return w.Obj()
}
