"""The training loop: config -> model/optimizer -> steps -> switches -> checkpoints -> metrics.

Data flows one way: :func:`resolve_run` (no processes) -> :meth:`Trainer.setup` (process groups,
data, model) -> :meth:`Trainer.train` (steps, evaluation, EPAS switches, checkpoints) -> a
``SUMMARY {json}`` line.

**The switch event** (:meth:`Trainer.apply_switch`) is the one place where the sharing region
changes. The schedule decides *what* changes; the trainer carries it out by rebuilding model
chunks (new layer specs, and a new pipeline layout when stages are rebalanced), DDP, optimizer
and LR scheduler for the new plan and moving the training state into them. The state moves in
the distributed-checkpoint format, which makes this exact: the V rows (and their Adam moments)
of a layer's fused QKV load into its new V projection, the Q/K rows into the frozen projection
(which no optimizer or DDP buffer sees), layers that moved to another pipeline stage are read by
their new owner, and everything else round-trips bit for bit. ``--epas-switch-mode memory`` (the
default) exchanges that state in memory, point to point between ranks for moved layers
(:mod:`epas_megatron.checkpointing.in_memory`); ``checkpoint`` saves it to a staging checkpoint
and loads it back. The two give bit-identical runs, and a resume is the same load, so runs
resumed before or after a switch match uninterrupted ones.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from epas_megatron.checkpointing import checkpoint as ckpt
from epas_megatron.config.cli import dump_yaml, to_dict
from epas_megatron.config.validation import ResolvedRun, model_shape_of
from epas_megatron.errors import ConfigError, NonFiniteError
from epas_megatron.runtime.distributed import ParallelDims, destroy_distributed, init_distributed


class ExitSignal:
    """SIGTERM / SIGUSR1 (Slurm's pre-timeout signal) request a checkpoint and a clean exit.

    The handler only sets a flag; the loop checks it after each iteration, agreeing across ranks
    with an all-reduce so that every rank saves the same iteration. The all-reduce carries the
    signal number itself (the largest one received anywhere), so every rank reports the same
    reason even when Slurm's signal reached the ranks in different iterations.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: Optional[int] = None
        self._previous = {}

    def install(self) -> None:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self) -> Optional[int]:
        """The signal number if any rank has received one (the same on every rank), else None."""
        from epas_megatron.runtime.distributed import all_reduce_values

        (signum,) = all_reduce_values([float(self.received or 0)], op=dist.ReduceOp.MAX)
        return int(signum) or None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Owns process groups, data iterators, model chunks, optimizer and metrics of one run."""

    def __init__(self, run: ResolvedRun, exit_signal: Optional[ExitSignal] = None):
        self.run = run
        self.cfg = run.cfg
        self.out = Path(self.cfg.logging.output_dir)
        self.dims: Optional[ParallelDims] = None
        self.plan = None  # BuildPlan of the current region (set by setup)
        self.state = None  # TrainingState built from it
        self.iteration = 0
        self.consumed_samples = 0
        self.metrics = None
        self.exit_signal = exit_signal or ExitSignal()
        self._own_signal_handler = exit_signal is None
        self.switch_seconds: list[float] = []
        self.progress = None  # TrainingProgress of the loop (set by train)
        self.resumed_train_seconds = 0.0
        """Training time (steps and switches) before this run, from the resumed checkpoint."""
        self.skipped_eval_regions: set[int] = set()  # --eval-regions sizes reported as skipped
        self.layer_timer = None
        self.timed_iterations = 0
        self.async_saver = None  # AsyncCheckpointer with --async-save (made in setup)

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

    # ------------------------------------------------------------------ output
    def print(self, *args) -> None:
        """Print on the logging rank."""
        if self.dims is None or self.dims.is_logging_rank:
            print(*args, flush=True)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Process groups, data, tokenizer, model, optimizer, optional resume."""
        cfg, run = self.cfg, self.run
        if cfg.training.deterministic:
            from epas_megatron.runtime.device import use_deterministic_kernels

            use_deterministic_kernels()
        self.dims = init_distributed(cfg.parallel.tp, cfg.parallel.pp, run.vpp, cfg.training.seed)
        self._prepare_data()
        self._build_datasets()
        self._write_run_dir()
        self.print(self._banner())
        for warning in run.warnings:
            self.print(f"WARNING: {warning}")
        for notice in run.notices:
            self.print(notice)

        start_iteration = 0
        if run.load_dir is not None:
            start_iteration = run.load_meta["iteration"]
            saved = run.load_meta.get("epas_schedule")
            if saved is not None:
                run.schedule.check_resume(saved, start_iteration)
            saved_ltd = run.load_meta.get("random_ltd")
            if run.random_ltd is not None:
                run.random_ltd.check_resume(saved_ltd, start_iteration)
            elif saved_ltd is not None:
                raise ConfigError(f"--load: the checkpoint at iteration {start_iteration} was trained with --random-ltd; resume "
                                  "with the same --random-ltd-* flags (or start from its weights with --pretrained)")
        self.iteration = start_iteration
        self.plan = self._plan_for(run.schedule.sharing_layers(start_iteration))
        if run.schedule.enabled:
            self.print(run.schedule.describe(cfg.training.train_iters))
            if run.rebalance:
                from epas_megatron.parallel.stage_plan import describe_schedule_layouts

                self.print("pipeline stages, rebalanced at every switch (predicted costs from the FLOPs model):")
                self.print(describe_schedule_layouts(self.plan, run.schedule, memory=self.memory_limit()))
        if run.random_ltd is not None:
            self.print(run.random_ltd.describe(cfg.training.train_iters) +
                       ("; LayerToken LR" if cfg.random_ltd.random_ltd_layer_token_lr else ""))
        self.build(initialize=run.load_dir is None and run.pretrained_dir is None)
        if run.load_dir is not None:
            self._load(run.load_dir)
            self.print(f"resumed from {run.load_dir} at iteration {self.iteration} ({self.consumed_samples} samples consumed)")
        elif run.pretrained_dir is not None:
            ckpt.load_checkpoint(run.pretrained_dir, self.model, self.optimizer, restore_rng=False, weights_only=True)
            self.print(f"initialised from the weights of {run.pretrained_dir} (fresh optimizer, iteration 0)")
        self._build_data_iterators()
        if cfg.checkpoint.async_save:
            self.async_saver = ckpt.AsyncCheckpointer()
        self.metrics = self._metrics_logger()
        if self._own_signal_handler:
            self.exit_signal.install()

    def _prepare_data(self) -> None:
        from epas_megatron.data.sources import prepare_data_sources

        self.data = prepare_data_sources(self.cfg.data)
        if self.data.tokenizer.vocab_size > self.cfg.model.vocab_size:  # resolve_run sized it; a changed file could not be
            raise ConfigError(f"the tokenizer {self.data.tokenizer_path} has {self.data.tokenizer.vocab_size} pieces, more than "
                              f"the model's vocabulary {self.cfg.model.vocab_size} resolved at start; was it replaced during start-up?")

    def _write_run_dir(self) -> None:
        if self.dims.is_logging_rank:
            from epas_megatron.runtime.fs import atomic_write_text

            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.out / "config.yaml", dump_yaml(self.cfg))

    def _banner(self) -> str:
        cfg, d = self.cfg, self.dims
        m, t = cfg.model, cfg.training
        return (
            f"epas-megatron: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}/{m.num_query_groups}, "
            f"ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, seq {t.seq_length} | world {d.world_size} = TP {d.tp} x PP {d.pp}"
            f"{f' (VPP {d.vpp})' if d.vpp else ''} x DP {d.dp} | global batch {t.global_batch_size} = {self.run.num_microbatches} micro-batches"
            f" x {t.micro_batch_size} x DP {d.dp} | {self.run.precision}, {self._layers_description()},"
            f" {'CUDA' if torch.cuda.is_available() else 'CPU (gloo)'}"
            f"{', distributed optimizer' if self.run.use_distributed_optimizer else ''}"
        )

    def _layers_description(self) -> str:
        from epas_megatron.model.fusions import KernelAvailability, describe, fusion_off_reasons, fusion_settings

        attention = "TE attention" if self.run.backend == "transformer_engine" else f"{self.cfg.model.core_attention} attention"
        kernels, backend = KernelAvailability.detect(), self.run.backend
        return f"{backend} layers, {attention}, {describe(fusion_settings(kernels, backend), fusion_off_reasons(kernels, backend))}"

    def _metrics_logger(self):
        from epas_megatron.metrics.logger import MetricsLogger

        lg = self.cfg.logging
        return MetricsLogger(
            self.out,
            enabled=self.dims.is_logging_rank,
            tensorboard=lg.tensorboard,
            wandb=lg.wandb,
            wandb_project=lg.wandb_project,
            wandb_run_name=lg.wandb_run_name,
            config=to_dict(self.cfg),
        )

    # ------------------------------------------------------------------ model
    def _arch(self):
        from epas_megatron.model.builder import architecture_from_config

        return architecture_from_config(self.cfg.model)

    def _plan_for(self, sharing_layers):
        """The build plan for a sharing region: the pipeline layout planned for it when stages
        are rebalanced (starting from the current one), the fixed --pipeline-layout otherwise."""
        from epas_megatron.model.build_plan import BuildPlan, RecomputeSettings

        if self.plan is not None:
            layout = self.plan.layout
            if self.run.rebalance:
                layout = self._rebalanced_layout(sharing_layers)
            return self.plan.with_region(sharing_layers, layout)
        p, m = self.cfg.parallel, self.cfg.model
        plan = BuildPlan.for_region(
            self._arch(),
            sharing_layers,
            seq_length=self.cfg.training.seq_length,
            tp=p.tp,
            pp=p.pp,
            vpp=self.run.vpp,
            layout=self.run.layout,
            sequence_parallel=p.sequence_parallel,
            precision=self.run.precision,
            recompute=RecomputeSettings(p.recompute, p.recompute_method, p.recompute_num_layers),
            backend=self.run.backend,
            core_attention=m.core_attention,
            share=self.cfg.epas.epas_share,
            detach_shared=self.cfg.epas.epas_detach_shared,
            exclude_last=self.cfg.epas.epas_exclude_last,
            deterministic=self.cfg.training.deterministic,
            random_ltd=self._random_ltd_settings(),
        )
        if self.run.rebalance:
            self.plan = plan  # the planner starts from it
            plan = plan.with_region(sharing_layers, self._rebalanced_layout(sharing_layers))
        return plan

    def _random_ltd_settings(self):
        from epas_megatron.model.build_plan import RandomLTDSettings

        if self.run.random_ltd is None:
            return None
        return RandomLTDSettings(self.run.random_ltd.layers, seed=self.cfg.training.seed, kernels=self.cfg.random_ltd.random_ltd_kernels)

    def _rebalanced_layout(self, sharing_layers):
        from epas_megatron.parallel.stage_plan import plan_stage_layout_noted

        layout, notice = plan_stage_layout_noted(self.plan, sharing_layers, timer=self.layer_timer, memory=self.memory_limit())
        if notice:
            self.print(f"memory budget: {notice}")
        return layout

    def memory_limit(self):
        """The per-rank memory budget of stage rebalancing (None: none), from
        --epas-memory-budget-gb or, on CUDA, 90% of the GPU's memory."""
        from epas_megatron.metrics.memory_model import RankMemorySettings
        from epas_megatron.parallel.memory_plan import memory_limit_for

        budget, explicit = self.cfg.epas.epas_memory_budget_gb, self.cfg.epas.epas_memory_budget_gb is not None
        if budget is None and torch.cuda.is_available():
            budget = 0.9 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        p = self.cfg.parallel
        if budget is None or (p.recompute == "full" and not explicit):
            return None
        if p.recompute == "full":
            raise ConfigError("--epas-memory-budget-gb: the memory model does not cover --recompute full yet "
                              "(use --recompute selective or none, or drop the budget)")
        settings = RankMemorySettings(vocab_size=self.plan.arch.vocab_size, tp=p.tp, dp=self.run.dp,
                                      num_microbatches=self.run.num_microbatches, precision=self.run.precision,
                                      distributed_optimizer=self.run.use_distributed_optimizer,
                                      sequence_parallel=p.sequence_parallel, recompute=p.recompute, share=self.cfg.epas.epas_share)
        return memory_limit_for(self.plan, settings, self.cfg.training.micro_batch_size, budget)

    def build(self, initialize: bool = True) -> None:
        """Model chunks, DDP, optimizer and LR schedule for the current plan.

        ``initialize=False`` skips the (layout-independent) weight initialisation when a
        checkpoint load follows."""
        from epas_megatron.training.state import build_training_state

        self.state = None  # the previous region's model and optimizer go before the new ones come
        gc.collect()  # (Megatron's DDP and optimizer hold reference cycles)
        self.state = build_training_state(self.plan, self._optimizer_settings(), seed=self.cfg.training.seed if initialize else None)
        if self.run.rebalance and self.cfg.epas.epas_cost_model == "measured":
            from epas_megatron.parallel.layer_timing import LayerTimer

            self.layer_timer = self.layer_timer or LayerTimer()
            self.layer_timer.attach(self.model)
            self.timed_iterations = 0

    def _optimizer_settings(self):
        from epas_megatron.training.optimizer import OptimizerSettings

        t = self.cfg.training
        return OptimizerSettings(
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            precision=self.run.precision,
            loss_scale=t.loss_scale,
            initial_loss_scale=t.initial_loss_scale,
            min_loss_scale=t.min_loss_scale,
            loss_scale_window=t.loss_scale_window,
            hysteresis=t.hysteresis,
            use_distributed_optimizer=self.run.use_distributed_optimizer,
            overlap_grad_reduce=self.cfg.parallel.overlap_grad_reduce,
            warmup_iters=t.lr_warmup_iters,
            decay_iters=t.train_iters,
            decay_style=t.lr_decay_style,
            lr_schedule_units=self.run.random_ltd.lr_steps(t.lr_warmup_iters, t.train_iters) if self._layer_token_lr else None,
        )

    @property
    def _layer_token_lr(self) -> bool:
        return self.run.random_ltd is not None and self.cfg.random_ltd.random_ltd_layer_token_lr

    # ------------------------------------------------------------------ data
    def _build_datasets(self) -> None:
        from epas_megatron.data.datasets import build_gpt_datasets

        t = self.cfg.training
        valid_samples = (t.eval_iters * t.global_batch_size) if t.eval_interval else 0
        remaining = t.train_iters * t.global_batch_size
        self.train_ds, self.valid_ds = build_gpt_datasets(
            self.data.prefixes,
            self.cfg.data.split,
            seq_length=t.seq_length,
            train_samples=max(remaining, t.global_batch_size),
            valid_samples=valid_samples,
            seed=t.seed,
            tokenizer=self.data.tokenizer,
            cache_dir=self.data.cache_dir,
        )

    def _build_data_iterators(self) -> None:
        from megatron.core import parallel_state

        from epas_megatron.data.datasets import build_data_iterator
        from epas_megatron.training.step import stage_batch_keys

        t = self.cfg.training
        self.dp_rank = parallel_state.get_data_parallel_rank()
        # A chunk's pipeline position (first/last stage) is the same in every layout a switch makes.
        self.train_iterators = [
            build_data_iterator(self.train_ds, t.micro_batch_size, self.dp_rank, self.dims.dp, self.consumed_samples,
                                keys=stage_batch_keys(chunk))
            for chunk in self.model
        ]

    def _valid_iterators(self):
        from epas_megatron.data.datasets import build_data_iterator
        from epas_megatron.training.step import stage_batch_keys

        t = self.cfg.training
        return [build_data_iterator(self.valid_ds, t.micro_batch_size, self.dp_rank, self.dims.dp, 0, keys=stage_batch_keys(chunk))
                for chunk in self.model]

    # ------------------------------------------------------------------ checkpoints
    def _meta(self) -> dict:
        d = self.dims
        return {
            "model": model_shape_of(self.cfg),
            "parallel": {"tp": d.tp, "pp": d.pp, "dp": d.dp, "vpp": d.vpp, "layout": self.layout,
                         "use_distributed_optimizer": self.run.use_distributed_optimizer},
            "precision": self.run.precision,
            "epas_schedule": self.run.schedule.state_dict(),
            "random_ltd": self.run.random_ltd.state_dict(self.iteration) if self.run.random_ltd is not None else None,
            "epas_share": self.cfg.epas.epas_share,
            "sharing_layers": list(self.sharing_layers),
            "tokenizer_model": self.data.tokenizer_path,
            "config": to_dict(self.cfg),
            "consumed_samples": self.consumed_samples,
            "backend": self.run.backend,
        }

    def _train_state(self) -> dict:
        from epas_megatron.runtime.distributed import all_reduce_values

        train_seconds = self.progress.train_seconds if self.progress is not None else self.resumed_train_seconds
        # Every rank clocks its own time; the checkpoint's common state must be one value (the slowest rank's).
        (train_seconds,) = all_reduce_values([train_seconds], op=dist.ReduceOp.MAX)
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples, "sharing_layers": list(self.sharing_layers),
                "train_time_s": train_seconds}

    def save(self, root: Optional[Path] = None, keep_last: Optional[int] = None) -> Path:
        """Checkpoint the full training state at the current iteration (synchronously: a save
        in flight is completed first)."""
        root = root or self.run.checkpoint_root
        keep = self.cfg.checkpoint.keep_last if keep_last is None else keep_last
        self._finish_async_saves()
        return ckpt.save_checkpoint(
            root, self.iteration, self.model, self.optimizer, self.scheduler, self._train_state(), self._meta(), keep_last=keep
        )

    def checkpoint(self) -> None:
        """Save the run's checkpoint of this iteration: in the background with --async-save."""
        if self.async_saver is None:
            self.print(f"saved checkpoint {self.save()}")
            return
        for done in self.async_saver.finish():
            self.print(f"saved checkpoint {done}")
        target = self.async_saver.save(self.run.checkpoint_root, self.iteration, self.model, self.optimizer, self.scheduler,
                                       self._train_state(), self._meta(), keep_last=self.cfg.checkpoint.keep_last)
        self.print(f"saving checkpoint {target} in the background")
        if os.environ.get("EPAS_TEST_KILL_DURING_ASYNC_SAVE") == str(self.iteration):  # fault injection (tests)
            os.kill(os.getpid(), signal.SIGKILL)

    def _poll_async_saves(self) -> None:
        if self.async_saver is not None and self.async_saver.in_flight:
            for done in self.async_saver.poll():
                self.print(f"saved checkpoint {done}")

    def _finish_async_saves(self) -> None:
        if self.async_saver is not None:
            for done in self.async_saver.finish():
                self.print(f"saved checkpoint {done}")

    def _load(self, checkpoint_dir: Path) -> None:
        meta = ckpt.read_meta(checkpoint_dir)
        d = self.dims
        saved = meta.get("parallel", {})
        same_sizes = (saved.get("tp"), saved.get("pp"), saved.get("dp")) == (d.tp, d.pp, d.dp)
        state = ckpt.load_checkpoint(checkpoint_dir, self.model, self.optimizer, self.scheduler, restore_rng=same_sizes)
        self.iteration = int(state.get("iteration", meta["iteration"]))
        self.consumed_samples = int(state.get("consumed_samples", meta.get("consumed_samples", 0)))
        self.resumed_train_seconds = float(state.get("train_time_s", 0.0))

    # ------------------------------------------------------------------ the switch event
    def apply_switch(self, sharing_layers: tuple[int, ...]) -> dict:
        """Change the sharing region (and pipeline layout) with --epas-switch-mode. See module doc."""
        start = time.perf_counter()
        previous_layout = self.layout
        if self.cfg.epas.epas_switch_mode == "checkpoint":
            info = self._switch_through_checkpoint(tuple(sharing_layers))
        else:
            info = self._switch_in_memory(tuple(sharing_layers))
        seconds = time.perf_counter() - start
        self.switch_seconds.append(seconds)
        return {"seconds": seconds, "layout": self.layout, "previous_layout": previous_layout,
                "mode": self.cfg.epas.epas_switch_mode, **info}

    def _switch_through_checkpoint(self, sharing_layers: tuple[int, ...]) -> dict:
        """Save the whole state to a staging checkpoint, rebuild, load it back."""
        staging = self.out / ".switch_staging"
        if self.dims.is_logging_rank and staging.exists():
            shutil.rmtree(staging)
        dist.barrier()
        saved = self.save(root=staging, keep_last=0)
        written = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file()) if self.dims.is_logging_rank else 0
        self.plan = self._plan_for(sharing_layers)
        self.build(initialize=False)
        self._load(saved)
        dist.barrier()
        if self.dims.is_logging_rank:
            shutil.rmtree(staging, ignore_errors=True)
        return {"bytes_written": written}

    def _switch_in_memory(self, sharing_layers: tuple[int, ...]) -> dict:
        """Hold the state's tensors, release the old objects, rebuild, move the tensors in
        (:mod:`epas_megatron.checkpointing.in_memory`)."""
        from epas_megatron.checkpointing.in_memory import drop_gradients, hold_state, restore_state
        from epas_megatron.runtime.rng import preserved_rng_state

        held = hold_state(self.model, self.optimizer, self.scheduler, {})
        drop_gradients(self.model)
        self.plan = self._plan_for(sharing_layers)
        with preserved_rng_state():  # building draws from it; a checkpoint load restores it
            self.build(initialize=False)
            stats = restore_state(held, self.model, self.optimizer, self.scheduler)
        del held
        from epas_megatron.runtime.distributed import all_reduce_values

        (moved,) = all_reduce_values([float(stats.bytes_received)])
        return {"bytes_written": 0, "bytes_between_ranks": int(moved)}

    # ------------------------------------------------------------------ loop
    def _flops_of_iteration(self, iteration: int) -> float:
        """Model FLOPs of ``iteration`` (1-based): its sharing region and, under Random-LTD, the
        tokens each layer keeps in it (the source of a sharing region projects Q/K/V for all)."""
        from epas_megatron.metrics.flops import Convention, layerwise_forward_flops
        from epas_megatron.sharing.schedule import LayerMode

        t, schedule = self.cfg.training, self.run.schedule
        plan = self.plan.with_region(schedule.sharing_layers(iteration), self.plan.layout)
        modes = ["compute" if mode != LayerMode.SHARE else f"share_{plan.share}" for mode in plan.modes]
        tokens = qkv_tokens = None
        if self.run.random_ltd is not None:
            tokens = self.run.random_ltd.tokens_per_layer(iteration - 1)
            qkv_tokens = [t.seq_length if mode == LayerMode.SOURCE else n for mode, n in zip(plan.modes, tokens)]
        forward = layerwise_forward_flops(plan.arch.flops_shape(t.seq_length), modes, tokens, Convention.MEGATRON, qkv_tokens)
        return float(3 * t.global_batch_size * forward)

    def _flops_per_iteration(self, first: Optional[int] = None, last: Optional[int] = None) -> float:
        """Mean model FLOPs per iteration over iterations ``first..last`` (default: the current one)."""
        last = self.iteration if last is None else last
        first = last if first is None else first
        return sum(self._flops_of_iteration(i) for i in range(first, last + 1)) / (last - first + 1)

    def _peak_name(self) -> str:
        if self.cfg.logging.peak_tflops:
            return self.cfg.logging.peak_tflops
        if not torch.cuda.is_available():
            return "cpu"
        from epas_megatron.metrics.flops import peak_name_for_device

        return peak_name_for_device(torch.cuda.get_device_name())

    def evaluate(self, region: Optional[int] = None) -> float:
        """Validation loss over --eval-iters global batches, with the region in training or, given
        ``region`` (a size), the same weights with that many layers sharing."""
        from epas_megatron.training.step import eval_step

        t = self.cfg.training
        num_microbatches = self.run.num_microbatches * t.eval_iters
        if region is None or region == len(self.sharing_layers):
            result = eval_step(self.model, self._valid_iterators(), num_microbatches=num_microbatches,
                               seq_length=self.schedule_seq_length, micro_batch_size=t.micro_batch_size)
        else:
            from epas_megatron.training.region_eval import evaluate_region

            result = evaluate_region(self.plan, self._region_layers(region), self.model, self._valid_iterators,
                                     num_microbatches=num_microbatches, micro_batch_size=t.micro_batch_size)
        return result.lm_loss

    def _region_layers(self, size: int) -> tuple[int, ...]:
        """The sharing layers of a region of ``size`` layers in this model."""
        return self.plan.region_layers(size, flag="--eval-regions")

    def train(self) -> dict:
        """Run until --train-iters (or --exit-interval, or an exit signal); return the summary."""
        from epas_megatron.training.progress import TrainingProgress

        t = self.cfg.training
        peak = self._peak_name()
        self.print(f"throughput: TFLOP/s per device from the sharing-aware model FLOPs (3 x forward matmuls, causal attention halved, as megatron-core 0.19); MFU peak: {peak}")
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
                self._log_interval(progress, result)
            if t.eval_interval and self.valid_ds is not None and self.iteration % t.eval_interval == 0:
                last_valid = self._log_validation(progress)
            self._poll_async_saves()
            if self.cfg.checkpoint.save_interval and self.iteration % self.cfg.checkpoint.save_interval == 0:
                self.checkpoint()
            signum = self.exit_signal.agreed()
            if signum is not None:
                exit_reason = f"signal {signum}"
                break

        stopped_early = self.iteration < t.train_iters
        self._finish_async_saves()
        if (stopped_early or not self.cfg.checkpoint.no_save_final) and ckpt.latest_iteration(self.run.checkpoint_root) != self.iteration:
            self.checkpoint()
            self._finish_async_saves()
        if stopped_early and exit_reason == "completed":
            exit_reason = "exit_interval"
        summary = self._summary(progress, last_valid, exit_reason)
        self.print("SUMMARY " + json.dumps(summary))
        return summary

    def _train_step(self):
        """One iteration over all micro-batches (and the layer timer's bookkeeping)."""
        from epas_megatron.training.step import train_step

        ltd, step = self.run.random_ltd, self.iteration  # the step about to run (completed iterations so far)
        if ltd is not None:
            from epas_megatron.random_ltd.model import set_kept_tokens

            set_kept_tokens(self.model, ltd.kept_tokens(step))
        result = train_step(self.model, self.optimizer, self.scheduler, self.train_iterators,
                            num_microbatches=self.run.num_microbatches, seq_length=self.schedule_seq_length,
                            micro_batch_size=self.cfg.training.micro_batch_size,
                            lr_increment=ltd.layer_tokens(step) if self._layer_token_lr else 1)
        if self.layer_timer is not None and self.layer_timer.attached:
            self.timed_iterations += 1
            if self.timed_iterations >= self.cfg.epas.epas_cost_timing_iters:
                self.layer_timer.detach()
        return result

    def _stop_non_finite(self, iteration: int, error: NonFiniteError) -> NonFiniteError:
        """The error that ends the run at a non-finite step (see :mod:`epas_megatron.training.step`):
        saves in flight (of earlier iterations) complete, nothing of this state is saved, and the
        message names the iteration and the checkpoint to resume from."""
        self._finish_async_saves()
        root = self.run.checkpoint_root
        last_good = ckpt.latest_iteration(root)
        self.metrics.log({"kind": "error", "iteration": iteration, "error": str(error)}, step=iteration)
        resume = (f"the last good checkpoint is iteration {last_good}: resume with --load {root}"
                  if last_good is not None else "no checkpoint was saved before it")
        return NonFiniteError(f"iteration {iteration}: {error}; training stopped without saving this state ({resume}; "
                              "a learning rate too high for the model is the usual cause: lower --lr or lengthen --lr-warmup-iters)")

    def _switch(self, target: tuple[int, ...], iteration: int, progress) -> None:
        """Carry out the switch before ``iteration``'s step, and report it."""
        info = self.apply_switch(target)
        source = self.run.schedule.source_layer(iteration)
        in_iterations = progress.switch(info["seconds"])
        cost = f" (= {in_iterations:.1f} iterations)" if in_iterations is not None else ""
        relayout = f"; pipeline layout {info['previous_layout']} -> {info['layout']}" if info["layout"] != info["previous_layout"] else ""
        self.print(
            f"EPAS switch at iteration {iteration}: sharing layers {list(target)} (source layer {source}); "
            f"{'in-memory rebuild' if info['mode'] == 'memory' else 'save/rebuild/load'} took {info['seconds']:.2f}s{cost}{relayout}"
        )
        self.metrics.log({"kind": "switch", "iteration": iteration, "sharing_layers": list(target), "source_layer": source,
                          "layout": info["layout"], "previous_layout": info["previous_layout"], "switch_seconds": info["seconds"], "switch_mode": info["mode"],
                          "switch_bytes_written": info["bytes_written"],
                          "switch_bytes_between_ranks": info.get("bytes_between_ranks"),
                          "switch_cost_iterations": in_iterations}, step=iteration, prefix="epas")

    def _log_interval(self, progress, result) -> None:
        first = max(self.iteration - self.cfg.logging.log_interval + 1, progress.start_iteration + 1, 1)
        extra = {"consumed_samples": self.consumed_samples, "sharing_layers": list(self.sharing_layers),
                 "region_size": len(self.sharing_layers), "layout": self.layout}
        if self.run.random_ltd is not None:
            extra.update(self._random_ltd_record())
        record = progress.interval_record(
            self.iteration, result, self.optimizer.param_groups[0]["lr"], self._flops_per_iteration(first, self.iteration), extra,
        )
        self.metrics.log(record, step=self.iteration)
        self.print(progress.console_line(record))

    def _random_ltd_record(self) -> dict:
        """Random-LTD's state after the current iteration: the kept tokens of its last step and
        DeepSpeed's layer-token count (and the mean tokens per layer it amounts to)."""
        ltd, t = self.run.random_ltd, self.cfg.training
        step_tokens = ltd.layer_tokens(self.iteration - 1)
        return {"random_ltd_kept_tokens": ltd.kept_tokens(self.iteration - 1),
                "consumed_layer_tokens": ltd.consumed_layer_tokens(self.iteration),
                "layer_averaged_seq_length": step_tokens / (t.global_batch_size * ltd.num_layers)}

    def _log_validation(self, progress) -> tuple[int, dict[int, float]]:
        """Validation loss of the region in training and of every --eval-regions region (one
        ``"kind": "valid"`` record each); returns (the region in training, {region size: loss})."""
        from epas_megatron.training.progress import perplexity

        current = len(self.sharing_layers)
        regions = [current]
        if self.run.eval_regions is not None:
            regions, skipped = self.run.eval_regions.resolve(current, self.cfg.training.eval_untrained_regions)
            for size in sorted(set(skipped) - self.skipped_eval_regions):
                self.print(f" --eval-regions: region {size} is skipped until the region in training has grown to it "
                           f"(now {current}); --eval-untrained-regions evaluates it anyway")
            self.skipped_eval_regions.update(skipped)
        losses = {size: self.evaluate(size) for size in sorted(set(regions) | {current})}
        for size, loss in losses.items():
            in_training = size == current
            record = {"kind": "valid", "iteration": self.iteration, "region": size,
                      "sharing_layers": list(self._region_layers(size)), "in_training": in_training, "lm_loss": loss,
                      "ppl": perplexity(loss), "consumed_samples": self.consumed_samples,
                      "train_time_s": progress.train_seconds}
            self.metrics.log(record, step=self.iteration, prefix=f"valid/region_{size}", scalars=("lm_loss", "ppl"))
            if in_training:  # the run's main validation curve keeps its name
                self.metrics.log(record, step=self.iteration, prefix="valid", scalars=("lm_loss", "ppl"), to_jsonl=False)
                self.print(f" validation at iteration {self.iteration}: lm loss {loss:.6E} | ppl {perplexity(loss):.3f}")
        for size, loss in losses.items():
            if size != current:
                self.print(f"   at region {size}: lm loss {loss:.6E} | ppl {perplexity(loss):.3f} | "
                           f"{loss - losses[current]:+.4f} vs the region in training ({current})")
        return current, losses

    def _summary(self, progress, last_valid: tuple[Optional[int], dict[int, float]], exit_reason: str) -> dict:
        valid_region, valid_losses = last_valid
        d, t = self.dims, self.cfg.training
        return {
            "iterations": self.iteration,
            "train_iters": t.train_iters,
            "iterations_this_run": self.iteration - progress.start_iteration,
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
            "sharing_layers": list(self.sharing_layers),
            "layout": self.layout,
            "switch_seconds": self.switch_seconds,
            "precision": self.run.precision,
            "skipped_iterations": progress.skipped_iterations,
            "exit_reason": exit_reason,
            "output_dir": str(self.out),
            **({"random_ltd": self._random_ltd_record()} if self.run.random_ltd is not None and self.iteration else {}),
        }

    def close(self) -> None:
        """Flush metrics and tear down process groups."""
        self.exit_signal.restore()
        if self.metrics is not None:
            self.metrics.close()
        if dist.is_initialized():
            destroy_distributed()
