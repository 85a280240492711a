"""GatedNixlConnector: vLLM's NixlConnector with the completion gate.

NIXL never reports a successful pull with no local block, but reports a failed handshake for
one: the same crash. kv_transfer_config: {"kv_connector": "GatedNixlConnector",
"kv_connector_module_path": "pdgate.nixl", ...}
"""

from __future__ import annotations

from typing import Any, Iterator

from . import _vllm

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1"
_found = _vllm.import_first(
    [f"{_BASE}.nixl.connector", f"{_BASE}.nixl_connector"],
    ["NixlConnector"])
NixlConnector = _found["NixlConnector"]
_meta = _vllm.import_first(
    [f"{_BASE}.nixl.metadata", f"{_BASE}.nixl.connector", f"{_BASE}.nixl_connector"],
    ["NixlConnectorMetadata", "ReqMeta"])
_vllm.require_method(NixlConnector, "build_connector_meta")
_vllm.require_method(NixlConnector, "update_connector_output")
_vllm.require_metadata(_meta["NixlConnectorMetadata"], "reqs_to_recv")
_vllm.require_field(_meta["ReqMeta"], "local_block_ids")


def _pulls(meta: Any) -> Iterator[tuple[str, Any]]:
    # reqs_to_recv: {request id: ReqMeta} (flat)
    for req_id, pull in (getattr(meta, "reqs_to_recv", None) or {}).items():
        yield req_id, pull.local_block_ids


GatedNixlConnector = _vllm.gated(NixlConnector, "GatedNixlConnector", "nixl", _pulls)
