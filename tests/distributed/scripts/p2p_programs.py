"""Under torchrun: run a point-to-point program (tests/p2p_orders.py) with real tensors --
on gloo, with or without the NCCL-rules transport (``EPAS_P2P_RULES``), or on GPUs over NCCL.
Each message is a tensor of ``--bytes`` filled with its number (its place in the sorted labels,
also its tag, which gloo pairs by); a receive checks what arrived. Each rank prints one RESULT
line: ``ok``, or the error the transport raised (its type and message), or ``hung`` when the
program has not finished after ``--hang-after`` seconds (the process then exits at once).

    torchrun --nproc-per-node 2 tests/distributed/scripts/p2p_programs.py PROGRAMS.json [--bytes N] [--hang-after S]
"""

import argparse
import json
import os
import threading
import time

import torch
import torch.distributed as dist

from epas_megatron.runtime.distributed import init_distributed
from epas_megatron.runtime.p2p_rules import MessageMismatch, WouldDeadlock


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("programs")
    parser.add_argument("--bytes", type=int, default=1 << 16)
    parser.add_argument("--hang-after", type=float, default=0.0)
    args = parser.parse_args()
    init_distributed(1, 1, None, seed=1)
    rank = dist.get_rank()
    with open(args.programs) as f:
        programs = json.load(f)
    names = sorted({text for program in programs for step in program if step[0] == "post" for _, _, text in step[2]})
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    report = {"rank": rank, "group": dist.group.WORLD.group_name, "backend": dist.get_backend()}
    if args.hang_after:
        def watchdog():
            print("RESULT " + json.dumps({**report, "hung": True}), flush=True)
            os._exit(0)
        timer = threading.Timer(args.hang_after, watchdog)
        timer.daemon = True
        timer.start()
    works, received = [], []
    try:
        for step in programs[rank]:
            if step[0] == "wait":
                for work in works[step[1]]:
                    work.wait()
                continue
            tensors = []  # the call's P2POps
            for kind, peer, text in step[2]:
                tensor = torch.full((args.bytes // 4,), float(names.index(text)) if kind == "send" else -1.0, device=device)
                tensors.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, tag=names.index(text)))
                if kind == "recv":
                    received.append((text, tensor))
            if step[1]:
                works.append(dist.batch_isend_irecv(tensors))
            else:
                (op,) = tensors
                works.append([op.op(op.tensor, op.peer, tag=op.tag)])
        wrong = [text for text, tensor in received if not bool((tensor == names.index(text)).all())]
        print("RESULT " + json.dumps({**report, "ok": not wrong, "wrong": wrong}), flush=True)
    except (WouldDeadlock, MessageMismatch) as error:
        print("RESULT " + json.dumps({**report, "error": type(error).__name__, "message": str(error)}), flush=True)
    # Every rank has reported before any leaves (rank 0 serves the store), then exit at once:
    # unfinished gloo work of a stopped program must not hold the process.
    store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    store.add("p2p-programs-done", 1)
    while int(store.add("p2p-programs-done", 0)) < world:
        time.sleep(0.01)
    store.add("p2p-programs-left", 1)  # the last store call of a rank other than 0
    while rank == 0 and int(store.add("p2p-programs-left", 0)) < world:
        time.sleep(0.01)
    os._exit(0)


if __name__ == "__main__":
    main()
