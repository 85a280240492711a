// Package vllmcli reads a `vllm serve` command line the way vLLM does, for the engine image that
// stands in for vLLM: the same flags (an unknown one is an error, as argparse makes it), the
// --kv-transfer-config JSON, and the connector class found through kv_connector_module_path on
// PYTHONPATH, as Python's import would find it. Whatever render writes must pass here, and
// whatever vLLM would refuse must fail here.
package vllmcli

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// Serve is the parsed `vllm serve MODEL ...`.
type Serve struct {
	Model            string
	ServedModelName  string
	Host             string
	Port             int
	BlockSize        int
	TensorParallel   int
	DataParallel     int
	PipelineParallel int
	ExpertParallel   bool
	PrefixCaching    bool
	MaxModelLen      int
	// MaxNumSeqs is --max-num-seqs: how many requests run at once (0: unset).
	MaxNumSeqs int
	// NumGPUBlocksOverride is vLLM's --num-gpu-blocks-override: the KV-cache capacity in
	// blocks instead of what GPU memory allows (0: unset).
	NumGPUBlocksOverride int
	// ShutdownTimeout is vLLM's --shutdown-timeout in seconds: on SIGTERM, 0 aborts what the
	// engine holds at once; more drains (running requests end, a producer's KV blocks wait
	// for their pulls) for up to that long.
	ShutdownTimeout int
	KVTransfer      *KVTransferConfig
	// KVEvents is --kv-events-config: the stand-in accepts what vLLM accepts and, with
	// enable_kv_cache_events, publishes its prefix cache's changes as vLLM does (kvpublish).
	KVEvents *vllm.KVEventsConfig
	// Dtype, KVCacheDtype, Quantization and Revision are vLLM's flags of those names ("" when
	// not given): with the model, block size and sharding they decide the engine's KV format.
	Dtype, KVCacheDtype, Quantization, Revision string
	// Group is this process's part of a replica across pods, as `connector launch` writes it.
	Group Group
}

// Group is a `vllm serve` of one pod of a replica across pods (vLLM's multi-node flags).
type Group struct {
	// DataParallelLocal is --data-parallel-size-local: the data-parallel ranks this pod runs
	// (0: all of them). DataParallelStartRank is --data-parallel-start-rank, the first of them.
	DataParallelLocal, DataParallelStartRank int
	// DataParallelAddress and DataParallelRPCPort are where the pod of rank 0 coordinates
	// the data-parallel group and the others reach it.
	DataParallelAddress string
	DataParallelRPCPort int
	// HybridLB is vLLM's data_parallel_hybrid_lb once its arguments are resolved: each pod's
	// API server serves its own ranks, which it counts from 0 (local_engines_only).
	HybridLB bool
	// NNodes and NodeRank are --nnodes and --node-rank: a model sharded over NNodes pods on
	// the multiprocessing backend, whose node 0 hosts torch.distributed at MasterAddr:MasterPort.
	NNodes, NodeRank int
	MasterAddr       string
	MasterPort       int
	// Headless is --headless: this pod runs workers and no API server.
	Headless bool
}

// LocalRanks is how many data-parallel ranks this process runs: --data-parallel-size-local of
// a pod of a replica across pods, else all of them.
func (s *Serve) LocalRanks() int {
	if s.Group.DataParallelLocal > 0 {
		return s.Group.DataParallelLocal
	}
	return max(s.DataParallel, 1)
}

// KVTransferConfig is the subset of vLLM's KVTransferConfig the simulator reads.
type KVTransferConfig struct {
	Connector         string         `json:"kv_connector"`
	Role              string         `json:"kv_role"`
	ModulePath        string         `json:"kv_connector_module_path,omitempty"`
	BufferDevice      string         `json:"kv_buffer_device,omitempty"`
	LoadFailurePolicy string         `json:"kv_load_failure_policy,omitempty"`
	ExtraConfig       map[string]any `json:"kv_connector_extra_config,omitempty"`
}

// UsageError is what argparse reports: vLLM prints it and exits with status 2.
type UsageError struct{ Msg string }

func (e *UsageError) Error() string { return "vllm serve: error: " + e.Msg }

type kind int

const (
	value    kind = iota // --flag V or --flag=V
	boolean              // store_true
	optional             // BooleanOptionalAction: --flag and --no-flag
)

