package render_test

import (
	"context"
	"encoding/json"
	"flag"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	vllmplugin "pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/router"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/internal/validation"
)

var update = flag.Bool("update", false, "rewrite the golden files")

func load(t *testing.T, path string) *v1alpha1.PDCluster {
	t.Helper()
	l, err := validation.NewLoader()
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	docs, err := l.Read(context.Background(), f)
	if err != nil {
		t.Fatal(err)
	}
	return docs[0].PDCluster
}

// testInputs are the PDClusters of testdata (each beside its .golden.yaml).
func testInputs(t *testing.T) []string {
	t.Helper()
	all, err := filepath.Glob("testdata/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var inputs []string
	for _, in := range all {
		if !strings.HasSuffix(in, ".golden.yaml") {
			inputs = append(inputs, in)
		}
	}
	return inputs
}

// Golden files pin the whole rendered output; `make golden` rewrites them after a deliberate change.
func TestRenderGolden(t *testing.T) {
	for _, in := range testInputs(t) {
		t.Run(filepath.Base(in), func(t *testing.T) {
			objs, err := render.Render(load(t, in), render.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			got, err := render.YAML(objs)
			if err != nil {
				t.Fatal(err)
			}
			golden := strings.TrimSuffix(in, ".yaml") + ".golden.yaml"
			if *update {
				if err := os.WriteFile(golden, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run `make golden` to create it)", err)
			}
			if diff := cmp.Diff(string(want), string(got)); diff != "" {
				t.Errorf("render differs from %s (-want +got):\n%s", golden, diff)
			}
		})
	}
}

func enginePod(t *testing.T, pdc *v1alpha1.PDCluster, role v1alpha1.Role) corev1.PodSpec {
	t.Helper()
	dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
	if err != nil {
		t.Fatal(err)
	}
	return dep.Spec.Template.Spec
}

func engineContainer(t *testing.T, pdc *v1alpha1.PDCluster, role v1alpha1.Role) corev1.Container {
	t.Helper()
	return enginePod(t, pdc, role).Containers[0]
}

func container(t *testing.T, pod corev1.PodSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range pod.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("pod has no container %q", name)
	return corev1.Container{}
}

func mountPaths(c corev1.Container) map[string]string {
	m := map[string]string{}
	for _, v := range c.VolumeMounts {
		m[v.Name] = v.MountPath
	}
	return m
}

// Every engine pod carries the connector sidecar: its pod-local socket (the gate's heartbeat) on
// a small volume it shares with the engine, probed on /readyz and /healthz on its public port.
// It renders nothing of the stand-in's transport: no data port, no KV file (vLLM moves the KV).
func TestConnectorSidecar(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	pdc.Spec.Connector.Health.PeriodSeconds = ptr.To[int32](7)
	for _, tc := range []struct {
		role     v1alpha1.Role
		wantArgs []string
		ports    []string
	}{
		{v1alpha1.RolePrefill, []string{"--role=kv_producer", "--listen=unix:///var/run/pdcluster/agent.sock", "--public-listen=:8190",
			"--bind-address=$(POD_IP)", "--require-gate", "--gate-startup-grace=1200s"}, []string{"connector"}},
		{v1alpha1.RoleDecode, []string{"--role=kv_consumer", "--listen=unix:///var/run/pdcluster/agent.sock", "--public-listen=:8190",
			"--bind-address=$(POD_IP)", "--require-gate", "--gate-startup-grace=1200s"}, []string{"connector"}},
	} {
		t.Run(string(tc.role), func(t *testing.T) {
			pod := enginePod(t, pdc, tc.role)
			c := container(t, pod, v1alpha1.ConnectorContainerName)
			if c.Image != render.DefaultOptions().ConnectorImage {
				t.Errorf("image = %q, want the operator default", c.Image)
			}
			if d := cmp.Diff(tc.wantArgs, c.Args); d != "" {
				t.Errorf("args (-want +got):\n%s", d)
			}
			var ports []string
			for _, p := range c.Ports {
				ports = append(ports, p.Name)
			}
			if d := cmp.Diff(tc.ports, ports); d != "" {
				t.Errorf("ports (-want +got):\n%s", d)
			}
			if got := c.ReadinessProbe; got.HTTPGet.Path != "/readyz" || got.HTTPGet.Port.StrVal != "connector" || got.PeriodSeconds != 7 || got.FailureThreshold != 1 {
				t.Errorf("readiness probe = %+v, want /readyz on connector every 7s, failing at once", got)
			}
			if got := c.LivenessProbe; got.HTTPGet.Path != "/healthz" || got.HTTPGet.Port.StrVal != "connector" {
				t.Errorf("liveness probe = %+v, want /healthz on connector", got)
			}
			engine := container(t, pod, "engine")
			env := map[string]string{}
			for _, e := range engine.Env {
				env[e.Name] = e.Value
			}
			if got := "--listen=" + env["PDCLUSTER_CONNECTOR_URL"]; !contains(c.Args, got) {
				t.Errorf("engine reaches the sidecar at %q, the sidecar listens with %v", env["PDCLUSTER_CONNECTOR_URL"], c.Args)
			}
			if _, ok := env["PDCLUSTER_KV_FILE"]; ok {
				t.Error("engine env sets PDCLUSTER_KV_FILE: a production pod has no KV file")
			}
			// Only the pod's IP, which --bind-address names (cmd/connector checks the other side).
			if len(c.Env) != 1 || c.Env[0].Name != "POD_IP" || c.Env[0].ValueFrom == nil || c.Env[0].ValueFrom.FieldRef.FieldPath != "status.podIP" {
				t.Errorf("sidecar env = %v, want POD_IP from status.podIP only", c.Env)
			}
			if engine.Resources.Limits.Name(v1alpha1.GPUResourceName, "").IsZero() || !c.Resources.Limits.Name(v1alpha1.GPUResourceName, "").IsZero() {
				t.Error("GPUs belong to the engine container only")
			}
			for _, ct := range []corev1.Container{engine, c} {
				if got := mountPaths(ct)["connector-run"]; got != render.ConnectorDir {
					t.Errorf("%s mounts connector-run at %q, want %s", ct.Name, got, render.ConnectorDir)
				}
			}
			var size string
			for _, v := range pod.Volumes {
				if v.Name == "connector-run" {
					size = v.EmptyDir.SizeLimit.String()
				}
			}
			if size != "1Mi" {
				t.Errorf("connector-run volume size = %q, want 1Mi (it holds one socket)", size)
			}
		})
	}
}

func TestPoolImageOverridesEngineImageForThatPoolOnly(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	pdc.Spec.Decode.Image = "vllm/vllm-openai:v0.12.0"
	if got := engineContainer(t, pdc, v1alpha1.RoleDecode).Image; got != "vllm/vllm-openai:v0.12.0" {
		t.Errorf("decode image = %q", got)
	}
	if got := engineContainer(t, pdc, v1alpha1.RolePrefill).Image; got != pdc.Spec.Engine.Image {
		t.Errorf("prefill image = %q, want engine.image %q", got, pdc.Spec.Engine.Image)
	}
}

func TestConnectorImageFromSpecOverridesOperatorDefault(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	pdc.Spec.Connector.Image = "registry.example/connector:dev"
	c := container(t, enginePod(t, pdc, v1alpha1.RoleDecode), v1alpha1.ConnectorContainerName)
	if c.Image != "registry.example/connector:dev" {
		t.Errorf("image = %q", c.Image)
	}
}

// flagValue reads --name value or --name=value from args.
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
		if a == name && i+1 < len(args) {
			return args[i+1], true
		}
	}
	return "", false
}

