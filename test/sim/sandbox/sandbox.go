// Package sandbox runs a whole P/D deployment as processes on loopback: per prefill and decode
// engine an engine simulator (its KV transfer engine in-process, as vLLM's) and the connector
// sidecar beside it, and a router in front. Processes that exit
// are restarted with backoff, as a kubelet restarts containers.
package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// Config configures a sandbox.
type Config struct {
	// Listen is the router's address.
	Listen          string
	Prefill, Decode int
	BlockSize       int
	KVBlocks        int
	BlockBytes      int
	Flow            routerconfig.Flow
	Policy          string // kv_load_failure_policy of the decode engines
	StepTime        time.Duration
	// SlowStepTime, if set, is the step time of the first engine of each pool: a slow engine
	// for the load-balancing benchmark.
	SlowStepTime time.Duration
	// Balance is the router's balance (empty: its default).
	Balance string
	// Routing is the router's routing strategy (empty: its default), with the default sizes.
	Routing routerconfig.RoutingStrategy
	// RouterFailure is the router's failure policy.
	RouterFailure routerconfig.FailurePolicy
	SendDelay     time.Duration
	HoldTimeout   time.Duration
	PullTimeout   time.Duration
	// UngatedCompletions starts the decode engines' transfer engines with the seed bug, to
	// demonstrate it.
	UngatedCompletions bool
	// BinDir holds the connector, enginesim and router binaries.
	BinDir string
	// WorkDir receives the sidecars' sockets, the logs and sandbox.json (the State).
	WorkDir string
	Log     logr.Logger
}

// Node is one engine with its sidecar, laid out as in a pod: the sidecar's pod-local socket
// (the gate's heartbeat) and its health, metrics and gate state on a TCP port; the engine's
// OpenAI API and /metrics (its transfer engine's counters) on another, and on prefill its
// bootstrap registry on a third.
type Node struct {
	Engine string `json:"engine"`
	// Sidecar serves /healthz, /readyz, /metrics and /gate.
	Sidecar string `json:"sidecar"`
	// SidecarSocket is the pod-local API (unix:///...).
	SidecarSocket  string `json:"sidecarSocket"`
	Bootstrap      string `json:"bootstrap,omitempty"`
	EnginePID      int    `json:"enginePID"`
	SidecarPID     int    `json:"sidecarPID"`
	EngineRestarts int    `json:"engineRestarts"`
	// KVEvents are the engine's KV events publisher and replay ports (routing KVEvents).
	KVEvents [2]int `json:"kvEvents,omitempty"`
}

// State is written to WorkDir/sandbox.json whenever a process starts.
type State struct {
	Router    string `json:"router"`
	RouterPID int    `json:"routerPID"`
	Prefill   []Node `json:"prefill"`
	Decode    []Node `json:"decode"`
}

// StateFile is where Run writes the State.
func StateFile(workDir string) string { return filepath.Join(workDir, "sandbox.json") }

type proc struct {
	name string
	bin  string
	args []string
	pid  *int
	rest *int
}

