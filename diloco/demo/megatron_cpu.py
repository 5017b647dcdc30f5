"""Run real megatron-core 0.16 on the CPU: the patches that redirect its CUDA assumptions.

The demo (and the tests and benchmarks, which build the demo's model) runs the island data path on
real megatron-core layouts on a machine with no GPU. The library assumes CUDA in a handful of
places; :func:`install_cpu_patches` redirects them to the CPU for the life of the process.

Contract: idempotent; never call it in a process that uses a real GPU (it makes ``.cuda()`` a
no-op and rewrites CUDA device requests). A real training job never imports this module.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is how megatron spells torch.cuda.current_device().
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to the CPU and makes `.cuda()` a no-op.

    Megatron's DDP, distributed optimizer and pipeline schedule allocate with
    `device='cuda'` / `torch.cuda.current_device()` and check `param.type()`
    against `torch.cuda.*Tensor`; under this mode those calls land on the CPU
    and `Tensor.type()` reports the CUDA name so the type checks pass.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) >= 2 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuRNGStatesTracker:
    """Stand-in for megatron's CudaRNGStatesTracker that forks the CPU generator.

    Megatron forks a named RNG stream around TP-region dropout and expert init;
    on CPU the named stream is a saved CPU generator state.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if name in self.states_ or seed in self.seeds_:
            raise RuntimeError(f"rng state {name!r} / seed {seed} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name!r} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


_PATCHED = False
_MODE: _CudaToCpuMode | None = None


def install_cpu_patches() -> None:
    """Make megatron-core run on the CPU in this process (idempotent).

    Call in each worker before building a model (tied embeddings under PP
    allocate on 'cuda' while the model is built). Never call it in a process
    that uses a real GPU.
    """
    global _PATCHED, _MODE
    if _PATCHED:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1 reads this name unguarded in the router GEMM when
    # Transformer Engine is absent (NameError); None selects the torch path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    _MODE = _CudaToCpuMode()
    # Entered for the life of the process on purpose: it must cover model
    # build, training steps and transfers alike.
    _MODE.__enter__()
    _PATCHED = True


def seed_cpu_tracker(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """Mirror megatron's model_parallel_cuda_manual_seed with a CPU tracker."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _CpuRNGStatesTracker()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
