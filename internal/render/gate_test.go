package render_test

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

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
				if fromCM != cm.Name || hash != vllm.Hash() || !requires {
					t.Errorf("%s: volume from %q (want %q), hash %q (want %q), --require-gate %v", role, fromCM, cm.Name, hash, vllm.Hash(), requires)
				}
			}
		})
	}
}
