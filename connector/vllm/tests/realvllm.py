"""The installed vLLM, driven as its engine drives it, for the gate's tests.

Nothing here models vLLM: the config is parsed by vLLM's own argument parser from the exact
``--kv-transfer-config`` that ``internal/render`` writes (read from its golden files), the
connector is built by vLLM's ``KVConnectorFactory`` inside a real ``Scheduler`` (a local tiny
model config: no weights, no tokenizer, no GPU), and the decode worker's reports come from the
real ``MooncakeConnectorWorker`` methods that turn a producer's answer into
``finished_recving`` (``process_pulling_result``, ``_handle_failed_recv``), through the real
``KVOutputAggregator``, into ``Scheduler.update_from_output``: later, at a step, after
aggregation, as ``EngineCore`` delivers them.

What cannot run here is the transfer itself (no Mooncake transfer engine, no NIXL, no GPU):
the worker half is the real class without its ``__init__`` (which opens the transfer engine),
with the state those methods use, as vLLM's own unit tests build it.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import queue
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[3]
GOLDEN = REPO / "internal" / "render" / "testdata"
# The launcher's command lines of multi-node replicas (connector/launch).
LAUNCHED = REPO / "connector" / "launch" / "testdata" / "commands.golden.json"
# Each pod's command line of render's LeaderWorkerSets as the connector binary launches it.
LAUNCHED_RENDERED = REPO / "cmd" / "connector" / "testdata" / "launched.golden.json"
BLOCK = 16
ENGINE = "prefill-engine-0"

# A Llama-shaped config.json: all vLLM's ModelConfig reads here (no weights, no tokenizer).
_TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


def rendered_kv_transfer_configs(golden: str) -> dict[str, str]:
    """The --kv-transfer-config argument of each engine Deployment in a render golden file,
    by kv_role."""
    import yaml  # a vLLM dependency; the plugin itself uses the standard library only

    out: dict[str, str] = {}
    with open(GOLDEN / golden) as f:
        for doc in yaml.safe_load_all(f):
            if not doc or doc.get("kind") != "Deployment":
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                args = list(c.get("args") or [])
                if "--kv-transfer-config" in args:
                    raw = args[args.index("--kv-transfer-config") + 1]
                    out[json.loads(raw)["kv_role"]] = raw
    if not out:
        raise AssertionError(f"{golden} renders no --kv-transfer-config")
    return out


def parse_kv_transfer_config(raw: str) -> Any:
    """The KVTransferConfig vLLM's CLI makes of a --kv-transfer-config argument: the body of
    vllm/engine/arg_utils.py's parse_dataclass (its parser cannot be built on a machine whose
    device vLLM cannot infer, as here)."""
    from pydantic import TypeAdapter
    from vllm.config import KVTransferConfig
    from vllm.engine import arg_utils

    expand = getattr(arg_utils, "_expand_json_human_readable_numbers", lambda v: v)
    return TypeAdapter(KVTransferConfig).validate_json(expand(raw))


def stock(raw: str) -> str:
    """The same config naming vLLM's own class instead of the plugin's."""
    cfg = json.loads(raw)
    cfg["kv_connector"] = cfg["kv_connector"].removeprefix("Gated")
    cfg.pop("kv_connector_module_path", None)
    return json.dumps(cfg)


def serve_parser() -> Any:
    """vLLM's `vllm serve` argument parser, as its CLI builds it. Building it instantiates the
    device config, which cannot infer a device here: the platform says cpu, nothing else
    changes (the parser is what is tested, not a device)."""
    import vllm.platforms as platforms
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    type(platforms.current_platform).device_type = "cpu"
    for name in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                 "vllm.entrypoints.openai.cli_args"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        return mod.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    raise AssertionError("no vLLM module defines make_arg_parser")


_model_dir: Optional[str] = None


def tiny_model() -> str:
    global _model_dir
    if _model_dir is None:
        _model_dir = tempfile.mkdtemp(prefix="pdgate-tiny-model-")
        with open(os.path.join(_model_dir, "config.json"), "w") as f:
            json.dump(_TINY_MODEL, f)
    return _model_dir


def vllm_config(kv_transfer: Any, groups: int = 1) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=tiny_model(), skip_tokenizer_init=True, dtype="float16", seed=42)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    return VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache,
                      kv_transfer_config=kv_transfer, device_config=DeviceConfig("cpu"))


def kv_cache_config(groups: int, num_blocks: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layer{g}"], spec) for g in range(groups)])


@dataclass
class Pulls:
    """One decode worker's pulls in flight, as its receive loop keeps them."""
    metas: dict[str, Any] = field(default_factory=dict)


