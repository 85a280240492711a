package main

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/connector/sidecar"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// The operator starts this command with the arguments render puts in the sidecar; every one
// must be a flag it defines, and the local API must be the one the engine is told to use.
func TestAcceptsTheRenderedSidecarArguments(t *testing.T) {
	pdc := &v1alpha1.PDCluster{}
	pdc.Name, pdc.Namespace = "c", "ns"
	grace := int32(1200)
	pdc.Spec.Connector.Health.GateStartupGraceSeconds = &grace
	// Prefill runs two data-parallel ranks, so two gates; decode the default one.
	dp := int32(2)
	pdc.Spec.Prefill.Parallelism.Data = &dp
	wantRanks := map[v1alpha1.Role]int{v1alpha1.RolePrefill: 2, v1alpha1.RoleDecode: 1}
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range dep.Spec.Template.Spec.Containers {
			if c.Name != v1alpha1.ConnectorContainerName {
				continue
			}
			// The kubelet expands $(POD_IP) from the container's downward-API env.
			podIP := map[v1alpha1.Role]string{v1alpha1.RolePrefill: "10.244.0.7", v1alpha1.RoleDecode: "fd00:10:244::7"}[role]
			args := wrappers.ContainerArgs(t, c, podIP)
			cfg, o, err := parseFlags(args)
			if err != nil {
				t.Fatalf("%s sidecar args %v: %v", role, args, err)
			}
			// The gate is on by default, and the sidecar beside a gated engine requires it.
			if !cfg.Gate.Required {
				t.Errorf("%s sidecar args %v: the sidecar does not require the completion gate", role, c.Args)
			}
			if cfg.Gate.StartupGrace != 1200*time.Second {
				t.Errorf("%s sidecar args %v: gate start-up grace %s, want spec.connector.health.gateStartupGraceSeconds (1200s)", role, c.Args, cfg.Gate.StartupGrace)
			}
			if cfg.Gate.Ranks != wantRanks[role] {
				t.Errorf("%s sidecar args %v: waits for %d gates, want one per data-parallel rank (%d)", role, c.Args, cfg.Gate.Ranks, wantRanks[role])
			}
			// It reads its engine's counts where render says the engine serves (both sides:
			// internal/render's sidecar test checks the engine's --host and --port).
			if cfg.Engine.MetricsURL != render.EngineMetricsURL {
				t.Errorf("%s sidecar args %v: engine metrics URL %q, want %q", role, c.Args, cfg.Engine.MetricsURL, render.EngineMetricsURL)
			}
			// Its Go heap follows the container's memory limit (the default, 256Mi).
			if want := c.Resources.Limits.Memory().Value(); o.memoryLimit != want || want != 256<<20 {
				t.Errorf("%s sidecar: --memory-limit %d, want the container's limit %d (256Mi)", role, o.memoryLimit, want)
			}
			// The public port on the pod's IP only (IPv6 included).
			wantPublic := net.JoinHostPort(podIP, strconv.Itoa(int(render.ConnectorPort)))
			if o.listen != render.ConnectorSocket || o.publicListen != wantPublic {
				t.Errorf("%s sidecar: listen %q, public %q, want %q and %s", role, o.listen, o.publicListen, render.ConnectorSocket, wantPublic)
			}
		}
	}
	for _, bad := range [][]string{{"--no-such-flag"}, {"--gate-ranks=0"}} {
		if _, _, err := parseFlags(bad); err == nil {
			t.Errorf("%v was accepted", bad)
		}
	}
}

// The gate flags reach the agent's config.
func TestGateFlags(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want sidecar.GateConfig
	}{
		{"defaults", nil, sidecar.GateConfig{Required: false, StartupGrace: 15 * time.Minute, HeartbeatTimeout: 30 * time.Second, Ranks: 1}},
		{"required", []string{"--require-gate"}, sidecar.GateConfig{Required: true, StartupGrace: 15 * time.Minute, HeartbeatTimeout: 30 * time.Second, Ranks: 1}},
		{"all set", []string{"--require-gate=true", "--gate-startup-grace=3m", "--gate-heartbeat-timeout=45s"},
			sidecar.GateConfig{Required: true, StartupGrace: 3 * time.Minute, HeartbeatTimeout: 45 * time.Second, Ranks: 1}},
		{"two data-parallel ranks", []string{"--require-gate", "--gate-ranks=2"}, sidecar.GateConfig{Required: true, StartupGrace: 15 * time.Minute, HeartbeatTimeout: 30 * time.Second, Ranks: 2}},
		{"not required, timings set", []string{"--require-gate=false", "--gate-startup-grace=90s", "--gate-heartbeat-timeout=1m"},
			sidecar.GateConfig{Required: false, StartupGrace: 90 * time.Second, HeartbeatTimeout: time.Minute, Ranks: 1}},
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

// The sidecar logs through the logger main builds: its refusals reach the container's log.
func TestSidecarLogsThroughMainsLogger(t *testing.T) {
	var lines []string
	log := funcr.New(func(prefix, args string) { lines = append(lines, args) }, funcr.Options{})
	s, err := sidecar.New(sidecar.Config{Log: log})
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	s.LocalHandler(prometheus.NewRegistry()).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, localapi.PathGate, strings.NewReader("{")))
	if len(lines) != 1 || !strings.Contains(lines[0], "refused a request") {
		t.Fatalf("sidecar log lines %q, want its refusal", lines)
	}
}

// --bind-address replaces the host of --public-listen; anything but an IP is refused.
func TestBindAddress(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		want    string
		wantErr bool
	}{
		{args: []string{"--public-listen=:8190"}, want: ":8190"},
		{args: []string{"--public-listen=:8190", "--bind-address=10.0.0.3"}, want: "10.0.0.3:8190"},
		{args: []string{"--public-listen=0.0.0.0:8190", "--bind-address=fd00::3"}, want: "[fd00::3]:8190"},
		{args: []string{"--public-listen=:8190", "--bind-address=$(POD_IP)"}, wantErr: true}, // not expanded
		{args: []string{"--public-listen=8190", "--bind-address=10.0.0.3"}, wantErr: true},
	} {
		_, o, err := parseFlags(tc.args)
		if (err != nil) != tc.wantErr {
			t.Fatalf("%v: error %v, want error %v", tc.args, err, tc.wantErr)
		}
		if err == nil && o.publicListen != tc.want {
			t.Errorf("%v: public listen %q, want %q", tc.args, o.publicListen, tc.want)
		}
	}
}
