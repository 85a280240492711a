"""Test-only (test/realengine): lets vLLM's CPU build run MooncakeConnector on a machine without
an accelerator. vLLM's Mooncake worker calls torch.accelerator.current_device_index() whatever
the device (0.30.0 and 0.32.0), and torch raises when no accelerator exists; a GPU node never
gets here. Loaded through PYTHONPATH by the real-engine harness only, never by a shipped image."""

import torch

_current_device_index = torch.accelerator.current_device_index


def _index_or_zero() -> int:
    if not torch.accelerator.is_available():
        return 0
    return _current_device_index()


torch.accelerator.current_device_index = _index_or_zero
