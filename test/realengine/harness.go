package realengine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
)

// Env names the tested vLLM releases' interpreters for the harness: "0.30.0=/path/bin/python
// 0.32.0=/path/bin/python" (make test sets it from hack/vllm-venv.sh --cpu).
const Env = "PDCLUSTER_VLLM_ENGINES"

// Release is one installed vLLM CPU build.
type Release struct {
	Version string
	// Bin is its environment's bin directory, holding vllm and python.
	Bin string
}

// Releases reads Env.
func Releases() ([]Release, error) {
	raw := strings.Fields(os.Getenv(Env))
	if len(raw) == 0 {
		return nil, fmt.Errorf("%s is not set: run make test (or set it to \"0.30.0=$(hack/vllm-venv.sh --cpu 0.30.0) ...\")", Env)
	}
	var out []Release
	for _, r := range raw {
		v, python, ok := strings.Cut(r, "=")
		if !ok {
			return nil, fmt.Errorf("%s: %q is not VERSION=PYTHON", Env, r)
		}
		out = append(out, Release{Version: v, Bin: filepath.Dir(python)})
	}
	return out, nil
}

// Options are where the harness finds what it runs.
type Options struct {
	Release Release
	// BinDir holds the project's binaries (make build): connector, router.
	BinDir string
	// Shim is a directory put first on the engines' PYTHONPATH (testdata/shim).
	Shim string
	// WorkDir receives each pod's volumes, sockets and logs. Unix socket paths are short:
	// keep it short.
	WorkDir string
}

