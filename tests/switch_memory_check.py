"""The in-memory switch's memory, measured on the real trainer, next to the memory model's
bound (:func:`~epas_megatron.metrics.switch_memory.switch_transient_terms`).

The trainer (``--epas-switch-mode memory``, local layers, 4 layers, one process) trains one step
-- so that the optimizer holds Adam state -- and then carries out its one switch (region 0 -> 1)
exactly as training does (``Trainer.apply_switch``). Measured: the most bytes allocated through
torch's allocator at any moment of the switch above what was allocated when it began
(``peak``), and the same up to the end of the new objects' build (``build_peak``: the model's
``build`` phase, the new model, DDP and optimizer before any state moves in).

- On a GPU: ``torch.cuda.max_memory_allocated`` (the caching allocator's own count).
- On CPU: torch's CPU allocation counter, read from the profiler's memory events
  (``profile_memory=True``: every allocation and release of torch's CPU allocator with its
  address and size, in order). Profiling starts before the trainer is set up, so that releasing
  the old state during the switch counts too: the allocator reports a release only for blocks it
  saw allocated. The resident set would not do: the new modules' weights are allocated and never
  written before the old ones replace them, so the pages of the very transient measured here
  never become resident.

Imported by ``tests/metrics/test_switch_memory.py``; run as a script (a process of its own,
away from the GPU suite's world fixture) by ``tests/gpu/test_gpu_memory_and_nccl.py``, printing
one ``RESULT {json}`` line per configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Optional

import torch

CONFIGURATIONS = [("fp32", False), ("bf16", False), ("bf16", True)]
"""(precision, distributed optimizer): Megatron's FP32Optimizer (Adam state on the model's
parameters, taken over by the switch), the mixed-precision optimizer (fp32 main weights through the
gradient buffer, moments taken over), and the distributed optimizer (its shards by element range,
kind by kind through the gradient buffer) -- the GPU's default."""


def trainer_args(precision: str, distributed_optimizer: bool, output_dir: Path, hidden_size: int = 256) -> list[str]:
    """A 4-layer run whose one switch (layer 3 starts sharing) comes after one step."""
    return ["--preset", "tiny", "--transformer-impl", "local", "--num-layers", "4", "--hidden-size", str(hidden_size),
            "--num-attention-heads", "8", "--num-query-groups", "2", "--ffn-hidden-size", str(hidden_size * 11 // 4),
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "3",
            "--epas-target-layers", "1", "--epas-first-switch", "2", "--epas-switch-mode", "memory", "--eval-interval", "0",
            "--no-tensorboard", "--no-save-final", "--lr-warmup-iters", "0", "--precision", precision,
            "--use-distributed-optimizer" if distributed_optimizer else "--no-use-distributed-optimizer",
            "--output-dir", str(output_dir)]


def _cpu_peaks(prof) -> tuple[int, int]:
    """(peak during the switch, peak up to the end of its build) above the bytes allocated when
    the switch began, from the profiler's CPU allocation events and the two markers. Only blocks
    allocated while this profiler ran count, their releases too: a block an earlier run left
    behind (garbage its trainer's cycles kept until the switch's own collection) is not this
    switch's."""
    from torch._C._profiler import _EventType

    marks, allocations = {}, []

    def walk(node):
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name in ("epas_switch", "epas_switch_build"):
            marks[node.name] = (node.start_time_ns, node.end_time_ns)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    (start, end), (_, build_end) = marks["epas_switch"], marks["epas_switch_build"]
    live: dict[int, int] = {}
    allocated = before = peak = build_peak = 0
    for time, ptr, size in sorted(allocations, key=lambda a: a[0]):
        if time > end:
            break
        if size > 0:
            live[ptr] = size
        elif ptr not in live:
            continue  # allocated before this profiler started
        else:
            size = -live.pop(ptr)
        allocated += size
        if time < start:
            before = allocated
            continue
        peak = max(peak, allocated - before)
        if time <= build_end:
            build_peak = max(build_peak, allocated - before)
    return peak, build_peak


def measure_switch(precision: str, distributed_optimizer: bool, output_dir: Optional[Path] = None) -> dict:
    """Set up the trainer, one step, the switch (see module doc); the measured ``peak`` and
    ``build_peak`` (bytes) and the memory model's terms for the same switch (``model``)."""
    from epas_megatron.assembly import memory_settings
    from epas_megatron.config.cli import parse_config
    from epas_megatron.metrics.rank_memory import rank_memory_bytes
    from epas_megatron.metrics.switch_memory import switch_transient_terms
    from epas_megatron.model.architecture import ModelShape
    from epas_megatron.sharing.shape import LayerMode
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    output_dir = Path(output_dir or tempfile.mkdtemp(prefix="epas-switch-memory-"))
    run = resolve_run(parse_config(trainer_args(precision, distributed_optimizer, output_dir)), world_size=1)
    cuda = torch.cuda.is_available()
    profiler = (contextlib.nullcontext() if cuda else
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True))
    trainer = Trainer(run)
    try:
        with profiler as prof:
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.setup()
            trainer._train_step()  # (the bench's way: a step without the loop's logging)
            trainer.iteration += 1
            (iteration, _), = run.schedule.switch_iterations()  # the one switch, right after that step
            target = tuple(run.schedule.sharing_layers(iteration))
            build = trainer.build
            peaks = {}

            def marked_build(*args, **kwargs):
                with torch.profiler.record_function("epas_switch_build"):
                    build(*args, **kwargs)
                if cuda:
                    torch.cuda.synchronize()
                    peaks["build"] = torch.cuda.max_memory_allocated() - peaks["before"]

            trainer.build = marked_build  # what SwitchExecutor calls (host.build)
            if cuda:
                torch.cuda.synchronize()
                peaks["before"] = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            with torch.profiler.record_function("epas_switch"):
                trainer.apply_switch(target)
            if cuda:
                torch.cuda.synchronize()
                peaks["switch"] = torch.cuda.max_memory_allocated() - peaks["before"]
        plan = trainer.plan
    finally:
        trainer.close()
    peak, build_peak = (peaks["switch"], peaks["build"]) if cuda else _cpu_peaks(prof)
    t = run.cfg.training
    shape = ModelShape(plan.arch, t.seq_length, t.micro_batch_size)
    roles = lambda iteration: ["share" if mode == LayerMode.SHARE else "compute" for mode in run.schedule.layer_modes(iteration)]
    layers = range(plan.arch.num_layers)
    settings = memory_settings(run)
    model = switch_transient_terms(shape, roles(iteration - 1), roles(iteration), layers, layers, 0, 1, settings)
    state = rank_memory_bytes(shape, [roles(iteration - 1)], 0, 1, 1, settings)["parameters"]
    return {"precision": precision, "distributed_optimizer": distributed_optimizer, "device": "cuda" if cuda else "cpu",
            "peak": peak, "build_peak": build_peak, "model": model, "state": state}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    for precision, distributed in CONFIGURATIONS:
        result = measure_switch(precision, distributed, args.output_dir / f"{precision}{'-dist' if distributed else ''}")
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
