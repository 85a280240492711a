"""GatedNixlConnector: vLLM's NixlConnector with the completion gate.

NIXL never reports a successful pull with no local block, but its failure path may report one
(a failed handshake): the same crash. kv_transfer_config: {"kv_connector": "GatedNixlConnector",
"kv_connector_module_path": "pdgate.nixl", ...}. As in pdgate.mooncake, the stock class is not
importable from here under its own name.
"""

from __future__ import annotations

from typing import Any, Iterator

from . import _vllm

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_Stock = _vllm.import_first([f"{_BASE}.connector"], ["NixlConnector"])["NixlConnector"]
_meta = _vllm.import_first([f"{_BASE}.metadata"], ["NixlConnectorMetadata", "ReqMeta"])
_vllm.require_method(_Stock, "build_connector_meta")
_vllm.require_method(_Stock, "update_connector_output")
_vllm.require_method(_Stock, "request_finished")
_vllm.require_metadata(_meta["NixlConnectorMetadata"], "reqs_to_recv")
_vllm.require_field(_meta["ReqMeta"], "local_block_ids")


def _pulls(meta: Any) -> Iterator[tuple[str, Any]]:
    # reqs_to_recv: {request id: ReqMeta} (flat)
    for req_id, pull in (getattr(meta, "reqs_to_recv", None) or {}).items():
        yield req_id, pull.local_block_ids


_vllm.require_shape(
    _meta["NixlConnectorMetadata"],
    lambda meta: meta.add_new_req_to_recv(
        request_id=_vllm.PROBE_REQUEST, local_block_ids=[[]],
        kv_transfer_params={"remote_block_ids": [[]], "remote_engine_id": "probe",
                            "remote_request_id": "probe", "remote_host": "probe", "remote_port": 5600}),
    _pulls)

GatedNixlConnector = _vllm.gated(_Stock, "GatedNixlConnector", "nixl", _pulls)
__getattr__ = _vllm.stock_name_refused(__name__, "NixlConnector", "GatedNixlConnector")
