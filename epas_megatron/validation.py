"""Check a :class:`RunConfig` and derive everything that does not need a process group.

:func:`resolve_run` runs before ``torch.distributed`` is initialised and before any data work;
every problem is a :class:`ConfigError` that names the flag to change (the entry points print it
and exit with status 2, leaving nothing written).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from epas_megatron.build_option import BuildFacts
from epas_megatron.checkpointing.metadata import CheckpointMeta
from epas_megatron.checkpointing.run_sources import resolve_sources
from epas_megatron.config.cli import flag_name, to_dict
from epas_megatron.config.presets import (
    EMBEDDED_DATA_LARGEST_PRESET,
    decoder_parameters,
    default_ffn_hidden_size,
    too_large_for_the_embedded_corpus,
)
from epas_megatron.config.schema import EMBEDDED_DATA, RunConfig
from epas_megatron.errors import ConfigError
from epas_megatron.model.build_plan import RECOMPUTE_MODULES, normalise_vpp
from epas_megatron.model.fusions import BackendChoice, choose_layers, choose_precision
from epas_megatron.model.option_registry import check_build_options
from epas_megatron.parallel.pipeline_schedule import (
    PIPELINE_SCHEDULES,
    PipelineSchedule,
    ScheduleFacts,
    megatron_schedule,
    pipeline_schedule,
)
from epas_megatron.sharing.regions import RegionSpec
from epas_megatron.sharing.schedule import SharingSchedule
from epas_megatron.sharing.shape import RegionShape

if TYPE_CHECKING:
    from epas_megatron.model.stage_layout import StageLayout, VStageLayout

_CHOICES = {
    "transformer_impl": ("auto", "local", "transformer_engine"),
    "core_attention": ("sdpa", "unfused"),
    "recompute": ("none", "selective", "full"),
    "recompute_method": ("uniform", "block"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "lr_decay_style": ("cosine", "linear", "constant"),
    "epas_share": ("qk", "kv"),
    "epas_rebalance": ("auto", "on", "off"),
    "epas_cost_model": ("flops", "measured"),
    "epas_switch_mode": ("memory", "checkpoint"),
    "random_ltd_kernels": ("auto", "torch", "deepspeed"),
}


@dataclass(frozen=True)
class ResolvedRun:
    """A validated config plus the values derived from it and from the world size."""

    cfg: RunConfig
    """The config, with defaults filled in (GQA groups, FFN size, global batch, ...)."""

    world_size: int
    """Processes."""

    dp: int
    """Data-parallel size."""

    num_microbatches: int
    """Micro-batches per iteration per DP rank."""

    vpp: Optional[int]
    """Model chunks per pipeline rank (from --pipeline-layout when given, else --vpp), None
    without interleaving: the one normalised value (:func:`~epas_megatron.model.build_plan.normalise_vpp`)."""

    layout: Optional["StageLayout"]
    """--pipeline-layout as a :class:`~epas_megatron.model.stage_layout.StageLayout` (None: even split)."""

    backend: str
    """'local' or 'transformer_engine'."""

    precision: str
    """'fp32', 'bf16' or 'fp16' ('auto' resolved)."""

    use_distributed_optimizer: bool
    """Shard optimizer state over DP."""

    schedule: SharingSchedule
    """The EPAS sharing schedule (disabled when --epas-target-layers is 0)."""

    rebalance: bool
    """Re-partition pipeline stages at switches."""

    checkpoint_root: Path
    """Where checkpoints are saved."""

    load_dir: Optional[Path]
    """The checkpoint to resume from (None: start fresh)."""

    load_meta: Optional[CheckpointMeta]
    """That checkpoint's run metadata."""

    pretrained_dir: Optional[Path] = None
    """Weights to start from when not resuming (--pretrained)."""

    warnings: tuple[str, ...] = ()
    """Things to print at start."""

    eval_regions: Optional[RegionSpec] = None
    """--eval-regions parsed (None: validate the region in training only)."""

    notices: tuple[str, ...] = ()
    """What the run starts from, when that is not what --load names (a first start, a fall-back
    past damaged checkpoints): printed at start."""

    pipeline_schedule: PipelineSchedule = megatron_schedule()
    """The resolved ``--pipeline-schedule`` (:class:`~epas_megatron.parallel.pipeline_schedule.PipelineSchedule`)."""

    v_layout: Optional["VStageLayout"] = None
    """Under a V schedule, ``--pipeline-layout V:...`` parsed (None: the even V split, or not V)."""

    cuda: bool = False
    """Whether the run's processes use CUDA devices (``resolve_run``'s ``cuda``: this node's, unless
    given)."""

    backend_reason: str = ""
    """Why that backend (:class:`~epas_megatron.model.fusions.BackendChoice`): printed at start-up."""

    @property
    def bf16(self) -> bool:
        """bf16 training."""
        return self.precision == "bf16"


