"""Two ranks: only rank 1 receives a signal. Both must stop at the same check and report it.

Prints ``AGREED {json}`` per rank: what ``ExitSignal.agreed()`` (blocking) returned before and
after the signal reached rank 1 (Slurm's ``scancel --signal`` can reach the ranks in different
iterations), and what three ``poll()`` s (the training loop's, non-blocking) returned around it:
the first poll has nothing to report, the second the check the first started (before the
signal), the third the signal; and how long rank 0's second poll took while rank 1 came a
second late to it (a blocking all-reduce would wait that second).
"""

import json
import signal
import time

import torch.distributed as dist

from epas_megatron.runtime.distributed import destroy_distributed, init_distributed
from epas_megatron.training.exit_signal import ExitSignal


def main() -> None:
    init_distributed(tp=1, pp=1, vpp=None, seed=1)
    rank = dist.get_rank()
    exit_signal = ExitSignal()
    before = exit_signal.agreed()
    polls = [exit_signal.poll()]
    if rank == 1:
        exit_signal._handle(signal.SIGUSR1, None)  # what the installed handler does on delivery
    if rank == 1:
        time.sleep(1.0)  # rank 1 polls late: rank 0's poll must not wait for it
    start = time.perf_counter()
    polls.append(exit_signal.poll())
    waited = time.perf_counter() - start
    polls.append(exit_signal.poll())
    after = exit_signal.agreed()
    drained = exit_signal.drain()
    print("AGREED " + json.dumps({"rank": rank, "before": before, "after": after, "polls": polls, "drained": drained,
                                  "poll_waited_s": waited}), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
