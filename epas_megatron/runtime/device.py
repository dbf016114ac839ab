"""Where model chunks live, and moving data there.

Every tensor that enters a model chunk from outside -- a micro-batch from a data iterator, a
benchmark's synthetic input, an evaluation batch -- goes through :func:`to_compute_device`.
On a GPU that is the current CUDA device; on a CPU machine it is the device that stands in for
the GPU (:func:`epas_megatron.compat.cpu_compat.stand_in_device`: ``cpu``, or ``meta`` when a
test checks device placement), so a missing move fails on CPU exactly as it would on a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from epas_megatron.compat import cpu_compat


def compute_device() -> torch.device:
    """The device model chunks, their inputs and their losses live on."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return cpu_compat.stand_in_device()


def to_compute_device(batch: Any) -> Any:
    """``batch`` (a tensor, or a dict/list/tuple of them) on :func:`compute_device`.

    Copies from pinned host memory are asynchronous (``non_blocking``); the consuming kernels
    are queued on the same stream, so they see the data."""
    device = compute_device()
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return {key: to_compute_device(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_compute_device(value) for value in batch)
    return batch


def synchronize() -> None:
    """Wait for queued GPU work (before reading a wall clock); nothing to wait for on CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def use_deterministic_kernels() -> None:
    """Deterministic kernels for the rest of the process (``--deterministic``); call before the
    first GPU kernel. The environment variables are read by cuBLAS, Transformer Engine and NCCL
    when they initialise; values already set by the user are kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    os.environ.setdefault("NCCL_ALGO", "^NVLS")
    # warn_only: an operation without a deterministic implementation warns instead of failing.
    torch.use_deterministic_algorithms(True, warn_only=True)


def device_memory_gb() -> float | None:
    """Memory of this process's GPU in GiB (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
