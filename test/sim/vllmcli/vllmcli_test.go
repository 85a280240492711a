package vllmcli_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/validation"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmcli"
	"pdcluster.dev/pdcluster-operator/test/vllmenv"
)

// mount lays out what the kubelet would put in the engine container from c's volume mounts
// that come from the gate ConfigMap, under root, and returns the container's PYTHONPATH as seen
// from root.
func mount(t *testing.T, root string, c corev1.Container, gateConfigMap string, pod corev1.PodSpec) string {
	t.Helper()
	for _, m := range c.VolumeMounts {
		for _, v := range pod.Volumes {
			if v.Name != m.Name || v.ConfigMap == nil || v.ConfigMap.Name != gateConfigMap {
				continue
			}
			dir := filepath.Join(root, m.MountPath)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			for name, data := range vllm.Files() {
				if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	var parts []string
	for _, e := range c.Env {
		if e.Name == "PYTHONPATH" {
			for p := range strings.SplitSeq(e.Value, ":") {
				parts = append(parts, filepath.Join(root, p))
			}
		}
	}
	return strings.Join(parts, ":")
}

// The other side of render's engine flags: every engine command line render writes for the
// test specs is one vLLM's parser accepts, and its connector class imports from the plugin
// files where the pod mounts them, on the PYTHONPATH the pod sets.
func TestRenderedEngineCommandsParseAndImport(t *testing.T) {
	specs, err := filepath.Glob("../../../internal/render/testdata/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	loader, err := validation.NewLoader()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	var inVLLM []vllmLoad
	mounts := t.TempDir()
	for _, spec := range specs {
		if strings.HasSuffix(spec, ".golden.yaml") {
			continue
		}
		f, err := os.Open(spec)
		if err != nil {
			t.Fatal(err)
		}
		docs, err := loader.Read(context.Background(), f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		pdc := docs[0].PDCluster
		for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
			t.Run(filepath.Base(spec)+"/"+string(role), func(t *testing.T) {
				dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
				if err != nil {
					t.Fatal(err)
				}
				pod := dep.Spec.Template.Spec
				c := pod.Containers[0]
				if d := cmp.Diff([]string{"vllm"}, c.Command); d != "" {
					t.Fatalf("command (-want +got):\n%s", d)
				}
				s, err := vllmcli.Parse(c.Args)
				if err != nil {
					t.Fatalf("vLLM would refuse the rendered command: %v", err)
				}
				if s.KVTransfer == nil || s.KVTransfer.Role != string(render.KVRole(role)) {
					t.Fatalf("kv-transfer-config = %+v, want kv_role %s", s.KVTransfer, render.KVRole(role))
				}
				// Kept until loadInVLLM has run: a subtest's own TempDir goes when it ends.
				pythonPath := mount(t, filepath.Join(mounts, strings.ReplaceAll(t.Name(), "/", "_")), c, render.GateObjectName(pdc.Name), pod)
				conn, err := vllmcli.LoadConnector(s.KVTransfer, pythonPath)
				if err != nil {
					t.Fatalf("vLLM could not load the connector: %v", err)
				}
				if render.GateEnabled(pdc.Spec.KVTransfer) && conn.File == "" {
					t.Errorf("gate enabled but vLLM would load its built-in %s", conn.Class)
				}
				i := slices.Index(c.Args, "--kv-transfer-config")
				if i < 0 || i+1 >= len(c.Args) {
					t.Fatalf("no --kv-transfer-config in %q", c.Args)
				}
				inVLLM = append(inVLLM, vllmLoad{Name: t.Name(), Config: c.Args[i+1], PythonPath: pythonPath, WantGated: render.GateEnabled(pdc.Spec.KVTransfer)})
				n++
			})
		}
	}
	if n < 6 {
		t.Fatalf("checked %d engine commands, want every pool of every test spec", n)
	}
	loadInVLLM(t, inVLLM)
}

// vllmLoad is one rendered engine's connector, to load in the installed vLLM.
type vllmLoad struct {
	Name       string `json:"name"`
	Config     string `json:"config"`
	PythonPath string `json:"pythonPath"`
	WantGated  bool   `json:"wantGated"`
}

// loadInVLLM has each installed vLLM release (vllmenv.Pythons) parse each rendered
// --kv-transfer-config and load its class through its own KVConnectorFactory, with the plugin
// files where the pod mounts them on the rendered PYTHONPATH: a plugin that raises on import,
// or the stock class under the gated name, fails here. One interpreter per release for all
// (importing vLLM takes tens of seconds).
func loadInVLLM(t *testing.T, loads []vllmLoad) {
	t.Helper()
	for _, py := range vllmenv.Pythons(t) {
		t.Run("vLLM "+py.Version, func(t *testing.T) { loadIn(t, py.Path, loads) })
	}
}

// loadIn loads every connector of loads in the vLLM of python. The answer goes through a file
// named on the command line: vLLM logs to stdout (0.30.0 at INFO), so stdout is not ours.
func loadIn(t *testing.T, python string, loads []vllmLoad) {
	t.Helper()
	const script = `
import importlib, json, sys
from pydantic import TypeAdapter
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
out = []
for load in json.load(sys.stdin):
    sys.path[:0] = load["pythonPath"].split(":")
    importlib.invalidate_caches()
    for m in [m for m in sys.modules if m == "pdgate" or m.startswith("pdgate.")]:
        del sys.modules[m]
    try:
        cls = KVConnectorFactory.get_connector_class(TypeAdapter(KVTransferConfig).validate_json(load["config"]))
        gated = cls.update_connector_output.__module__ == "pdgate._vllm" and cls.__module__.startswith("pdgate.")
        out.append({"name": load["name"], "class": cls.__name__, "file": sys.modules[cls.__module__].__file__, "gated": gated})
    except Exception as e:
        out.append({"name": load["name"], "error": f"{type(e).__name__}: {e}"})
    del sys.path[:len(load["pythonPath"].split(":"))]
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
`
	in, err := json.Marshal(loads)
	if err != nil {
		t.Fatal(err)
	}
	answer := filepath.Join(t.TempDir(), "loaded.json")
	cmd := exec.Command(python, "-c", script, answer)
	cmd.Env = append(os.Environ(), "HF_HUB_OFFLINE=1")
	cmd.Stdin = strings.NewReader(string(in))
	output, err := cmd.CombinedOutput() // vLLM's logs: shown only when it fails
	if err != nil {
		t.Fatalf("%s: %v\n%s", python, err, output)
	}
	raw, err := os.ReadFile(answer)
	if err != nil {
		t.Fatalf("%s wrote no answer: %v\n%s", python, err, output)
	}
	var got []struct {
		Name, Class, File, Error string
		Gated                    bool
	}
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatalf("%v: %s", err, raw)
	}
	if len(got) != len(loads) {
		t.Fatalf("vLLM loaded %d connectors, want %d", len(got), len(loads))
	}
	for i, g := range got {
		want := loads[i]
		switch {
		case g.Error != "":
			t.Errorf("%s: vLLM could not load the rendered connector: %s", g.Name, g.Error)
		case g.Gated != want.WantGated:
			t.Errorf("%s: vLLM loaded %s (gated %v), want gated %v", g.Name, g.Class, g.Gated, want.WantGated)
		case want.WantGated && !strings.HasPrefix(g.File, strings.Split(want.PythonPath, ":")[0]):
			t.Errorf("%s: the gated class came from %s, not the mounted plugin on %s", g.Name, g.File, want.PythonPath)
		}
	}
}

func TestParse(t *testing.T) {
	single := vllmcli.Group{DataParallelRPCPort: 29550, NNodes: 1, MasterAddr: "127.0.0.1", MasterPort: 29501}
	for _, tc := range []struct {
		name string
		args []string
		want *vllmcli.Serve
		err  string
	}{
		{"defaults", []string{"serve", "m"}, &vllmcli.Serve{Model: "m", ServedModelName: "m", Host: "0.0.0.0", Port: 8000, BlockSize: 16,
			TensorParallel: 1, DataParallel: 1, PipelineParallel: 1, PrefixCaching: true, Group: single}, ""},
		{"both spellings, short aliases and negation", []string{"serve", "m", "--block_size=64", "-tp", "4", "--data-parallel-size=2",
			"--no-enable-prefix-caching", "--enable-expert-parallel", "--port", "9000", "--served-model-name", "x"},
			&vllmcli.Serve{Model: "m", ServedModelName: "x", Host: "0.0.0.0", Port: 9000, BlockSize: 64, TensorParallel: 4, DataParallel: 2,
				PipelineParallel: 1, ExpertParallel: true, Group: single}, ""},
		{"a hybrid-LB pod: local ranks from its start rank", []string{"serve", "m", "-dp", "4", "--data-parallel-hybrid-lb", "--data-parallel-size-local", "2",
			"--data-parallel-start-rank", "2", "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "1234"},
			&vllmcli.Serve{Model: "m", ServedModelName: "m", Host: "0.0.0.0", Port: 8000, BlockSize: 16, TensorParallel: 1, DataParallel: 4,
				PipelineParallel: 1, PrefixCaching: true, Group: vllmcli.Group{DataParallelLocal: 2, DataParallelStartRank: 2, DataParallelAddress: "10.0.0.1",
					DataParallelRPCPort: 1234, HybridLB: true, NNodes: 1, MasterAddr: "127.0.0.1", MasterPort: 29501}}, ""},
		{"a start rank infers hybrid LB", []string{"serve", "m", "-dp", "4", "--data-parallel-size-local=2", "--data-parallel-start-rank=0"},
			&vllmcli.Serve{Model: "m", ServedModelName: "m", Host: "0.0.0.0", Port: 8000, BlockSize: 16, TensorParallel: 1, DataParallel: 4,
				PipelineParallel: 1, PrefixCaching: true, Group: vllmcli.Group{DataParallelLocal: 2, DataParallelRPCPort: 29550, HybridLB: true,
					NNodes: 1, MasterAddr: "127.0.0.1", MasterPort: 29501}}, ""},
		{"a headless model worker", []string{"serve", "m", "-tp", "8", "-pp", "2", "--distributed-executor-backend", "mp", "-n", "2", "-r", "1",
			"--master-addr", "10.0.0.1", "--master-port", "4321", "--headless"},
			&vllmcli.Serve{Model: "m", ServedModelName: "m", Host: "0.0.0.0", Port: 8000, BlockSize: 16, TensorParallel: 8, DataParallel: 1,
				PipelineParallel: 2, PrefixCaching: true, Group: vllmcli.Group{DataParallelRPCPort: 29550, NNodes: 2, NodeRank: 1,
					MasterAddr: "10.0.0.1", MasterPort: 4321, Headless: true}}, ""},
		{"hybrid LB without local ranks", []string{"serve", "m", "-dp", "4", "--data-parallel-hybrid-lb"}, nil, "requires `--data-parallel-size-local`"},
		{"hybrid LB headless", []string{"serve", "m", "-dp", "4", "--data-parallel-hybrid-lb", "--data-parallel-size-local=2", "--headless"}, nil, "not applicable in headless mode"},
		{"more local ranks than ranks", []string{"serve", "m", "-dp", "2", "--data-parallel-size-local=4"}, nil, "must be between 1 and data_parallel_size (2)"},
		{"nodes that do not divide the world", []string{"serve", "m", "-tp", "3", "--nnodes=2"}, nil, "must evenly divide the total world size (3)"},
		{"a node rank past the nodes", []string{"serve", "m", "-tp", "2", "--nnodes=2", "--node-rank=2"}, nil, "between 0 and 1; got `--node-rank 2`"},
		{"unknown flag", []string{"serve", "m", "--kv-connector", "x"}, nil, "unrecognized arguments: --kv-connector x"},
		{"a second positional", []string{"serve", "m", "n"}, nil, "unrecognized arguments: n"},
		{"no model", []string{"serve", "--port=1"}, nil, "required: model_tag"},
		{"not serve", []string{"bench"}, nil, "only runs `vllm serve`"},
		{"value missing", []string{"serve", "m", "--port"}, nil, "expected one argument"},
		{"bad int", []string{"serve", "m", "--block-size=big"}, nil, "invalid int value"},
		{"bool with a value", []string{"serve", "m", "--enforce-eager=yes"}, nil, "ignored explicit argument"},
		{"bad kv json", []string{"serve", "m", "--kv-transfer-config", "{"}, nil, "invalid loads value"},
		{"bad kv role", []string{"serve", "m", `--kv-transfer-config={"kv_connector":"NixlConnector","kv_role":"prefill"}`}, nil, "kv_role \"prefill\""},
		{"a KV events field vLLM does not define", []string{"serve", "m", `--kv-events-config={"enable_kv_cache_events":true,"port":5557}`}, nil, "invalid loads value"},
		{"an unknown KV events publisher", []string{"serve", "m", `--kv-events-config={"enable_kv_cache_events":true,"publisher":"nats"}`}, nil, "unknown event publisher 'nats'"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := vllmcli.Parse(tc.args)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Errorf("(-want +got):\n%s", d)
			}
		})
	}
}

func TestLoadConnector(t *testing.T) {
	root := t.TempDir()
	pkg := filepath.Join(root, "pdgate")
	if err := os.MkdirAll(pkg, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, data := range vllm.Files() {
		if err := os.WriteFile(filepath.Join(pkg, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	noInit := filepath.Join(t.TempDir(), "pdgate")
	_ = os.MkdirAll(noInit, 0o755)
	_ = os.WriteFile(filepath.Join(noInit, "mooncake.py"), []byte(vllm.Files()["mooncake.py"]), 0o644)
	gated := func(class, module string) *vllmcli.KVTransferConfig {
		return &vllmcli.KVTransferConfig{Connector: class, ModulePath: module, Role: "kv_consumer"}
	}
	for _, tc := range []struct {
		name       string
		kv         *vllmcli.KVTransferConfig
		pythonPath string
		flow       vllmcli.Flow
		err        string
	}{
		{"gated mooncake", gated(vllm.MooncakeClass, vllm.MooncakeModule), "/nowhere:" + root, vllmcli.FlowMooncake, ""},
		{"gated nixl", gated(vllm.NixlClass, vllm.NixlModule), root, vllmcli.FlowNixl, ""},
		{"built-in", &vllmcli.KVTransferConfig{Connector: "NixlConnector"}, "", vllmcli.FlowNixl, ""},
		{"not on PYTHONPATH", gated(vllm.MooncakeClass, vllm.MooncakeModule), "", "", "ModuleNotFoundError: No module named 'pdgate.mooncake'"},
		{"package without __init__.py", gated(vllm.MooncakeClass, vllm.MooncakeModule), filepath.Dir(noInit), "", "ModuleNotFoundError"},
		{"class the module lacks", gated("GatedLMCacheConnector", vllm.MooncakeModule), root, "", "has no attribute 'GatedLMCacheConnector'"},
		{"unknown built-in", &vllmcli.KVTransferConfig{Connector: "FooConnector"}, "", "", "Unsupported connector type"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := vllmcli.LoadConnector(tc.kv, tc.pythonPath)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Flow != tc.flow {
				t.Errorf("flow = %q, want %q", c.Flow, tc.flow)
			}
		})
	}
}

// The other side of `connector launch`: every command line the launcher completes for the
// pods of the rendered multi-node groups (cmd/connector's golden, which vLLM's own parser of
// each tested release reads too) is one the stand-in runs, and it runs there the ranks vLLM
// would: a data-parallel pod its data/nodes with hybrid load balancing, a model worker
// headless.
func TestLaunchedGroupPodsParse(t *testing.T) {
	b, err := os.ReadFile("../../../cmd/connector/testdata/launched.golden.json")
	if err != nil {
		t.Fatal(err)
	}
	var pods []struct {
		Name string   `json:"name"`
		Args []string `json:"args"`
	}
	if err := json.Unmarshal(b, &pods); err != nil {
		t.Fatal(err)
	}
	if len(pods) == 0 {
		t.Fatal("no launched pods in the golden")
	}
	for _, p := range pods {
		t.Run(p.Name, func(t *testing.T) {
			s, err := vllmcli.Parse(p.Args)
			if err != nil {
				t.Fatalf("the stand-in refuses what the launcher runs: %v", err)
			}
			index, _ := strconv.Atoi(p.Name[strings.LastIndex(p.Name, "/")+1:])
			g := s.Group
			if s.DataParallel > 1 {
				local := s.DataParallel / 2
				if !g.HybridLB || s.LocalRanks() != local || g.DataParallelStartRank != index*local || g.DataParallelAddress == "" {
					t.Errorf("group %+v, %d local ranks: want hybrid LB, %d ranks from %d, the leader's address", g, s.LocalRanks(), local, index*local)
				}
				return
			}
			if g.NNodes != 2 || g.NodeRank != index || g.Headless != (index > 0) || g.HybridLB {
				t.Errorf("group %+v: want node %d of 2, headless unless the leader", g, index)
			}
		})
	}
}
