"""A fake of the parts of vLLM the gate touches, with vLLM's behaviour where it matters.

- The stock connectors (Mooncake, NIXL): a scheduler half that turns allocations and finished
  requests into pulls in ``reqs_to_recv``, and a worker half with vLLM's bug: every completed
  Mooncake pull is reported in ``finished_recving``, local blocks or not; a failed NIXL
  handshake reports every pull, empty ones included.
- ``Scheduler``: request states and ``_update_from_kv_xfer_finished`` with its asserts
  (vllm/v1/core/sched/scheduler.py): ``update_connector_output`` first, then
  ``assert req_id in self.requests`` and, for a request not waiting for remote KV,
  ``assert RequestStatus.is_finished(status)``; ``_free_blocks`` deletes the request.
- ``Aggregator``: KVOutputAggregator, which passes an id once every worker has reported it.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
from typing import Any, Optional

BASE = "vllm.distributed.kv_transfer.kv_connector.v1"


class RequestStatus(enum.IntEnum):
    WAITING = 1
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_ABORTED = 6

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclasses.dataclass
class KVConnectorOutput:
    finished_sending: Optional[set] = None
    finished_recving: Optional[set] = None
    failed_recving: Any = None


@dataclasses.dataclass
class PullReqMeta:
    d_req_id: str
    transfer_id: str
    local_block_ids: Any
    remote_engine_id: str = "prefill-0"
    remote_bootstrap_addr: str = "http://p:8998"


class MooncakeConnectorMetadata:
    def __init__(self) -> None:
        self.reqs_to_recv: dict[str, dict[str, PullReqMeta]] = {}


@dataclasses.dataclass
class ReqMeta:
    local_block_ids: Any
    remote_engine_id: str = "prefill-0"


class NixlConnectorMetadata:
    def __init__(self) -> None:
        self.reqs_to_recv: dict[str, ReqMeta] = {}


class KVConnectorBase_V1:
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        self.vllm_config, self.role = vllm_config, role
        self._pending: list[tuple[str, Any]] = []

    # Scheduler half.
    def update_state_after_alloc(self, req_id: str, local_block_ids: Any) -> None:
        self._pending.append((req_id, local_block_ids))

    def request_finished(self, req_id: str) -> None:
        self._pending.append((req_id, []))  # the cleanup pull of a request never scheduled

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        return None  # the base class does nothing


class MooncakeConnector(KVConnectorBase_V1):
    def build_connector_meta(self, scheduler_output: Any) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata()
        for req_id, blocks in self._pending:
            meta.reqs_to_recv.setdefault("prefill-0", {})[req_id] = PullReqMeta(req_id, "x-" + req_id, blocks)
        self._pending = []
        return meta

    # Worker half, vLLM's bug included: process_pulling_result adds every completed pull.
    @staticmethod
    def worker_finished(meta: MooncakeConnectorMetadata, failed: frozenset = frozenset()) -> tuple[set, set]:
        done, bad = set(), set()
        for by_req in meta.reqs_to_recv.values():
            for req_id in by_req:
                (bad if req_id in failed else done).add(req_id)
        return done, bad


class NixlConnector(KVConnectorBase_V1):
    def build_connector_meta(self, scheduler_output: Any) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata()
        for req_id, blocks in self._pending:
            meta.reqs_to_recv[req_id] = ReqMeta(blocks)
        self._pending = []
        return meta

    # Worker half: a successful empty pull only notifies; a failed handshake reports all.
    @staticmethod
    def worker_finished(meta: NixlConnectorMetadata, failed: frozenset = frozenset()) -> tuple[set, set]:
        done, bad = set(), set()
        for req_id, r in meta.reqs_to_recv.items():
            if req_id in failed:
                done.add(req_id)
                bad.add(req_id)
            elif any(len(g) if isinstance(g, list) else 1 for g in (r.local_block_ids or [])):
                done.add(req_id)
        return done, bad


class AssertionInEngine(AssertionError):
    """The scheduler's assert: EngineCore would die, every request after it fails."""


