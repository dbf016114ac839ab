"""What a training run tells its user: the console lines, the metrics records (``metrics.jsonl``,
TensorBoard, wandb) and the ``SUMMARY`` dict.

The trainer holds one :class:`Reporter` and hands it the state it reports; the reporter owns the
run directory's ``config.yaml``, the :class:`~epas_megatron.metrics.logger.MetricsLogger` and the
record formats, and only prints and writes on the logging rank. What can be computed without
a process group is a pure function here (the banner, the FLOPs of an iteration, the switch's
line and record), so it is tested without running a trainer.

Throughput counts the sharing-aware model FLOPs of the iterations an interval ran
(:func:`iteration_flops`): 3 x the forward matmuls with causal attention halved, as megatron-core
0.19 counts them, with the region each iteration trained with and, under Random-LTD, the tokens
each layer kept (:meth:`~epas_megatron.training.features.TrainingFeature.flop_tokens`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from epas_megatron.assembly import v_stage_sizes_for_run
from epas_megatron.config.cli import dump_yaml, to_dict
from epas_megatron.engine.progress import TrainingProgress, perplexity
from epas_megatron.errors import NonFiniteError
from epas_megatron.metrics.flops import Convention, layerwise_forward_flops, peak_name_for_device
from epas_megatron.metrics.logger import MetricsLogger
from epas_megatron.model.architecture import ModelShape
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.fusions import KernelAvailability, describe, fusion_off_reasons, fusion_settings
from epas_megatron.model.moc_sizes import MoCSettings
from epas_megatron.parallel.memory_budget import MemoryLimit
from epas_megatron.parallel.stage_layouts import describe_schedule_layouts
from epas_megatron.runtime.distributed import ParallelDims
from epas_megatron.runtime.fs import atomic_write_text
from epas_megatron.sharing.shape import LayerMode
from epas_megatron.training.features import TrainingFeatures
from epas_megatron.validation import ResolvedRun


# ---------------------------------------------------------------------------- pure parts
def layers_description(run: ResolvedRun) -> str:
    """Layer backend, attention kernel and the fusions in use (and why any is off)."""
    attention = "TE attention" if run.backend == "transformer_engine" else f"{run.cfg.model.core_attention} attention"
    kernels, backend = KernelAvailability.detect(), run.backend
    why = f" ({run.backend_reason})" if run.backend_reason.startswith("auto") else ""
    return f"{backend} layers{why}, {attention}, {describe(fusion_settings(kernels, backend), fusion_off_reasons(kernels, backend))}"


def pipeline_note(run: ResolvedRun, dims: ParallelDims) -> str:
    """' (VPP v)' for the interleaved schedule, ' (v-1f1b, V placement: stages of L1|L2|...)' for a
    V schedule (its layers per stage, in V order; with stage rebalancing, that they are chosen
    per region -- the layouts are listed with the EPAS schedule), '' otherwise."""
    if run.pipeline_schedule.v_placement:
        if run.rebalance:
            return f" ({run.pipeline_schedule}, V placement: {2 * dims.pp} stages, rebalanced for every region)"
        sizes = v_stage_sizes_for_run(run)
        return f" ({run.pipeline_schedule}, V placement: {'|'.join(map(str, sizes))} layers per stage)"
    return f" (VPP {dims.vpp})" if dims.vpp else ""


def moc_note(m) -> str:
    """The MLP's Mixture-of-Channels setting, where it is on."""
    moc = MoCSettings.from_flags(m.moc_topk, m.moc_groups)
    if moc is None:
        return ""
    return (f" (Mixture-of-Channels: top {moc.kept(m.ffn_hidden_size)} of {m.ffn_hidden_size // moc.groups} channels in "
            f"each of {moc.groups} groups)")


