package main

import (
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/google/go-cmp/cmp"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/agent"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// The operator starts this command with the arguments render puts in the sidecar; every one
// must be a flag it defines, and the local API must be the one the engine is told to use.
func TestAcceptsTheRenderedSidecarArguments(t *testing.T) {
	pdc := &v1alpha1.PDCluster{}
	pdc.Name, pdc.Namespace = "c", "ns"
	grace := int32(1200)
	pdc.Spec.Connector.Health.GateStartupGraceSeconds = &grace
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range dep.Spec.Template.Spec.Containers {
			if c.Name != v1alpha1.ConnectorContainerName {
				continue
			}
			cfg, o, err := parseFlags(c.Args)
			if err != nil {
				t.Fatalf("%s sidecar args %v: %v", role, c.Args, err)
			}
			// The gate is on by default, and the sidecar beside a gated engine requires it.
			if !cfg.Gate.Required {
				t.Errorf("%s sidecar args %v: the agent does not require the completion gate", role, c.Args)
			}
			if cfg.Gate.StartupGrace != 1200*time.Second {
				t.Errorf("%s sidecar args %v: gate start-up grace %s, want spec.connector.health.gateStartupGraceSeconds (1200s)", role, c.Args, cfg.Gate.StartupGrace)
			}
			if o.listen != render.ConnectorSocket || o.kvPath == "" || o.blocks <= 0 {
				t.Errorf("%s sidecar: listen %q, kv file %q, %d blocks", role, o.listen, o.kvPath, o.blocks)
			}
		}
	}
	if _, _, err := parseFlags([]string{"--no-such-flag"}); err == nil {
		t.Error("an unknown flag was accepted")
	}
}

// The gate flags reach the agent's config.
func TestGateFlags(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want agent.GateConfig
	}{
		{"defaults", nil, agent.GateConfig{Required: false, StartupGrace: 15 * time.Minute, HeartbeatTimeout: 30 * time.Second}},
		{"required", []string{"--require-gate"}, agent.GateConfig{Required: true, StartupGrace: 15 * time.Minute, HeartbeatTimeout: 30 * time.Second}},
		{"all set", []string{"--require-gate=true", "--gate-startup-grace=3m", "--gate-heartbeat-timeout=45s"},
			agent.GateConfig{Required: true, StartupGrace: 3 * time.Minute, HeartbeatTimeout: 45 * time.Second}},
		{"not required, timings set", []string{"--require-gate=false", "--gate-startup-grace=90s", "--gate-heartbeat-timeout=1m"},
			agent.GateConfig{Required: false, StartupGrace: 90 * time.Second, HeartbeatTimeout: time.Minute}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg, _, err := parseFlags(tc.args)
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tc.want, cfg.Gate); d != "" {
				t.Errorf("parseFlags(%q).Gate (-want +got):\n%s", tc.args, d)
			}
		})
	}
}

// The agent logs through the logger main builds (it once had none, so it logged nothing after
// its start line).
func TestAgentLogsThroughMainsLogger(t *testing.T) {
	var lines []string
	log := funcr.New(func(prefix, args string) { lines = append(lines, args) }, funcr.Options{})
	cfg := withRun(agent.Config{}, options{role: "kv_consumer"}, nil, log)
	cfg.Log.Info("refused a pull", "why", "test")
	if len(lines) != 1 || !strings.Contains(lines[0], "refused a pull") {
		t.Fatalf("agent log lines %q, want the agent's message", lines)
	}
}