class Scheduler:
    """vLLM's request bookkeeping around the KV connector, with its asserts."""

    def __init__(self, connector: KVConnectorBase_V1) -> None:
        self.connector = connector
        self.requests: dict[str, RequestStatus] = {}
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()

    def add_request(self, req_id: str) -> None:
        self.requests[req_id] = RequestStatus.WAITING

    def schedule(self, req_id: str, blocks: Any) -> Any:
        """Allocates: with blocks to load the request waits for remote KV, without any it runs
        (a full local prefix hit); either way the connector gets a pull."""
        self.connector.update_state_after_alloc(req_id, blocks)
        loads = any(len(g) if isinstance(g, list) else 1 for g in blocks)
        self.requests[req_id] = RequestStatus.WAITING_FOR_REMOTE_KVS if loads else RequestStatus.RUNNING
        return self.connector.build_connector_meta(None)

    def finish_requests(self, req_id: str) -> Any:
        """Aborts a request. A request waiting for remote KV keeps its blocks until the
        connector reports; one never scheduled is freed now and its pull is a cleanup pull."""
        status = self.requests[req_id]
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS and req_id not in self.finished_recving_kv_req_ids:
            self.requests[req_id] = RequestStatus.FINISHED_ABORTED  # delay_free_blocks
            return None
        if status == RequestStatus.WAITING:
            self.connector.request_finished(req_id)
        self.requests[req_id] = RequestStatus.FINISHED_ABORTED
        self._free_blocks(req_id)
        return self.connector.build_connector_meta(None)

    def _free_blocks(self, req_id: str) -> None:
        if not RequestStatus.is_finished(self.requests[req_id]):
            raise AssertionInEngine(f"assert request.is_finished() in _free_blocks ({req_id})")
        del self.requests[req_id]

    def update_from_kv_xfer_finished(self, output: KVConnectorOutput) -> None:
        self.connector.update_connector_output(output)
        for req_id in output.failed_recving or ():
            if req_id not in self.requests:
                raise AssertionInEngine(f"assert req_id in self.requests ({req_id}, failed_recving)")
            self.failed_recving_kv_req_ids.add(req_id)
        for req_id in output.finished_recving or ():
            if req_id not in self.requests:
                raise AssertionInEngine(f"assert req_id in self.requests ({req_id})")
            status = self.requests[req_id]
            if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            else:
                if not RequestStatus.is_finished(status):
                    raise AssertionInEngine(f"assert RequestStatus.is_finished(request.status) ({req_id} is {status.name})")
                self._free_blocks(req_id)


class Aggregator:
    """KVOutputAggregator: an id is passed on once all workers reported it."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.seen: dict[str, int] = {}

    def aggregate(self, per_worker: list[set]) -> set:
        out = set()
        for ids in per_worker:
            for req_id in ids:
                self.seen[req_id] = self.seen.get(req_id, 0) + 1
                if self.seen[req_id] == self.workers:
                    del self.seen[req_id]
                    out.add(req_id)
        return out


def install(version: str = "0.27.0", layout: str = "new", drop: tuple[str, ...] = ()) -> None:
    """Puts a fake vllm into sys.modules. layout "new" has v1/mooncake/mooncake_connector.py and
    v1/nixl/, "old" has v1/mooncake_connector.py and v1/nixl_connector.py. drop removes
    attributes ("MooncakeConnector.update_connector_output", "PullReqMeta.local_block_ids")
    to stand for a vLLM whose surface changed."""
    uninstall()

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    classes: dict[str, Any] = {}
    for cls in (MooncakeConnector, MooncakeConnectorMetadata, PullReqMeta, NixlConnector, NixlConnectorMetadata, ReqMeta):
        # Fresh subclasses per install, so dropping an attribute does not leak between tests.
        classes[cls.__name__] = type(cls.__name__, (cls,), {})
    for spec in drop:
        cls_name, attr = spec.split(".")
        cls = classes[cls_name]
        if attr == "local_block_ids":
            fields = {k: v for k, v in cls.__dataclass_fields__.items() if k != attr}
            cls.__dataclass_fields__ = fields
            cls.__annotations__ = {}
        else:
            setattr(cls, attr, None)

    module("vllm", __version__=version)
    for part in ["vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector", BASE]:
        module(part)
    mooncake = {k: classes[k] for k in ("MooncakeConnector", "MooncakeConnectorMetadata", "PullReqMeta")}
    nixl = {k: classes[k] for k in ("NixlConnector", "NixlConnectorMetadata", "ReqMeta")}
    if layout == "new":
        module(f"{BASE}.mooncake")
        module(f"{BASE}.mooncake.mooncake_connector", **mooncake)
        module(f"{BASE}.nixl")
        module(f"{BASE}.nixl.connector", NixlConnector=nixl["NixlConnector"])
        module(f"{BASE}.nixl.metadata", NixlConnectorMetadata=nixl["NixlConnectorMetadata"], ReqMeta=nixl["ReqMeta"])
    else:
        module(f"{BASE}.mooncake_connector", **mooncake)
        module(f"{BASE}.nixl_connector", **nixl)


def uninstall() -> None:
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm.") or name in ("pdgate.mooncake", "pdgate.nixl"):
            del sys.modules[name]