// flags are the `vllm serve` options the simulator knows: the ones render writes and common
// ones users pass through engine.args; every other option is refused, as vLLM refuses a flag
// it does not define.
var flags = map[string]kind{
	"--served-model-name": value, "--host": value, "--port": value, "--block-size": value,
	"--tensor-parallel-size": value, "--data-parallel-size": value, "--pipeline-parallel-size": value,
	"--enable-expert-parallel": boolean, "--enable-prefix-caching": optional, "--kv-transfer-config": value,
	"--max-model-len": value, "--max-num-seqs": value, "--max-num-batched-tokens": value,
	"--gpu-memory-utilization": value, "--dtype": value, "--kv-cache-dtype": value, "--seed": value,
	"--quantization": value, "--tokenizer": value, "--revision": value, "--download-dir": value,
	"--load-format": value, "--swap-space": value, "--trust-remote-code": boolean, "--enforce-eager": boolean,
	"--enable-chunked-prefill": optional, "--disable-log-requests": boolean, "--disable-log-stats": boolean,
	"--uvicorn-log-level": value, "--api-server-count": value, "--distributed-executor-backend": value,
	"--generation-config": value, "--chat-template": value, "--max-logprobs": value,
	"--num-gpu-blocks-override": value, "--shutdown-timeout": value, vllm.FlagKVEventsConfig: value,
	// A replica across pods (what `connector launch` adds).
	vllm.FlagDataParallelHybridLB: boolean, vllm.FlagDataParallelSizeLocal: value, vllm.FlagDataParallelStartRank: value,
	vllm.FlagDataParallelAddress: value, vllm.FlagDataParallelRPCPort: value, vllm.FlagNNodes: value, vllm.FlagNodeRank: value,
	vllm.FlagMasterAddr: value, vllm.FlagMasterPort: value, vllm.FlagHeadless: boolean,
}

// short are vLLM's short aliases.
var short = map[string]string{"-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size", "-pp": "--pipeline-parallel-size",
	"-n": vllm.FlagNNodes, "-r": vllm.FlagNodeRank}