// Run starts everything, waits until all of it is healthy, calls ready, and serves until ctx
// ends; then it stops every process.
func Run(ctx context.Context, cfg Config, ready func(State)) error {
	if cfg.Prefill < 1 || cfg.Decode < 1 {
		return fmt.Errorf("need at least one prefill and one decode engine, got %d and %d", cfg.Prefill, cfg.Decode)
	}
	if cfg.BlockSize < 1 || cfg.KVBlocks < 1 || cfg.BlockBytes < 1 {
		return errors.New("block size, KV blocks and block bytes must be positive")
	}
	for _, b := range []string{"connector", "enginesim", "router"} {
		if _, err := os.Stat(filepath.Join(cfg.BinDir, b)); err != nil {
			return fmt.Errorf("binary %s not found in %s (run make build): %w", b, cfg.BinDir, err)
		}
	}
	if err := os.MkdirAll(cfg.WorkDir, 0o755); err != nil {
		return err
	}
	var (
		st    State
		mu    sync.Mutex
		procs []proc
	)
	st.Prefill, st.Decode = make([]Node, cfg.Prefill), make([]Node, cfg.Decode)
	// Not the router's port either: the caller picked it (and let it go) before.
	_, routerPort, _ := net.SplitHostPort(cfg.Listen)
	ports, err := nodePorts(cfg.Prefill+cfg.Decode, func(n int) ([]int, error) {
		all, err := freePorts(n + 1)
		if err != nil {
			return nil, err
		}
		all = slices.DeleteFunc(all, func(p int) bool { return strconv.Itoa(p) == routerPort })
		return all[:n], nil
	})
	if err != nil {
		return err
	}
	addNode := func(role string, i int, n *Node) error {
		p := ports[0]
		ports = ports[1:]
		name := fmt.Sprintf("%s-%d", role, i)
		kvRole := map[string]string{"prefill": "kv_producer", "decode": "kv_consumer"}[role]
		n.Sidecar = fmt.Sprintf("http://127.0.0.1:%d", p[0])
		n.Engine = fmt.Sprintf("http://127.0.0.1:%d", p[1])
		sock := filepath.Join(cfg.WorkDir, name+".sock")
		if len(sock) > 100 { // sun_path holds 108 bytes
			return fmt.Errorf("socket path %s is too long for a Unix socket: use a shorter --work-dir", sock)
		}
		n.SidecarSocket = "unix://" + sock
		sidecarArgs := []string{"--role", kvRole, "--listen", n.SidecarSocket, "--public-listen", fmt.Sprintf("127.0.0.1:%d", p[0])}
		step := cfg.StepTime
		if i == 0 && cfg.SlowStepTime > 0 {
			step = cfg.SlowStepTime
		}
		engineArgs := []string{"--kv-role", kvRole, "--listen", fmt.Sprintf("127.0.0.1:%d", p[1]),
			"--block-size", strconv.Itoa(cfg.BlockSize), "--step-time", step.String(), "--kv-load-failure-policy", cfg.Policy,
			"--kv-blocks", strconv.Itoa(cfg.KVBlocks), "--block-bytes", strconv.Itoa(cfg.BlockBytes)}
		if cfg.Routing == routerconfig.RoutingKVEvents {
			// Every engine publishes on ports of its own: the router is told them by flag.
			n.KVEvents = [2]int{p[3], p[4]}
			ev, _ := json.Marshal(vllm.KVEventsConfig{EnableKVCacheEvents: true, Publisher: "zmq", Topic: vllm.KVEventsTopic,
				Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", p[3]), ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", p[4])})
			engineArgs = append(engineArgs, "--kv-events-config", string(ev))
		}
		if role == "prefill" {
			n.Bootstrap = fmt.Sprintf("http://127.0.0.1:%d", p[2])
			engineArgs = append(engineArgs, "--bootstrap-listen", fmt.Sprintf("127.0.0.1:%d", p[2]), "--send-delay", cfg.SendDelay.String(),
				"--hold-timeout", cfg.HoldTimeout.String(), "--ready-timeout", cfg.HoldTimeout.String(), "--tombstone-ttl", (2 * cfg.HoldTimeout).String())
		} else {
			engineArgs = append(engineArgs, "--pull-timeout", cfg.PullTimeout.String())
			if cfg.UngatedCompletions {
				engineArgs = append(engineArgs, "--unsafe-ungated-completions")
			}
		}
		procs = append(procs,
			proc{name: name + "-sidecar", bin: "connector", args: sidecarArgs, pid: &n.SidecarPID},
			proc{name: name + "-engine", bin: "enginesim", args: engineArgs, pid: &n.EnginePID, rest: &n.EngineRestarts})
		return nil
	}
	for i := range st.Prefill {
		if err := addNode("prefill", i, &st.Prefill[i]); err != nil {
			return err
		}
	}
	for i := range st.Decode {
		if err := addNode("decode", i, &st.Decode[i]); err != nil {
			return err
		}
	}
	st.Router = "http://" + cfg.Listen
	// The router reads router.json as in a cluster; only the pools come by flag: a cluster's
	// router.json names headless Services, and no DNS name lists loopback engines on their own
	// ports.
	routerFile := routerconfig.File{Flow: cfg.Flow, Balance: routerconfig.Balance(cfg.Balance), FailurePolicy: &cfg.RouterFailure}
	if cfg.Routing != "" {
		routerFile.Routing = &routerconfig.Routing{Strategy: cfg.Routing, LoadSlack: 2}
		if cfg.Routing == routerconfig.RoutingKVEvents {
			routerFile.Routing.KVEvents = &routerconfig.KVEventsEndpoints{Port: vllm.KVEventsPort, ReplayPort: vllm.KVEventsReplayPort, Topic: vllm.KVEventsTopic}
		}
	}
	if err := routerFile.Validate(); err != nil {
		return fmt.Errorf("router config: %w", err)
	}
	b, err := json.MarshalIndent(routerFile, "", "  ")
	if err != nil {
		return err
	}
	routerPath := filepath.Join(cfg.WorkDir, routerconfig.FileName)
	if err := os.WriteFile(routerPath, b, 0o644); err != nil {
		return err
	}
	routerArgs := []string{"--listen", cfg.Listen, "--config", routerPath}
	for _, n := range st.Prefill {
		routerArgs = append(routerArgs, "--prefill", n.Engine+","+n.Bootstrap)
	}
	for _, n := range st.Decode {
		routerArgs = append(routerArgs, "--decode", n.Engine)
	}
	for _, n := range append(slices.Clone(st.Prefill), st.Decode...) {
		if n.KVEvents != [2]int{} {
			routerArgs = append(routerArgs, "--kv-events-ports", fmt.Sprintf("%s=%d,%d", n.Engine, n.KVEvents[0], n.KVEvents[1]))
		}
	}
	procs = append(procs, proc{name: "router", bin: "router", args: routerArgs, pid: &st.RouterPID})

	writeState := func() {
		mu.Lock()
		defer mu.Unlock()
		b, _ := json.MarshalIndent(st, "", "  ")
		tmp := StateFile(cfg.WorkDir) + ".tmp"
		if err := os.WriteFile(tmp, b, 0o644); err == nil {
			_ = os.Rename(tmp, StateFile(cfg.WorkDir))
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	for _, p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			supervise(ctx, cfg, p, &mu, writeState)
		}()
	}
	defer wg.Wait()

	if err := waitHealthy(ctx, st); err != nil {
		return fmt.Errorf("sandbox did not become healthy (logs in %s): %w", cfg.WorkDir, err)
	}
	mu.Lock()
	snapshot := st
	mu.Unlock()
	writeState()
	if ready != nil {
		ready(snapshot)
	}
	<-ctx.Done()
	return nil
}