// Process is one container's process.
type Process struct {
	Name string
	Args []string
	Log  string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// Exited says whether the process has exited, and how.
func (p *Process) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// Stop ends the process: SIGTERM, then SIGKILL after grace.
func (p *Process) Stop(grace time.Duration) {
	if exited, _ := p.Exited(); exited {
		return
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

// Kill ends the process and its children at once, as a crashed container.
func (p *Process) Kill() {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
}

// Tail is the end of the process's log.
func (p *Process) Tail(n int) string {
	b, _ := os.ReadFile(p.Log)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

func start(name, dir string, args, env []string) (*Process, error) {
	log := filepath.Join(dir, name+".log")
	// Appended to: a restarted container's log follows the one before.
	f, err := os.OpenFile(log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env, cmd.Stdout, cmd.Stderr, cmd.Dir = env, f, f, dir
	// Its own process group, so a stop reaches vLLM's engine-core children; never outlive the
	// test.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s (%s): %w", name, args[0], err)
	}
	p := &Process{Name: name, Args: args, Log: log, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

// Pod is one rendered engine pod on loopback: vLLM and the connector sidecar.
type Pod struct {
	Name string
	// Engine is vLLM's OpenAI server and /metrics; Bootstrap its Mooncake bootstrap server
	// (prefill only); Sidecar the connector's public port (/readyz, /metrics, /gate).
	Engine, Bootstrap, Sidecar string
	// KVEvents are its KV events publisher and replay ports (routing.strategy KVEvents),
	// renumbered as the pod's other ports are; 0 without.
	KVEvents, KVReplay      int
	EngineProc, SidecarProc *Process
	dir                     string
}

// RestartEngine starts the engine container again with the same command and environment, as
// the kubelet restarts a container that exited: the old process is killed first if it still
// runs (a dead EngineCore can leave its API server up).
func (p *Pod) RestartEngine() error {
	p.EngineProc.Kill()
	next, err := start(p.EngineProc.Name, p.dir, p.EngineProc.Args, p.EngineProc.cmd.Env)
	if err != nil {
		return err
	}
	p.EngineProc = next
	return nil
}

// Stop stops both containers.
func (p *Pod) Stop() {
	p.SidecarProc.Stop(5 * time.Second)
	p.EngineProc.Stop(20 * time.Second)
}

// StartPod runs the engine Deployment dep's pod template on loopback with the ConfigMaps its
// volumes name: the engine container's command, args and environment as rendered (vllm from
// the release, $(POD_IP) and the declared ports laid out for loopback), with the test shim on
// PYTHONPATH, and the connector container as the connector binary with its rendered args.
func StartPod(o Options, name string, dep *appsv1.Deployment, configMaps map[string]*corev1.ConfigMap) (*Pod, error) {
	spec := dep.Spec.Template.Spec
	dir := filepath.Join(o.WorkDir, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	ports := map[int32]int{}
	for _, c := range spec.Containers {
		for _, p := range c.Ports {
			ports[p.ContainerPort] = 0
		}
	}
	free, err := sandbox.FreePorts(len(ports))
	if err != nil {
		return nil, err
	}
	for p := range ports {
		ports[p], free = free[0], free[1:]
	}
	l, err := newPodLayout(dir, spec, configMaps, ports)
	if err != nil {
		return nil, fmt.Errorf("pod %s: %w", name, err)
	}
	pod := &Pod{Name: name, dir: dir}
	for _, c := range spec.Containers {
		env, vars, err := l.env(c)
		if err != nil {
			return nil, fmt.Errorf("pod %s: %w", name, err)
		}
		args := l.args(c, vars)
		switch c.Name {
		case v1alpha1.EngineContainerName:
			if len(args) == 0 || args[0] != "vllm" {
				return nil, fmt.Errorf("pod %s: engine command %q is not vllm", name, args)
			}
			args[0] = filepath.Join(o.Release.Bin, "vllm")
			env = engineEnv(o, env, vars)
			pod.Engine = fmt.Sprintf("http://%s:%d", podIP, ports[vllm.APIPort])
			if p, ok := ports[vllm.MooncakeBootstrapPort]; ok {
				pod.Bootstrap = fmt.Sprintf("http://%s:%d", podIP, p)
			}
			pod.KVEvents, pod.KVReplay = ports[vllm.KVEventsPort], ports[vllm.KVEventsReplayPort]
			if pod.EngineProc, err = start(name+"-engine", dir, args, env); err != nil {
				return nil, err
			}
		case v1alpha1.ConnectorContainerName:
			// The image's entrypoint is the connector binary.
			args = append([]string{filepath.Join(o.BinDir, "connector")}, args...)
			pod.Sidecar = fmt.Sprintf("http://%s:%d", podIP, ports[render.ConnectorPort])
			if pod.SidecarProc, err = start(name+"-connector", dir, args, append(env, "PATH="+os.Getenv("PATH"))); err != nil {
				return nil, err
			}
		default:
			return nil, fmt.Errorf("pod %s: container %s does not run on loopback", name, c.Name)
		}
	}
	if pod.EngineProc == nil || pod.SidecarProc == nil {
		return nil, fmt.Errorf("pod %s: rendered without an engine or a connector container", name)
	}
	return pod, nil
}

// engineEnv adds what a pod's engine has without the render saying so: its image's PATH and
// HOME, the pod's one address as vLLM's host IP (vLLM otherwise picks the machine's outward
// interface, which in a pod is the pod IP), and the test shim ahead of the rendered PYTHONPATH.
func engineEnv(o Options, env []string, vars map[string]string) []string {
	python := o.Shim
	if p := vars["PYTHONPATH"]; p != "" {
		python += ":" + p
	}
	out := make([]string, 0, len(env)+4)
	for _, e := range env {
		if !strings.HasPrefix(e, "PYTHONPATH=") {
			out = append(out, e)
		}
	}
	// VLLM_HOST_IP comes from the rendered pod ($(POD_IP), laid out as loopback): the address
	// vLLM registers at its bootstrap server, which the router checks is the pod's.
	return append(out, "PYTHONPATH="+python, "PATH="+o.Release.Bin+":"+os.Getenv("PATH"),
		"HOME="+os.Getenv("HOME"))
}

// Router is the rendered router on loopback: URL its clients' port, MetricsURL its metrics
// port (/metrics, /canary, /pairs, /routing).
type Router struct {
	URL, MetricsURL string
	Proc            *Process
}

// StartRouter runs the router Deployment's container with its rendered args and router.json,
// the pools given as the engines' loopback addresses: router.json names headless Services,
// and no DNS name lists loopback engines on ports of their own.
func StartRouter(o Options, name string, dep *appsv1.Deployment, cm *corev1.ConfigMap, prefill, decode []*Pod) (*Router, error) {
	dir := filepath.Join(o.WorkDir, name)
	var file routerconfig.File
	if err := json.Unmarshal([]byte(cm.Data[routerconfig.FileName]), &file); err != nil {
		return nil, fmt.Errorf("rendered %s: %w", routerconfig.FileName, err)
	}
	file.PrefillHost, file.DecodeHost, file.EnginePort, file.BootstrapPort = "", "", 0, 0
	file.Revisions, file.Domains = nil, nil
	b, err := json.Marshal(file)
	if err != nil {
		return nil, err
	}
	cm = cm.DeepCopy()
	cm.Data[routerconfig.FileName] = string(b)
	spec := dep.Spec.Template.Spec
	free, err := sandbox.FreePorts(2)
	if err != nil {
		return nil, err
	}
	l, err := newPodLayout(dir, spec, map[string]*corev1.ConfigMap{cm.Name: cm}, map[int32]int{render.RouterPort: free[0], render.RouterMetricsPort: free[1]})
	if err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	c := spec.Containers[0]
	env, vars, err := l.env(c)
	if err != nil {
		return nil, err
	}
	args := append([]string{filepath.Join(o.BinDir, "router")}, l.args(c, vars)...)
	for _, p := range prefill {
		args = append(args, "--prefill="+p.Engine+","+p.Bootstrap)
	}
	for _, d := range decode {
		args = append(args, "--decode="+d.Engine)
	}
	// On loopback every pod's KV events ports are renumbered: the router is told each one.
	for _, p := range append(append([]*Pod(nil), prefill...), decode...) {
		if p.KVEvents != 0 {
			args = append(args, fmt.Sprintf("--kv-events-ports=%s=%d,%d", p.Engine, p.KVEvents, p.KVReplay))
		}
	}
	proc, err := start(name, dir, args, env)
	if err != nil {
		return nil, err
	}
	return &Router{URL: fmt.Sprintf("http://%s:%d", podIP, free[0]), MetricsURL: fmt.Sprintf("http://%s:%d", podIP, free[1]), Proc: proc}, nil
}

// WaitOK polls url until it answers 200, the process exits, or timeout passes.
func WaitOK(ctx context.Context, url string, p *Process, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for {
		if exited, err := p.Exited(); exited {
			return fmt.Errorf("%s exited (%v) before %s answered 200; its log ends:\n%s", p.Name, err, url, p.Tail(4000))
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
		if err == nil {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%s: %s", resp.Status, b)
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not answer 200 in %s (last: %s); %s's log ends:\n%s", url, timeout, last, p.Name, p.Tail(4000))
		}
		select {
		case <-ctx.Done():
			return errors.Join(ctx.Err(), fmt.Errorf("waiting for %s", url))
		case <-time.After(500 * time.Millisecond):
		}
	}
}