def banner(run: ResolvedRun, dims: ParallelDims) -> str:
    """The start-up line: model shape, parallel sizes, batch, precision, layers, device."""
    m, t, d = run.cfg.model, run.cfg.training, dims
    return (
        f"epas-megatron: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}/{m.num_query_groups}, "
        f"ffn {m.ffn_hidden_size}{moc_note(m)}, vocab {m.vocab_size}, seq {t.seq_length} | world {d.world_size} = TP {d.tp} x PP {d.pp}"
        f"{pipeline_note(run, d)} x DP {d.dp} | global batch {t.global_batch_size} = {run.num_microbatches} micro-batches"
        f" x {t.micro_batch_size} x DP {d.dp} | {run.precision}, {layers_description(run)},"
        f" {'CUDA' if torch.cuda.is_available() else 'CPU (gloo)'}"
        f"{', distributed optimizer' if run.use_distributed_optimizer else ''}"
    )


def peak_name(peak_tflops: Optional[str]) -> str:
    """The MFU peak: ``--peak-tflops`` when given, else this device's ('cpu' without CUDA)."""
    if peak_tflops:
        return peak_tflops
    if not torch.cuda.is_available():
        return "cpu"
    return peak_name_for_device(torch.cuda.get_device_name())


def throughput_line(peak: str) -> str:
    return ("throughput: TFLOP/s per device from the sharing-aware model FLOPs (3 x forward matmuls, causal attention halved, "
            f"as megatron-core 0.19); MFU peak: {peak}")


def iteration_flops(shape: ModelShape, modes: Sequence[LayerMode], share: str, global_batch_size: int,
                    tokens_per_layer: Optional[Sequence[int]] = None) -> float:
    """Model FLOPs of one training iteration (3 x forward, Megatron's convention) of a model of
    ``shape`` whose layers run in ``modes``, sharing ``share`` ('qk' or 'kv'); given
    ``tokens_per_layer`` (Random-LTD's kept tokens), each layer runs on its count, except the
    Q/K/V projections of a region's source, which run on the whole sequence."""
    flops_modes = ["compute" if mode != LayerMode.SHARE else f"share_{share}" for mode in modes]
    qkv_tokens = None
    if tokens_per_layer is not None:
        qkv_tokens = [shape.seq_length if mode == LayerMode.SOURCE else n for mode, n in zip(modes, tokens_per_layer)]
    forward = layerwise_forward_flops(shape, flops_modes, tokens_per_layer, Convention.MEGATRON, qkv_tokens)
    return float(3 * global_batch_size * forward)


def switch_line(iteration: int, sharing_layers: Sequence[int], sources: Sequence[int], info: dict,
                cost_iterations: Optional[float]) -> str:
    """The console line of a switch (``info``: :meth:`~epas_megatron.training.switch.SwitchExecutor.apply`'s record)."""
    cost = f" (= {cost_iterations:.1f} iterations)" if cost_iterations is not None else ""
    relayout = f"; pipeline layout {info['previous_layout']} -> {info['layout']}" if info["layout"] != info["previous_layout"] else ""
    how = "in-memory rebuild" if info["mode"] == "memory" else "save/rebuild/load"
    named = f"source layer {sources[0]}" if len(sources) == 1 else f"source layers {', '.join(map(str, sources))}"
    return (f"EPAS switch at iteration {iteration}: sharing layers {list(sharing_layers)} ({named}); "
            f"{how} took {info['seconds']:.2f}s{cost}{relayout}")


def switch_record(iteration: int, sharing_layers: Sequence[int], sources: Sequence[int], info: dict,
                  cost_iterations: Optional[float]) -> dict:
    """The ``"kind": "switch"`` metrics record of a switch: ``source_layers`` has one source per
    sharing block, ``source_layer`` the deepest block's (the only one without ``--epas-blocks``)."""
    return {"kind": "switch", "iteration": iteration, "sharing_layers": list(sharing_layers), "source_layer": sources[-1],
            "source_layers": list(sources),
            "layout": info["layout"], "previous_layout": info["previous_layout"], "switch_seconds": info["seconds"],
            "switch_mode": info["mode"], "switch_bytes_written": info["bytes_written"],
            "switch_bytes_between_ranks": info.get("bytes_between_ranks"), "switch_cost_iterations": cost_iterations}


