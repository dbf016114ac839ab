"""Run Megatron-Core without CUDA: CPU stand-ins for the library's CUDA-only calls.

Megatron-Core assumes a GPU in a handful of places that have nothing to do with the math:

1. the tensor-parallel RNG tracker stores and swaps *CUDA* generator states;
2. ``torch.cuda.current_device()`` is used as the device of buffers, RoPE tables, p2p and DDP;
3. tensor factories with a literal ``device="cuda"`` (causal masks, token counters, grad-norm
   scratch, loss scalers) and ``Tensor.cuda()``;
4. ``torch.cuda.synchronize``, streams and events (DDP's gradient reduction, p2p) and NVTX
   ranges.

:func:`activate` installs CPU equivalents for exactly these. It does nothing when a CUDA device is
present (then the real CUDA paths run untouched), and it is idempotent. Literal ``"cuda"`` devices
are rewritten only inside the Megatron-Core modules listed in :data:`_MODULES_WITH_CUDA_LITERALS`
(through a proxy of the ``torch`` module bound in their namespace), so user code and the rest of
PyTorch are not slowed down or changed.

5. gradient clipping inside the Megatron optimizer asserts CUDA gradients: replaced by the same
   scaling without the assertion;
6. the mixed-precision optimizer (bf16/fp16 with fp32 main parameters) and the distributed
   optimizer accept only parameters whose ``Tensor.type()`` is a ``torch.cuda.*Tensor`` name:
   while those constructors run, CPU tensors report the CUDA name of their dtype (the math
   is device-agnostic; gloo has the reduce-scatter and all-gather the distributed optimizer uses).

**The stand-in device.** CUDA maps to ``cpu`` by default. :func:`activate` with
``stand_in="meta"`` maps it to PyTorch's ``meta`` device instead: every tensor Megatron would put
on the GPU (parameters, buffers, masks, counters) lands on ``meta``, so a CPU tensor that reaches
the model without being moved to the model's device fails just as it would against a CUDA model
(see :mod:`epas_megatron.compat.device_guard`). Meta tensors hold no data, so only shapes flow:
a meta process can run forward and backward passes, not optimizer steps.

What does not run on CPU even with these patches: CUDA kernels (fused bias/dropout/RoPE/
softmax/cross-entropy, gradient-accumulation fusion; :mod:`epas_megatron.model.fusions` turns
them off without CUDA) and Transformer Engine.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from typing import Optional

import torch

__all__ = ["activate", "is_active", "cuda_available", "stand_in_device"]

_ACTIVE = False
_STAND_IN = torch.device("cpu")
STAND_INS = ("cpu", "meta")

# Megatron-Core modules whose functions create tensors on a literal "cuda" device.
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.transformer.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.optimizer",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
)

_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "triu", "tril",
)


def cuda_available() -> bool:
    """True when a usable CUDA device is present (then nothing is patched)."""
    return torch.cuda.is_available()


def is_active() -> bool:
    """True once :func:`activate` has installed the CPU stand-ins."""
    return _ACTIVE


def stand_in_device() -> torch.device:
    """The device that stands in for the GPU: ``cpu``, or ``meta`` for device-placement checks."""
    return _STAND_IN


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return _STAND_IN
    if isinstance(device, str) and device.startswith("cuda"):
        return _STAND_IN
    if isinstance(device, torch.device) and device.type == "cuda":
        return _STAND_IN
    return device


def _wrap_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    factory.__name__ = getattr(fn, "__name__", "factory")
    factory.__doc__ = fn.__doc__
    return factory


class _CpuTorchProxy(types.ModuleType):
    """Stands in for ``torch`` inside a Megatron module: factories map "cuda" to "cpu"."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _wrap_factory(getattr(torch, name)))

    def __getattr__(self, name):  # everything else is the real torch
        return getattr(torch, name)


class _NoOpRange:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuStream:
    """Stands in for a CUDA stream/event: CPU work is already ordered, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _CpuStream()

    def synchronize(self):
        pass

    def query(self):
        return True


def _patch_torch_cuda():
    """Process-wide CUDA stand-ins; only installed when CUDA is absent, where they would raise."""
    cuda = torch.cuda
    cuda.current_device = lambda: str(_STAND_IN)
    cuda.synchronize = lambda *a, **k: None
    # torch.manual_seed itself calls the (lazy, no-op) cuda.manual_seed_all: leave that one alone.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    cuda.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.nvtx.range = lambda *a, **k: _NoOpRange()
    cuda.current_stream = lambda *a, **k: _CpuStream()
    cuda.default_stream = lambda *a, **k: _CpuStream()
    cuda.Stream = _CpuStream
    cuda.Event = _CpuStream
    cuda.stream = lambda *a, **k: _NoOpRange()
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self.to(_STAND_IN)


def _patch_rng_tracker():
    """The TP RNG tracker swaps generator states: back it with the CPU default generator."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )

    # fork() compares the CPU generator before and after its body and warns when it changed;
    # on CPU the tracked state *is* the CPU generator, so the warning is always a false alarm.
    class _DropCpuRngWarning(logging.Filter):
        def filter(self, record):
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(random.__name__).addFilter(_DropCpuRngWarning())


def _patch_module_factories():
    proxy = _CpuTorchProxy()
    for name in _MODULES_WITH_CUDA_LITERALS:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = proxy


def _patch_grad_clipping():
    """Megatron's clip_grad_by_total_norm_fp32 asserts CUDA gradients; scale on CPU instead."""

    @torch.no_grad()
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff = clip_coeff.clamp_max(1.0)
            for g in grads:
                g.mul_(clip_coeff)
        elif clip_coeff < 1.0:
            for g in grads:
                g.mul_(clip_coeff)

    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


@contextlib.contextmanager
def _cuda_type_names():
    """Inside: ``Tensor.type()`` (no arguments) of a stand-in tensor names the CUDA type."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == _STAND_IN.type:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _patch_optimizer_type_checks():
    """Megatron's mixed-precision and distributed optimizers check ``param.type()`` against CUDA
    type names in their constructors: run those constructors with CUDA names reported."""
    for module_name, class_name in (
        ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
    ):
        cls = getattr(importlib.import_module(module_name), class_name)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, __init=init, **kwargs):
            with _cuda_type_names():
                __init(self, *args, **kwargs)

        cls.__init__ = __init__


def activate(stand_in: Optional[str] = None) -> bool:
    """Install the CPU stand-ins if no CUDA device is present. Returns True if active.

    ``stand_in``: the device that takes the GPU's place, ``"cpu"`` (run for real; the default)
    or ``"meta"`` (shapes only, to check device placement). Fixed by the first activation of a
    process; later calls without ``stand_in`` keep it."""
    global _ACTIVE, _STAND_IN
    if stand_in is not None and stand_in not in STAND_INS:
        raise ValueError(f"stand_in must be one of {STAND_INS}, got {stand_in!r}")
    if _ACTIVE:
        if stand_in is not None and stand_in != _STAND_IN.type:
            raise RuntimeError(f"the CPU stand-ins are already active with the {_STAND_IN.type!r} device")
        return True
    if cuda_available():
        return False
    _STAND_IN = torch.device(stand_in or "cpu")
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_module_factories()
    _patch_grad_clipping()
    _patch_optimizer_type_checks()
    _ACTIVE = True
    return True