func TestEngineFlagsPerRole(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	for _, tc := range []struct {
		role   v1alpha1.Role
		kvRole string
	}{{v1alpha1.RolePrefill, "kv_producer"}, {v1alpha1.RoleDecode, "kv_consumer"}} {
		t.Run(string(tc.role), func(t *testing.T) {
			c := engineContainer(t, pdc, tc.role)
			if diff := cmp.Diff([]string{"serve", "Qwen/Qwen3-32B"}, c.Args[:2]); diff != "" {
				t.Errorf("vllm serve <path> (-want +got):\n%s", diff)
			}
			for name, want := range map[string]string{
				"--block-size": "64", "--tensor-parallel-size": "2", "--served-model-name": "qwen3-32b", "--port": "8000",
			} {
				if got, _ := flagValue(c.Args, name); got != want {
					t.Errorf("%s = %q, want %q", name, got, want)
				}
			}
			raw, ok := flagValue(c.Args, "--kv-transfer-config")
			if !ok {
				t.Fatal("no --kv-transfer-config")
			}
			var cfg map[string]any
			if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
				t.Fatal(err)
			}
			want := map[string]any{
				"kv_connector": "GatedMooncakeConnector", "kv_connector_module_path": "pdgate.mooncake",
				"kv_role": tc.kvRole, "kv_buffer_device": "cuda",
				"kv_load_failure_policy": "recompute",
				"kv_connector_extra_config": map[string]any{
					"mooncake_protocol": "rdma", "device_name": "mlx5_0,mlx5_1", "num_workers": float64(10),
				},
			}
			if diff := cmp.Diff(want, cfg); diff != "" {
				t.Errorf("kv-transfer-config (-want +got):\n%s", diff)
			}
			if got := c.Resources.Limits[v1alpha1.GPUResourceName]; got.Value() != 2 {
				t.Errorf("GPU limit = %s, want 2", got.String())
			}
			if got := c.Resources.Requests["rdma/hca"]; got.Value() != 1 {
				t.Errorf("RDMA request = %s, want 1", got.String())
			}
			if diff := cmp.Diff([]corev1.Capability{"IPC_LOCK"}, c.SecurityContext.Capabilities.Add); diff != "" {
				t.Errorf("capabilities (-want +got):\n%s", diff)
			}
		})
	}
}