# ---------------------------------------------------------------------------- the reporter
class Reporter:
    """The console, the run directory and the metrics of one run, on the logging rank."""

    def __init__(self, run: ResolvedRun, dims: ParallelDims, features: TrainingFeatures, out: Path):
        self.run, self.cfg, self.dims, self.features, self.out = run, run.cfg, dims, features, out
        self.metrics: Optional[MetricsLogger] = None  # opened by open_metrics, once the run has started up
        self.skipped_eval_regions: set[int] = set()  # --eval-regions sizes reported as skipped

    def print(self, *args) -> None:
        if self.dims.is_logging_rank:
            print(*args, flush=True)

    def write_run_dir(self) -> None:
        """The output directory with the resolved ``config.yaml``."""
        if self.dims.is_logging_rank:
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.out / "config.yaml", dump_yaml(self.cfg))

    def start_up(self) -> None:
        """The banner, then the run's warnings and notices."""
        self.print(banner(self.run, self.dims))
        for warning in self.run.warnings:
            self.print(f"WARNING: {warning}")
        for notice in self.run.notices:
            self.print(notice)

    def describe_schedules(self, plan: BuildPlan, memory_limit: Callable[[], Optional[MemoryLimit]]) -> None:
        """The EPAS schedule (with the pipeline layouts of its regions when stages are rebalanced,
        under ``memory_limit()``) and the features' lines."""
        run, train_iters = self.run, self.cfg.training.train_iters
        if run.schedule.enabled:
            self.print(run.schedule.describe(train_iters))
            if run.rebalance:
                self.print("pipeline stages, rebalanced at every switch (predicted costs from the FLOPs model):")
                self.print(describe_schedule_layouts(plan, run.schedule, memory=memory_limit()))
        for line in self.features.describe(train_iters):
            self.print(line)

    def open_metrics(self) -> MetricsLogger:
        lg = self.cfg.logging
        self.metrics = MetricsLogger(self.out, enabled=self.dims.is_logging_rank, tensorboard=lg.tensorboard, wandb=lg.wandb,
                                     wandb_project=lg.wandb_project, wandb_run_name=lg.wandb_run_name, config=to_dict(self.cfg))
        return self.metrics

    # ------------------------------------------------------------------ training
    def flops_of_iteration(self, plan: BuildPlan, iteration: int) -> float:
        """Model FLOPs of ``iteration`` (1-based): the region it trains with (from the schedule)
        and the tokens the features keep in each layer."""
        t = self.cfg.training
        modes = plan.with_region(self.run.schedule.sharing_layers(iteration), plan.layout).modes
        return iteration_flops(ModelShape(plan.arch, t.seq_length), modes, plan.share, t.global_batch_size,
                               self.features.flop_tokens(iteration))

    def flops_per_iteration(self, plan: BuildPlan, first: int, last: int) -> float:
        """Mean model FLOPs per iteration over iterations ``first..last``."""
        return sum(self.flops_of_iteration(plan, i) for i in range(first, last + 1)) / (last - first + 1)

    def log_interval(self, progress: TrainingProgress, result, iteration: int, consumed_samples: int, plan: BuildPlan,
                     lr: float) -> None:
        """The interval record ending at ``iteration`` and its console line."""
        first = max(iteration - self.cfg.logging.log_interval + 1, progress.start_iteration + 1, 1)
        extra = {"consumed_samples": consumed_samples, "sharing_layers": list(plan.sharing_layers),
                 "region_size": len(plan.sharing_layers), "layout": plan.layout_string, **self.features.record(iteration)}
        record = progress.interval_record(iteration, result, lr, self.flops_per_iteration(plan, first, iteration), extra)
        self.metrics.log(record, step=iteration)
        self.print(progress.console_line(record))

    def log_switch(self, iteration: int, sharing_layers: Sequence[int], sources: Sequence[int], info: dict,
                   cost_iterations: Optional[float]) -> None:
        self.print(switch_line(iteration, sharing_layers, sources, info, cost_iterations))
        self.metrics.log(switch_record(iteration, sharing_layers, sources, info, cost_iterations), step=iteration, prefix="epas")

    def log_validation(self, progress: TrainingProgress, iteration: int, consumed_samples: int, current: int,
                       evaluate: Callable[[int], float], region_layers: Callable[[int], tuple[int, ...]]) -> tuple[int, dict[int, float]]:
        """Validation loss (``evaluate(size)``) of the region in training (``current`` layers) and
        of every --eval-regions region, one ``"kind": "valid"`` record each; returns (the region
        in training, {region size: loss})."""
        regions = [current]
        if self.run.eval_regions is not None:
            regions, skipped = self.run.eval_regions.resolve(current, self.cfg.training.eval_untrained_regions)
            for size in sorted(set(skipped) - self.skipped_eval_regions):
                self.print(f" --eval-regions: region {size} is skipped until the region in training has grown to it "
                           f"(now {current}); --eval-untrained-regions evaluates it anyway")
            self.skipped_eval_regions.update(skipped)
        losses = {size: evaluate(size) for size in sorted(set(regions) | {current})}
        for size, loss in losses.items():
            in_training = size == current
            record = {"kind": "valid", "iteration": iteration, "region": size, "sharing_layers": list(region_layers(size)),
                      "in_training": in_training, "lm_loss": loss, "ppl": perplexity(loss), "consumed_samples": consumed_samples,
                      "train_time_s": progress.train_seconds}
            self.metrics.log(record, step=iteration, prefix=f"valid/region_{size}", scalars=("lm_loss", "ppl"))
            if in_training:  # the run's main validation curve keeps its name
                self.metrics.log(record, step=iteration, prefix="valid", scalars=("lm_loss", "ppl"), to_jsonl=False)
                self.print(f" validation at iteration {iteration}: lm loss {loss:.6E} | ppl {perplexity(loss):.3f}")
        for size, loss in losses.items():
            if size != current:
                self.print(f"   at region {size}: lm loss {loss:.6E} | ppl {perplexity(loss):.3f} | "
                           f"{loss - losses[current]:+.4f} vs the region in training ({current})")
        return current, losses

    def non_finite_error(self, iteration: int, error: NonFiniteError, last_good: Optional[int]) -> NonFiniteError:
        """Record the error that stops the run at a non-finite step; the message names the
        iteration and the checkpoint to resume from."""
        root = self.run.checkpoint_root
        self.metrics.log({"kind": "error", "iteration": iteration, "error": str(error)}, step=iteration)
        resume = (f"the last good checkpoint is iteration {last_good}: resume with --load {root}"
                  if last_good is not None else "no checkpoint was saved before it")
        return NonFiniteError(f"iteration {iteration}: {error}; training stopped without saving this state ({resume}; "
                              "a learning rate too high for the model is the usual cause: lower --lr or lengthen --lr-warmup-iters)")

    def summary(self, progress: TrainingProgress, iteration: int, plan: BuildPlan, switch_seconds: list[float],
                last_valid: tuple[Optional[int], dict[int, float]], exit_reason: str) -> dict:
        """The run's ``SUMMARY`` record."""
        valid_region, valid_losses = last_valid
        d, t = self.dims, self.cfg.training
        return {
            "iterations": iteration,
            "train_iters": t.train_iters,
            "iterations_this_run": iteration - progress.start_iteration,
            "final_lm_loss": progress.last_loss,
            "final_valid_lm_loss": valid_losses.get(valid_region),
            "final_valid_lm_loss_by_region": {str(size): loss for size, loss in valid_losses.items()},
            "tokens_per_s": progress.tokens_per_s(),
            "wall_s": progress.wall_seconds(),
            "train_time_s": progress.train_seconds,
            "world_size": d.world_size,
            "tp": d.tp,
            "pp": d.pp,
            "vpp": d.vpp,
            "dp": d.dp,
            "global_batch_size": t.global_batch_size,
            "seq_length": t.seq_length,
            "sharing_layers": list(plan.sharing_layers),
            "layout": plan.layout_string,
            "switch_seconds": switch_seconds,
            "precision": self.run.precision,
            "skipped_iterations": progress.skipped_iterations,
            "exit_reason": exit_reason,
            "output_dir": str(self.out),
            **self.features.summary(iteration),
        }
