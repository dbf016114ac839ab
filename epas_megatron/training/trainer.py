"""The training loop: config -> model/optimizer -> steps -> switches -> checkpoints -> metrics.

Data flows one way: :func:`resolve_run` (no processes) -> :meth:`Trainer.setup` (process groups,
data, model) -> :meth:`Trainer.train` (steps, evaluation, EPAS switches, checkpoints) -> a
``SUMMARY {json}`` line -> :meth:`Trainer.close`.

The trainer owns the run's state (plan, model chunks, optimizer, data iterators, iteration) and
sequences it; the rest is delegated, as in torchtitan: the switch event to
:class:`~epas_megatron.training.switch.SwitchExecutor` (whose module documents it), everything
printed or logged to :class:`~epas_megatron.training.reporting.Reporter`, one training step to
:func:`~epas_megatron.engine.step.train_step`, the loop's bookkeeping to
:class:`~epas_megatron.engine.progress.TrainingProgress`. Optional features (Random-LTD, the LR re-warm after switches) are
:class:`~epas_megatron.training.features.TrainingFeature` objects whose hooks the trainer calls
at fixed points without knowing which features are on (:data:`FEATURES` lists the kinds).
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from epas_megatron.assembly import optimizer_settings_for_run, pipeline_schedule_for, plan_after_switch, plan_for_run, stage_memory_limit
from epas_megatron.checkpointing.checkpoint import load_checkpoint
from epas_megatron.engine.progress import TrainingProgress
from epas_megatron.errors import NonFiniteError
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.option_registry import check_build_options_resume
from epas_megatron.parallel.layer_timing import LayerTimer
from epas_megatron.runtime.device import device_memory_gb, use_deterministic_kernels
from epas_megatron.runtime.distributed import ParallelDims, destroy_distributed, init_distributed
from epas_megatron.runtime.garbage import freeze_long_lived, unfreeze_long_lived
from epas_megatron.training.checkpointer import RunCheckpointer
from epas_megatron.training.exit_signal import ExitSignal
from epas_megatron.training.region_eval import evaluate_region
from epas_megatron.training.registry import features_for_run
from epas_megatron.training.reporting import Reporter, peak_name, throughput_line
from epas_megatron.training.run_data import RunData
from epas_megatron.training.switch import SwitchExecutor
from epas_megatron.validation import ResolvedRun


class Trainer:
    """Owns process groups, data iterators, model chunks, optimizer and metrics of one run."""

    def __init__(self, run: ResolvedRun, exit_signal: Optional[ExitSignal] = None):
        self.features = features_for_run(run)  # each feature checks its own flags (refusals raise here)
        run = replace(run, warnings=run.warnings + self.features.warnings)
        self.run = run
        self.cfg = run.cfg
        self.out = Path(self.cfg.logging.output_dir)
        if run.load_meta is not None:  # every resume check, before any process group or data
            if run.load_meta.epas_schedule is not None:
                run.schedule.check_resume(run.load_meta.epas_schedule, run.load_meta.iteration)
            self.features.check_resume(run.load_meta)
            if run.load_meta.config is not None:
                check_build_options_resume(run.load_meta.run_config(), run.cfg, run.load_meta.iteration)
        self.data = RunData(run)
        self.checkpointer = RunCheckpointer(run, self.print)
        self.switcher = SwitchExecutor(self.cfg.epas.epas_switch_mode, self.out / ".switch_staging")
        self.dims: Optional[ParallelDims] = None
        self.reporter: Optional[Reporter] = None  # made by setup, once the ranks are known
        self.plan: Optional[BuildPlan] = None  # of the current region (set by setup)
        self.state = None  # TrainingState built from it
        self.iteration = 0
        self.consumed_samples = 0
        self.metrics = None
        self.exit_signal = exit_signal or ExitSignal()
        self._own_signal_handler = exit_signal is None
        self.progress: Optional[TrainingProgress] = None  # of the loop (set by train)
        self.resumed_train_seconds = 0.0
        """Training time (steps and switches) before this run, from the resumed checkpoint."""
        self.layer_timer = None
        self.timed_iterations = 0
        self.froze_long_lived: Optional[bool] = None
        """Whether the first build froze the objects alive then (runtime/garbage.py); None before it."""

    # ------------------------------------------------------------------ what is built
    @property
    def model(self) -> list:
        """This rank's (DDP-wrapped) model chunks."""
        return self.state.model if self.state is not None else []

    @property
    def optimizer(self):
        return self.state.optimizer if self.state is not None else None

    @property
    def scheduler(self):
        return self.state.scheduler if self.state is not None else None

    @property
    def tf_config(self):
        return self.state.tf_config if self.state is not None else None

    @property
    def schedule_seq_length(self) -> int:
        return self.state.schedule_seq_length

    @property
    def sharing_layers(self) -> tuple[int, ...]:
        """The current sharing region."""
        return self.plan.sharing_layers if self.plan is not None else ()

    @property
    def layout(self) -> Optional[str]:
        """The current pipeline layout in Megatron's syntax (None: Megatron's even split)."""
        return self.plan.layout_string if self.plan is not None else self.cfg.parallel.pipeline_layout

    def print(self, *args) -> None:
        """Print on the logging rank."""
        if self.dims is None or self.dims.is_logging_rank:
            print(*args, flush=True)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Process groups, data, tokenizer, model, optimizer, optional resume."""
        cfg, run = self.cfg, self.run
        if cfg.training.deterministic:
            use_deterministic_kernels()
        chunks_per_rank = run.pipeline_schedule.chunks_per_rank(run.vpp)  # V placement: two chunks per rank
        self.dims = init_distributed(cfg.parallel.tp, cfg.parallel.pp, chunks_per_rank, cfg.training.seed)
        self.reporter = Reporter(run, self.dims, self.features, self.out)
        self.data.prepare()
        self.reporter.write_run_dir()
        self.reporter.start_up()
        start_iteration = run.load_meta.iteration if run.load_dir is not None else 0
        self.iteration = start_iteration
        self.plan = self._plan_for(run.schedule.sharing_layers(start_iteration))
        self.reporter.describe_schedules(self.plan, self.memory_limit)
        self.build(initialize=run.load_dir is None and run.pretrained_dir is None)
        if run.load_dir is not None:
            self.load(run.load_dir)
            self.print(f"resumed from {run.load_dir} at iteration {self.iteration} ({self.consumed_samples} samples consumed)")
        elif run.pretrained_dir is not None:
            load_checkpoint(run.pretrained_dir, self.model, self.optimizer, restore_rng=False, weights_only=True)
            self.print(f"initialised from the weights of {run.pretrained_dir} (fresh optimizer, iteration 0)")
        self.data.start_training(self.model, self.dims.dp_rank, self.dims.dp, self.consumed_samples)
        self.checkpointer.start()
        self.metrics = self.reporter.open_metrics()
        if self._own_signal_handler:
            self.exit_signal.install()

    # ------------------------------------------------------------------ model
    def _plan_for(self, sharing_layers) -> BuildPlan:
        """The build plan of a sharing region: the run's first plan, or the one following the
        current plan, its pipeline layout rebalanced for the region when stages are rebalanced
        (:func:`epas_megatron.assembly.plan_after_switch`)."""
        if self.plan is None:
            first = plan_for_run(self.run, sharing_layers)
            if not self.run.rebalance:
                return first
            self.plan = first  # the balancer starts from it
        plan, notice = plan_after_switch(self.run, self.plan, sharing_layers, timer=self.layer_timer, memory=self.memory_limit())
        if notice:
            self.print(f"memory budget: {notice}")
        return plan

    def memory_limit(self):
        """The per-rank memory budget of stage rebalancing (None: none), from
        --epas-memory-budget-gb or, on CUDA, 90% of the GPU's memory."""
        return stage_memory_limit(self.run, self.plan, device_memory_gb())

    def build(self, initialize: bool = True, adoption=None) -> None:
        """Model chunks, DDP, optimizer and LR schedule for the current plan.

        ``initialize=False`` skips the (layout-independent) weight initialisation when a
        checkpoint load follows; ``adoption`` (an in-memory switch) fills the state as it is built
        (:class:`epas_megatron.engine.state.StateAdoption`)."""
        from epas_megatron.engine.state import build_training_state  # megatron-core (seconds to import; epas-plan needs none)

        t = self.cfg.training
        self.state = None  # the previous region's model and optimizer go before the new ones come
        if self.froze_long_lived is None:  # the first build: what exists now lives as long as the run
            self.froze_long_lived = freeze_long_lived()  # (collects first, where it freezes)
        else:
            gc.collect()  # (Megatron's DDP and optimizer hold reference cycles)
        settings = optimizer_settings_for_run(self.run, self.features.lr_schedule_units(t.lr_warmup_iters, t.train_iters))
        self.state = build_training_state(self.plan, settings, seed=self.cfg.training.seed if initialize and adoption is None
                                          else None, adoption=adoption)
        if self.run.rebalance and self.cfg.epas.epas_cost_model == "measured":
            self.layer_timer = self.layer_timer or LayerTimer()
            self.layer_timer.attach(self.model)
            self.timed_iterations = 0

    def set_region(self, sharing_layers: tuple[int, ...]) -> None:
        """Make the plan of ``sharing_layers`` the current one (built by :meth:`build`)."""
        self.plan = self._plan_for(sharing_layers)

    # ------------------------------------------------------------------ checkpoints
    def _train_seconds(self) -> float:
        return self.progress.train_seconds if self.progress is not None else self.resumed_train_seconds

    def save(self, root: Optional[Path] = None, keep_last: Optional[int] = None) -> Path:
        """Checkpoint the full training state at the current iteration (synchronously)."""
        return self.checkpointer.save(self, self._train_seconds(), root, keep_last)

    def load(self, checkpoint_dir: Path) -> None:
        """Load a checkpoint into the built state, and the iteration, samples and training time it records."""
        state = self.checkpointer.load(self, checkpoint_dir)
        self.iteration, self.consumed_samples, self.resumed_train_seconds = (state["iteration"], state["consumed_samples"],
                                                                             state["train_time_s"])

    # ------------------------------------------------------------------ the switch event
    def apply_switch(self, sharing_layers: tuple[int, ...]) -> dict:
        """Change the sharing region (and pipeline layout) with --epas-switch-mode
        (:meth:`~epas_megatron.training.switch.SwitchExecutor.apply`, which returns the switch's record)."""
        return self.switcher.apply(self, tuple(sharing_layers))

    def _switch(self, target: tuple[int, ...], iteration: int, progress: TrainingProgress) -> None:
        """Carry out the switch before ``iteration``'s step, and report it."""
        info = self.apply_switch(target)
        sources = self.run.schedule.source_layers(iteration)
        self.reporter.log_switch(iteration, target, sources, info, progress.switch(info["seconds"]))

    # ------------------------------------------------------------------ loop
    def evaluate(self, region: Optional[int] = None) -> float:
        """Validation loss over --eval-iters global batches, with the region in training or, given
        ``region`` (a size), the same weights with that many layers sharing."""
        from epas_megatron.engine.step import eval_step  # megatron-core (seconds to import)

        t = self.cfg.training
        num_microbatches = self.run.num_microbatches * t.eval_iters
        if region is None or region == len(self.sharing_layers):
            result = eval_step(self.model, self.data.valid_iterators(self.model), num_microbatches=num_microbatches,
                               seq_length=self.schedule_seq_length, micro_batch_size=t.micro_batch_size,
                               pipeline_schedule=pipeline_schedule_for(self.run, num_microbatches))
        else:
            result = evaluate_region(self.plan, self._region_layers(region), self.model, lambda: self.data.valid_iterators(self.model),
                                     num_microbatches=num_microbatches, micro_batch_size=t.micro_batch_size,
                                     pipeline_schedule=pipeline_schedule_for(self.run, num_microbatches))
        return result.lm_loss

    def _region_layers(self, size: int) -> tuple[int, ...]:
        """The sharing layers of a region of ``size`` layers in this model."""
        return self.plan.region_layers(size, flag="--eval-regions")

    def train(self) -> dict:
        """Run until --train-iters (or --exit-interval, or an exit signal); return the summary."""
        t = self.cfg.training
        peak = peak_name(self.cfg.logging.peak_tflops)
        self.print(throughput_line(peak))
        stop_at = min(t.train_iters, self.iteration + t.exit_interval) if t.exit_interval else t.train_iters
        progress = TrainingProgress(self.iteration, stop_at, t.train_iters, t.global_batch_size * t.seq_length,
                                    self.dims.world_size, peak, train_seconds=self.resumed_train_seconds)
        self.progress = progress
        last_valid, exit_reason = (None, {}), "completed"

        while self.iteration < stop_at:
            next_iteration = self.iteration + 1
            target = tuple(self.run.schedule.sharing_layers(next_iteration))
            after_rebuild = target != self.sharing_layers
            if after_rebuild:
                self._switch(target, next_iteration, progress)
            step_start = time.perf_counter()
            try:
                result = self._train_step()
            except NonFiniteError as error:
                raise self._stop_non_finite(next_iteration, error) from None
            self.iteration, self.consumed_samples = next_iteration, self.consumed_samples + t.global_batch_size
            progress.step(self.iteration, result, time.perf_counter() - step_start, after_rebuild)

            if self.iteration % self.cfg.logging.log_interval == 0 or self.iteration == stop_at:
                self.reporter.log_interval(progress, result, self.iteration, self.consumed_samples, self.plan,
                                           self.optimizer.param_groups[0]["lr"])
            if t.eval_interval and self.data.valid_ds is not None and self.iteration % t.eval_interval == 0:
                last_valid = self.reporter.log_validation(progress, self.iteration, self.consumed_samples, len(self.sharing_layers),
                                                          self.evaluate, self._region_layers)
            self.checkpointer.poll()
            if self.cfg.checkpoint.save_interval and self.iteration % self.cfg.checkpoint.save_interval == 0:
                self.checkpointer.checkpoint(self, self._train_seconds())
            signum = self.exit_signal.poll()  # never blocks the step: agreed one iteration later
            if signum is not None:
                exit_reason = f"signal {signum}"
                break

        self.exit_signal.drain()  # the all-reduce the last poll started (every rank reaches this line)
        stopped_early = self.iteration < t.train_iters
        self.checkpointer.finish()
        if (stopped_early or self.cfg.checkpoint.save_final) and self.checkpointer.latest_iteration() != self.iteration:
            self.checkpointer.checkpoint(self, self._train_seconds())
            self.checkpointer.finish()
        if stopped_early and exit_reason == "completed":
            exit_reason = "exit_interval"
        summary = self.reporter.summary(progress, self.iteration, self.plan, self.switcher.seconds, last_valid, exit_reason)
        self.print("SUMMARY " + json.dumps(summary))
        return summary

    def _train_step(self):
        """One iteration over all micro-batches (with the features' preparation, and the layer timer's bookkeeping)."""
        from epas_megatron.engine.step import train_step  # megatron-core (seconds to import)

        step = self.iteration  # the step about to run (completed iterations so far)
        self.features.before_step(self.model, step)
        result = train_step(self.model, self.optimizer, self.scheduler, self.data.train_iterators,
                            num_microbatches=self.run.num_microbatches, seq_length=self.schedule_seq_length,
                            micro_batch_size=self.cfg.training.micro_batch_size, lr_increment=self.features.lr_increment(step),
                            lr_factor=self.features.lr_factor(step + 1), next_lr_factor=self.features.lr_factor(step + 2),
                            pipeline_schedule=pipeline_schedule_for(self.run, self.run.num_microbatches))
        if self.layer_timer is not None and self.layer_timer.attached:
            self.timed_iterations += 1
            if self.timed_iterations >= self.cfg.epas.epas_cost_timing_iters:
                self.layer_timer.detach()
        return result

    def _stop_non_finite(self, iteration: int, error: NonFiniteError) -> NonFiniteError:
        """The error that ends the run at a non-finite step (see :mod:`epas_megatron.engine.step`):
        saves in flight (of earlier iterations) complete, nothing of this state is saved, and the
        message names the iteration and the checkpoint to resume from."""
        self.checkpointer.finish()
        return self.reporter.non_finite_error(iteration, error, self.checkpointer.latest_iteration())

    def close(self) -> None:
        """Flush metrics and tear down process groups."""
        self.exit_signal.restore()
        if self.metrics is not None:
            self.metrics.close()
        unfreeze_long_lived(bool(self.froze_long_lived))
        self.froze_long_lived = None
        if dist.is_initialized():
            destroy_distributed()
