package render_test

import (
	"encoding/json"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

var cmpSorted = cmp.Options{cmpopts.SortSlices(func(a, b string) bool { return a < b }), cmpopts.EquateEmpty()}

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

// Each engine replica asks for tensor*data*pipeline GPUs, an unset factor counting as its default (1).
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
		pdc := load(t, "testdata/mooncake-rdma.yaml")
		pdc.Spec.Decode.Parallelism = tc.p
		c := engineContainer(t, pdc, v1alpha1.RoleDecode)
		if got := c.Resources.Limits[v1alpha1.GPUResourceName]; got.Value() != tc.want {
			t.Errorf("parallelism %+v: GPU limit = %s, want %d", tc.p, got.String(), tc.want)
		}
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
		// The router reads no model name: a new one must not roll it.
		{"served name: the engines only", func(p *v1alpha1.PDCluster) { p.Spec.Model.ServedModelName = "q" }, []string{"qwen3-32b-decode", "qwen3-32b-prefill"}},
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