// supervise runs p until ctx ends, restarting it with exponential backoff when it exits.
func supervise(ctx context.Context, cfg Config, p proc, mu *sync.Mutex, changed func()) {
	backoff := 200 * time.Millisecond
	for ctx.Err() == nil {
		logf, err := os.OpenFile(filepath.Join(cfg.WorkDir, p.name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			cfg.Log.Error(err, "open log", "process", p.name)
			return
		}
		cmd := exec.Command(filepath.Join(cfg.BinDir, p.bin), p.args...)
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // never outlive the sandbox
		started := time.Now()
		if err := cmd.Start(); err != nil {
			logf.Close()
			cfg.Log.Error(err, "start", "process", p.name)
			return
		}
		mu.Lock()
		*p.pid = cmd.Process.Pid
		mu.Unlock()
		changed()
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		select {
		case <-ctx.Done():
			_ = cmd.Process.Signal(syscall.SIGTERM)
			var err error
			select {
			case err = <-exited:
			case <-time.After(3 * time.Second):
				_ = cmd.Process.Kill()
				err = <-exited
			}
			logf.Close()
			cfg.Log.V(1).Info("process stopped", "process", p.name, "err", fmt.Sprint(err))
			return
		case err := <-exited:
			logf.Close()
			cfg.Log.Info("process exited; restarting", "process", p.name, "err", fmt.Sprint(err), "backoff", backoff.String())
		}
		if time.Since(started) > 10*time.Second {
			backoff = 200 * time.Millisecond
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 5*time.Second)
		if p.rest != nil {
			mu.Lock()
			*p.rest++
			mu.Unlock()
		}
	}
}

func waitHealthy(ctx context.Context, st State) error {
	var urls []string
	for _, n := range append(append([]Node(nil), st.Prefill...), st.Decode...) {
		urls = append(urls, n.Sidecar+"/readyz", n.Engine+"/health")
	}
	urls = append(urls, st.Router+"/health")
	deadline := time.Now().Add(60 * time.Second)
	for _, u := range urls {
		for {
			resp, err := http.Get(u)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s: not healthy: %v", u, err)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return nil
}

// freePorts reserves n loopback ports by binding them, then releases them for the children.
func freePorts(n int) ([]int, error) { return FreePorts(n) }

// portsPerNode are a node's ports: sidecar, engine, bootstrap, KV events, KV events replay.
const portsPerNode = 5

// nodePorts are portsPerNode ports for each of n nodes, picked in one call: each call's ports
// are free only while it holds them, so ports picked node by node could repeat (a decode
// sidecar was once given a prefill's bootstrap port).
func nodePorts(n int, pick func(int) ([]int, error)) ([][]int, error) {
	all, err := pick(portsPerNode * n)
	if err != nil {
		return nil, err
	}
	out := make([][]int, n)
	for i := range out {
		out[i] = all[portsPerNode*i : portsPerNode*(i+1)]
	}
	return out, nil
}

// FreePorts returns n free loopback ports below the kernel's ephemeral range. A port the
// kernel hands out for ":0" is in that range, where any process's outgoing connection may take
// it between the check and the bind: with kept (keep-alive) connections a sandbox process then
// could not bind it for as long as the connection lived.
func FreePorts(n int) ([]int, error) {
	low := ephemeralLow()
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	out := make([]int, 0, n)
	for tries := 0; len(out) < n; tries++ {
		if tries > 1000 {
			return nil, fmt.Errorf("no free port below %d", low)
		}
		port := 10000 + rand.IntN(low-10000)
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue
		}
		ls = append(ls, l)
		out = append(out, port)
	}
	return out, nil
}

// ephemeralLow is the start of the kernel's ephemeral port range (32768 if unknown).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil && v > 11000 {
				return v
			}
		}
	}
	return 32768
}
