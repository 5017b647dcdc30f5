"""The device helper on this machine (CPU here; CUDA paths run in test_bridge_gpu.py)."""

from __future__ import annotations

import ctypes
import os
import resource
import signal

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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_advice_keeps_a_large_buffer_out_of_forked_children_and_gives_it_back() -> None:
    """What ``_registered_buffer`` does to a large registered buffer on a GPU host, checked on plain
    memory: a forked child has no such pages (it dies touching them), the parent keeps them, and
    DOFORK undoes it."""
    buf = torch.ones(device.DONT_FORK_MIN_BYTES + 12345, dtype=torch.uint8)
    middle = buf.data_ptr() + buf.numel() // 2

    def child_reads() -> int:
        pid = os.fork()
        if pid == 0:  # the child reads one byte in the middle of the buffer (no core file if it dies)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os._exit(ctypes.c_uint8.from_address(middle).value)
        return os.waitpid(pid, 0)[1]

    assert not device._fork_advice(buf.data_ptr(), 1 << 20, device._MADV_DONTFORK)  # small: left alone
    assert device._fork_advice(buf.data_ptr(), buf.numel(), device._MADV_DONTFORK)
    status = child_reads()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    assert int(buf[buf.numel() // 2]) == 1  # the parent's pages are untouched
    assert device._fork_advice(buf.data_ptr(), buf.numel(), device._MADV_DOFORK)
    status = child_reads()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 1