def _check_choices(cfg: RunConfig) -> None:
    for section in (cfg.model, cfg.parallel, cfg.training, cfg.epas, cfg.random_ltd):
        for name, allowed in _CHOICES.items():
            if hasattr(section, name) and getattr(section, name) not in allowed:
                raise ConfigError(f"{flag_name(name)} {getattr(section, name)!r}: choose one of {', '.join(allowed)}")


def _positive(value, flag: str, minimum: int = 1) -> None:
    if value is None or value < minimum:
        raise ConfigError(f"{flag} must be >= {minimum}, got {value}")


def _check_data(cfg: RunConfig) -> None:
    from epas_megatron.data.datasets import parse_blend
    from epas_megatron.data.indexed import bin_path, idx_path

    if cfg.data.data is not None and not cfg.data.data:
        raise ConfigError("--data is empty; give indexed dataset prefixes or omit it for the embedded corpus")
    if cfg.data.embedded:
        return
    for prefix in parse_blend(cfg.data.data).prefixes:
        for path in (bin_path(prefix), idx_path(prefix)):
            if not path.is_file():
                raise ConfigError(f"--data {prefix}: {path} does not exist (make it with tools/preprocess_data.py)")
            if path.stat().st_size == 0:
                raise ConfigError(f"--data {prefix}: {path} is empty")


def _check_data_fits_model(cfg: RunConfig, m) -> None:
    """The embedded corpus is a demo: tokenized with its own tokenizer, and about 0.44M training
    tokens -- a 125M model at its config's batch would see it thousands of times. A model
    larger than the 'small' preset stops unless it names its data (``--data embedded`` included)."""
    if not cfg.data.embedded:
        return
    if cfg.data.tokenizer_model is not None:
        raise ConfigError(f"--tokenizer-model {cfg.data.tokenizer_model} without --data: the embedded corpus is tokenized "
                          "with its own tokenizer (--default-vocab-size pieces); give --data made with this tokenizer "
                          "(tools/preprocess_data.py), or drop --tokenizer-model")
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size)
    if cfg.data.data is None and too_large_for_the_embedded_corpus(*shape):
        size = decoder_parameters(*shape)
        raise ConfigError(f"this model ({m.num_layers} layers, hidden {m.hidden_size}: {size / 1e6:.0f}M decoder parameters, "
                          f"more than the '{EMBEDDED_DATA_LARGEST_PRESET}' "
                          "preset the embedded demo corpus is meant for) has no --data: it would train on that corpus (about "
                          "0.44M tokens) over and over. Give --data PREFIX --tokenizer-model MODEL (tools/preprocess_data.py), "
                          f"or --data {EMBEDDED_DATA} to train on the demo corpus anyway")