// Parse reads args, the arguments after the `vllm` command.
func Parse(args []string) (*Serve, error) {
	if len(args) == 0 || args[0] != "serve" {
		return nil, &UsageError{"the simulator only runs `vllm serve`"}
	}
	s := &Serve{Host: "0.0.0.0", Port: 8000, BlockSize: 16, TensorParallel: 1, DataParallel: 1, PipelineParallel: 1, PrefixCaching: true,
		Group: Group{DataParallelRPCPort: int(vllm.DataParallelRPCPort), NNodes: 1, MasterAddr: "127.0.0.1", MasterPort: int(vllm.MasterPort)}}
	vals := map[string]string{}
	var unknown []string
	for i := 1; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			if s.Model != "" {
				unknown = append(unknown, a)
				continue
			}
			s.Model = a
			continue
		}
		name, val, hasVal := strings.Cut(a, "=")
		if long, ok := short[name]; ok {
			name = long
		}
		// vLLM accepts --block_size for --block-size.
		name = "--" + strings.ReplaceAll(strings.TrimPrefix(name, "--"), "_", "-")
		negated := false
		k, ok := flags[name]
		if !ok {
			if base, isNo := strings.CutPrefix(name, "--no-"); isNo && flags["--"+base] == optional {
				name, k, ok, negated = "--"+base, optional, true, true
			}
		}
		if !ok {
			unknown = append(unknown, a)
			continue
		}
		switch k {
		case value:
			if !hasVal {
				if i+1 >= len(args) {
					return nil, &UsageError{fmt.Sprintf("argument %s: expected one argument", name)}
				}
				i++
				val = args[i]
			}
			vals[name] = val
		case boolean, optional:
			if hasVal {
				return nil, &UsageError{fmt.Sprintf("argument %s: ignored explicit argument '%s'", name, val)}
			}
			vals[name] = strconv.FormatBool(!negated)
		}
	}
	if len(unknown) > 0 {
		return nil, &UsageError{"unrecognized arguments: " + strings.Join(unknown, " ")}
	}
	if s.Model == "" {
		return nil, &UsageError{"the following arguments are required: model_tag"}
	}
	s.ServedModelName = s.Model
	if v, ok := vals["--served-model-name"]; ok {
		s.ServedModelName = v
	}
	if v, ok := vals["--host"]; ok {
		s.Host = v
	}
	ints := []struct {
		flag string
		dst  *int
	}{{"--port", &s.Port}, {"--block-size", &s.BlockSize}, {"--tensor-parallel-size", &s.TensorParallel},
		{"--data-parallel-size", &s.DataParallel}, {"--pipeline-parallel-size", &s.PipelineParallel}, {"--max-model-len", &s.MaxModelLen},
		{"--max-num-seqs", &s.MaxNumSeqs}, {"--num-gpu-blocks-override", &s.NumGPUBlocksOverride}, {"--shutdown-timeout", &s.ShutdownTimeout},
		{vllm.FlagDataParallelSizeLocal, &s.Group.DataParallelLocal}, {vllm.FlagDataParallelStartRank, &s.Group.DataParallelStartRank},
		{vllm.FlagDataParallelRPCPort, &s.Group.DataParallelRPCPort}, {vllm.FlagNNodes, &s.Group.NNodes}, {vllm.FlagNodeRank, &s.Group.NodeRank},
		{vllm.FlagMasterPort, &s.Group.MasterPort}}
	for _, f := range ints {
		v, ok := vals[f.flag]
		if !ok {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return nil, &UsageError{fmt.Sprintf("argument %s: invalid int value: '%s'", f.flag, v)}
		}
		*f.dst = n
	}
	s.ExpertParallel = vals["--enable-expert-parallel"] == "true"
	g := &s.Group
	g.DataParallelAddress = vals[vllm.FlagDataParallelAddress]
	if v, ok := vals[vllm.FlagMasterAddr]; ok {
		g.MasterAddr = v
	}
	g.Headless = vals[vllm.FlagHeadless] == "true"
	g.HybridLB = vals[vllm.FlagDataParallelHybridLB] == "true"
	if err := g.resolve(s, vals); err != nil {
		return nil, err
	}
	s.Dtype, s.KVCacheDtype, s.Quantization, s.Revision = vals["--dtype"], vals["--kv-cache-dtype"], vals["--quantization"], vals["--revision"]
	if v, ok := vals["--enable-prefix-caching"]; ok {
		s.PrefixCaching = v == "true"
	}
	if v, ok := vals["--kv-transfer-config"]; ok {
		var kv KVTransferConfig
		dec := json.NewDecoder(strings.NewReader(v))
		if err := dec.Decode(&kv); err != nil {
			return nil, &UsageError{fmt.Sprintf("argument --kv-transfer-config: invalid loads value: '%s'", v)}
		}
		switch kv.Role {
		case "kv_producer", "kv_consumer", "kv_both":
		default:
			return nil, fmt.Errorf("kv_role %q is not one of kv_producer, kv_consumer, kv_both", kv.Role)
		}
		s.KVTransfer = &kv
	}
	if v, ok := vals[vllm.FlagKVEventsConfig]; ok {
		// vLLM's KVEventsConfig refuses fields it does not define.
		var ev struct {
			vllm.KVEventsConfig
			BufferSteps  *int `json:"buffer_steps"`
			HWM          *int `json:"hwm"`
			MaxQueueSize *int `json:"max_queue_size"`
		}
		dec := json.NewDecoder(strings.NewReader(v))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&ev); err != nil {
			return nil, &UsageError{fmt.Sprintf("argument %s: invalid loads value: '%s'", vllm.FlagKVEventsConfig, v)}
		}
		switch ev.Publisher {
		case "", "null", "zmq":
		default:
			return nil, fmt.Errorf("unknown event publisher '%s'", ev.Publisher)
		}
		s.KVEvents = &ev.KVEventsConfig
	}
	return s, nil
}

