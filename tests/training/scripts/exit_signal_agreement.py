"""Two ranks: only rank 1 receives a signal. Both must stop at the same check and report it.

Prints ``AGREED {json}`` per rank: what ``ExitSignal.agreed()`` (blocking) returned before and
after the signal reached rank 1 (Slurm's ``scancel --signal`` can reach the ranks in different
iterations), and what three ``poll()`` s (the training loop's, non-blocking) returned around it:
the first poll has nothing to report, the second the check the first started (before the
signal), the third the signal. Rank 1 posts its second poll only after rank 0's second poll has
returned (rank 0 leaves a marker file in the directory given as the argument): a poll that
waited for the other rank would never return, and rank 1 reports that it gave up waiting.
"""

import json
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

from epas_megatron.runtime.distributed import destroy_distributed, init_distributed
from epas_megatron.training.exit_signal import ExitSignal

GIVE_UP_S = 60


def main() -> None:
    marker = Path(sys.argv[1]) / "rank0_second_poll_returned"
    init_distributed(tp=1, pp=1, vpp=None, seed=1)
    rank = dist.get_rank()
    exit_signal = ExitSignal()
    before = exit_signal.agreed()
    polls = [exit_signal.poll()]
    rank0_returned_first = None
    if rank == 1:
        exit_signal._handle(signal.SIGUSR1, None)  # what the installed handler does on delivery
        deadline = time.monotonic() + GIVE_UP_S
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        rank0_returned_first = marker.exists()
    polls.append(exit_signal.poll())
    if rank == 0:
        marker.touch()
    polls.append(exit_signal.poll())
    after = exit_signal.agreed()
    drained = exit_signal.drain()
    print("AGREED " + json.dumps({"rank": rank, "before": before, "after": after, "polls": polls, "drained": drained,
                                  "rank0_returned_first": rank0_returned_first}), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
