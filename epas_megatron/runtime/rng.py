"""Every random-number state a training process has, captured and restored as one value.

Python's ``random``, PyTorch's CPU generator, the CUDA generator (when there is a GPU) and
Megatron-Core's model-parallel RNG tracker (the forks that dropout and initialisation draw from).
Checkpoints save this state, and work done *beside* training that draws random numbers (building
an evaluation model runs Megatron's initialisation) runs inside :func:`preserved_rng_state`, so
that training continues with exactly the numbers it would have drawn otherwise.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import torch


def capture_rng_state() -> dict:
    """All RNG states of this process, as tensors and plain Python values."""
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state` (also for states read back from a checkpoint, where
    Python's tuple state may have become lists)."""
    from megatron.core import tensor_parallel

    random.setstate(_to_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


@contextmanager
def preserved_rng_state():
    """Run the body, then put every RNG state back as it was before."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)


def _to_tuple(x):
    return tuple(_to_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x
