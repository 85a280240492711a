"""GatedMooncakeConnector: vLLM's MooncakeConnector with the completion gate.

kv_transfer_config: {"kv_connector": "GatedMooncakeConnector",
                     "kv_connector_module_path": "pdgate.mooncake", ...}
"""

from __future__ import annotations

from typing import Any, Iterator

from . import _vllm

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1"
_found = _vllm.import_first(
    [f"{_BASE}.mooncake.mooncake_connector", f"{_BASE}.mooncake_connector"],
    ["MooncakeConnector", "MooncakeConnectorMetadata", "PullReqMeta"])
MooncakeConnector = _found["MooncakeConnector"]
_vllm.require_method(MooncakeConnector, "build_connector_meta")
_vllm.require_method(MooncakeConnector, "update_connector_output")
_vllm.require_metadata(_found["MooncakeConnectorMetadata"], "reqs_to_recv")
_vllm.require_field(_found["PullReqMeta"], "local_block_ids")


def _pulls(meta: Any) -> Iterator[tuple[str, Any]]:
    # reqs_to_recv: {remote engine id: {request id: PullReqMeta}}
    for by_request in (getattr(meta, "reqs_to_recv", None) or {}).values():
        for req_id, pull in by_request.items():
            yield req_id, pull.local_block_ids


GatedMooncakeConnector = _vllm.gated(MooncakeConnector, "GatedMooncakeConnector", "mooncake", _pulls)
