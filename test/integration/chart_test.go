package integration

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"pdcluster.dev/pdcluster-operator/test/needs"
)

// adminKubeconfig writes a kubeconfig for a cluster-admin of the envtest API server.
func adminKubeconfig(t *testing.T) string {
	t.Helper()
	user, err := testEnv.AddUser(envtest.User{Name: "admin-" + t.Name(), Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, kc, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestHelmChartInstalls installs the chart with the helm built by hack/envtest-assets.sh and
// checks that its ClusterRole is the one controller-gen generates.
func TestHelmChartInstalls(t *testing.T) {
	helm := filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "helm")
	if _, err := os.Stat(helm); err != nil {
		needs.Skip(t, "helm not in KUBEBUILDER_ASSETS: %v", err)
	}
	kubeconfig := adminKubeconfig(t)
	cmd := exec.Command(helm, "install", "ops", filepath.Join("..", "..", "charts", "pdcluster-operator"),
		"--kubeconfig", kubeconfig, "--namespace", "pdcluster-helm", "--create-namespace", "--set", "routerImage=example/router:v1")
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("helm install: %v\n%s", err, out.String())
	}
	// NOTES.txt points at a sample that exists, by its path in the repository.
	if !strings.Contains(out.String(), "kubectl apply -f config/samples/serving_v1alpha1_pdcluster.yaml\n") {
		t.Errorf("helm install's notes do not say how to apply the sample:\n%s", out.String())
	}
	if _, err := os.Stat(filepath.Join("..", "..", "config", "samples", "serving_v1alpha1_pdcluster.yaml")); err != nil {
		t.Errorf("the sample the notes name: %v", err)
	}
	f := newFixture(t)
	var dep appsv1.Deployment
	if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: "pdcluster-helm", Name: "ops-pdcluster-operator"}, &dep); err != nil {
		t.Fatal(err)
	}
	c := dep.Spec.Template.Spec.Containers[0]
	if d := cmp.Diff([]string{"--leader-elect", "--metrics-bind-address=:8080", "--metrics-secure=true", "--health-probe-bind-address=:8081", "--max-concurrent-reconciles=16", "--router-image=example/router:v1"}, c.Args); d != "" {
		t.Errorf("manager args (-want +got):\n%s", d)
	}
	// The manager takes its namespace from POD_NAMESPACE (cmd/manager): the PDClusters'
	// NetworkPolicies admit the sidecars' /gate reads from it.
	wantEnv := []corev1.EnvVar{{Name: "POD_NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "metadata.namespace"}}}}
	if d := cmp.Diff(wantEnv, c.Env); d != "" {
		t.Errorf("manager env (-want +got):\n%s", d)
	}
	var role rbacv1.ClusterRole
	if err := f.c.Get(f.ctx, client.ObjectKey{Name: "ops-pdcluster-operator-manager"}, &role); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "rbac", "role.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var generated rbacv1.ClusterRole
	if err := yaml.Unmarshal(raw, &generated); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(generated.Rules, role.Rules); d != "" {
		t.Errorf("chart ClusterRole differs from config/rbac/role.yaml (-generated +chart):\n%s", d)
	}
}
