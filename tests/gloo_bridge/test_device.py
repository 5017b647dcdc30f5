"""The device helper on this machine (CPU here; CUDA paths run in test_bridge_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from gloo_bridge import device

pytestmark = pytest.mark.timeout(30)


def test_cpu_tensor_is_not_accelerator() -> None:
    assert not device.is_accelerator(torch.zeros(2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_cpu_only_answers() -> None:
    assert device.accelerator_type() is None
    assert device.current_device() == torch.device("cpu")
    assert device.default_backend() == "gloo"
    assert not device.pinning_available()
    assert device.set_current_device(0) == torch.device("cpu")
    device.synchronize()
    device.synchronize_stream(torch.device("cpu"))


def test_host_buffer() -> None:
    buf = device.host_buffer(16, pinned=False)
    assert buf.dtype == torch.uint8 and buf.numel() == 16 and buf.device.type == "cpu"
    assert not buf.is_pinned()
    with pytest.raises(ValueError, match="nbytes"):
        device.host_buffer(-1, pinned=False)
