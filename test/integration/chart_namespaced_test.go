package integration

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers"
	"pdcluster.dev/pdcluster-operator/test/needs"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// TestHelmChartNamespaced installs the chart's RBAC with watchNamespaces and runs the manager
// as its ServiceAccount, with the cache the --watch-namespaces flag builds: the PDCluster in
// the watched namespace is reconciled with nothing but the chart's Roles, and the account can
// read nothing in a namespace it does not watch. (A manager watching every namespace with
// these Roles is refused its lists and never syncs, so the reconcile below would not happen.)
func TestHelmChartNamespaced(t *testing.T) {
	helm := filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "helm")
	if _, err := os.Stat(helm); err != nil {
		needs.Skip(t, "helm not in KUBEBUILDER_ASSETS: %v", err)
	}
	admin := newFixture(t) // its namespace is the watched one
	ctx := admin.ctx
	watched := admin.ns
	mkns := func(prefix string) string {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix}}
		if err := admin.c.Create(ctx, ns); err != nil {
			t.Fatal(err)
		}
		return ns.Name
	}
	release, other := mkns("ops-"), mkns("other-")

	// Not TestHelmChartInstalls' release name: ClusterRole names are cluster-wide.
	cmd := exec.Command(helm, "template", "nsops", filepath.Join("..", "..", "charts", "pdcluster-operator"),
		"--namespace", release, "--set", "watchNamespaces={"+watched+"}")
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("helm template: %v\n%s", err, stderr.String())
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(&out, 4096)
	var sa string
	for {
		var u unstructured.Unstructured
		if err := dec.Decode(&u.Object); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		switch u.GetKind() {
		case "":
			continue
		case "Deployment", "Service":
			continue // the manager runs in this test instead
		case "ClusterRole":
			// The manager's rules must not be granted cluster-wide in this mode.
			var cr rbacv1.ClusterRole
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &cr); err != nil {
				t.Fatal(err)
			}
			// Cluster-scoped reads only: the metrics' reviews, and nodes' labels to read
			// (spec.scheduling.pairing), never written.
			for _, r := range cr.Rules {
				for _, res := range r.Resources {
					readNodes := res == "nodes" && !slices.ContainsFunc(r.Verbs, func(v string) bool { return v != "get" && v != "list" && v != "watch" })
					if res != "tokenreviews" && res != "subjectaccessreviews" && !readNodes {
						t.Errorf("ClusterRole %s grants %v on %s with watchNamespaces set", cr.Name, r.Verbs, res)
					}
				}
			}
		case "ServiceAccount":
			sa = u.GetName()
		}
		if err := admin.c.Create(ctx, &u); err != nil {
			t.Fatalf("create %s %s: %v", u.GetKind(), u.GetName(), err)
		}
	}
	if sa == "" {
		t.Fatal("the chart rendered no ServiceAccount")
	}

	user, err := testEnv.AddUser(envtest.User{
		Name:   "system:serviceaccount:" + release + ":" + sa,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + release, "system:authenticated"},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	asOperator := user.Config()
	startManager(t, asOperator, ctrl.Options{
		Cache:                   controllers.CacheOptions(watched),
		LeaderElectionID:        "pdcluster-ns-" + watched,
		LeaderElectionNamespace: release,
	})

	pdc := wrappers.MakePDCluster(watched, "team").Obj()
	if err := admin.c.Create(ctx, pdc); err != nil {
		t.Fatal(err)
	}
	// The operator's metrics registry is the process's: leave no series for other tests.
	t.Cleanup(func() {
		if err := admin.c.Delete(ctx, pdc); err != nil {
			t.Error(err)
		}
		eventually(t, "metrics of the deleted PDCluster dropped", func() error {
			if n := metricSeries(t, "pdcluster_ready", map[string]string{"namespace": watched}); n != 0 {
				return fmt.Errorf("%d pdcluster_ready series left for %s", n, watched)
			}
			return nil
		})
	})
	eventually(t, "children of the watched namespace's PDCluster", func() error {
		for _, n := range []string{"team-prefill", "team-decode", "team-router"} {
			if err := admin.c.Get(ctx, client.ObjectKey{Namespace: watched, Name: n}, &appsv1.Deployment{}); err != nil {
				return err
			}
		}
		return nil
	})

	// The operator's account reaches nothing outside the namespaces it watches.
	opc, err := client.New(asOperator, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		what string
		list client.ObjectList
		ns   string
	}{
		{"Deployments in an unwatched namespace", &appsv1.DeploymentList{}, other},
		{"Pods in an unwatched namespace", &corev1.PodList{}, other},
		{"PDClusters in every namespace", &v1alpha1.PDClusterList{}, ""},
	} {
		if err := opc.List(ctx, tc.list, client.InNamespace(tc.ns)); !apierrors.IsForbidden(err) {
			t.Errorf("%s: %v, want forbidden", tc.what, err)
		}
	}
}
