"""Process groups: torch.distributed from the torchrun environment, then Megatron's parallel state.

One process (``python -m epas_megatron.train``) works without torchrun: it initialises a
world of one on a free local port. ``gloo`` is used on CPU, ``nccl`` on GPU.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from epas_megatron.compat import cpu_compat, megatron_fixes, nccl_rules


@dataclass(frozen=True)
class ParallelDims:
    """Sizes and this process's coordinates."""

    world_size: int
    """All processes."""

    rank: int
    """This process's global rank."""

    tp: int
    """Tensor-parallel size."""

    pp: int
    """Pipeline-parallel size."""

    dp: int
    """Data-parallel size (world / (tp * pp))."""

    vpp: Optional[int]
    """Virtual pipeline size (None without interleaving)."""

    dp_rank: int = 0
    """This process's data-parallel rank (which shard of every global batch it reads)."""

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 prints, writes metrics and the run directory."""
        return self.rank == 0


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


_ENV_WE_SET: list[str] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(tp: int, pp: int, vpp: Optional[int], seed: int, timeout_minutes: int = 30) -> ParallelDims:
    """Initialise torch.distributed and Megatron-Core's model-parallel groups, and seed RNGs."""
    cpu_compat.activate()
    megatron_fixes.apply()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a single process started without torchrun
            single = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            _ENV_WE_SET.extend(k for k in single if k not in os.environ)
            os.environ.update(single)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    nccl_rules.install_from_env()  # EPAS_P2P_RULES=nccl: point-to-point under NCCL's rules (a check on CPU)

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
    )
    if not torch.cuda.is_available():
        from epas_megatron.compat.gloo_threads import single_threaded_gloo_workers

        single_threaded_gloo_workers()
    seed_everything(seed)
    world = dist.get_world_size()
    return ParallelDims(
        world_size=world,
        rank=dist.get_rank(),
        tp=tp,
        pp=pp,
        dp=world // (tp * pp),
        vpp=vpp if vpp and vpp > 1 else None,
        dp_rank=parallel_state.get_data_parallel_rank(),
    )


def collective_device() -> torch.device:
    """Where small tensors for collectives live: the GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def all_reduce_tensor(tensor: torch.Tensor, op=None) -> torch.Tensor:
    """All-reduce ``tensor`` (on :func:`collective_device`) over the world in place, with no host
    copy (a no-op without a process group); returns it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor


def all_reduce_values(values, op=None) -> list[float]:
    """All-reduce a short list of numbers over the world (a no-op without a process group)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor.cpu().tolist()


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch RNGs, plus Megatron's tensor-parallel RNG tracker.

    As Megatron-LM does, the seed is offset by the pipeline rank so that stages do not draw the
    same numbers; weights do not depend on it when they come from a checkpoint.
    """
    import random

    import numpy as np

    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    # A world of one set these itself; leaving them would make child processes join it.
    while _ENV_WE_SET:
        os.environ.pop(_ENV_WE_SET.pop(), None)
