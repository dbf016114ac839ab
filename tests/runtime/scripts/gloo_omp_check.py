"""One process: small element-wise op time and OS thread count before and after the gloo
collectives that a checkpoint save runs. argv[1] == 'off' skips the fix (the control)."""

import glob
import json
import os
import sys
import time

import torch
import torch.distributed as dist

if sys.argv[1] == "off":
    import epas_megatron.runtime.gloo_threads as gloo_threads

    gloo_threads.single_threaded_gloo_workers = lambda exempt=None: None

from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

init_distributed(1, 1, None, seed=0)
x, y = torch.randn(200_000), torch.randn(200_000)


def op_us() -> float:
    """Median over blocks of the time of one small in-place add (parallelised by OpenMP)."""
    blocks = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(300):
            x.add_(y)
        blocks.append((time.perf_counter() - start) / 300 * 1e6)
    return sorted(blocks)[3]


threads = lambda: len(glob.glob(f"/proc/{os.getpid()}/task/*"))
from megatron.core import parallel_state

dist.all_reduce(torch.ones(1 << 22), group=parallel_state.get_data_parallel_group())  # what DDP does every step
before_us, before_threads = op_us(), threads()
# What megatron-core's checkpoint save does on the world group: object collectives, large copies.
dist.gather_object(list(range(300_000)), [None], dst=0)
dist.all_gather_object([None], list(range(300_000)))
dist.broadcast(torch.ones(1 << 22), src=0)
print("GLOO " + json.dumps({"before_us": before_us, "after_us": op_us(), "new_threads": threads() - before_threads}), flush=True)
destroy_distributed()
