"""pdgate: the completion gate of pdcluster-operator, as a vLLM KV-connector plugin.

vLLM loads it through ``kv_transfer_config``:
``{"kv_connector": "GatedMooncakeConnector", "kv_connector_module_path": "pdgate.mooncake"}``
(or ``GatedNixlConnector`` / ``pdgate.nixl``). This package file imports nothing from vLLM;
``pdgate.mooncake`` and ``pdgate.nixl`` do, and refuse to load on a vLLM they do not fit.
"""

__version__ = "0.1.0"
