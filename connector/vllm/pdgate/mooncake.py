"""GatedMooncakeConnector: vLLM's MooncakeConnector with the completion gate.

kv_transfer_config: {"kv_connector": "GatedMooncakeConnector",
                     "kv_connector_module_path": "pdgate.mooncake", ...}

The stock class is not importable from here under its own name: vLLM's factory looks
kv_connector up in this module, and ``MooncakeConnector`` must not load ungated.
"""

from __future__ import annotations

from typing import Any, Iterator

from . import _vllm

_found = _vllm.import_first(
    ["vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"],
    ["MooncakeConnector", "MooncakeConnectorMetadata", "PullReqMeta"])
_Stock = _found["MooncakeConnector"]
_vllm.require_method(_Stock, "build_connector_meta")
_vllm.require_method(_Stock, "update_connector_output")
_vllm.require_method(_Stock, "request_finished")
_vllm.require_metadata(_found["MooncakeConnectorMetadata"], "reqs_to_recv")
_vllm.require_field(_found["PullReqMeta"], "local_block_ids")


def _pulls(meta: Any) -> Iterator[tuple[str, Any]]:
    # reqs_to_recv: {remote engine id: {request id: PullReqMeta}}
    for by_request in (getattr(meta, "reqs_to_recv", None) or {}).values():
        for req_id, pull in by_request.items():
            yield req_id, pull.local_block_ids


_vllm.require_shape(
    _found["MooncakeConnectorMetadata"],
    lambda meta: meta.add_new_req(
        request_id=_vllm.PROBE_REQUEST, local_block_ids=[[]],
        kv_transfer_params={"transfer_id": "probe", "remote_engine_id": "probe",
                            "remote_bootstrap_addr": "http://probe:8998"}),
    _pulls)

GatedMooncakeConnector = _vllm.gated(_Stock, "GatedMooncakeConnector", "mooncake", _pulls)
__getattr__ = _vllm.stock_name_refused(__name__, "MooncakeConnector", "GatedMooncakeConnector")