func TestGPUsAreTensorTimesDataTimesPipeline(t *testing.T) {
	cases := []struct {
		p    v1alpha1.Parallelism
		want int64
	}{
		{v1alpha1.Parallelism{}, 1},
		{v1alpha1.Parallelism{Tensor: ptr.To[int32](8)}, 8},
		{v1alpha1.Parallelism{Tensor: ptr.To[int32](2), Data: ptr.To[int32](4)}, 8},
		{v1alpha1.Parallelism{Tensor: ptr.To[int32](2), Data: ptr.To[int32](2), Pipeline: ptr.To[int32](3)}, 12},
	}
	for _, tc := range cases {
		if got := render.GPUsPerReplica(tc.p); got != tc.want {
			t.Errorf("GPUsPerReplica(%+v) = %d, want %d", tc.p, got, tc.want)
		}
	}
}

func TestTCPRequestsNoRDMA(t *testing.T) {
	pdc := load(t, "testdata/nixl-tcp.yaml")
	c := engineContainer(t, pdc, v1alpha1.RoleDecode)
	if _, ok := c.Resources.Requests["rdma/hca"]; ok {
		t.Errorf("tcp pool requests rdma/hca: %v", c.Resources.Requests)
	}
	if got := c.Resources.Limits[v1alpha1.GPUResourceName]; got.Value() != 8 {
		t.Errorf("GPU limit = %s, want 8 (tensor 2 x data 4)", got.String())
	}
	for _, f := range []string{"--enable-expert-parallel", "--no-enable-prefix-caching", "--max-num-seqs=256"} {
		if !contains(c.Args, f) {
			t.Errorf("decode args %v lack %s", c.Args, f)
		}
	}
	if contains(engineContainer(t, pdc, v1alpha1.RolePrefill).Args, "--max-num-seqs=256") {
		t.Error("decode-only args leaked into prefill")
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func TestExtraConfigMayNotSetOperatorKeys(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	pdc.Spec.KVTransfer.ExtraConfig = &apiextensionsv1.JSON{Raw: []byte(`{"device_name":"mlx5_9"}`)}
	_, err := render.Render(pdc, render.DefaultOptions())
	if err == nil || !strings.Contains(err.Error(), "kvTransfer.extraConfig.device_name is set by the operator from kvTransfer.rdmaDevices") {
		t.Errorf("err = %v, want the reserved-key error", err)
	}
}

// A spec change rolls only the pool it touches: its pod template hash changes, the others' do not.
func TestConfigHashChangesOnlyForTheChangedPool(t *testing.T) {
	hashes := func(pdc *v1alpha1.PDCluster) map[string]string {
		objs, err := render.Render(pdc, render.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, o := range objs {
			if d, ok := o.(*appsv1.Deployment); ok {
				out[d.Name] = d.Spec.Template.Annotations[v1alpha1.AnnotationConfigHash]
			}
		}
		return out
	}
	base := load(t, "testdata/mooncake-rdma.yaml")
	before := hashes(base)
	cases := []struct {
		name    string
		mutate  func(*v1alpha1.PDCluster)
		changed []string
	}{
		{"decode args", func(p *v1alpha1.PDCluster) { p.Spec.Decode.Args = append(p.Spec.Decode.Args, "--max-num-seqs=64") }, []string{"qwen3-32b-decode"}},
		{"prefill replicas only", func(p *v1alpha1.PDCluster) { p.Spec.Prefill.Replicas = ptr.To[int32](5) }, nil},
		{"engine image", func(p *v1alpha1.PDCluster) { p.Spec.Engine.Image = "vllm/vllm-openai:v0.12.0" }, []string{"qwen3-32b-decode", "qwen3-32b-prefill"}},
		{"served name reaches router config", func(p *v1alpha1.PDCluster) { p.Spec.Model.ServedModelName = "q" }, []string{"qwen3-32b-decode", "qwen3-32b-prefill", "qwen3-32b-router"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pdc := base.DeepCopy()
			tc.mutate(pdc)
			var changed []string
			for name, h := range hashes(pdc) {
				if before[name] != h {
					changed = append(changed, name)
				}
			}
			if diff := cmp.Diff(tc.changed, changed, cmpSorted); diff != "" {
				t.Errorf("rolled deployments (-want +got):\n%s", diff)
			}
		})
	}
}

var cmpSorted = cmp.Options{cmpopts.SortSlices(func(a, b string) bool { return a < b }), cmpopts.EquateEmpty()}

func TestRenderIsDeterministic(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	first, err := render.Render(pdc, render.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	a, _ := render.YAML(first)
	for i := 0; i < 20; i++ {
		again, _ := render.Render(pdc, render.DefaultOptions())
		b, _ := render.YAML(again)
		if string(a) != string(b) {
			t.Fatalf("render %d differs from the first", i)
		}
	}
}

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

// The completion gate in a real pod: the plugin's ConfigMap, mounted read-only on the engine's
// PYTHONPATH, the gated class and its module in --kv-transfer-config, a content hash that rolls
// the pods, and a sidecar that requires the gate's heartbeat. Disabled renders the stock class.
func TestCompletionGate(t *testing.T) {
	for _, tc := range []struct {
		in, class, module string
		gate              v1alpha1.CompletionGate
	}{
		{"testdata/mooncake-rdma.yaml", "GatedMooncakeConnector", "pdgate.mooncake", ""},
		{"testdata/nixl-tcp.yaml", "GatedNixlConnector", "pdgate.nixl", v1alpha1.CompletionGateEnabled},
		{"testdata/mooncake-rdma.yaml", "MooncakeConnector", "", v1alpha1.CompletionGateDisabled},
		{"testdata/nixl-tcp.yaml", "NixlConnector", "", v1alpha1.CompletionGateDisabled},
	} {
		t.Run(tc.in+"/"+string(tc.gate), func(t *testing.T) {
			pdc := load(t, tc.in)
			pdc.Spec.KVTransfer.CompletionGate = tc.gate
			enabled := tc.module != ""
			objs, err := render.Render(pdc, render.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			var cm *corev1.ConfigMap
			for _, o := range objs {
				if c, ok := o.(*corev1.ConfigMap); ok && c.Name == render.GateObjectName(pdc.Name) {
					cm = c
				}
			}
			if (cm != nil) != enabled {
				t.Fatalf("gate ConfigMap rendered = %v, want %v", cm != nil, enabled)
			}
			if enabled && (!strings.Contains(cm.Data["mooncake.py"], "GatedMooncakeConnector") || cm.Data["__init__.py"] == "") {
				t.Errorf("gate ConfigMap holds %d files without the plugin", len(cm.Data))
			}
			for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
				dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
				if err != nil {
					t.Fatal(err)
				}
				pod := dep.Spec.Template.Spec
				c := container(t, pod, v1alpha1.EngineContainerName)
				raw, _ := flagValue(c.Args, "--kv-transfer-config")
				var cfg map[string]any
				if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
					t.Fatal(err)
				}
				module, _ := cfg["kv_connector_module_path"].(string)
				if cfg["kv_connector"] != tc.class || module != tc.module {
					t.Errorf("%s: kv_connector %v from %q, want %s from %q", role, cfg["kv_connector"], module, tc.class, tc.module)
				}
				env := map[string]string{}
				for _, e := range c.Env {
					env[e.Name] = e.Value
				}
				mounts := mountPaths(c)
				hash := dep.Spec.Template.Annotations[v1alpha1.AnnotationGateHash]
				sidecar := container(t, pod, v1alpha1.ConnectorContainerName)
				requires := slices.Contains(sidecar.Args, "--require-gate")
				if !enabled {
					if env["PYTHONPATH"] != "" || mounts["completion-gate"] != "" || hash != "" || requires {
						t.Errorf("%s: a disabled gate left PYTHONPATH %q, mount %q, hash %q, --require-gate %v", role, env["PYTHONPATH"], mounts["completion-gate"], hash, requires)
					}
					continue
				}
				// vLLM imports kv_connector_module_path from PYTHONPATH: the mount must be the
				// package directory right under it.
				if env["PYTHONPATH"] != "/opt/pdgate" || mounts["completion-gate"] != env["PYTHONPATH"]+"/"+strings.Split(tc.module, ".")[0] {
					t.Errorf("%s: PYTHONPATH %q, plugin mounted at %q", role, env["PYTHONPATH"], mounts["completion-gate"])
				}
				for _, m := range c.VolumeMounts {
					if m.Name == "completion-gate" && !m.ReadOnly {
						t.Errorf("%s: plugin mounted writable", role)
					}
				}
				var fromCM string
				for _, v := range pod.Volumes {
					if v.Name == "completion-gate" && v.ConfigMap != nil {
						fromCM = v.ConfigMap.Name
					}
				}
				if fromCM != cm.Name || hash != vllmplugin.Hash() || !requires {
					t.Errorf("%s: volume from %q (want %q), hash %q (want %q), --require-gate %v", role, fromCM, cm.Name, hash, vllmplugin.Hash(), requires)
				}
			}
		})
	}
}

// Where the weights come from: the volume, its read-only mount at /models, what vllm serve
// loads, and the Hugging Face cache and token.
func TestModelSources(t *testing.T) {
	for _, tc := range []struct {
		in        string
		wantModel string
		wantMount corev1.VolumeMount
		wantEnv   []corev1.EnvVar
	}{
		{"testdata/model-pvc.yaml", "/models/Qwen3-32B", corev1.VolumeMount{Name: "model", MountPath: "/models", SubPath: "qwen3", ReadOnly: true}, nil},
		{"testdata/model-huggingface.yaml", "meta-llama/Llama-3.1-8B-Instruct", corev1.VolumeMount{Name: "hf-cache", MountPath: "/var/cache/huggingface"},
			[]corev1.EnvVar{{Name: "HF_HOME", Value: "/var/cache/huggingface"}, {Name: "HF_TOKEN", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
				LocalObjectReference: corev1.LocalObjectReference{Name: "hf-token"}, Key: "token"}}}}},
	} {
		t.Run(tc.in, func(t *testing.T) {
			pdc := load(t, tc.in)
			pod := enginePod(t, pdc, v1alpha1.RoleDecode)
			c := pod.Containers[0]
			if c.Args[1] != tc.wantModel {
				t.Errorf("vllm serve %s, want %s", c.Args[1], tc.wantModel)
			}
			var mount *corev1.VolumeMount
			for i := range c.VolumeMounts {
				if c.VolumeMounts[i].Name == tc.wantMount.Name {
					mount = &c.VolumeMounts[i]
				}
			}
			if mount == nil {
				t.Fatalf("no %s mount in %+v", tc.wantMount.Name, c.VolumeMounts)
			}
			if d := cmp.Diff(tc.wantMount, *mount); d != "" {
				t.Errorf("mount (-want +got):\n%s", d)
			}
			var vol *corev1.Volume
			for i := range pod.Volumes {
				if pod.Volumes[i].Name == tc.wantMount.Name {
					vol = &pod.Volumes[i]
				}
			}
			switch {
			case vol == nil:
				t.Fatal("no volume for the mount")
			case vol.PersistentVolumeClaim != nil && (!vol.PersistentVolumeClaim.ReadOnly || vol.PersistentVolumeClaim.ClaimName != "model-store"):
				t.Errorf("weights volume %+v, want model-store read-only", vol.PersistentVolumeClaim)
			case vol.EmptyDir != nil && vol.EmptyDir.SizeLimit.String() != "200Gi":
				t.Errorf("cache emptyDir %+v, want 200Gi", vol.EmptyDir)
			}
			for _, want := range tc.wantEnv {
				if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return cmp.Equal(e, want) }) {
					t.Errorf("env lacks %+v", want)
				}
			}
		})
	}
}

