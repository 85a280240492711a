package render_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

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
		{v1alpha1.RolePrefill, []string{"--role=kv_producer", "--listen=unix:///var/run/pdcluster/agent.sock", "--control-listen=unix:///var/run/pdcluster-ctl/ctl.sock", "--public-listen=:8190",
			"--bind-address=$(POD_IP)", "--require-gate", "--gate-startup-grace=1200s", "--engine-metrics-url=http://127.0.0.1:8000/metrics", "--memory-limit=$(PDCLUSTER_MEMORY_LIMIT)"}, []string{"connector"}},
		{v1alpha1.RoleDecode, []string{"--role=kv_consumer", "--listen=unix:///var/run/pdcluster/agent.sock", "--control-listen=unix:///var/run/pdcluster-ctl/ctl.sock", "--public-listen=:8190",
			"--bind-address=$(POD_IP)", "--require-gate", "--gate-startup-grace=1200s", "--engine-metrics-url=http://127.0.0.1:8000/metrics", "--memory-limit=$(PDCLUSTER_MEMORY_LIMIT)"}, []string{"connector"}},
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
			// The URL the sidecar reads is where the engine serves: its --port, on every
			// interface (so loopback too).
			if !contains(engine.Args, "--port") || engine.Args[slices.Index(engine.Args, "--port")+1] != "8000" ||
				engine.Args[slices.Index(engine.Args, "--host")+1] != "0.0.0.0" {
				t.Errorf("engine args %q: want --host 0.0.0.0 --port 8000, where --engine-metrics-url reads", engine.Args)
			}
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
			// Only the pod's IP, which --bind-address names, and the container's memory limit,
			// which --memory-limit reads (cmd/connector checks the other side).
			if len(c.Env) != 2 || c.Env[0].Name != "POD_IP" || c.Env[0].ValueFrom == nil || c.Env[0].ValueFrom.FieldRef.FieldPath != "status.podIP" ||
				c.Env[1].Name != "PDCLUSTER_MEMORY_LIMIT" || c.Env[1].ValueFrom == nil || c.Env[1].ValueFrom.ResourceFieldRef.Resource != "limits.memory" ||
				c.Env[1].ValueFrom.ResourceFieldRef.ContainerName != c.Name {
				t.Errorf("sidecar env = %v, want POD_IP from status.podIP and PDCLUSTER_MEMORY_LIMIT from its own limits.memory", c.Env)
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

func TestConnectorImageFromSpecOverridesOperatorDefault(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	pdc.Spec.Connector.Image = "registry.example/connector:dev"
	c := container(t, enginePod(t, pdc, v1alpha1.RoleDecode), v1alpha1.ConnectorContainerName)
	if c.Image != "registry.example/connector:dev" {
		t.Errorf("image = %q", c.Image)
	}
}

// With verification Disabled the sidecar reads nothing of its engine.
func TestConnectorSidecarWithoutVerification(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	pdc.Spec.KVTransfer.Verification.Mode = v1alpha1.KVVerificationDisabled
	c := container(t, enginePod(t, pdc, v1alpha1.RoleDecode), v1alpha1.ConnectorContainerName)
	for _, a := range c.Args {
		if strings.HasPrefix(a, "--engine-metrics-url") {
			t.Errorf("args %q: want no engine metrics read", c.Args)
		}
	}
}
