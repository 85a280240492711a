package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/yaml"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"

	"pdcluster.dev/pdcluster-operator/test/golden"
)

// launchedPod is one pod's `vllm serve` command line of a rendered LeaderWorkerSet, as
// `connector launch` completes it.
type launchedPod struct {
	Name string   `json:"name"`
	Args []string `json:"args"`
	Env  []string `json:"env"`
}

// renderedGroupSets are the LeaderWorkerSets of render's golden files.
func renderedGroupSets(t *testing.T) []*lwsv1.LeaderWorkerSet {
	t.Helper()
	goldens, err := filepath.Glob("../../internal/render/testdata/*.golden.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var out []*lwsv1.LeaderWorkerSet
	for _, g := range goldens {
		b, err := os.ReadFile(g)
		if err != nil {
			t.Fatal(err)
		}
		dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
		for {
			var raw json.RawMessage
			if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				t.Fatalf("%s: %v", g, err)
			}
			var kind struct{ Kind string }
			if json.Unmarshal(raw, &kind) != nil || kind.Kind != "LeaderWorkerSet" {
				continue
			}
			lws := &lwsv1.LeaderWorkerSet{}
			if err := json.Unmarshal(raw, lws); err != nil {
				t.Fatalf("%s: %v", g, err)
			}
			out = append(out, lws)
		}
	}
	return out
}

// Each pod of each rendered LeaderWorkerSet, with the variables LeaderWorkerSet's pod webhook
// gives it, through this binary's own `launch` parser: the rendered command is one it takes,
// the binary is where the init container installs it, and the command lines it execs go to
// testdata/launched.golden.json, which connector/vllm/tests reads with vLLM's own parser.
func TestLaunchesTheRenderedGroups(t *testing.T) {
	sets := renderedGroupSets(t)
	if len(sets) < 2 {
		t.Fatalf("%d LeaderWorkerSets in render's goldens, want the multi-node samples'", len(sets))
	}
	var pods []launchedPod
	for _, lws := range sets {
		size := int(*lws.Spec.LeaderWorkerTemplate.Size)
		for i := range size {
			tmpl := &lws.Spec.LeaderWorkerTemplate.WorkerTemplate
			if l := lws.Spec.LeaderWorkerTemplate.LeaderTemplate; i == 0 && l != nil {
				tmpl = l
			}
			engine := container(t, tmpl.Spec.Containers, v1alpha1.EngineContainerName)
			init := tmpl.Spec.InitContainers
			if len(init) != 1 || !slices.Equal(init[0].Command, []string{render.ConnectorBinary, "install", engine.Command[0]}) {
				t.Fatalf("%s: the engine runs %s, which no init container installs (%+v)", lws.Name, engine.Command[0], init)
			}
			if engine.Command[1] != "launch" {
				t.Fatalf("%s: engine command %q is not `connector launch`", lws.Name, engine.Command)
			}
			o, err := parseLaunchFlags(append(slices.Clone(engine.Command[2:]), engine.Args...), io.Discard)
			if err != nil {
				t.Fatalf("%s: the binary refuses the rendered command %q: %v", lws.Name, engine.Command, err)
			}
			// What the webhook injects (`<lws>-<group>.<subdomain>.<namespace>`), and the pod IP.
			env := map[string]string{
				"LWS_LEADER_ADDRESS": fmt.Sprintf("%s-0.%s.%s", lws.Name, lws.Name, lws.Namespace),
				"LWS_GROUP_SIZE":     strconv.Itoa(size), "LWS_WORKER_INDEX": strconv.Itoa(i),
				"POD_IP": fmt.Sprintf("10.0.0.%d", 10+i),
			}
			resolve := func(_ context.Context, host string) ([]string, error) {
				if host != env["LWS_LEADER_ADDRESS"] {
					return nil, fmt.Errorf("no such host %s", host)
				}
				return []string{"10.0.0.10"}, nil
			}
			argv, extra, err := launchCommand(context.Background(), o, func(k string) string { return env[k] }, resolve)
			if err != nil {
				t.Fatalf("%s pod %d: %v", lws.Name, i, err)
			}
			if argv[0] != "vllm" {
				t.Fatalf("%s pod %d execs %q, want vllm", lws.Name, i, argv)
			}
			pods = append(pods, launchedPod{Name: fmt.Sprintf("%s/%d", lws.Name, i), Args: argv[1:], Env: extra})
		}
	}
	got, err := json.MarshalIndent(pods, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	golden.Equal(t, filepath.Join("testdata", "launched.golden.json"), append(got, '\n'), "go test ./cmd/connector -run TestLaunchesTheRenderedGroups -update")
}

func container(t *testing.T, cs []corev1.Container, name string) corev1.Container {
	t.Helper()
	for _, c := range cs {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no %s container", name)
	return corev1.Container{}
}