class MooncakeWorker:
    """The real MooncakeConnectorWorker's report path without its transfer engine."""

    def __init__(self, hma: bool) -> None:
        mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector")
        self._mod = mod
        w = object.__new__(mod.MooncakeConnectorWorker)
        w.finished_recving_reqs = set()
        w._failed_recv_reqs = queue.Queue()
        w._invalid_block_ids = queue.Queue()
        w._is_hma_required = hma
        w.xfer_stats = _stats(mod)
        w.shutdown = lambda: None  # __del__ would stop a transfer engine this one never started
        self.w = w
        self.pulls = Pulls()

    def start(self, meta: Any, producers: int = 1) -> None:
        """start_load_kv: takes the pulls of a step's metadata (receive_kv pairs each with the
        producer workers it reads from)."""
        for by_req in meta.reqs_to_recv.values():
            for req_id, pull in by_req.items():
                p = copy.copy(pull)
                p.pull_tasks_count = producers
                self.pulls.metas[req_id] = p

    def producer_answers(self, ok: list[str] = (), err: list[str] = ()) -> None:
        """The producer's answer to a pull, through the real process_pulling_result."""
        resp = self._mod.MooncakeXferResponse(status=self._mod.MooncakeXferResponseStatus.FINISH,
                                              ok_reqs=list(ok) or None, err_reqs=list(err) or None,
                                              err_msg="producer failed" if err else None)
        self.w.process_pulling_result(resp, self.pulls.metas)
        for r in list(ok) + list(err):
            p = self.pulls.metas.get(r)
            if p is not None and p.pull_tasks_count <= 0:
                del self.pulls.metas[r]

    def get_finished(self) -> Any:
        """What the worker's get_transfer_results hands the model runner this step."""
        from vllm.v1.outputs import KVConnectorOutput

        done, self.w.finished_recving_reqs = self.w.finished_recving_reqs, set()
        failed: set[str] = set()
        while True:
            try:
                failed.add(self.w._failed_recv_reqs.get_nowait())
            except queue.Empty:
                break
        out = KVConnectorOutput(finished_recving=done or None)
        if failed and hasattr(out, "failed_recving"):
            out.failed_recving = failed
        invalid = self.w.get_block_ids_with_load_errors()
        if invalid:
            out.invalid_block_ids = invalid
        return out


def _stats(mod: Any) -> Any:
    cls = getattr(mod, "MooncakeKVConnectorStats", None)
    if cls is None:
        stats = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats")
        cls = stats.MooncakeKVConnectorStats
    return cls()


