"""A fork server for the tests' multi-rank runs: torch, Megatron-Core and epas-megatron are
imported once, and every run forks its ranks from this process instead of starting torchrun
and one interpreter per rank (three interpreter starts, ~10 CPU-seconds, per 2-rank run).

Started by :func:`epas_testing.fork_server` (one per test session). Protocol, one JSON object
per line: the server writes ``{"ready": pid}`` once its imports are done, then reads requests
from stdin and answers each with one line on the stdout it started with:

* request: ``{"module": "epas_megatron.train"}`` or ``{"script": path}``, ``argv``, ``nproc``,
  ``env`` (the ranks' whole environment), ``cwd``, ``stdout`` / ``stderr`` (files the ranks
  append to, shared as torchrun's ranks share its pipes) and ``timeout`` (seconds);
* answer: ``{"returncode": r, "ranks": [codes], "timed_out": bool}``; ``r`` is torchrun's: 0
  when every rank exits 0, else 1.

What a rank gets is what torchrun's worker would: the rendezvous variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` on a free port, ``TORCHELASTIC_RUN_ID``), stdin from /dev/null, unbuffered
stdout/stderr, ``sys.argv``, the working directory, ``__main__`` run by :mod:`runpy`, atexit
handlers at the end. Forking is safe because nothing here runs before the fork but imports:
no OpenMP pool, gloo thread or CUDA context exists yet (the server checks it has one thread).
As torchrun does, when a rank fails the others are stopped (SIGTERM after a grace period, then
SIGKILL), and a run past its timeout is killed.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import warnings

GRACE_S = 5.0
"""How long the other ranks may finish after one rank failed, before SIGTERM."""

KILL_AFTER_S = 10.0
"""How long after SIGTERM a rank is killed."""


def _preload() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import megatron.core  # noqa: F401

    import epas_megatron.train  # noqa: F401
    import epas_megatron.training.trainer  # noqa: F401
    from epas_megatron.runtime.garbage import freeze_long_lived

    # The imports never die: frozen, every rank's collections (one before each model build)
    # skip them, and the ranks share their pages (a collection writes to every object it walks).
    freeze_long_lived()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(request: dict, rank: int, port: int) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: stopping a rank stops what it started
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)  # noqa: SIM115
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)  # noqa: SIM115
        nproc = request["nproc"]
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          TORCHELASTIC_RUN_ID="fork-server")
        os.chdir(request["cwd"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")  # "found in sys.modules"
        try:
            if "module" in request:
                sys.argv = [request["module"], *request["argv"]]
                runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            else:
                script = request["script"]
                sys.argv = [script, *request["argv"]]
                sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:  # what the interpreter would print before exiting with 1
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _stop(pids: dict[int, int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:  # not yet its own group leader
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _run(request: dict) -> dict:
    port = _free_port()
    pids: dict[int, int] = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank_main(request, rank, port)
        pids[pid] = rank
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    failed_at = stopped_at = None
    timed_out = False
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if now > deadline and not timed_out:
                timed_out = True
                _stop(pids, signal.SIGKILL)
            elif failed_at is not None and stopped_at is None and now > failed_at + GRACE_S:
                stopped_at = now
                _stop(pids, signal.SIGTERM)
            elif stopped_at is not None and now > stopped_at + KILL_AFTER_S:
                _stop(pids, signal.SIGKILL)
            time.sleep(0.02)
            continue
        if pid in pids:
            rank = pids.pop(pid)
            codes[rank] = os.waitstatus_to_exitcode(status)
            if codes[rank] != 0 and failed_at is None:
                failed_at = time.monotonic()
    ranks = [codes[r] for r in range(request["nproc"])]
    return {"returncode": 0 if not any(ranks) else 1, "ranks": ranks, "timed_out": timed_out}


def main() -> None:
    reply = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing the imports print may reach the protocol channel
    _preload()
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit(f"fork server: {len(os.listdir('/proc/self/task'))} threads after the imports; forking is not safe")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the test session reaches the ranks, not the server
    print(json.dumps({"ready": os.getpid()}), file=reply, flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(_run(json.loads(line))), file=reply, flush=True)


if __name__ == "__main__":
    main()