def resolve_run(cfg: RunConfig, world_size: Optional[int] = None, cuda: Optional[bool] = None, *,
                planning_only: bool = False) -> ResolvedRun:
    """Validate ``cfg`` for ``world_size`` processes and derive the run's fixed quantities
    (``planning_only``: for ``epas-plan``, which trains nothing -- the data need not suit the model).

    Section by section, pure checks and derivations first; then the two steps that read files:
    the checkpoint to resume or start from (its metadata) and the vocabulary (the tokenizer's
    size when ``--tokenizer-model`` is given; the embedded corpus's tokenizer has exactly
    ``--default-vocab-size`` pieces)."""
    from epas_megatron.runtime.distributed import world_size_from_env

    world_size = world_size_from_env() if world_size is None else world_size
    cuda = torch.cuda.is_available() if cuda is None else cuda
    _check_choices(cfg)
    m = _resolve_model(cfg.model)
    p = cfg.parallel
    dp, vpp, layout = _resolve_parallel(p, m, world_size)
    layers, precision, use_dist_opt = _resolve_devices(cfg, cuda)
    option_warnings = check_build_options(replace(cfg, model=m), BuildFacts(p.tp, p.pp, layers.backend, precision, cuda))
    t = _resolve_training(cfg, m, dp)
    m = replace(m, max_position_embeddings=m.max_position_embeddings or t.seq_length)
    schedule, rebalance, warnings = _resolve_epas(cfg, m, t)
    schedule_kind = _resolve_pipeline_schedule(cfg, m, vpp, t.global_batch_size // (t.micro_batch_size * dp), layers.backend)
    v_layout = _resolve_v_layout(cfg, m, schedule_kind)
    if schedule_kind.v_placement and rebalance and cfg.epas.epas_memory_budget_gb is not None:
        raise ConfigError(f"--epas-memory-budget-gb: stage rebalancing under --pipeline-schedule {schedule_kind} does not "
                          "price memory yet (V placement's in-flight micro-batches per rank); drop the budget, or use "
                          "--epas-rebalance off")
    eval_regions = _resolve_eval_regions(t, schedule)
    _check_data(cfg)
    if not planning_only:
        _check_data_fits_model(cfg, m)
    if not cfg.data.embedded and cfg.data.tokenizer_model is None:
        raise ConfigError("--data needs --tokenizer-model (the tokenizer the data was preprocessed with)")
    m = replace(m, vocab_size=resolve_vocabulary(cfg.data, m.vocab_size))
    cfg = replace(cfg, model=m, training=t)
    sources = resolve_sources(cfg, use_dist_opt)
    return ResolvedRun(
        cfg=cfg,
        world_size=world_size,
        dp=dp,
        num_microbatches=t.global_batch_size // (t.micro_batch_size * dp),
        vpp=vpp,
        layout=layout,
        backend=layers.backend,
        backend_reason=layers.reason,
        cuda=cuda,
        precision=precision,
        use_distributed_optimizer=use_dist_opt,
        schedule=schedule,
        rebalance=rebalance,
        pipeline_schedule=schedule_kind,
        v_layout=v_layout,
        warnings=tuple(warnings) + tuple(option_warnings),
        eval_regions=eval_regions,
        **sources,
    )


def _resolve_model(m):
    """ModelConfig checks; GQA groups and FFN size filled in."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        _positive(getattr(m, name), flag_name(name))
    if m.num_query_groups is None:
        m = replace(m, num_query_groups=m.num_attention_heads)
    if m.ffn_hidden_size is None:
        m = replace(m, ffn_hidden_size=default_ffn_hidden_size(m.hidden_size))
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {m.num_query_groups}")
    return m


def _resolve_pipeline_schedule(cfg: RunConfig, m, vpp: Optional[int], num_microbatches: int,
                               backend: str = "local") -> PipelineSchedule:
    """``--pipeline-schedule`` resolved (default: Megatron's, by --vpp) and checked against the run
    (``backend``: the layers chosen, 'local' or 'transformer_engine'): the schedule's first
    refusal is raised."""
    p = cfg.parallel
    schedule = pipeline_schedule(p.pipeline_schedule) if p.pipeline_schedule else megatron_schedule(vpp)
    # (a V schedule is refused a --vpp the user gave; a chunk count read off a Megatron layout is
    # refused by the V layout's own check, which names --pipeline-layout)
    schedule.check(ScheduleFacts(pp=p.pp, microbatches=num_microbatches, vpp=p.vpp if schedule.v_placement else vpp,
                                 num_layers=m.num_layers,
                                 tied_embeddings=not m.untie_embeddings_and_output_weights,
                                 overlap_grad_reduce=p.overlap_grad_reduce, backend=backend))
    return schedule


def _is_v_layout(layout: Optional[str]) -> bool:
    """``--pipeline-layout`` is a V layout (``V:...``, for a V pipeline schedule)."""
    return layout is not None and layout.startswith("V:")


def _resolve_v_layout(cfg: RunConfig, m, schedule: PipelineSchedule) -> Optional["VStageLayout"]:
    """``--pipeline-layout`` under a V schedule, parsed (None without one); a V layout is refused
    under any other schedule, a Megatron layout under a V schedule."""
    from epas_megatron.model.stage_layout import VStageLayout

    layout, pp = cfg.parallel.pipeline_layout, cfg.parallel.pp
    if not schedule.v_placement:
        if _is_v_layout(layout):
            v_names = [name for name, kind in PIPELINE_SCHEDULES.items() if kind.v_placement]
            raise ConfigError(f"--pipeline-layout {layout!r} places the layers in V order, which only a V schedule runs: "
                              f"add --pipeline-schedule {' or '.join(v_names)}, or give a Megatron layout ('Ett|ttL')")
        return None
    if layout is None:
        return None
    return VStageLayout.from_layout_string(layout, pp, m.num_layers)


def _resolve_parallel(p, m, world_size: int) -> tuple[int, Optional[int], Optional["StageLayout"]]:
    """ParallelConfig checks against the model and world; (dp, normalised vpp, parsed layout)."""
    _positive(p.tp, "--tp")
    _positive(p.pp, "--pp")
    if p.vpp is not None:
        _positive(p.vpp, "--vpp")
    if world_size % (p.tp * p.pp):
        raise ConfigError(f"--tp {p.tp} x --pp {p.pp} = {p.tp * p.pp} does not divide the {world_size} processes; "
                          "change --tp/--pp or the number of processes")
    if m.num_attention_heads % p.tp:
        raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by --tp {p.tp}")
    if m.num_query_groups % p.tp:
        raise ConfigError(f"--num-query-groups {m.num_query_groups} is not divisible by --tp {p.tp}; "
                          "every TP rank must hold whole KV groups")
    layout = None
    vpp = p.vpp if p.vpp and p.vpp > 1 else 1
    if vpp > 1 and p.pp < 2:
        raise ConfigError("--vpp needs --pp >= 2 (interleaving splits each pipeline rank's layers)")
    if _is_v_layout(p.pipeline_layout):
        pass  # V placement's own layout: parsed with the schedule (_resolve_v_layout)
    elif p.pipeline_layout is None:
        if m.num_layers % (p.pp * vpp):
            raise ConfigError(f"--num-layers {m.num_layers} cannot be split evenly over --pp {p.pp} x --vpp {vpp} = {p.pp * vpp} stages; "
                              "change --pp/--vpp or give --pipeline-layout")
    else:
        layout = _check_layout(p.pipeline_layout, m.num_layers, p.pp, p.vpp)
    if p.sequence_parallel and p.tp < 2:
        raise ConfigError("--sequence-parallel needs --tp >= 2")
    if p.recompute_modules is not None:
        if p.recompute != "selective":
            raise ConfigError(f"--recompute-modules needs --recompute selective (this run: --recompute {p.recompute})")
        unknown = [name for name in p.recompute_modules if name not in RECOMPUTE_MODULES]
        if unknown or not p.recompute_modules:
            raise ConfigError(f"--recompute-modules {' '.join(p.recompute_modules)}: choose among {', '.join(RECOMPUTE_MODULES)} "
                              "(Megatron-Core's 'layernorm' is not done by EPAS source and sharing layers)")
    return world_size // (p.tp * p.pp), normalise_vpp(p.vpp, layout), layout


def _resolve_devices(cfg: RunConfig, cuda: bool) -> tuple[BackendChoice, str, bool]:
    """(layer backend, precision, distributed optimizer) for this machine, and the loss-scale flags."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    backend = choose_layers(m.transformer_impl, cuda)
    use_dist_opt = cuda if p.use_distributed_optimizer is None else p.use_distributed_optimizer
    precision = choose_precision(t.precision, cuda)
    if precision != "fp16" and t.loss_scale is not None:
        raise ConfigError(f"--loss-scale applies to --precision fp16 only (this run: {precision})")
    if t.loss_scale is not None and t.loss_scale <= 0:
        raise ConfigError(f"--loss-scale must be > 0, got {t.loss_scale}")
    if precision == "fp16" and (t.initial_loss_scale <= 0 or t.min_loss_scale <= 0 or t.min_loss_scale > t.initial_loss_scale):
        raise ConfigError(f"need 0 < --min-loss-scale <= --initial-loss-scale, got {t.min_loss_scale} and {t.initial_loss_scale}")
    if precision == "fp16":
        _positive(t.loss_scale_window, "--loss-scale-window")
        _positive(t.hysteresis, "--hysteresis")
    return backend, precision, use_dist_opt


def _resolve_training(cfg: RunConfig, m, dp: int):
    """TrainingConfig checks; the global batch filled in."""
    t = cfg.training
    for name in ("train_iters", "micro_batch_size", "seq_length", "log_interval"):
        section = cfg.logging if name == "log_interval" else t
        _positive(getattr(section, name), flag_name(name))
    gbs = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {t.micro_batch_size} "
                          f"x data-parallel size {dp} = {t.micro_batch_size * dp}")
    max_pos = m.max_position_embeddings if m.max_position_embeddings is not None else t.seq_length
    if t.seq_length > max_pos:
        raise ConfigError(f"--seq-length {t.seq_length} exceeds the model's maximum --max-position-embeddings {max_pos}")
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(f"need 0 <= --min-lr <= --lr and --lr > 0, got --lr {t.lr} --min-lr {t.min_lr}")
    if t.eval_interval and t.eval_iters < 1:
        raise ConfigError("--eval-iters must be >= 1 when --eval-interval is set")
    return replace(t, global_batch_size=gbs)


def sharing_schedule(cfg: RunConfig) -> SharingSchedule:
    """The progressive schedule a run of ``cfg`` trains with (its ``--epas-*`` flags and
    ``--num-layers``); a ``ConfigError`` naming the flag if they do not make one. Whoever needs a
    run's switches without resolving the run (a recipe's report, a sweep's submission check) takes
    them from here, not from a schedule of its own."""
    return SharingSchedule.from_config(cfg)


def _resolve_epas(cfg: RunConfig, m, t) -> tuple[SharingSchedule, bool, list[str]]:
    """(sharing schedule, whether stages are rebalanced at switches, warnings)."""
    p, e = cfg.parallel, cfg.epas
    schedule = sharing_schedule(cfg)
    warnings = schedule.check_against_training(t.train_iters) if schedule.enabled else []
    if e.epas_exclude_last and not schedule.enabled:
        warnings.append(f"--epas-exclude-last {e.epas_exclude_last} has no effect: EPAS is off (--epas-target-layers 0)")
    if e.epas_blocks != 1 and not schedule.enabled:
        warnings.append(f"--epas-blocks {e.epas_blocks} has no effect: EPAS is off (--epas-target-layers 0)")
    # --epas-switch-rewarm and --epas-switch-ramp: their features check them (TrainingFeature.check_config)
    rebalance = {"on": True, "off": False, "auto": p.pp > 1 and p.pipeline_layout is None}[e.epas_rebalance]
    if rebalance and p.pipeline_layout is not None:
        raise ConfigError("--epas-rebalance on conflicts with a fixed --pipeline-layout; drop one of them")
    if e.epas_memory_budget_gb is not None:
        if not e.epas_memory_budget_gb > 0:
            raise ConfigError(f"--epas-memory-budget-gb must be > 0 (GiB per GPU), got {e.epas_memory_budget_gb}")
        if p.recompute == "full":
            raise ConfigError("--epas-memory-budget-gb: the memory model does not cover --recompute full yet "
                              "(use --recompute selective or none, or drop the budget)")
        if not (rebalance and p.pp >= 2):
            warnings.append("--epas-memory-budget-gb has no effect: stages are not rebalanced (needs --pp > 1 and --epas-rebalance)")
    return schedule, rebalance and p.pp >= 2, list(warnings)


def _resolve_eval_regions(t, schedule: SharingSchedule) -> Optional[RegionSpec]:
    """--eval-regions parsed and checked against the model (sizes it can have at all)."""

    if t.eval_regions is None:
        if t.eval_untrained_regions:
            raise ConfigError("--eval-untrained-regions applies to --eval-regions; give the regions to evaluate")
        return None
    if not t.eval_interval:
        raise ConfigError("--eval-regions needs --eval-interval > 0 (regions are evaluated at every evaluation)")
    spec = RegionSpec.parse(t.eval_regions, "--eval-regions")
    spec.check_limit(RegionShape.of(schedule), "--eval-regions")
    return spec


def resolve_vocabulary(data_cfg, vocab_size: Optional[int]) -> int:
    """The model's vocabulary (before padding): ``--vocab-size`` if given (checked against the
    tokenizer), else the tokenizer's size -- read from ``--tokenizer-model``, or
    ``--default-vocab-size`` for the embedded corpus, whose tokenizer is trained to exactly that
    size."""
    if data_cfg.tokenizer_model is None:
        return vocab_size or data_cfg.default_vocab_size
    from epas_megatron.data.tokenizer import load_tokenizer

    tokenizer_size = load_tokenizer(data_cfg.tokenizer_model).vocab_size
    if vocab_size is not None and vocab_size < tokenizer_size:
        raise ConfigError(f"--vocab-size {vocab_size} is smaller than the tokenizer's {tokenizer_size}")
    return vocab_size or tokenizer_size


def _check_layout(layout: str, num_layers: int, pp: int, vpp: Optional[int]) -> "StageLayout":
    """--pipeline-layout checked by Megatron-Core's parser, as a StageLayout."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from epas_megatron.model.stage_layout import StageLayout

    if pp < 2:
        raise ConfigError(f"--pipeline-layout {layout!r} splits layers over pipeline stages and needs --pp >= 2 "
                          f"(this run: --pp {pp}); drop --pipeline-layout or raise --pp")
    try:
        parsed = PipelineParallelLayerLayout.from_str(layout=layout, pipeline_model_parallel_size=pp)
        parsed.validate_layer_layout(num_layers=num_layers, mtp_num_layers=None)
    except Exception as e:  # Megatron raises assertions and ValueErrors
        raise ConfigError(f"--pipeline-layout {layout!r} is not valid for --num-layers {num_layers} and --pp {pp}: {e}") from None
    detected = parsed.virtual_pipeline_model_parallel_size
    if vpp and vpp > 1 and detected != vpp:
        raise ConfigError(f"--pipeline-layout {layout!r} has {detected} virtual stages per rank but --vpp is {vpp}")
    return StageLayout.from_layout_string(layout, pp)


def config_dict(run: ResolvedRun) -> dict:
    """The resolved config as a plain sectioned dict."""
    return to_dict(run.cfg)