class Engine:
    """A decode (kv_consumer) engine: a real Scheduler, its connector from vLLM's factory, and
    tp workers whose reports reach the scheduler through KVOutputAggregator, one step late."""

    def __init__(self, raw_kv_transfer_config: str, tp: int = 1, groups: int = 1,
                 num_blocks: int = 200, dp: Optional[tuple[int, int, int]] = None) -> None:
        """dp is (size, global rank, rank on this node): the engine of one data-parallel rank, as
        vLLM's DP coordinator configures each EngineCore before it builds the scheduler."""
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        cfg = vllm_config(parse_kv_transfer_config(raw_kv_transfer_config), groups)
        cfg.cache_config.num_gpu_blocks = num_blocks
        if dp is not None:
            p = cfg.parallel_config
            p.data_parallel_size, p.data_parallel_rank, p.data_parallel_rank_local = dp
        self.scheduler = Scheduler(vllm_config=cfg, kv_cache_config=kv_cache_config(groups, num_blocks),
                                   log_stats=True, structured_output_manager=StructuredOutputManager(cfg),
                                   block_size=BLOCK)
        self.connector = self.scheduler.connector
        # NIXL's worker needs the nixl package: a NIXL engine here has the scheduler half only.
        mooncake = "Mooncake" in type(self.connector).__name__
        self.workers = [MooncakeWorker(hma=groups > 1) for _ in range(tp)] if mooncake else []
        self.tp = tp
        self.aggregator = KVOutputAggregator(tp)
        self._ids = 0
        # Steps whose model output the engine has not processed yet (async scheduling and
        # pipeline parallelism keep one or more in flight).
        self.in_flight: list[tuple[Any, list[Any]]] = []

    # Requests.
    def request(self, prompt_tokens: int = 4 * BLOCK, remote: bool = True, prompt_logprobs: bool = False,
                max_tokens: int = 4, kv_transfer_params: Optional[dict[str, Any]] = None) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._ids += 1
        sp = SamplingParams(max_tokens=max_tokens, prompt_logprobs=1 if prompt_logprobs else None)
        sp.update_from_generation_config({}, 2)
        req = Request(request_id=f"req-{self._ids}", prompt_token_ids=[7 + self._ids * 31 + i for i in range(prompt_tokens)],
                      sampling_params=sp, pooling_params=None, block_hasher=_block_hasher())
        if kv_transfer_params is not None:
            req.kv_transfer_params = kv_transfer_params
        elif remote:
            req.kv_transfer_params = {"do_remote_prefill": True, "remote_engine_id": ENGINE,
                                      "remote_bootstrap_addr": "http://prefill:8998",
                                      "transfer_id": f"xfer-{self._ids}"}
        self.scheduler.add_request(req)
        return req

    def abort(self, req: Any) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)

    def answer(self, req: Any, ok: bool = True) -> None:
        """The producer answers every worker's pull of req: served, or failed."""
        for w in self.workers:
            w.producer_answers(ok=[req.request_id]) if ok else w.producer_answers(err=[req.request_id])

    def status(self, req: Any) -> Any:
        r = self.scheduler.requests.get(req.request_id)
        return None if r is None else r.status

    # Steps.
    def schedule(self) -> Any:
        """scheduler.schedule(), and the workers start the step's pulls (start_load_kv)."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        if meta is not None and hasattr(meta, "reqs_to_recv"):
            for w in self.workers:
                w.start(meta)
        return out

    def execute(self, out: Any) -> None:
        """The model runs the step: each worker's get_finished goes into its output."""
        from vllm.v1.outputs import KVConnectorOutput

        reports = [w.get_finished() for w in self.workers] or [KVConnectorOutput() for _ in range(self.tp)]
        self.in_flight.append((out, reports))

    def process(self) -> None:
        """The oldest step's outputs reach the scheduler, aggregated over the workers."""
        out, kv_outputs = self.in_flight.pop(0)
        self.scheduler.update_from_output(out, self._aggregate(out, kv_outputs))

    def step(self) -> Any:
        """One synchronous EngineCore step: schedule, execute, process."""
        out = self.schedule()
        self.execute(out)
        self.process()
        return out

    def _aggregate(self, out: Any, kv_outputs: list[Any]) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(out.num_scheduled_tokens)
        runner_outputs = []
        for kv in kv_outputs:
            runner_outputs.append(ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[0] for _ in req_ids], logprobs=None, prompt_logprobs_dict={},
                pooler_output=None, kv_connector_output=None if _empty(kv) else kv))
        return self.aggregator.aggregate(runner_outputs)

    # The gate, where the connector is the gated class.
    @property
    def gate(self) -> Any:
        return getattr(self.connector, "_pdgate", None)


def _empty(kv: Any) -> bool:
    return not (kv.finished_recving or kv.finished_sending or getattr(kv, "failed_recving", None) or kv.invalid_block_ids)


_hasher = None


def _block_hasher() -> Any:
    global _hasher
    if _hasher is None:
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        try:
            from vllm.utils.hashing import sha256
        except ImportError:  # older layout
            from vllm.utils import sha256  # type: ignore[no-redef]
        init_none_hash(sha256)
        _hasher = get_request_block_hasher(BLOCK, sha256)
    return _hasher
