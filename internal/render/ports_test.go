package render_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// Over every golden file: in each pod, no two containers declare the same port, every port a
// container's process binds is declared on that container, nothing is declared that no process
// binds, and every probe and Service targets a declared port. A port bound twice in one
// network namespace, or bound but undeclared, fails in a real pod and nowhere else.
func TestGoldenPodPorts(t *testing.T) {
	goldens, err := filepath.Glob("testdata/*.golden.yaml")
	if err != nil || len(goldens) == 0 {
		t.Fatalf("no golden files: %v", err)
	}
	for _, golden := range goldens {
		t.Run(filepath.Base(golden), func(t *testing.T) {
			deps, svcs := readGolden(t, golden)
			if len(deps) == 0 {
				t.Fatal("no Deployments in the golden file")
			}
			for _, dep := range deps {
				pod := dep.Spec.Template.Spec
				byPort := map[string]string{} // port/protocol -> container
				names := map[string]int32{}
				for _, c := range pod.Containers {
					for _, p := range c.Ports {
						key := fmt.Sprintf("%d/%s", p.ContainerPort, p.Protocol)
						if other, dup := byPort[key]; dup {
							t.Errorf("%s: port %s declared by both %s and %s", dep.Name, key, other, c.Name)
						}
						byPort[key] = c.Name
						if _, dup := names[p.Name]; dup {
							t.Errorf("%s: port name %q declared twice", dep.Name, p.Name)
						}
						names[p.Name] = p.ContainerPort
					}
					bound := boundPorts(t, c)
					var declared []int32
					for _, p := range c.Ports {
						declared = append(declared, p.ContainerPort)
					}
					slices.Sort(bound)
					slices.Sort(declared)
					if d := cmp.Diff(bound, declared); d != "" {
						t.Errorf("%s/%s: ports the process binds (-) against ports declared (+):\n%s", dep.Name, c.Name, d)
					}
					for what, pr := range map[string]*corev1.Probe{"startup": c.StartupProbe, "readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
						if pr == nil || pr.HTTPGet == nil {
							continue
						}
						if !slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.Name == pr.HTTPGet.Port.StrVal }) {
							t.Errorf("%s/%s: %s probe targets port %q, which the container does not declare", dep.Name, c.Name, what, pr.HTTPGet.Port.String())
						}
					}
				}
				for _, svc := range svcs {
					if !selects(svc.Spec.Selector, dep.Spec.Template.Labels) {
						continue
					}
					for _, sp := range svc.Spec.Ports {
						if _, ok := names[sp.TargetPort.StrVal]; !ok {
							t.Errorf("Service %s port %s targets %q, which pods of %s do not declare", svc.Name, sp.Name, sp.TargetPort.String(), dep.Name)
						}
					}
				}
			}
		})
	}
}

func readGolden(t *testing.T, path string) ([]appsv1.Deployment, []corev1.Service) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var deps []appsv1.Deployment
	var svcs []corev1.Service
	for doc := range bytes.SplitSeq(b, []byte("\n---\n")) {
		var meta struct{ Kind string }
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			t.Fatal(err)
		}
		switch meta.Kind {
		case "Deployment":
			var d appsv1.Deployment
			if err := yaml.UnmarshalStrict(doc, &d); err != nil {
				t.Fatal(err)
			}
			deps = append(deps, d)
		case "Service":
			var s corev1.Service
			if err := yaml.UnmarshalStrict(doc, &s); err != nil {
				t.Fatal(err)
			}
			svcs = append(svcs, s)
		}
	}
	return deps, svcs
}

func selects(selector, labels map[string]string) bool {
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return len(selector) > 0
}

// boundPorts are the TCP ports c's process listens on, read the way the process reads its
// arguments and environment: vLLM's --port, Mooncake's bootstrap server on a kv_producer,
// NIXL's side channel per data-parallel rank; the connector's and router's listen flags.
func boundPorts(t *testing.T, c corev1.Container) []int32 {
	t.Helper()
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	argValue := func(name string) string {
		v, _ := flagValue(c.Args, name)
		return v
	}
	var ports []int32
	switch c.Name {
	case v1alpha1.EngineContainerName:
		ports = append(ports, atoi32(t, argValue("--port")))
		var kv struct {
			Connector string `json:"kv_connector"`
			Role      string `json:"kv_role"`
		}
		if err := json.Unmarshal([]byte(argValue("--kv-transfer-config")), &kv); err != nil {
			t.Fatalf("%s: --kv-transfer-config: %v", c.Name, err)
		}
		switch {
		case strings.Contains(kv.Connector, "Mooncake"):
			if kv.Role == string(vllm.KVProducer) {
				ports = append(ports, atoi32(t, envOr(env, "VLLM_MOONCAKE_BOOTSTRAP_PORT", "8998")))
			}
		case strings.Contains(kv.Connector, "Nixl"):
			base := atoi32(t, envOr(env, "VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
			for rank := range atoi32(t, argValue("--data-parallel-size")) {
				ports = append(ports, base+rank)
			}
		default:
			t.Fatalf("%s: unknown kv_connector %q", c.Name, kv.Connector)
		}
		if raw, ok := flagValue(c.Args, "--kv-events-config"); ok {
			var events struct {
				Endpoint string `json:"endpoint"`
				Replay   string `json:"replay_endpoint"`
			}
			if err := json.Unmarshal([]byte(raw), &events); err != nil {
				t.Fatalf("%s: --kv-events-config: %v", c.Name, err)
			}
			// vLLM's ZmqEventPublisher binds an endpoint with a wildcard and connects to any
			// other; the replay socket always binds. Each data-parallel rank adds its rank to
			// both ports (offset_endpoint_port).
			if !strings.Contains(events.Endpoint, "*") {
				t.Errorf("%s: KV events endpoint %q has no wildcard: vLLM would connect to it, not bind it", c.Name, events.Endpoint)
			}
			for rank := range atoi32(t, argValue("--data-parallel-size")) {
				for _, ep := range []string{events.Endpoint, events.Replay} {
					ports = append(ports, listenPort(t, strings.TrimPrefix(ep, "tcp://"))+rank)
				}
			}
		}
	case v1alpha1.ConnectorContainerName:
		// The sidecar binds nothing else: vLLM's transfer engine moves the KV.
		ports = append(ports, listenPort(t, argValue("--public-listen")))
		if l := argValue("--listen"); !strings.HasPrefix(l, "unix://") {
			ports = append(ports, listenPort(t, l))
		}
	case v1alpha1.RouterContainerName:
		ports = append(ports, listenPort(t, argValue("--listen")), listenPort(t, argValue("--metrics-listen")))
	default:
		t.Fatalf("container %q: the test does not know what it binds", c.Name)
	}
	return ports
}

func envOr(env map[string]string, key, def string) string {
	if v, ok := env[key]; ok {
		return v
	}
	return def
}

func listenPort(t *testing.T, addr string) int32 {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("listen address %q: %v", addr, err)
	}
	return atoi32(t, port)
}

func atoi32(t *testing.T, s string) int32 {
	t.Helper()
	n, err := strconv.ParseInt(s, 10, 32)
	if err != nil {
		t.Fatalf("port %q: %v", s, err)
	}
	return int32(n)
}