// The router's own scheduling and resources come from spec.router; unset, small defaults.
func TestRouterPodSettings(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	_, dep := renderRouter(t, pdc)
	pod := dep.Spec.Template.Spec
	if got := pod.Containers[0].Resources.Requests.Cpu().String(); got != "2" {
		t.Errorf("router cpu request %s, want 2 from spec.router.resources", got)
	}
	if d := cmp.Diff(map[string]string{"node-role.kubernetes.io/ingress": ""}, pod.NodeSelector); d != "" {
		t.Errorf("nodeSelector (-want +got):\n%s", d)
	}
	if len(pod.Tolerations) != 1 || pod.Tolerations[0].Key != "dedicated" {
		t.Errorf("tolerations %+v", pod.Tolerations)
	}
	pdc.Spec.Router = v1alpha1.RouterSpec{}
	_, dep = renderRouter(t, pdc)
	if got := dep.Spec.Template.Spec.Containers[0].Resources.Requests.Memory().String(); got != "128Mi" {
		t.Errorf("default router memory request %s, want 128Mi", got)
	}
}

// engine.pod and a pool's pod merge as documented, after the operator's own settings.
func TestPodSettingsMerge(t *testing.T) {
	pdc := load(t, "testdata/pod-settings.yaml")
	for _, tc := range []struct {
		role                      v1alpha1.Role
		nccl, priority, sa, sched string
		labels                    map[string]string
	}{
		{v1alpha1.RolePrefill, "WARN", "inference", "", "", map[string]string{"team": "inference"}},
		{v1alpha1.RoleDecode, "INFO", "inference-critical", "decode-engine", "gang-scheduler", map[string]string{"team": "inference", "tier": "decode"}},
	} {
		t.Run(string(tc.role), func(t *testing.T) {
			dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), tc.role)
			if err != nil {
				t.Fatal(err)
			}
			pod := dep.Spec.Template.Spec
			env := map[string]string{}
			for _, e := range pod.Containers[0].Env {
				if _, dup := env[e.Name]; dup {
					t.Errorf("env %s twice", e.Name)
				}
				env[e.Name] = e.Value
			}
			if env["NCCL_DEBUG"] != tc.nccl || env["VLLM_LOGGING_LEVEL"] != "INFO" || pod.Containers[0].Env[0].Name != "POD_IP" {
				t.Errorf("env %v, want NCCL_DEBUG=%s after the operator's own", env, tc.nccl)
			}
			if len(pod.Containers[0].EnvFrom) != 1 || len(pod.ImagePullSecrets) != 1 {
				t.Errorf("envFrom %v, pull secrets %v", pod.Containers[0].EnvFrom, pod.ImagePullSecrets)
			}
			if pod.PriorityClassName != tc.priority || pod.ServiceAccountName != tc.sa || pod.SchedulerName != tc.sched || *pod.TerminationGracePeriodSeconds != 120 {
				t.Errorf("priority %q sa %q scheduler %q grace %d", pod.PriorityClassName, pod.ServiceAccountName, pod.SchedulerName, *pod.TerminationGracePeriodSeconds)
			}
			for k, v := range tc.labels {
				if dep.Spec.Template.Labels[k] != v {
					t.Errorf("pod label %s = %q, want %q", k, dep.Spec.Template.Labels[k], v)
				}
			}
			if d := cmp.Diff(render.Labels(pdc.Name, tc.role), dep.Spec.Selector.MatchLabels); d != "" {
				t.Errorf("selector changed (-want +got):\n%s", d)
			}
			if dep.Spec.Template.Annotations["k8s.v1.cni.cncf.io/networks"] != "rdma-net" || dep.Spec.Template.Annotations[v1alpha1.AnnotationConfigHash] == "" {
				t.Errorf("annotations %v", dep.Spec.Template.Annotations)
			}
			if !slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool { return v.Name == "nccl-topo" && v.ConfigMap != nil }) ||
				!slices.ContainsFunc(pod.Containers[0].VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == "/etc/nccl" }) {
				t.Errorf("the extra volume or its mount is missing: %v / %v", pod.Volumes, pod.Containers[0].VolumeMounts)
			}
			if len(pod.TopologySpreadConstraints) != 1 || (pod.Affinity != nil) != (tc.role == v1alpha1.RoleDecode) {
				t.Errorf("spread %v, affinity %v", pod.TopologySpreadConstraints, pod.Affinity)
			}
			if got := pod.Volumes[0].EmptyDir.SizeLimit.String(); pod.Volumes[0].Name != "dshm" || got != "16Gi" {
				t.Errorf("/dev/shm volume %s limit %s, want 16Gi", pod.Volumes[0].Name, got)
			}
		})
	}
}

