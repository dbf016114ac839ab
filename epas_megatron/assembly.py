"""One assembly: every source of a model -> the :class:`~epas_megatron.model.build_plan.BuildPlan`
(and, for training, the optimizer settings and the checkpoint metadata).

A model is described by one of three sources, and every entry point goes through the function
for its source instead of rebuilding a plan by hand:

* a **resolved run** (:class:`~epas_megatron.validation.ResolvedRun`): the trainer, its
  switches, ``epas-plan``, in-process tests -- :func:`plan_for_run`, :func:`optimizer_settings_for_run`,
  :func:`checkpoint_meta_for_run`;
* a **checkpoint's metadata** (:class:`~epas_megatron.checkpointing.metadata.CheckpointMeta`):
  ``epas-eval``, ``epas-generate`` and the lm-eval model, ``epas-convert hf-export`` --
  :func:`checkpoint_regions`, :func:`plan_for_checkpoint`; ``epas-convert hf-import`` writes one
  with :func:`checkpoint_meta_for_import`;
* a **preset** with overrides (benchmarks, which build models without a run) --
  :func:`plan_for_preset`.

An option that changes what is built is not named here: the assembly asks the registry of build
options (:mod:`epas_megatron.model.option_registry`) for a run's or a checkpoint's. Precision and
layer backend are chosen in :mod:`epas_megatron.model.fusions` (``choose_precision``,
``choose_backend``), the architecture in :mod:`epas_megatron.model.architecture`.

Layering: this module sits above config, model, sharing, checkpointing and the training
components it configures (``training.optimizer``), and below the trainer, evaluation,
inference and the command-line modules that call it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from epas_megatron.build_option import BuildOption
from epas_megatron.checkpointing.metadata import CheckpointMeta, SavedParallel, model_record
from epas_megatron.config.cli import to_dict
from epas_megatron.config.presets import get_preset
from epas_megatron.errors import ConfigError
from epas_megatron.metrics.rank_memory import RankMemorySettings
from epas_megatron.model.architecture import architecture_from_config, architecture_from_preset
from epas_megatron.model.build_plan import BuildPlan, RecomputeSettings
from epas_megatron.model.fusions import KernelAvailability, activation_kernels, choose_backend, choose_precision, fusion_settings
from epas_megatron.model.moc_sizes import MoCSettings
from epas_megatron.model.option_registry import build_options
from epas_megatron.model.v_placement import even_v_stage_sizes
from epas_megatron.parallel.memory_budget import MemoryLimit, memory_limit_for
from epas_megatron.parallel.pipeline_schedule import ScheduleActions
from epas_megatron.parallel.stage_layouts import balanced_layout_noted, balanced_v_layout
from epas_megatron.sharing.regions import parse_regions
from epas_megatron.validation import ResolvedRun

if TYPE_CHECKING:  # (its module imports Megatron's optimizer: seconds, which epas-plan never needs)
    from epas_megatron.engine.optimizer import OptimizerSettings


# ---------------------------------------------------------------------------- a resolved run
def plan_for_run(run: ResolvedRun, sharing_layers: Sequence[int] = ()) -> BuildPlan:
    """The plan of a run for ``sharing_layers``, with its fixed layout (``--pipeline-layout``, or
    Megatron's even split); a switch derives the next plans from it with
    :meth:`~epas_megatron.model.build_plan.BuildPlan.with_region` (and a rebalanced layout)."""
    cfg = run.cfg
    p, m, e = cfg.parallel, cfg.model, cfg.epas
    return BuildPlan.for_region(
        architecture_from_config(m),
        sharing_layers,
        seq_length=cfg.training.seq_length,
        tp=p.tp,
        pp=p.pp,
        vpp=run.vpp,
        layout=run.layout,
        sequence_parallel=p.sequence_parallel,
        precision=run.precision,
        recompute=RecomputeSettings(p.recompute, p.recompute_method, p.recompute_num_layers, recompute_modules(run)),
        backend=run.backend,
        core_attention=m.core_attention,
        share=e.epas_share,
        detach_shared=e.epas_detach_shared,
        shape=run.schedule.shape,
        deterministic=cfg.training.deterministic,
        options=build_options(cfg),
        v_stage_sizes=v_stage_sizes_for_run(run),
    )


def v_stage_sizes_for_run(run: ResolvedRun):
    """Under a V pipeline schedule, the V stage sizes a run starts from (``--pipeline-layout
    V:...``, or the even V split); None for Megatron's placements."""
    if not run.pipeline_schedule.v_placement:
        return None
    if run.v_layout is not None:
        return run.v_layout.stage_sizes
    return even_v_stage_sizes(run.cfg.model.num_layers, run.cfg.parallel.pp)


def pipeline_schedule_for(run: ResolvedRun, num_microbatches: int) -> Optional[ScheduleActions]:
    """The action lists the project's executor runs for ``num_microbatches`` (training or
    evaluation), or None where Megatron-Core's own schedule runs (1f1b, interleaved)."""
    if not run.pipeline_schedule.executor:
        return None
    return run.pipeline_schedule.actions(run.cfg.parallel.pp, num_microbatches)


def plan_after_switch(run: ResolvedRun, current: BuildPlan, sharing_layers: Sequence[int], *, timer=None,
                      memory: Optional[MemoryLimit] = None) -> tuple[BuildPlan, Optional[str]]:
    """The plan of the region ``sharing_layers`` that follows ``current`` (same settings): its
    pipeline layout rebalanced for that region when the run rebalances stages (from the FLOPs
    model, calibrated by a layer ``timer``, within a ``memory`` limit), ``current``'s otherwise;
    and the memory budget's notice (None when the budget changed nothing).

    Under V placement (``current.v_stage_sizes`` set) rebalancing chooses new V stage sizes
    (:func:`~epas_megatron.parallel.stage_layouts.balanced_v_layout`); the memory limit is not
    applied there -- the V balancer prices time only -- and the notice says so (a budget is never
    dropped silently; ``epas-plan`` shows each rank's memory under the V schedules)."""
    if not run.rebalance:
        return current.with_region(sharing_layers, current.layout), None
    if current.v_stage_sizes is not None:
        layout = balanced_v_layout(current, sharing_layers, timer=timer)
        notice = None if memory is None else (
            f"not applied under --pipeline-schedule {run.pipeline_schedule} (the V balancer prices time only); "
            f"the layout {layout} is the fastest, whatever each rank holds -- epas-plan shows every rank's memory")
        return replace(current.with_region(sharing_layers), v_stage_sizes=layout.stage_sizes), notice
    layout, notice = balanced_layout_noted(current, sharing_layers, timer=timer, memory=memory)
    return current.with_region(sharing_layers, layout), notice


def memory_kernels(kernels: KernelAvailability, backend: str = "local", options: Sequence[BuildOption] = ()) -> dict[str, bool]:
    """The memory model's kernel settings (``fused_norm``, ``fused_swiglu``, ``fused_rope`` of
    :class:`~epas_megatron.metrics.rank_memory.RankMemorySettings`) for a model built with
    ``kernels``, ``backend`` and the build ``options``: :func:`~epas_megatron.model.fusions.activation_kernels`,
    and RoPE fused where the builder sets ``apply_rope_fusion`` -- the flag of
    :func:`~epas_megatron.model.fusions.fusion_settings`, unless an option turns it off
    (Random-LTD; :func:`~epas_megatron.model.builder.make_transformer_config`)."""
    rope = fusion_settings(kernels, backend)["apply_rope_fusion"]
    rope = rope and all(option.transformer_config().get("apply_rope_fusion", True) for option in options)
    return {**activation_kernels(kernels, backend), "fused_rope": rope}


def recompute_modules(run: ResolvedRun) -> tuple[str, ...]:
    """The selective-recompute modules of a run (``--recompute-modules``, default core attention)."""
    return tuple(run.cfg.parallel.recompute_modules or ("core_attn",))


def memory_settings(run: ResolvedRun, kernels: Optional[KernelAvailability] = None) -> RankMemorySettings:
    """The memory model's settings for ``run`` on a node with ``kernels`` (default: this
    process's, :meth:`~epas_megatron.model.fusions.KernelAvailability.detect`)."""
    kernels = KernelAvailability.detect() if kernels is None else kernels
    p = run.cfg.parallel
    options = build_options(run.cfg)
    return RankMemorySettings(tp=p.tp, dp=run.dp, num_microbatches=run.num_microbatches,
                              precision=run.precision, distributed_optimizer=run.use_distributed_optimizer,
                              sequence_parallel=p.sequence_parallel, recompute=p.recompute if p.recompute != "full" else "none",
                              recompute_modules=recompute_modules(run),
                              share=run.cfg.epas.epas_share,
                              moc=MoCSettings.from_config(run.cfg),
                              pipeline_schedule=run.pipeline_schedule.name,
                              **memory_kernels(kernels, run.backend, options))


def stage_memory_limit(run: ResolvedRun, plan: BuildPlan, device_memory_gb: Optional[float] = None,
                       kernels: Optional[KernelAvailability] = None) -> Optional[MemoryLimit]:
    """The per-rank memory budget of stage rebalancing (None: none): ``--epas-memory-budget-gb``,
    else 90% of ``device_memory_gb`` (the GPU's memory; None on CPU); ``kernels`` as
    :func:`memory_settings`."""
    e, p = run.cfg.epas, run.cfg.parallel
    explicit = e.epas_memory_budget_gb is not None
    budget = e.epas_memory_budget_gb if explicit else (0.9 * device_memory_gb if device_memory_gb else None)
    if budget is None or (p.recompute == "full" and not explicit):
        return None
    if p.recompute == "full":
        raise ConfigError("--epas-memory-budget-gb: the memory model does not cover --recompute full yet "
                          "(use --recompute selective or none, or drop the budget)")
    return memory_limit_for(plan, memory_settings(run, kernels), run.cfg.training.micro_batch_size, budget)


def optimizer_settings_for_run(run: ResolvedRun, lr_schedule_units=None) -> "OptimizerSettings":
    """The optimizer and LR schedule of a run; ``lr_schedule_units``: the LR schedule's
    per-iteration units when they are not iterations (Random-LTD's layer tokens)."""
    from epas_megatron.engine.optimizer import OptimizerSettings  # Megatron's optimizer (see the import above)

    t = run.cfg.training
    return OptimizerSettings(
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        precision=run.precision,
        loss_scale=t.loss_scale,
        initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window,
        hysteresis=t.hysteresis,
        use_distributed_optimizer=run.use_distributed_optimizer,
        overlap_grad_reduce=run.cfg.parallel.overlap_grad_reduce,
        warmup_iters=t.lr_warmup_iters,
        decay_iters=t.train_iters,
        decay_style=t.lr_decay_style,
        lr_schedule_units=lr_schedule_units,
    )


def checkpoint_meta_for_run(run: ResolvedRun, *, dims, plan: BuildPlan, consumed_samples: int,
                            tokenizer_model: Optional[str]) -> CheckpointMeta:
    """What a checkpoint of ``run`` records, for the world ``dims`` (a ``ParallelDims``) and the
    current ``plan`` (its region and layout); the training features add their own records
    (:meth:`~epas_megatron.training.features.TrainingFeatures.checkpoint_meta`)."""
    cfg = run.cfg
    return CheckpointMeta(
        model=model_record(cfg.model),
        parallel=SavedParallel(tp=dims.tp, pp=dims.pp, dp=dims.dp, vpp=dims.vpp, layout=plan.layout_string,
                               use_distributed_optimizer=run.use_distributed_optimizer),
        precision=run.precision,
        epas_schedule=run.schedule.state_dict(),
        epas_share=cfg.epas.epas_share,
        sharing_layers=plan.sharing_layers,
        tokenizer_model=tokenizer_model,
        config=to_dict(cfg),
        consumed_samples=consumed_samples,
        backend=run.backend,
    )


# ---------------------------------------------------------------------------- a checkpoint
def checkpoint_meta_for_import(cfg, tokenizer_model: Optional[str], imported_from: str, sharing_layers: Sequence[int] = (),
                               share: str = "qk") -> CheckpointMeta:
    """The metadata of a model imported from elsewhere (weights only, no schedule) that was saved
    with ``sharing_layers`` sharing ``share`` (an exported EPAS model; none for a plain LLaMA);
    ``cfg``'s EPAS section holds its region shape (``--epas-exclude-last``, ``--epas-blocks``), so
    :func:`plan_for_checkpoint` builds it, as any checkpoint."""
    return CheckpointMeta(model=model_record(cfg.model), config=to_dict(cfg), tokenizer_model=tokenizer_model,
                          sharing_layers=tuple(sharing_layers), epas_share=share, extra={"imported_from": imported_from})


def checkpoint_regions(meta: CheckpointMeta, text: str, allow_untrained: bool = False, flag: str = "--regions") -> list[int]:
    """Region sizes (``'0,half,max'``) to run a checkpoint at, checked against its layers, its
    trained region, its ``--epas-exclude-last`` and ``--epas-blocks`` (:func:`~epas_megatron.sharing.regions.parse_regions`)."""
    return parse_regions(text, meta.trained_region, meta.shape, allow_untrained, flag=flag)


def plan_for_checkpoint(meta: CheckpointMeta, region: Optional[int] = None, *, flag: str = "--regions", tp: int = 1, pp: int = 1,
                        precision: str = "auto", backend: Optional[str] = None, cuda: Optional[bool] = None) -> BuildPlan:
    """The plan that loads a checkpoint with ``region`` layers sharing (None: its trained region),
    ending where its regions end; on ``tp`` x ``pp`` ranks, in ``precision`` ('auto': bf16 on a GPU,
    fp32 on CPU), with ``backend`` (None: the run's where it is available here, else local
    layers), at the run's sequence length and attention kernel. Needs the saved run config."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    cfg = meta.run_config()
    size = meta.trained_region if region is None else region
    sharing = meta.shape.layers(size, flag=flag)
    return BuildPlan.for_region(
        architecture_from_config(cfg.model),
        sharing,
        seq_length=cfg.training.seq_length,
        tp=tp,
        pp=pp,
        share=meta.epas_share,
        precision=choose_precision(precision, cuda),
        backend=backend or choose_backend(cfg.model.transformer_impl, cuda),
        core_attention=cfg.model.core_attention,
        shape=meta.shape,
        options=build_options(cfg, training=False),
    )


# ---------------------------------------------------------------------------- a preset
def plan_for_preset(preset: str, sharing_layers: Sequence[int] = (), *, seq_length: int, max_length: Optional[int] = None,
                    precision: str = "auto", cuda: Optional[bool] = None, tie_embeddings: bool = False,
                    moc: Optional[MoCSettings] = None, **settings) -> BuildPlan:
    """A benchmark's plan: ``preset``'s architecture (:func:`~epas_megatron.model.architecture.architecture_from_preset`)
    with room for ``max_length`` tokens (default ``seq_length``), sequences of ``seq_length``,
    ``sharing_layers`` sharing, in ``precision`` ('auto': bf16 on a GPU, fp32 on CPU), the LM head
    tied to the embedding with ``tie_embeddings``, Mixture-of-Channels MLPs with ``moc`` =
    ``(topk, groups)``; ``settings``: any other :class:`BuildPlan` field (tp, pp, layout, share, ...)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    arch = replace(architecture_from_preset(get_preset(preset), max_length or seq_length), tie_embeddings=tie_embeddings)
    options = tuple(settings.pop("options", ())) + ((moc,) if moc is not None else ())
    return BuildPlan.for_region(arch, sharing_layers, seq_length=seq_length, precision=choose_precision(precision, cuda),
                                options=options, **settings)
