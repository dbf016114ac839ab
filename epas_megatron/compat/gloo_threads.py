"""Keep gloo's worker threads from making OpenMP thread pools (CPU runs only).

Measured here (2 cores, torch 2.14.1's bundled libgomp): after the first distributed checkpoint
save, every training step was ~12% slower for the rest of the run, and a small element-wise op
went from ~10 us to ~60 us. The cause is an interaction of three things:

* gloo runs each collective in one of its own worker threads ("pt_gloo_runloop", two per
  process group), and the copies some collectives make there (``all_gather`` and the object
  collectives that checkpointing uses) are ATen ops that run ``at::parallel_for``;
* a thread's first ``at::parallel_for`` sets its OpenMP team size from ``torch.get_num_threads()``
  (PyTorch's process-wide value), so those threads make OpenMP pools of their own;
* libgomp counts all pool threads of the process, and once they outnumber the CPUs, its idle
  workers stop spinning between parallel regions ("throttled" waits): the main thread's pool
  then pays a futex wake-up per parallel region, which is most of a small op's time.

:func:`single_threaded_gloo_workers` runs, right after the process groups exist, a few
``all_gather`` s on every gloo group while PyTorch's thread count is 1, so each worker thread
makes its first ``at::parallel_for`` -- and fixes its team size -- at 1: it never makes a pool.
The main thread's team size and the BLAS threads are restored afterwards. Only CPU (gloo-only)
runs need it; with CUDA the collectives run on NCCL and this is not called.

The data-parallel groups are left alone: DDP's gradient all-reduce runs an O(parameters) ATen op
in its gloo thread every step (even with one data-parallel rank), which two OpenMP threads do
~4% of a CPU step faster; that one extra pool stays within libgomp's budget (measured: steps are
not throttled with it). It was the pools of further threads -- the checkpoint collectives on the
other groups -- that tipped the count over the CPUs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

ROUNDS = 8
"""Asynchronous ``all_gather`` s per group: enough that both worker threads take some."""

NUMEL = 1 << 18
"""Elements per rank of each warm-up ``all_gather`` (1 MiB of fp32: each copy takes long enough
that the queue's work spreads over the group's worker threads)."""


def gloo_groups(exempt: Sequence = ()) -> list:
    """This rank's gloo process groups but ``exempt``, in creation order (the same order on every
    rank, so the warm-up collectives of groups that ranks share cannot interleave differently)."""
    from torch.distributed.distributed_c10d import _world

    return [group for group in _world.pg_map
            if group is not None and dist.get_backend(group) == "gloo" and all(group is not e for e in exempt)]


def data_parallel_groups() -> list:
    """The groups DDP reduces gradients over (Megatron-Core's data-parallel groups)."""
    from megatron.core import parallel_state

    return [parallel_state.get_data_parallel_group(with_context_parallel=True), parallel_state.get_data_parallel_group()]


def single_threaded_gloo_workers(exempt: Optional[Sequence] = None) -> None:
    """Make the OpenMP team size of the worker threads of every gloo group but ``exempt``
    (default: the data-parallel groups) 1 (see the module notes)."""
    exempt = data_parallel_groups() if exempt is None else exempt
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for group in gloo_groups(exempt):
            size = dist.get_world_size(group)
            works = [
                dist.all_gather([torch.empty(NUMEL) for _ in range(size)], torch.zeros(NUMEL), group=group, async_op=True)
                for _ in range(ROUNDS)
            ]
            for work in works:
                work.wait()
    finally:
        torch.set_num_threads(threads)
