"""The training loop's bookkeeping: per-interval averages, throughput, the console line and the
run summary's totals.

:class:`TrainingProgress` is fed one :meth:`~TrainingProgress.step` per iteration by
:meth:`epas_megatron.training.trainer.Trainer.train`; at every log interval
:meth:`~TrainingProgress.interval_record` returns the metrics record (and starts a new interval)
and :func:`console_line` formats it. Throughput excludes nothing within an interval (the console
shows what the interval cost, switches included); the run's ``tokens_per_s`` excludes the first
step of a run and the first step after each rebuild, which pay one-off costs.
"""

from __future__ import annotations

import math
import time
from typing import Optional


def format_duration(seconds: float) -> str:
    """``3725.4`` -> ``"1:02:05"``."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class TrainingProgress:
    """Counts, sums and clocks of one run of the training loop."""

    def __init__(self, start_iteration: int, stop_at: int, train_iters: int, tokens_per_iteration: int,
                 world_size: int, peak: str, train_seconds: float = 0.0):
        self.start_iteration = start_iteration
        self.stop_at = stop_at
        self.train_iters = train_iters
        self.tokens_per_iteration = tokens_per_iteration
        self.world_size = world_size
        self.peak = peak
        self.wall_start = time.perf_counter()
        self.last_step_time: Optional[float] = None
        """Seconds of the latest step (to express a switch's cost in iterations)."""
        self.last_loss = float("nan")
        self.skipped_iterations = 0
        """fp16 steps whose update was skipped (gradient overflow)."""
        self.total_train_time, self.timed_iterations = 0.0, 0
        self.train_seconds = train_seconds
        """Training time of the run so far, resumes included: every step and every switch, but
        no evaluation or checkpoint -- the clock that time-to-target-loss comparisons read."""
        self._interval_iterations, self._interval_time = 0, 0.0
        self._loss_sum, self._loss_count = 0.0, 0

    def step(self, iteration: int, result, step_time: float, after_rebuild: bool) -> None:
        """Account for the step that made ``iteration`` (a :class:`~epas_megatron.engine.step.StepResult`)."""
        self.last_step_time = step_time
        self.train_seconds += step_time
        self._interval_iterations += 1
        self._interval_time += step_time
        if iteration > self.start_iteration + 1 and not after_rebuild:  # one-off costs stay out of tokens_per_s
            self.total_train_time += step_time
            self.timed_iterations += 1
        self.last_loss = result.lm_loss
        self.skipped_iterations += 0 if result.update_successful else 1
        self._loss_sum += result.lm_loss
        self._loss_count += 1

    def switch(self, seconds: float) -> Optional[float]:
        """Account for a switch that took ``seconds``; its cost as a number of the latest steps
        (None before the first step)."""
        self.train_seconds += seconds
        return seconds / self.last_step_time if self.last_step_time else None

    def interval_record(self, iteration: int, result, lr: float, flops_per_iteration: float, extra: dict) -> dict:
        """The metrics record of the interval ending at ``iteration``; starts the next interval."""
        from epas_megatron.metrics.flops import mfu, tflops_per_device

        per_iter = self._interval_time / self._interval_iterations
        tflops = tflops_per_device(flops_per_iteration, per_iter, self.world_size)
        record = {
            "iteration": iteration,
            "lm_loss": self._loss_sum / self._loss_count,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "loss_scale": result.loss_scale,
            "skipped_iterations": self.skipped_iterations,
            "tokens_per_s": self.tokens_per_iteration / per_iter,
            "tflops_per_device": tflops,
            "mfu": mfu(tflops, self.peak),
            "iteration_time_s": per_iter,
            "train_time_s": self.train_seconds,
            **extra,
        }
        self._interval_iterations, self._interval_time = 0, 0.0
        self._loss_sum, self._loss_count = 0.0, 0
        return record

    def tokens_per_s(self) -> Optional[float]:
        """The run's throughput without the one-off steps (None if no step counted)."""
        if not self.timed_iterations:
            return None
        return self.tokens_per_iteration / (self.total_train_time / self.timed_iterations)

    def wall_seconds(self) -> float:
        """Seconds since the loop started."""
        return time.perf_counter() - self.wall_start

    def console_line(self, record: dict) -> str:
        """The progress line of an interval record: elapsed time, and the time left at the
        interval's pace."""
        remaining = (self.stop_at - record["iteration"]) * record["iteration_time_s"]
        return console_line(record, self.train_iters, self.wall_seconds(), remaining)


def console_line(record: dict, train_iters: int, elapsed: float, remaining: float) -> str:
    """The one-line progress report of a metrics record (Megatron-LM's layout)."""
    r = record
    grad_norm = "skipped" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
    scaler = "" if r["loss_scale"] is None else f"loss scale: {r['loss_scale']:.1f} | skipped: {r['skipped_iterations']} | "
    utilisation = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
    kept = "" if r.get("random_ltd_kept_tokens") is None else f"kept tokens: {r['random_ltd_kept_tokens']} | "
    return (
        f" iteration {r['iteration']:8d}/{train_iters:8d} | consumed samples: {r['consumed_samples']:10d} | "
        f"ms/iter: {r['iteration_time_s'] * 1000:8.1f} | lr: {r['lr']:.3E} | lm loss: {r['lm_loss']:.6E} | "
        f"grad norm: {grad_norm} | {scaler}"
        f"tokens/s: {r['tokens_per_s']:8.0f} | TFLOP/s/dev: {r['tflops_per_device']:7.3f} | "
        f"MFU: {utilisation} | sharing: {r['region_size']} | {kept}"
        f"elapsed: {format_duration(elapsed)} | ETA: {format_duration(remaining)}"
    )


def perplexity(loss: float) -> float:
    """exp(loss), capped so that a diverged loss prints as a huge number instead of raising."""
    return math.exp(min(loss, 50.0))

