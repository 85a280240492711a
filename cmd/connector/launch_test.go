package main

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// `connector launch` resolves the leader and execs the command with the layout's flags; a
// leader that never resolves fails naming it, before anything is exec'd.
func TestLaunchCommand(t *testing.T) {
	env := map[string]string{"LWS_LEADER_ADDRESS": "eng-0.eng.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "POD_IP": "10.0.0.8"}
	o, err := parseLaunchFlags([]string{"--layout=model", "--port=29501", "--resolve-timeout=50ms", "--", "vllm", "serve", "m", "--tensor-parallel-size", "8"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	resolve := func(context.Context, string) ([]string, error) { return []string{"10.0.0.9"}, nil }
	argv, extra, err := launchCommand(context.Background(), o, func(k string) string { return env[k] }, resolve)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"vllm", "serve", "m", "--tensor-parallel-size", "8", "--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", "1",
		"--master-addr", "10.0.0.9", "--master-port", "29501", "--headless"}
	if d := cmp.Diff(want, argv); d != "" {
		t.Errorf("argv (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]string{"VLLM_HOST_IP=10.0.0.8", "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.8"}, extra); d != "" {
		t.Errorf("env (-want +got):\n%s", d)
	}

	never := func(context.Context, string) ([]string, error) { return nil, errors.New("no such host") }
	start := time.Now()
	if _, _, err := launchCommand(context.Background(), o, func(k string) string { return env[k] }, never); err == nil || !strings.Contains(err.Error(), "eng-0.eng.ns") {
		t.Errorf("a leader that never resolves: %v, want an error naming it", err)
	}
	if time.Since(start) > 10*time.Second {
		t.Error("--resolve-timeout was not applied")
	}
	if _, err := parseLaunchFlags([]string{"--layout=model"}, io.Discard); err == nil {
		t.Error("launch without a command was accepted")
	}
	if code := launchMain([]string{"--no-such-flag"}, io.Discard); code != 2 {
		t.Errorf("an unknown flag exits %d, want 2", code)
	}
}

// The launcher's variables replace the pod's of the same name instead of following them: the
// engine's Python reads the first of duplicate names (CPython's os.environ keeps the first),
// so an appended VLLM_HOST_IP that differed from the pod's would be ignored.
func TestLaunchEnvReplacesThePodsVariables(t *testing.T) {
	got := launchEnv([]string{"PATH=/bin", "VLLM_HOST_IP=10.0.0.9", "HOME=/"}, []string{"VLLM_HOST_IP=10.0.0.10", "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.10"})
	want := []string{"PATH=/bin", "HOME=/", "VLLM_HOST_IP=10.0.0.10", "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.10"}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("environment (-want +got):\n%s", d)
	}
}
