package pdctl

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const sample = "../../config/samples/serving_v1alpha1_pdcluster.yaml"

func run(stdin string, args ...string) (code int, stdout, stderr string) {
	var out, errb bytes.Buffer
	code = Execute(args, strings.NewReader(stdin), &out, &errb)
	return code, out.String(), errb.String()
}

func TestRenderJSONIsAListOfEveryObject(t *testing.T) {
	code, out, stderr := run("", "render", "-f", sample, "-o", "json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var list struct {
		APIVersion, Kind string
		Items            []struct {
			Kind     string
			Metadata struct{ Name string }
		}
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, it := range list.Items {
		got = append(got, it.Kind+"/"+it.Metadata.Name)
	}
	want := []string{
		"Deployment/qwen3-32b-prefill", "Service/qwen3-32b-prefill",
		"Deployment/qwen3-32b-decode", "Service/qwen3-32b-decode",
		"ConfigMap/qwen3-32b-pdgate", "ConfigMap/qwen3-32b-router", "Deployment/qwen3-32b-router", "Service/qwen3-32b-router",
		"NetworkPolicy/qwen3-32b-prefill", "NetworkPolicy/qwen3-32b-decode", "NetworkPolicy/qwen3-32b-router",
	}
	if list.APIVersion != "v1" || list.Kind != "List" {
		t.Errorf("got %s %s, want v1 List", list.APIVersion, list.Kind)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("items (-want +got):\n%s", diff)
	}
}

func TestRenderYAMLFromStdin(t *testing.T) {
	in := "apiVersion: serving.pdcluster.dev/v1alpha1\nkind: PDCluster\nmetadata: {name: a}\nspec: {model: {path: m}, engine: {image: i}, kvTransfer: {protocol: tcp}}\n"
	code, out, stderr := run(in, "render", "-f", "-")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if n := strings.Count(out, "\n---\n"); n != 10 {
		t.Errorf("%d document separators, want 10 (11 objects)", n)
	}
	if !strings.Contains(out, `"kv_role":"kv_consumer"`) || !strings.Contains(out, `"kv_role":"kv_producer"`) {
		t.Error("output lacks one of the kv roles")
	}
}

// TestRenderExternalPool: pdctl render prints the PoolScale the operator creates for an
// External pool, seeded from spec, and the Deployment at the same count.
func TestRenderExternalPool(t *testing.T) {
	in := "apiVersion: serving.pdcluster.dev/v1alpha1\nkind: PDCluster\nmetadata: {name: a}\nspec: {model: {path: m}, engine: {image: i}, kvTransfer: {protocol: tcp}, " +
		"prefill: {replicas: 9}, decode: {replicas: 2}, scaling: {prefill: {mode: External, maxReplicas: 3}, ratio: {max: \"1\"}}}\n"
	code, out, stderr := run(in, "render", "-f", "-")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{"kind: PoolScale\nmetadata:\n  labels:", "name: a-prefill\n  namespace: default\nspec:\n  replicas: 3\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	// The prefill Deployment runs the seed, 3 (9 within maxReplicas); decode is raised from 2
	// to 3 by ratio max 1.
	if n := strings.Count(out, "  replicas: 3\n"); n != 3 {
		t.Errorf("%d objects at 3 replicas, want 3 (the PoolScale and both engine Deployments):\n%s", n, out)
	}
}

func TestValidate(t *testing.T) {
	const head = "apiVersion: serving.pdcluster.dev/v1alpha1\nkind: PDCluster\nmetadata: {name: a}\nspec: {model: {path: m}, engine: {image: i}, kvTransfer: {protocol: tcp}, "
	const misspelled = head + "prefil: {}}\n"
	cases := []struct {
		name, stdin string
		args        []string
		code        int
		out, err    string
		notErr      string // stderr must not have it
	}{
		{name: "sample is valid", args: []string{"validate", "-f", sample}, code: 0, out: "pdcluster/qwen3-32b (namespace default) is valid"},
		{
			name:  "bad spec names the field",
			stdin: "apiVersion: serving.pdcluster.dev/v1alpha1\nkind: PDCluster\nmetadata: {name: a}\nspec: {model: {path: m}, engine: {image: i, args: [--port=1]}, decode: {replicas: -2}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: "spec.decode.replicas: Invalid value: -2",
		},
		{
			name:  "reserved extraConfig key",
			stdin: "apiVersion: serving.pdcluster.dev/v1alpha1\nkind: PDCluster\nmetadata: {name: a}\nspec: {model: {path: m}, engine: {image: i}, kvTransfer: {protocol: tcp, extraConfig: {mooncake_protocol: rdma}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: "spec.kvTransfer.extraConfig[mooncake_protocol]: Forbidden: set by the operator from spec.kvTransfer.protocol",
		},
		// Core/v1 values the CRD's schema takes and the API server would refuse only in the
		// Deployment: named by the PDCluster field, before anything is applied.
		{
			name:  "toleration effect",
			stdin: head + "decode: {tolerations: [{key: a, operator: Exists}, {key: gpu, operator: Exists, effect: Sometimes}]}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: `spec.decode.tolerations[1].effect: Unsupported value: "Sometimes"`,
		},
		{
			name:  "a mount naming no volume",
			stdin: head + "prefill: {pod: {volumeMounts: [{name: scratch, mountPath: /scratch}]}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: `spec.prefill.pod.volumeMounts[0].name: Not found: "scratch (no volume of that name in spec.engine.pod.volumes or spec.prefill.pod.volumes)"`,
		},
		{
			name:  "negative shmSize",
			stdin: head + "decode: {pod: {shmSize: -1Gi}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: `spec.decode.pod.shmSize: Invalid value: "-1Gi": must be greater than zero`,
		},
		{
			name:  "affinity operator",
			stdin: head + "decode: {pod: {affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: rack, operator: Near, values: [r1]}]}]}}}}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: `spec.decode.pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator: Unsupported value: "Near"`,
		},
		{
			name:  "disruption budget past 100%",
			stdin: head + "decode: {disruptionBudget: {maxUnavailable: 150%}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: `spec.decode.disruptionBudget.maxUnavailable: Invalid value: "150%": must be a percentage between 0% and 100%`,
		},
		// Unknown fields: refused by default, as kubectl apply's strict field validation does.
		{
			name:  "unknown field refused",
			stdin: misspelled,
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: `PDCluster "a": strict decoding error (as kubectl apply; --field-validation=Warn to go on without them): unknown field "spec.prefil"`,
		},
		{
			name:  "unknown field refused by render",
			stdin: misspelled,
			args:  []string{"render", "-f", "-"}, code: 1,
			err: `unknown field "spec.prefil"`,
		},
		{
			name:  "unknown field warns with Warn",
			stdin: misspelled,
			args:  []string{"validate", "-f", "-", "--field-validation=Warn"}, code: 0,
			out: "pdcluster/a (namespace default) is valid", err: `unknown field "spec.prefil" would be dropped`,
		},
		{
			name:  "unknown field dropped silently with Ignore",
			stdin: misspelled,
			args:  []string{"validate", "-f", "-", "--field-validation", "Ignore"}, code: 0,
			out: "pdcluster/a (namespace default) is valid", notErr: "prefil",
		},
		{name: "a field validation kubectl does not have", stdin: misspelled, args: []string{"validate", "-f", "-", "--field-validation=warn"}, code: 1,
			err: `--field-validation must be Strict, Warn or Ignore, not "warn"`},
		{
			name:  "replicas of an External pool warn but pass",
			stdin: head + "prefill: {replicas: 3}, scaling: {prefill: {mode: External}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 0,
			out: "pdcluster/a (namespace default) is valid", err: "warning: default/a: spec.prefill.replicas (3) is ignored: spec.scaling.prefill.mode is External, so PoolScale a-prefill sets the count",
		},
		{
			name:  "a ratio pdctl cannot read",
			stdin: head + "scaling: {ratio: {min: \"2\", max: \"1\"}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: "ratio.min may not exceed ratio.max",
		},
		// The multi-node CEL rules, offline as the API server runs them.
		{
			name:  "data-parallel ranks that do not divide over the pods",
			stdin: head + "decode: {parallelism: {nodes: 2, data: 3}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: "spec.decode.parallelism.nodes: Invalid value: data must be a multiple of nodes", notErr: "no such key",
		},
		{
			name:  "a model sharded over pods that do not divide it",
			stdin: head + "prefill: {parallelism: {nodes: 2, tensor: 3}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: "spec.prefill.parallelism.nodes: Invalid value: with data 1 the model is sharded across the replica's pods: tensor x pipeline must be a multiple of nodes",
		},
		{
			name:  "one data-parallel rank per pod without expert",
			stdin: head + "decode: {parallelism: {nodes: 2, data: 2}}}\n",
			args:  []string{"validate", "-f", "-"}, code: 1,
			err: "spec.decode.parallelism.nodes: Invalid value: with data-parallel ranks across pods each pod runs at least 2 (data >= 2 x nodes), or set expert", notErr: "no such key",
		},
		{
			name:  "one data-parallel rank per pod with expert: a LeaderWorkerSet",
			stdin: head + "decode: {parallelism: {nodes: 2, data: 2, expert: true}}}\n",
			args:  []string{"render", "-f", "-"}, code: 0,
			out: "kind: LeaderWorkerSet",
		},
		{name: "missing file", args: []string{"validate", "-f", "/nonexistent.yaml"}, code: 1, err: "no such file"},
		{name: "missing -f", args: []string{"validate"}, code: 1, err: "-f FILE is required"},
		{name: "bad output format", args: []string{"render", "-f", sample, "-o", "xml"}, code: 1, err: `-o must be yaml or json, not "xml"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, out, stderr := run(tc.stdin, tc.args...)
			if code != tc.code {
				t.Errorf("exit %d, want %d (stderr %q)", code, tc.code, stderr)
			}
			if !strings.Contains(out, tc.out) {
				t.Errorf("stdout %q lacks %q", out, tc.out)
			}
			if !strings.Contains(stderr, tc.err) {
				t.Errorf("stderr %q lacks %q", stderr, tc.err)
			}
			if tc.notErr != "" && strings.Contains(stderr, tc.notErr) {
				t.Errorf("stderr %q has %q", stderr, tc.notErr)
			}
		})
	}
}

// --serving is read strictly: a misspelled field or a missing file is an error naming the flag,
// never a render that silently ignores it.
func TestRenderServingIsReadStrictly(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, content, want string
	}{
		{"unknown field", `{"stpe": {"prefill": 1, "decode": 1}}`, `unknown field "stpe"`},
		{"not JSON", `step: 1`, "--serving"},
		{"missing file", "", "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".json")
			if tc.content != "" {
				if err := os.WriteFile(path, []byte(tc.content), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			code, _, stderr := run("", "render", "-f", sample, "--serving", path)
			if code == 0 || !strings.Contains(stderr, tc.want) {
				t.Errorf("exit %d, stderr %q; want a failure with %q", code, stderr, tc.want)
			}
		})
	}
	// A step renders the update revision's Deployments at its counts.
	step := filepath.Join(dir, "step.json")
	if err := os.WriteFile(step, []byte(`{"step": {"prefill": 3, "decode": 5}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, stderr := run("", "render", "-f", sample, "--serving", step, "-o", "json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{`"name": "qwen3-32b-prefill"`, `"replicas": 3`, `"replicas": 5`} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %s", want)
		}
	}
}
