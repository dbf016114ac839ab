"""Two ranks: only rank 1 receives a signal. Both must stop at the same check and report it.

Prints ``AGREED {json}`` per rank: what ``ExitSignal.agreed()`` returned before and after the
signal reached rank 1 (Slurm's ``scancel --signal`` can reach the ranks in different iterations).
"""

import json
import signal

import torch.distributed as dist

from epas_megatron.runtime.distributed import destroy_distributed, init_distributed
from epas_megatron.training.exit_signal import ExitSignal


def main() -> None:
    init_distributed(tp=1, pp=1, vpp=None, seed=1)
    rank = dist.get_rank()
    exit_signal = ExitSignal()
    before = exit_signal.agreed()
    if rank == 1:
        exit_signal._handle(signal.SIGUSR1, None)  # what the installed handler does on delivery
    after = exit_signal.agreed()
    print("AGREED " + json.dumps({"rank": rank, "before": before, "after": after}), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
