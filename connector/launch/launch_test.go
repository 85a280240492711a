package launch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"pdcluster.dev/pdcluster-operator/test/golden"
)

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestFromEnvAndArgs(t *testing.T) {
	base := map[string]string{"LWS_LEADER_ADDRESS": "eng-0.eng.ns", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2", "POD_IP": "10.0.0.7"}
	cases := []struct {
		name       string
		layout     Layout
		localRanks int
		port       int
		change     map[string]string
		wantArgs   []string
		wantErr    string
	}{
		{name: "data parallel: this pod's ranks start at index x local ranks", layout: LayoutDataParallel, localRanks: 8, port: 29550,
			wantArgs: []string{"--data-parallel-hybrid-lb", "--data-parallel-size-local", "8", "--data-parallel-start-rank", "16",
				"--data-parallel-address", "10.0.0.9", "--data-parallel-rpc-port", "29550"}},
		{name: "model: a worker is headless", layout: LayoutModel, port: 29501,
			wantArgs: []string{"--distributed-executor-backend", "mp", "--nnodes", "4", "--node-rank", "2", "--master-addr", "10.0.0.9", "--master-port", "29501", "--headless"}},
		{name: "model: the leader serves", layout: LayoutModel, port: 29501, change: map[string]string{"LWS_WORKER_INDEX": "0"},
			wantArgs: []string{"--distributed-executor-backend", "mp", "--nnodes", "4", "--node-rank", "0", "--master-addr", "10.0.0.9", "--master-port", "29501"}},
		{name: "no group", layout: LayoutModel, port: 1, change: map[string]string{"LWS_LEADER_ADDRESS": ""}, wantErr: "LWS_LEADER_ADDRESS is empty"},
		{name: "index outside the group", layout: LayoutModel, port: 1, change: map[string]string{"LWS_WORKER_INDEX": "4"}, wantErr: "LWS_WORKER_INDEX 4 is outside the group of 4"},
		{name: "no group size", layout: LayoutModel, port: 1, change: map[string]string{"LWS_GROUP_SIZE": ""}, wantErr: `LWS_GROUP_SIZE ""`},
		{name: "no pod IP", layout: LayoutModel, port: 1, change: map[string]string{"POD_IP": ""}, wantErr: `POD_IP "" is not an IP`},
		{name: "no local ranks", layout: LayoutDataParallel, port: 1, wantErr: "ranks per pod 0"},
		{name: "unknown layout", layout: "pipeline", port: 1, wantErr: `layout "pipeline"`},
		// Checked as given, not after narrowing or multiplying (issue 56).
		{name: "a port past 16 bits", layout: LayoutModel, port: 1<<32 + 29501, wantErr: "port 4294996797: want 1 to 65535"},
		{name: "ranks per pod whose first rank would wrap", layout: LayoutDataParallel, localRanks: 1 << 62, port: 1, wantErr: "ranks per pod 4611686018427387904: want 1 to 65536"},
		{name: "a group past any replica", layout: LayoutModel, port: 1, change: map[string]string{"LWS_GROUP_SIZE": "4611686018427387904"}, wantErr: "LWS_GROUP_SIZE 4611686018427387904: a replica across pods has 2 to 65536"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := map[string]string{}
			for k, v := range base {
				m[k] = v
			}
			for k, v := range tc.change {
				m[k] = v
			}
			g, err := FromEnv(env(m), tc.layout, tc.localRanks, tc.port)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tc.wantArgs, g.Args("10.0.0.9")); d != "" {
				t.Errorf("args (-want +got):\n%s", d)
			}
			if d := cmp.Diff([]string{"VLLM_HOST_IP=10.0.0.7", "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.7"}, g.Env()); d != "" {
				t.Errorf("env (-want +got):\n%s", d)
			}
		})
	}
}

func TestResolveLeader(t *testing.T) {
	ctx := context.Background()
	calls := 0
	late := func(_ context.Context, host string) ([]string, error) {
		if calls++; calls < 3 {
			return nil, errors.New("no such host")
		}
		return []string{"not-an-ip", "10.0.0.9"}, nil
	}
	if ip, err := ResolveLeader(ctx, late, "eng-0.eng.ns", time.Minute, time.Millisecond); err != nil || ip != "10.0.0.9" || calls != 3 {
		t.Errorf("resolving late: %q, %v after %d calls; want 10.0.0.9 on the third", ip, err, calls)
	}
	never := func(context.Context, string) ([]string, error) { return nil, errors.New("no such host") }
	ip, err := ResolveLeader(ctx, never, "eng-0.eng.ns", 20*time.Millisecond, time.Millisecond)
	if err == nil || ip != "" || !strings.Contains(err.Error(), "eng-0.eng.ns did not resolve") || !strings.Contains(err.Error(), "no such host") {
		t.Errorf("never resolving: %q, %v; want an error naming the address and why", ip, err)
	}
	empty := func(context.Context, string) ([]string, error) { return nil, nil }
	if ip, err := ResolveLeader(ctx, empty, "eng-0.eng.ns", 5*time.Millisecond, time.Millisecond); err == nil || ip != "" {
		t.Errorf("resolving to nothing: %q, %v; want an error, never an empty address", ip, err)
	}
	if ip, err := ResolveLeader(ctx, never, "10.0.0.9", time.Second, time.Millisecond); err != nil || ip != "10.0.0.9" {
		t.Errorf("an IP: %q, %v", ip, err)
	}
}

// launchedCommand is one pod's `vllm serve` command line as the launcher completes it.
type launchedCommand struct {
	Name string   `json:"name"`
	Args []string `json:"args"`
}

// TestCommandsGolden writes every pod's command line of two replicas, one per layout, to
// testdata/commands.golden.json, which connector/vllm/tests parses with vLLM's own `vllm
// serve` parser (so a flag vLLM does not define, or a value it refuses, fails there).
func TestCommandsGolden(t *testing.T) {
	var cmds []launchedCommand
	for _, r := range []struct {
		name       string
		layout     Layout
		base       []string
		size       int
		localRanks int
		port       int
	}{
		{"deepseek-dp16-over-2-pods", LayoutDataParallel, []string{"serve", "deepseek-ai/DeepSeek-V3", "--data-parallel-size", "16", "--enable-expert-parallel"}, 2, 8, 29550},
		{"tp8-pp2-over-2-pods", LayoutModel, []string{"serve", "meta-llama/Llama-3.1-405B", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2"}, 2, 0, 29501},
	} {
		for i := range r.size {
			g := Group{Layout: r.layout, Size: r.size, Index: i, Leader: "eng-0.eng.ns", PodIP: "10.0.0.1", LocalRanks: r.localRanks, Port: int32(r.port)}
			if err := g.validate(); err != nil {
				t.Fatal(err)
			}
			cmds = append(cmds, launchedCommand{Name: fmt.Sprintf("%s/pod-%d", r.name, i), Args: append(slices.Clone(r.base), g.Args("10.0.0.9")...)})
		}
	}
	got, err := json.MarshalIndent(cmds, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	golden.Equal(t, filepath.Join("testdata", "commands.golden.json"), append(got, '\n'), "go test ./connector/launch -update")
}