// resolve checks and completes g as vLLM's EngineArgs.create_engine_config does (its
// ValueErrors, not argparse's: exit 1).
func (g *Group) resolve(s *Serve, vals map[string]string) error {
	_, local := vals[vllm.FlagDataParallelSizeLocal]
	_, start := vals[vllm.FlagDataParallelStartRank]
	if g.Headless && g.HybridLB {
		return errors.New("AssertionError: data_parallel_hybrid_lb is not applicable in headless mode")
	}
	if g.NNodes > 1 {
		world := s.DataParallel * s.TensorParallel * s.PipelineParallel
		if world%g.NNodes != 0 {
			return fmt.Errorf("ValueError: Invalid data-parallel launch options: `--nnodes %d` must evenly divide the total world size (%d)", g.NNodes, world)
		}
		if g.NodeRank < 0 || g.NodeRank >= g.NNodes {
			return fmt.Errorf("ValueError: Invalid data-parallel launch options: `--node-rank` must be between 0 and %d; got `--node-rank %d`", g.NNodes-1, g.NodeRank)
		}
	}
	switch {
	case local:
		if start && !g.Headless {
			g.HybridLB = true // vLLM infers hybrid load balancing
		}
		if g.DataParallelLocal < 1 || g.DataParallelLocal > s.DataParallel {
			return fmt.Errorf("ValueError: data_parallel_size_local (%d) must be between 1 and data_parallel_size (%d)", g.DataParallelLocal, s.DataParallel)
		}
		if g.DataParallelLocal == s.DataParallel {
			g.HybridLB = false // one node holds every rank
		}
	case g.HybridLB:
		return errors.New("ValueError: Invalid data-parallel launch options: `--data-parallel-hybrid-lb` requires `--data-parallel-size-local`. Set it to the number of data-parallel ranks on this node")
	}
	return nil
}

// Flow is how a connector class moves KV: mooncake or nixl.
type Flow string

const (
	FlowMooncake Flow = "mooncake"
	FlowNixl     Flow = "nixl"
)

// builtin are vLLM's own connector classes the simulator can stand in for.
var builtin = map[string]Flow{"MooncakeConnector": FlowMooncake, "NixlConnector": FlowNixl}

// Connector is the connector class vLLM would load.
type Connector struct {
	Class string
	// File is the source file the class came from; empty for a class built into vLLM.
	File string
	Flow Flow
}

// LoadConnector finds kv's connector class as vLLM's factory does: from
// kv_connector_module_path when it is set (importing the module from pythonPath, which fails
// when it is not there), or among vLLM's built-in connectors.
func LoadConnector(kv *KVTransferConfig, pythonPath string) (Connector, error) {
	if kv.ModulePath == "" {
		flow, ok := builtin[kv.Connector]
		if !ok {
			return Connector{}, fmt.Errorf("ValueError: Unsupported connector type: %s", kv.Connector)
		}
		return Connector{Class: kv.Connector, Flow: flow}, nil
	}
	file, err := FindModule(pythonPath, kv.ModulePath)
	if err != nil {
		return Connector{}, err
	}
	src, err := os.ReadFile(file)
	if err != nil {
		return Connector{}, err
	}
	if !definesName(string(src), kv.Connector) {
		return Connector{}, fmt.Errorf("AttributeError: module '%s' has no attribute '%s'", kv.ModulePath, kv.Connector)
	}
	c := Connector{Class: kv.Connector, File: file}
	switch {
	case strings.Contains(kv.Connector, "Mooncake"):
		c.Flow = FlowMooncake
	case strings.Contains(kv.Connector, "Nixl"):
		c.Flow = FlowNixl
	default:
		return Connector{}, fmt.Errorf("the simulator does not know how %s moves KV (neither Mooncake nor NIXL)", kv.Connector)
	}
	return c, nil
}

// FindModule resolves a dotted module name against pythonPath (os.PathListSeparator-separated
// directories) as Python's path finder does for source files: every package on the way needs
// its __init__.py, and the module is name.py or a package name/__init__.py.
func FindModule(pythonPath, module string) (string, error) {
	parts := strings.Split(module, ".")
	for _, dir := range filepath.SplitList(pythonPath) {
		if dir == "" {
			continue
		}
		p, ok := dir, true
		for _, pkg := range parts[:len(parts)-1] {
			p = filepath.Join(p, pkg)
			if !isFile(filepath.Join(p, "__init__.py")) {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		last := filepath.Join(p, parts[len(parts)-1])
		if isFile(last + ".py") {
			return last + ".py", nil
		}
		if isFile(filepath.Join(last, "__init__.py")) {
			return filepath.Join(last, "__init__.py"), nil
		}
	}
	return "", fmt.Errorf("ModuleNotFoundError: No module named '%s' (PYTHONPATH=%q)", module, pythonPath)
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}

// definesName reports whether Python source binds name at module level: a class statement or
// an assignment (pdgate builds its classes with a factory: GatedX = gated(...)).
func definesName(src, name string) bool {
	re := regexp.MustCompile(`(?m)^(class\s+` + regexp.QuoteMeta(name) + `\b|` + regexp.QuoteMeta(name) + `\s*(:[^=]*)?=[^=])`)
	return re.MatchString(src)
}
