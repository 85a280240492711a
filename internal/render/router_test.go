package render_test

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/router"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// renderRouter is the router's ConfigMap and Deployment for pdc.
func renderRouter(t *testing.T, pdc *v1alpha1.PDCluster) (*corev1.ConfigMap, *appsv1.Deployment) {
	t.Helper()
	cm, err := render.RouterConfigMap(pdc)
	if err != nil {
		t.Fatal(err)
	}
	dep, err := render.RouterDeployment(pdc, render.DefaultOptions(), cm)
	if err != nil {
		t.Fatal(err)
	}
	return cm, dep
}

// The router reads the router.json render writes, from where its Deployment mounts it, and
// probes what the router serves.
func TestRouterReadsTheRenderedConfig(t *testing.T) {
	for _, tc := range []struct {
		in      string
		balance v1alpha1.RouterBalance
		flow    routerconfig.Flow
		want    routerconfig.Balance
	}{
		{"testdata/mooncake-rdma.yaml", "", routerconfig.FlowMooncake, ""},
		{"testdata/nixl-tcp.yaml", v1alpha1.RouterBalanceLeastInFlight, routerconfig.FlowNIXL, ""},
		{"testdata/mooncake-rdma.yaml", v1alpha1.RouterBalanceRoundRobin, routerconfig.FlowMooncake, routerconfig.BalanceRoundRobin},
	} {
		t.Run(tc.in+"/"+string(tc.balance), func(t *testing.T) {
			pdc := load(t, tc.in)
			pdc.Spec.Router.Balance = tc.balance
			cm, dep := renderRouter(t, pdc)
			pod := dep.Spec.Template.Spec
			c := pod.Containers[0]
			var path string
			for _, a := range c.Args {
				if v, ok := strings.CutPrefix(a, "--config="); ok {
					path = v
				}
			}
			mounts := mountPaths(c)
			if path != filepath.Join(mounts["config"], "router.json") || pod.Volumes[0].ConfigMap.Name != cm.Name {
				t.Fatalf("--config=%s, config volume at %q from ConfigMap %q; want router.json of %s", path, mounts["config"], pod.Volumes[0].ConfigMap.Name, cm.Name)
			}
			file := filepath.Join(t.TempDir(), "router.json")
			if err := os.WriteFile(file, []byte(cm.Data["router.json"]), 0o600); err != nil {
				t.Fatal(err)
			}
			fc, err := routerconfig.Load(file)
			if err != nil {
				t.Fatal(err)
			}
			if fc.Flow != tc.flow || fc.Balance != tc.want || fc.PrefillHost != render.ObjectName(pdc.Name, v1alpha1.RolePrefill)+"."+pdc.Namespace+".svc" {
				t.Errorf("router config %+v, want flow %s, balance %q and the prefill Service", fc, tc.flow, tc.want)
			}
			// The router the probes reach answers them (200 once it knows both pools), and
			// readiness is not liveness: an empty pool must not get the router killed.
			r, err := router.New(router.Config{Flow: fc.Flow, Balance: fc.Balance}, logr.Discard(), nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := r.SetPools(router.Pools{Prefill: []router.Prefill{{URL: "http://p:8000", Bootstrap: "http://p:8998"}}, Decode: []string{"http://d:8000"}}); err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(r.Handler(nil))
			defer srv.Close()
			for what, pr := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
				resp, err := http.Get(srv.URL + pr.HTTPGet.Path)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Errorf("%s probe GET %s = %d, want 200", what, pr.HTTPGet.Path, resp.StatusCode)
				}
			}
			if c.ReadinessProbe.HTTPGet.Path == c.LivenessProbe.HTTPGet.Path {
				t.Errorf("readiness and liveness share %s", c.LivenessProbe.HTTPGet.Path)
			}
		})
	}
}
