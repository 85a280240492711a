"""What the gate needs from vLLM, found or refused at import (fail closed)."""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Iterable, Optional

from .gate import Gate, HeldSends, Reporter, socket_path_from_env, ttl_from_env

# A child of vLLM's own "vllm" logger: vLLM gives only that one a handler, so the load line
# shows in the engine's log with vLLM's format and level (VLLM_LOGGING_LEVEL).
logger = logging.getLogger("vllm.pdgate")

# What the gate was measured on (docs/completion-gate.md): make test-plugin runs its tests
# against each of these releases, installed from PyPI. Other releases load when they have the
# surface the checks below probe, and are refused otherwise.
TESTED = ("0.30.0", "0.32.0", "0.33.0")
SUPPORTED = ("vLLM releases whose kv_connector factory loads a class from "
             "kv_connector_module_path, with the connectors in v1/mooncake/ and v1/nixl/ "
             f"(tested: {', '.join(TESTED)})")


class UnsupportedVLLM(ImportError):
    """vLLM lacks a surface the gate relies on: the engine must not run ungated."""


def vllm_version() -> str:
    try:
        import vllm  # type: ignore[import-not-found]
    except ImportError:
        return "not installed"
    return str(getattr(vllm, "__version__", "unknown"))


def refuse(what: str) -> UnsupportedVLLM:
    return UnsupportedVLLM(
        f"pdgate: vLLM {vllm_version()} has no {what}; the completion gate cannot load, and "
        f"running the stock connector would let empty pulls crash the decode engine. "
        f"Supported: {SUPPORTED}. Set spec.kvTransfer.completionGate: Disabled to run ungated.")


def import_first(modules: Iterable[str], names: Iterable[str]) -> dict[str, Any]:
    """Imports names from the first of modules that has them all (vLLM moved its connectors)."""
    names = list(names)
    tried = []
    for mod in modules:
        try:
            m = importlib.import_module(mod)
        except ImportError as e:
            tried.append(f"{mod} ({e})")
            continue
        found = {n: getattr(m, n, None) for n in names}
        if all(v is not None for v in found.values()):
            return found
        tried.append(f"{mod} (missing {[n for n, v in found.items() if v is None]})")
    raise refuse(f"{', '.join(names)} in any of: {'; '.join(tried)}")


def require_method(cls: type, name: str) -> None:
    if not callable(getattr(cls, name, None)):
        raise refuse(f"{cls.__name__}.{name}")


def require_field(cls: type, field: str) -> None:
    fields = getattr(cls, "__dataclass_fields__", None) or getattr(cls, "__annotations__", {})
    if field not in fields and not hasattr(cls, field):
        raise refuse(f"{cls.__name__}.{field}")


def require_metadata(meta_cls: type, attr: str) -> None:
    try:
        meta = meta_cls()
    except Exception as e:  # noqa: BLE001 - any failure means the surface changed
        raise refuse(f"{meta_cls.__name__}() without arguments ({e})") from e
    if not isinstance(getattr(meta, attr, None), dict):
        raise refuse(f"{meta_cls.__name__}.{attr} as a dict")


PROBE_REQUEST = "pdgate-import-probe"


def require_shape(meta_cls: type, add: Callable[[Any], None],
                  pulls_of: Callable[[Any], Iterable[tuple[str, Any]]]) -> None:
    """Fails closed unless the gate's walk of the metadata finds the one empty pull that add
    put in: a vLLM that nests reqs_to_recv differently would otherwise pass import and die on
    its first pull."""
    what = f"{meta_cls.__name__}.reqs_to_recv in the shape the gate walks"
    try:
        meta = meta_cls()
        add(meta)
        found = [(req_id, list(blocks)) for req_id, blocks in pulls_of(meta)]
    except Exception as e:  # noqa: BLE001 - any failure means the surface changed
        raise refuse(f"{what} ({type(e).__name__}: {e})") from e
    if found != [(PROBE_REQUEST, [[]])]:
        raise refuse(f"{what} (a probe pull came back as {found!r})")


def stock_name_refused(module: str, stock: str, gated_name: str) -> Callable[[str], Any]:
    """A module __getattr__: `kv_connector: <stock>` with this module path must not load the
    stock class from here (vLLM's factory does getattr(module, kv_connector))."""

    def __getattr__(name: str) -> Any:
        if name == stock:
            raise AttributeError(
                f"pdgate: {module} has no {stock}: use kv_connector {gated_name!r} (the gated "
                f"class); {stock!r} with kv_connector_module_path {module!r} would run ungated")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def dp_rank_of(vllm_config: Any) -> int:
    """The data-parallel rank of this engine on its pod: with DP across nodes (hybrid load
    balancing) vLLM sets data_parallel_rank to the global rank and data_parallel_rank_local to
    the rank on this node, which is what the pod's sidecar counts."""
    parallel = getattr(vllm_config, "parallel_config", None)
    local = getattr(parallel, "data_parallel_rank_local", None)
    if local is not None:
        return int(local)
    return int(getattr(parallel, "data_parallel_rank", 0) or 0)


def gated(base: type, name: str, flow: str,
          pulls_of: Callable[[Any], Iterable[tuple[str, Any]]]) -> type:
    """A subclass of base whose scheduler side gates completions. Nothing else changes."""

    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Optional[Any] = None) -> None:
        if kv_cache_config is None:
            base.__init__(self, vllm_config, role)
        else:
            base.__init__(self, vllm_config, role, kv_cache_config)
        self._pdgate = Gate(ttl_seconds=ttl_from_env())
        self._pdgate_held = HeldSends()
        self._pdgate_reporter = None
        role_name = str(getattr(role, "name", role))
        logger.info("pdgate: %s loaded on vLLM %s (role %s): pulls with no local block are not "
                    "reported to the scheduler", name, vllm_version(), role_name)
        path = socket_path_from_env()
        if "SCHEDULER" in role_name.upper() and path:
            self._pdgate_reporter = Reporter(path, self._pdgate.counts, name, vllm_version(), role_name,
                                             held=self._pdgate_held, dp_rank=dp_rank_of(vllm_config))
            self._pdgate_reporter.start()

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        meta = base.build_connector_meta(self, scheduler_output)
        self._pdgate.observe(pulls_of(meta))
        return meta

    def update_connector_output(self: Any, connector_output: Any) -> None:
        base.update_connector_output(self, connector_output)
        self._pdgate_held.sent(getattr(connector_output, "finished_sending", None))
        self._pdgate.filter_output(connector_output)

    # The scheduler calls one of the two, by whether the model has one KV-cache group or many.
    def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
        delay_free, params = base.request_finished(self, request, block_ids)
        self._pdgate_held.finished(request.request_id, bool(delay_free))
        return delay_free, params

    def request_finished_all_groups(self: Any, request: Any, block_ids: Any) -> Any:
        delay_free, params = base.request_finished_all_groups(self, request, block_ids)
        self._pdgate_held.finished(request.request_id, bool(delay_free))
        return delay_free, params

    methods: dict[str, Any] = {
        "__init__": __init__,
        "build_connector_meta": build_connector_meta,
        "update_connector_output": update_connector_output,
        "request_finished": request_finished,
        "__doc__": f"{base.__name__} whose scheduler never hears of a {flow} pull with no local block.",
        "__module__": f"pdgate.{flow}",
    }
    if callable(getattr(base, "request_finished_all_groups", None)):
        methods["request_finished_all_groups"] = request_finished_all_groups
    return type(name, (base,), methods)
