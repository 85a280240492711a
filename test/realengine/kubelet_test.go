package realengine

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// The harness runs what render gives, laid out for loopback and nothing else: the rendered
// engine and sidecar arguments with the pod's declared ports renumbered, the mounts under the
// pod's directory and the pod IP as loopback.
func TestPodLayoutOfTheRenderedPrefillPod(t *testing.T) {
	pdc, err := LoadPDCluster(filepath.Join("testdata", "pdcluster.yaml"), "/models-on-node")
	if err != nil {
		t.Fatal(err)
	}
	r, err := Render(pdc)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	ports := map[int32]int{vllm.APIPort: 20000, vllm.MooncakeBootstrapPort: 20001, render.ConnectorPort: 20002}
	l, err := newPodLayout(dir, r.Prefill.Spec.Template.Spec, r.ConfigMaps, ports)
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "root")
	socket := "unix://" + root + "/var/run/pdcluster/agent.sock"
	want := map[string]struct{ args, env []string }{
		"engine": {
			args: []string{"vllm", "serve", root + "/models", "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "20000",
				"--block-size", "64", "--tensor-parallel-size", "1", "--data-parallel-size", "1", "--pipeline-parallel-size", "1",
				"--enable-prefix-caching", "--kv-transfer-config",
				`{"kv_buffer_device":"cpu","kv_connector":"GatedMooncakeConnector","kv_connector_extra_config":{"mooncake_protocol":"tcp"},"kv_connector_module_path":"pdgate.mooncake","kv_load_failure_policy":"fail","kv_role":"kv_producer"}`,
				"--shutdown-timeout", "120", "--load-format=dummy", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len=1024", "--max-num-seqs=4"},
			env: []string{"POD_IP=127.0.0.1", "VLLM_HOST_IP=127.0.0.1", "PDCLUSTER_CONNECTOR_URL=" + socket, "VLLM_MOONCAKE_BOOTSTRAP_PORT=20001",
				"PYTHONPATH=" + root + "/opt/pdgate", "VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "HF_HUB_OFFLINE=1"},
		},
		"connector": {
			args: []string{"--role=kv_producer", "--listen=" + socket, "--control-listen=unix://" + root + "/var/run/pdcluster-ctl/ctl.sock",
				"--public-listen=127.0.0.1:20002", "--bind-address=127.0.0.1",
				"--require-gate", "--engine-metrics-url=http://127.0.0.1:20000/metrics", "--memory-limit=268435456"},
			env: []string{"POD_IP=127.0.0.1", "PDCLUSTER_MEMORY_LIMIT=268435456"}, // its limits.memory, 256Mi
		},
	}
	for _, c := range r.Prefill.Spec.Template.Spec.Containers {
		env, vars, err := l.env(c)
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(want[c.Name].args, l.args(c, vars)); diff != "" {
			t.Errorf("%s args (-want +got):\n%s", c.Name, diff)
		}
		if diff := cmp.Diff(want[c.Name].env, env); diff != "" {
			t.Errorf("%s env (-want +got):\n%s", c.Name, diff)
		}
	}
	// The plugin is the rendered ConfigMap's files, where PYTHONPATH finds the package, and
	// the model is the hostPath.
	if _, err := filepath.EvalSymlinks(filepath.Join(root, "opt", "pdgate", "pdgate", "mooncake.py")); err != nil {
		t.Errorf("the completion gate ConfigMap is not mounted under PYTHONPATH: %v", err)
	}
	if got, err := os.Readlink(filepath.Join(root, "models")); err != nil || got != "/models-on-node" {
		t.Errorf("/models links to %q (%v), want the hostPath", got, err)
	}
}