// Every environment variable render sets on an engine is one the CRD refuses in pod.env, so a
// user's value can never silently shadow (or be shadowed by) the operator's.
func TestOperatorEnvIsReservedInTheCRD(t *testing.T) {
	crdYAML, err := os.ReadFile("../../config/crd/bases/serving.pdcluster.dev_pdclusters.yaml")
	if err != nil {
		t.Fatal(err)
	}
	crdText := string(crdYAML)
	for _, in := range testInputs(t) {
		pdc := load(t, in)
		pdc.Spec.Engine.Pod, pdc.Spec.Prefill.Pod, pdc.Spec.Decode.Pod = nil, nil, nil
		for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
			for _, e := range engineContainer(t, pdc, role).Env {
				if !strings.Contains(crdText, "'"+e.Name+"'") {
					t.Errorf("%s: render sets %s, which the CRD's pod.env rule does not reserve", in, e.Name)
				}
			}
		}
	}
}

// Env and volume names admission cannot check (see PodSettings) fail the render, naming the
// field: the reconciler reports it as InvalidSpec instead of failing every apply of the pods.
func TestPodSettingsNamesAreCheckedAtRender(t *testing.T) {
	pdc := load(t, "testdata/minimal.yaml")
	pdc.Spec.Decode.Pod = &v1alpha1.PodSettings{
		Env:     []corev1.EnvVar{{Name: "OK", Value: "1"}, {Name: "1BAD", Value: "2"}},
		Volumes: []corev1.Volume{{Name: "Topo"}},
	}
	_, err := render.Render(pdc, render.DefaultOptions())
	for _, want := range []string{`spec.decode.pod.env[1].name: Invalid value: "1BAD"`, `spec.decode.pod.volumes[0].name: Invalid value: "Topo"`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("err = %v, want it to contain %q", err, want)
		}
	}
	pdc.Spec.Decode.Pod = &v1alpha1.PodSettings{Env: []corev1.EnvVar{{Name: "NCCL_DEBUG", Value: "INFO"}}, Volumes: []corev1.Volume{{Name: "topo"}}}
	if _, err := render.Render(pdc, render.DefaultOptions()); err != nil {
		t.Errorf("valid names refused: %v", err)
	}
}

// ToUnstructured goes through JSON for speed: it must give what apimachinery's converter
// gives (the map the reconciler applies), for every object of every test input.
func TestToUnstructuredMatchesTheConverter(t *testing.T) {
	for _, in := range testInputs(t) {
		objs, err := render.Render(load(t, in), render.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		for _, obj := range objs {
			got, err := render.ToUnstructured(obj)
			if err != nil {
				t.Fatal(err)
			}
			want, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
			if err != nil {
				t.Fatal(err)
			}
			unstructured.RemoveNestedField(want, "metadata", "creationTimestamp")
			unstructured.RemoveNestedField(want, "spec", "template", "metadata", "creationTimestamp")
			if status, ok := want["status"].(map[string]any); ok && len(status) == 0 {
				delete(want, "status")
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("%s: %s %s (-converter +ToUnstructured):\n%s", in, obj.GetObjectKind().GroupVersionKind().Kind, obj.GetName(), diff)
			}
		}
	}
}
