"""``epas-bench switch``: what one EPAS switch costs, with ``--epas-switch-mode memory`` and
``checkpoint``, measured on the real trainer.

Each measurement is a fresh process (so that one mode's allocations do not flatter or burden the
other's memory figures): it sets up the trainer on the embedded corpus with a one-layer region
scheduled after ``--steps`` iterations, runs those steps by hand (so that Adam state exists and a
step's time and memory are known), then times ``Trainer.apply_switch`` -- exactly what training
does before the first step of the new region -- and one step after it. Measured per switch:

- seconds (wall clock of the switch) and the cost in iterations (seconds / median step time);
- bytes written: what the process wrote through system calls during the switch
  (``/proc/self/io`` ``wchar``; the staging checkpoint, for ``checkpoint``);
- peak extra host memory: the resident-set high-water mark during the switch minus the resident
  set before it (the kernel's ``VmHWM``, reset through ``/proc/self/clear_refs``), next to the
  same figure for a training step.

Modes alternate between repeats (memory, checkpoint, checkpoint, memory, ...) and every figure is
the median over repeats, with the spread. A model-based prediction for LLaMA-7B on 8 and 32
H100s follows (:mod:`epas_megatron.bench.switch_model`). Last line: ``BENCH {json}``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

MODES = ("memory", "checkpoint")
_PROCESS_GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
RESULT = "SWITCH_RESULT "


@dataclass(frozen=True)
class SwitchBenchConfig:
    """One ``epas-bench switch`` invocation."""

    preset: str
    """Model preset (tiny ... 350m on CPU)."""

    modes: tuple[str, ...]
    """Switch modes to measure."""

    repeats: int
    """Fresh processes per mode; figures are medians over them."""

    steps: int
    """Training iterations before the switch (the first is not timed)."""

    seq_length: int
    """Sequence length of the steps (short: the switch moves state, not activations)."""

    micro_batch_size: int
    """Micro-batch size (one micro-batch per iteration)."""

    seed: int = 1234
    """Seed of the model."""


# ---------------------------------------------------------------- process memory and I/O (Linux)
def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark (VmHWM) to the current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def written_bytes() -> int:
    """Bytes this process has written through system calls (``wchar``)."""
    return int(re.search(r"wchar:\s+(\d+)", Path("/proc/self/io").read_text()).group(1))


# ---------------------------------------------------------------- one measurement (a fresh process)
def trainer_args(cfg: SwitchBenchConfig, mode: str, output_dir: Path) -> list[str]:
    """A run whose only switch (one layer) comes right after ``cfg.steps`` iterations (on the
    embedded corpus whatever the preset: a switch's cost does not depend on the data)."""
    return ["--preset", cfg.preset, "--seq-length", str(cfg.seq_length), "--micro-batch-size", str(cfg.micro_batch_size),
            "--global-batch-size", str(cfg.micro_batch_size), "--train-iters", str(cfg.steps + 2),
            "--epas-target-layers", "1", "--epas-first-switch", str(cfg.steps + 1), "--epas-switch-mode", mode,
            "--eval-interval", "0", "--no-tensorboard", "--no-save-final", "--seed", str(cfg.seed),
            "--lr-warmup-iters", "0", "--data", "embedded", "--output-dir", str(output_dir)]


def measure_once(cfg: SwitchBenchConfig, mode: str, output_dir: Path) -> dict:
    """Set up, train ``cfg.steps`` iterations, switch, train one more; the measurements."""
    import contextlib
    import io

    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    trainer = Trainer(resolve_run(parse_config(trainer_args(cfg, mode, output_dir)), world_size=1))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.setup()
    try:
        step_seconds, step_peaks = [], []
        for i in range(cfg.steps):
            before = rss_bytes()
            reset_peak_rss()
            start = time.perf_counter()
            trainer._train_step()
            if i > 0:  # the first step allocates Adam state
                step_seconds.append(time.perf_counter() - start)
                step_peaks.append(peak_rss_bytes() - before)
            trainer.iteration += 1
        target = tuple(trainer.run.schedule.sharing_layers(cfg.steps + 1))
        before, wrote = rss_bytes(), written_bytes()
        reset_peak_rss()
        info = trainer.apply_switch(target)
        switch_peak = peak_rss_bytes() - before
        wrote = written_bytes() - wrote
        start = time.perf_counter()
        trainer._train_step()
        after_seconds = time.perf_counter() - start
        state_bytes = sum(p.numel() * p.element_size() for chunk in trainer.model for p in chunk.parameters())
    finally:
        trainer.close()
    step = statistics.median(step_seconds)
    return {"mode": mode, "seconds": info["seconds"], "bytes_written": wrote, "bytes_staged": info["bytes_written"],
            "peak_extra_bytes": switch_peak, "step_peak_extra_bytes": statistics.median(step_peaks),
            "step_seconds": step, "step_after_switch_seconds": after_seconds, "cost_iterations": info["seconds"] / step,
            "rss_before_switch": before, "weight_bytes": state_bytes, "sharing_layers": list(target)}


def _worker(argv: Sequence[str]) -> int:
    """``python -m epas_megatron.bench.switch_bench MODE OUTPUT_DIR CONFIG_JSON``."""
    mode, output_dir, config = argv
    cfg = SwitchBenchConfig(**{**json.loads(config), "modes": (mode,)})
    from epas_megatron.compat.quiet import quiet_library_noise

    quiet_library_noise()
    print(RESULT + json.dumps(measure_once(cfg, mode, Path(output_dir))), flush=True)
    return 0


# ---------------------------------------------------------------- the benchmark
def run_switch_bench(cfg: SwitchBenchConfig, log: Callable[[str], None] = print) -> dict:
    """All repeats of all modes (fresh processes), the summary table, the 7B prediction; returns
    the BENCH record."""
    from dataclasses import asdict

    config = json.dumps({k: v for k, v in asdict(cfg).items() if k != "modes"})
    results: dict[str, list[dict]] = {m: [] for m in cfg.modes}
    log(f"bench: one switch (region 0 -> 1 layer) of the {cfg.preset} preset after {cfg.steps} steps (seq {cfg.seq_length}, "
        f"micro-batch {cfg.micro_batch_size}), modes {', '.join(cfg.modes)}, {cfg.repeats} fresh process(es) each")
    with tempfile.TemporaryDirectory(prefix="epas-switch-bench-") as scratch:
        for repeat in range(cfg.repeats):
            order = cfg.modes if repeat % 2 == 0 else tuple(reversed(cfg.modes))
            for mode in order:
                out = Path(scratch) / f"{mode}-{repeat}"
                env = {k: v for k, v in os.environ.items() if k not in _PROCESS_GROUP_ENV}  # a world of its own
                env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))
                proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.switch_bench", mode, str(out), config],
                                      capture_output=True, text=True, env=env)
                lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
                if proc.returncode != 0 or not lines:
                    raise RuntimeError(f"the {mode} measurement failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                result = json.loads(lines[-1][len(RESULT):])
                results[mode].append(result)
                log(f"  repeat {repeat + 1} {mode:>10}: {result['seconds']:.2f} s, {result['bytes_written'] / 1e6:.1f} MB written, "
                    f"peak +{result['peak_extra_bytes'] / 1e6:.0f} MB (a step: +{result['step_peak_extra_bytes'] / 1e6:.0f} MB), "
                    f"step {result['step_seconds']:.2f} s")
    record = summarize(cfg, results)
    for line in format_table(record):
        log(line)
    record["prediction_7b"] = predict_7b()
    for line in format_prediction(record["prediction_7b"]):
        log(line)
    return record


def _median_spread(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), (max(values) - min(values))


def summarize(cfg: SwitchBenchConfig, results: dict[str, list[dict]]) -> dict:
    """Medians (and spreads) per mode, flattened as ``<figure>_<mode>``."""
    record: dict = {"preset": cfg.preset, "steps": cfg.steps, "seq_length": cfg.seq_length,
                    "micro_batch_size": cfg.micro_batch_size, "repeats": cfg.repeats, "modes": list(cfg.modes)}
    for mode, runs in results.items():
        for figure in ("seconds", "bytes_written", "peak_extra_bytes", "step_peak_extra_bytes", "step_seconds", "cost_iterations"):
            median, spread = _median_spread([r[figure] for r in runs])
            record[f"{figure}_{mode}"] = median
            record[f"{figure}_{mode}_spread"] = spread
        record["weight_bytes"] = runs[0]["weight_bytes"]
    if {"memory", "checkpoint"} <= set(results):
        record["speedup_memory_over_checkpoint"] = record["seconds_checkpoint"] / record["seconds_memory"]
    return record


def format_table(record: dict) -> list[str]:
    modes = record["modes"]
    rows = [("seconds per switch", "seconds", lambda v: f"{v:.2f}"),
            ("cost in iterations", "cost_iterations", lambda v: f"{v:.2f}"),
            ("bytes written (MB)", "bytes_written", lambda v: f"{v / 1e6:.1f}"),
            ("peak extra host memory (MB)", "peak_extra_bytes", lambda v: f"{v / 1e6:.0f}"),
            ("a training step's (MB)", "step_peak_extra_bytes", lambda v: f"{v / 1e6:.0f}")]
    lines = [f"| {record['preset']} (median of {record['repeats']}, spread) | " + " | ".join(modes) + " |",
             "|---|" + "---:|" * len(modes)]
    for label, figure, fmt in rows:
        cells = [f"{fmt(record[f'{figure}_{m}'])} ({fmt(record[f'{figure}_{m}_spread'])})" for m in modes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if "speedup_memory_over_checkpoint" in record:
        lines.append(f"memory mode is {record['speedup_memory_over_checkpoint']:.2f}x faster than the checkpoint round trip")
    return lines


def predict_7b() -> list[dict]:
    """LLaMA-7B (the 7b preset) on 8 and 32 H100s, global batch 1024 x 2048 tokens."""
    from epas_megatron.bench.switch_model import ClusterAssumptions, llama_parameters, predict_switch
    from epas_megatron.config.presets import get_preset
    from epas_megatron.metrics.flops import Convention, flops_per_iteration
    from epas_megatron.model.architecture import ModelShape, architecture_from_preset

    arch = architecture_from_preset(get_preset("7b"), 2048)
    params, layer = llama_parameters(arch)
    flops = float(flops_per_iteration(ModelShape(arch, 2048), 1024, 0, convention=Convention.MEGATRON))
    a = ClusterAssumptions()
    qkv = arch.hidden_size * (arch.hidden_size + 2 * arch.kv_projection_size)
    return [{**predict_switch(params, layer, tp=2, pp=2, dp=dp, moved_layers=1, qkv_params=qkv, iteration_flops=flops, a=a),
             "params": params, "global_batch": 1024, "seq_length": 2048, "assumptions": vars(a)} for dp in (2, 8)]


def format_prediction(rows: list[dict]) -> list[str]:
    a = rows[0]["assumptions"]
    lines = [f"prediction, LLaMA-7B ({rows[0]['params'] / 1e9:.2f}B parameters, {rows[0]['state_bytes'] / 1e9:.0f} GB of bf16 weights + "
             f"fp32 main weights and Adam moments), distributed optimizer, one layer changing stage per switch:",
             "| GPUs (TP x PP x DP) | checkpoint: s (iterations) | memory: s (iterations) | written by checkpoint "
             "| gathered per GPU by checkpoint (memory: none) |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['gpus']} ({r['tp']}x{r['pp']}x{r['dp']}) | {r['seconds_checkpoint']:.0f} ({r['iterations_checkpoint']:.2f}) | "
                     f"{r['seconds_memory']:.1f} ({r['iterations_memory']:.2f}) | {r['bytes_written_checkpoint'] / 1e9:.0f} GB | "
                     f"{r['gathered_bytes_per_gpu_checkpoint'] / 1e9:.1f} GB |")
    lines.append(f"assumptions: file system {a['fs_write_gb_s_per_node']:g} GB/s write and "
                 f"{a['fs_read_gb_s_per_node']:g} GB/s read per node, "
                 f"{a['intra_node_gb_s']:g} GB/s per GPU in a node, {a['inter_node_gb_s']:g} GB/s between nodes, HBM copies "
                 f"{a['hbm_copy_gb_s']:g} GB/s, rebuild {a['rebuild_s']:g} s; iteration at {a['mfu']:.0%} MFU of "
                 f"{a['peak_tflops']:g} TFLOP/s ({rows[0]['iteration_s']:.1f} s on {rows[0]['gpus']} GPUs)")
    return lines


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
