"""One process: the OS thread count before and after the gloo collectives that a checkpoint
save runs. argv[1] == 'off' skips the fix (the control)."""

import glob
import json
import os
import sys

import torch
import torch.distributed as dist

if sys.argv[1] == "off":
    import epas_megatron.compat.gloo_threads as gloo_threads

    gloo_threads.single_threaded_gloo_workers = lambda exempt=None: None

from megatron.core import parallel_state  # noqa: E402  (after the fix is disabled above)

from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

init_distributed(1, 1, None, seed=0)
threads = lambda: len(glob.glob(f"/proc/{os.getpid()}/task/*"))
dist.all_reduce(torch.ones(1 << 22), group=parallel_state.get_data_parallel_group())  # what DDP does every step
before_threads = threads()
# What megatron-core's checkpoint save does on the world group: object collectives, large copies.
dist.gather_object(list(range(300_000)), [None], dst=0)
dist.all_gather_object([None], list(range(300_000)))
dist.broadcast(torch.ones(1 << 22), src=0)
print("GLOO " + json.dumps({"new_threads": threads() - before_threads}), flush=True)
destroy_distributed()
