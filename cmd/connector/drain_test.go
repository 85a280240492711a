package main

import (
	"bytes"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/connector/sidecar"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// The sidecar's preStop hook, as render writes it, is this command's drain with flags it
// defines, on the socket the sidecar listens on, waiting as long as the pool's drain allows.
func TestAcceptsTheRenderedPreStopHook(t *testing.T) {
	pdc := &v1alpha1.PDCluster{}
	pdc.Name, pdc.Namespace = "c", "ns"
	timeout := int32(300)
	pdc.Spec.Prefill.Drain.TimeoutSeconds = &timeout
	for role, wantTimeout := range map[v1alpha1.Role]time.Duration{v1alpha1.RolePrefill: 315 * time.Second, v1alpha1.RoleDecode: 135 * time.Second} {
		dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range dep.Spec.Template.Spec.Containers {
			if c.Name != v1alpha1.ConnectorContainerName {
				continue
			}
			var listen string
			for _, a := range c.Args {
				if v, ok := strings.CutPrefix(a, "--control-listen="); ok {
					listen = v
				}
			}
			// The control socket is on a volume the sidecar's container mounts and the engine's
			// does not, at any path: nothing in the engine's container can drain the pod.
			dir := filepath.Dir(strings.TrimPrefix(listen, "unix://"))
			var volume string
			for _, m := range c.VolumeMounts {
				if m.MountPath == dir {
					volume = m.Name
				}
			}
			if volume == "" {
				t.Fatalf("%s: the sidecar mounts no volume at the control socket's directory %s", role, dir)
			}
			for _, other := range dep.Spec.Template.Spec.Containers {
				mounted := slices.ContainsFunc(other.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == volume })
				if mounted != (other.Name == c.Name) {
					t.Errorf("%s: container %s mounts the control socket's volume %s: %v, want the sidecar alone", role, other.Name, volume, mounted)
				}
			}
			cmd := c.Lifecycle.PreStop.Exec.Command
			if len(cmd) < 2 || cmd[0] != render.ConnectorBinary || cmd[1] != "drain" {
				t.Fatalf("%s preStop %q: want %s drain", role, cmd, render.ConnectorBinary)
			}
			d, err := parseDrainFlags(cmd[2:])
			if err != nil {
				t.Fatalf("%s preStop %q: %v", role, cmd, err)
			}
			if d.listen != listen || listen == "" || d.min != 15*time.Second || d.timeout != wantTimeout {
				t.Errorf("%s preStop: %+v, want the sidecar's control socket %q, 15s min, %s timeout", role, d, listen, wantTimeout)
			}
			grace := time.Duration(*dep.Spec.Template.Spec.TerminationGracePeriodSeconds) * time.Second
			if grace <= d.timeout {
				t.Errorf("%s: grace period %s does not cover the drain's %s", role, grace, d.timeout)
			}
		}
	}
	for _, bad := range [][]string{{"--min=2s", "--timeout=1s"}, {"--nope"}, {"extra"}} {
		if _, err := parseDrainFlags(bad); err == nil {
			t.Errorf("drain %q accepted", bad)
		}
	}
}

// `connector drain` against a running sidecar on its Unix socket: it waits for the engine's
// held sends and says how the drain ended; with no sidecar it fails, so the kubelet reports a
// failed preStop hook.
func TestDrainCommandAgainstTheSidecar(t *testing.T) {
	dir := t.TempDir()
	sock, ctl := "unix://"+filepath.Join(dir, "agent.sock"), "unix://"+filepath.Join(dir, "ctl.sock")
	s, err := sidecar.New(sidecar.Config{Log: logr.Discard(), DrainPoll: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	for addr, h := range map[string]http.Handler{sock: s.LocalHandler(prometheus.NewRegistry()), ctl: s.ControlHandler()} {
		l, err := localapi.Listen(addr)
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: h}
		go func() { _ = srv.Serve(l) }()
		t.Cleanup(func() { _ = srv.Close() })
	}
	base, hc := localapi.Client(sock, time.Second)
	beat := func(held int) {
		resp, err := hc.Post(base+localapi.PathGate, "application/json", strings.NewReader(`{"connector":"GatedNixlConnector","counts":{},"held_sends":`+string(rune('0'+held))+`}`))
		if err != nil {
			t.Error(err)
			return
		}
		resp.Body.Close()
	}
	beat(2)
	go func() {
		time.Sleep(200 * time.Millisecond)
		beat(0)
	}()
	var out, errOut bytes.Buffer
	start := time.Now()
	if code := drainMain([]string{"--listen=" + sock, "--min=0s", "--timeout=1s"}, &out, &errOut); code != 1 {
		t.Errorf("drain on the engine's pod-local socket: exit %d, want refused (1)", code)
	}
	out.Reset()
	errOut.Reset()
	if code := drainMain([]string{"--listen=" + ctl, "--min=10ms", "--timeout=10s"}, &out, &errOut); code != 0 {
		t.Fatalf("drain exit %d: %s", code, errOut.String())
	}
	if took := time.Since(start); took < 200*time.Millisecond {
		t.Errorf("drain returned after %s, before held sends reached 0", took)
	}
	if !strings.Contains(out.String(), "drained") {
		t.Errorf("drain said %q", out.String())
	}
	missing := "unix://" + filepath.Join(t.TempDir(), "none.sock")
	if code := drainMain([]string{"--listen=" + missing, "--min=0s", "--timeout=1s"}, &out, &errOut); code != 1 || !strings.Contains(errOut.String(), missing) {
		t.Errorf("drain with no sidecar: exit %d, %q", code, errOut.String())
	}
	_ = os.Remove(strings.TrimPrefix(sock, "unix://"))
}
