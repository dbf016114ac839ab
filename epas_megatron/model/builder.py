"""Build plan -> Megatron ``TransformerConfig`` -> the model chunks this rank holds.

The decoder is described by one *global* list of layer specs (one per layer, from the plan's
:class:`~epas_megatron.sharing.shape.LayerMode` s); each pipeline stage / virtual stage takes the slice of its own layers, found with
the same Megatron-Core functions ``TransformerBlock`` uses (``get_transformer_layer_offset``,
``get_num_layers_to_build``), so even, uneven and explicit-layout pipelines all agree.

Chunks are built on :func:`epas_megatron.runtime.device.compute_device` (the GPU, or what stands
in for it on CPU). In bf16/fp16 the parameters are created in that dtype and each chunk is wrapped
in Megatron-Core's ``Float16Module`` (as Megatron-LM does): per-token losses leave the last stage
in fp32; the optimizer keeps fp32 main parameters (:mod:`epas_megatron.engine.optimizer`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.float16 import StageFloat16Module
from epas_megatron.model.fusions import KernelAvailability, fusion_settings, output_layer_gradient_accumulation_fusion
from epas_megatron.model.gpt import EpasGPTModel
from epas_megatron.model.init import initialize_model
from epas_megatron.model.materialize import parameters_on_meta as parameters_on_meta_context
from epas_megatron.model.specs import decoder_layer_specs, get_backend
from epas_megatron.model.v_layout import VPipelineLayout
from epas_megatron.runtime.device import compute_device
from epas_megatron.sharing import handoff as qk_handoff
from epas_megatron.sharing.shape import LayerMode

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The parameter dtype of each precision (:data:`epas_megatron.model.fusions.PRECISIONS`)."""


def make_transformer_config(plan: BuildPlan, kernels: Optional[KernelAvailability] = None,
                            megatron_init: bool = True, meta_device: bool = False) -> TransformerConfig:
    """The Megatron ``TransformerConfig`` of a plan (a LLaMA decoder).

    ``kernels``: the fused kernels to use where they help (default: what this process can load),
    for the plan's layer backend (:func:`epas_megatron.model.fusions.fusion_settings`; the LM
    head's own gradient-accumulation setting is :func:`build_model`'s). ``megatron_init=False``:
    weights are allocated but not drawn (Megatron's ``perform_initialization``), for builds whose
    weights are loaded next; ``meta_device``: parameters are made on the meta device (Megatron's
    ``init_model_with_meta_device``: Transformer Engine's layers are built there, and a tied LM
    head on the last stage is not copied from the first at construction)."""
    kernels = KernelAvailability.detect() if kernels is None else kernels
    arch, dtype = plan.arch, PRECISION_DTYPES[plan.precision]
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_method_std,
        perform_initialization=megatron_init,
        init_model_with_meta_device=meta_device,
        tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp,
        # With a layout, Megatron takes the chunks per rank from it (V placement: two).
        virtual_pipeline_model_parallel_size=plan.vpp if plan.layout is None and plan.v_stage_sizes is None else None,
        pipeline_model_parallel_layout=(VPipelineLayout(plan.v_stage_sizes, plan.pp) if plan.v_stage_sizes is not None
                                        else plan.layout_string),
        sequence_parallel=plan.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=plan.precision == "bf16",
        fp16=plan.precision == "fp16",
        # Weights are created where the model runs (the CPU, or the GPU / its meta stand-in).
        use_cpu_initialization=compute_device().type == "cpu",
        # Loss is a per-token mean over the whole global batch (DP and micro-batch invariant).
        calculate_per_token_loss=True,
        # gloo computes wrong gradients with batched p2p under interleaving (STACK.md).
        batch_p2p_comm=kernels.cuda,
        deallocate_pipeline_outputs=True,
        deterministic_mode=plan.deterministic,
        **fusion_settings(kernels, plan.backend),
    )
    for option in plan.options:  # what the build options need (Random-LTD: no fused RoPE)
        kwargs.update(option.transformer_config())
    recompute = plan.recompute
    if recompute.granularity == "full":
        kwargs.update(
            recompute_granularity="full",
            recompute_method=recompute.method,
            recompute_num_layers=recompute.num_layers,
        )
    elif recompute.granularity == "selective":
        kwargs.update(recompute_granularity="selective", recompute_modules=list(recompute.modules))
    return TransformerConfig(**kwargs)


@dataclass(frozen=True)
class ChunkPlacement:
    """Where one model chunk sits in the pipeline and what it holds."""

    vp_stage: Optional[int]
    """Virtual stage index (None without interleaving)."""

    layer_ids: tuple[int, ...]
    """Global (0-based) decoder layers of the chunk."""

    pre_process: bool
    """Holds the embedding."""

    post_process: bool
    """Holds the final norm, LM head and loss."""

    receives_handoff: bool
    """Its first layer shares Q/K computed on an earlier stage."""

    sends_handoff: bool
    """The next stage's first layer shares Q/K that pass through this chunk."""


def chunk_placements(config: TransformerConfig, modes: Sequence[LayerMode], pp_rank: Optional[int] = None) -> list[ChunkPlacement]:
    """Placements of ``pp_rank``'s chunks (one per virtual stage; default: this rank's)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    pp_size = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    num_layers = len(modes)

    def shares(boundary: int) -> bool:
        return 0 < boundary < num_layers and modes[boundary] == LayerMode.SHARE

    placements = []
    for vp_stage in range(vpp) if vpp else [None]:
        stage = vp_stage if vp_stage is not None else 0
        layout = config.pipeline_model_parallel_layout
        if isinstance(layout, VPipelineLayout):  # embedding and loss both on rank 0
            first, last = layout.is_first_stage(pp_rank, vp_stage), layout.is_last_stage(pp_rank, vp_stage)
        else:
            first = pp_rank == 0 and stage == 0
            last = pp_rank == pp_size - 1 and stage == (vpp or 1) - 1
        if layout is not None:  # (Megatron's helpers ignore pp_rank for layouts)
            offset = layout.get_layer_offset(LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
            count = layout.get_num_layers_to_build(LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
        else:
            offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
            count = get_num_layers_to_build(config, vp_stage, pp_rank)
        placements.append(
            ChunkPlacement(
                vp_stage=vp_stage,
                layer_ids=tuple(range(offset, offset + count)),
                pre_process=first,
                post_process=last,
                receives_handoff=not first and shares(offset),
                sends_handoff=not last and shares(offset + count),
            )
        )
    return placements


def handoff_heads(config: TransformerConfig, share: str) -> tuple[int, int]:
    """Heads on one TP rank of the two hand-off tensors: (np, ng) for Q/K, (ng, ng) for K/V."""
    tp = config.tensor_model_parallel_size
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    return (heads, groups) if share == "qk" else (groups, groups)


def pipeline_handoff_rows(config: TransformerConfig, modes: Sequence[LayerMode], seq_length: int, share: str) -> tuple[int, int, int]:
    """(hidden rows, p2p rows, schedule seq_length) for the current region and layout.

    While any stage boundary lies inside the sharing region, every p2p tensor gets extra rows for
    the hand-off; Megatron's schedules derive the p2p shape from the ``seq_length`` they are
    given, so that argument grows accordingly.
    """
    sp_tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    hidden_rows = seq_length // sp_tp
    crossing = any(
        placement.sends_handoff
        for rank in range(config.pipeline_model_parallel_size)
        for placement in chunk_placements(config, modes, pp_rank=rank)
    )
    if not crossing:
        return hidden_rows, hidden_rows, seq_length
    width = sum(handoff_heads(config, share)) * config.kv_channels
    extra = qk_handoff.extra_p2p_rows(width, seq_length, config.hidden_size)
    total = hidden_rows + extra
    return hidden_rows, total, total * sp_tp


@dataclass
class BuiltModel:
    """Model chunks of this rank plus what running them through Megatron's schedules needs."""

    plan: BuildPlan
    """What was built."""

    chunks: list
    """This rank's model chunks (one per virtual stage), on the compute device."""

    config: TransformerConfig
    """Their TransformerConfig (the schedules' hooks get installed on it)."""

    schedule_seq_length: int
    """The ``seq_length`` to give Megatron's schedules: the p2p tensor rows, which include the
    QK hand-off while it crosses stages (see :func:`pipeline_handoff_rows`)."""


def build_model(plan: BuildPlan, seed: Optional[int] = None, kernels: Optional[KernelAvailability] = None,
                load_follows: bool = False, parameters_on_meta: bool = False) -> BuiltModel:
    """This rank's model chunks for a plan: the one place the trainer, evaluation, benchmarks and
    conversion assemble a model.

    With ``seed``, weights are initialised independently of the parallel layout and of the
    sharing region (:mod:`epas_megatron.model.init`); without, Megatron's own initialisation
    stays (weights that a checkpoint load overwrites anyway) -- or, with ``load_follows``, none
    (the weights hold whatever memory held until the caller loads every one of them: a switch or
    a resume skips drawing a model's worth of random numbers). In bf16/fp16 each chunk is a
    ``Float16Module`` around the :class:`EpasGPTModel`.

    ``parameters_on_meta``: every parameter is left on the meta device (no weight is allocated:
    :mod:`epas_megatron.model.materialize`), for a caller that gives them data before anything
    else sees them (a switch, which adopts the old region's tensors); implies ``load_follows``."""
    if (load_follows or parameters_on_meta) and seed is not None:
        raise ValueError("build_model: a seed initialises the weights, load_follows leaves them to a load")
    load_follows = load_follows or parameters_on_meta
    kernels = KernelAvailability.detect() if kernels is None else kernels
    config = make_transformer_config(plan, kernels, megatron_init=not load_follows, meta_device=parameters_on_meta)
    hidden_rows, total_rows, schedule_seq = pipeline_handoff_rows(config, plan.modes, plan.seq_length, plan.share)
    layers_backend = get_backend(plan.backend, plan.core_attention)
    specs = [_configured(spec, mode, plan) for spec, mode in
             zip(decoder_layer_specs(plan.modes, layers_backend, plan.share, plan.detach_shared), plan.modes)]
    device = compute_device()
    chunks = []
    for placement in chunk_placements(config, plan.modes):
        with parameters_on_meta_context() if parameters_on_meta else contextlib.nullcontext():
            chunks.append(_build_chunk(plan, config, placement, specs, layers_backend, kernels, seed, device,
                                       hidden_rows, total_rows, move=not parameters_on_meta))
    return BuiltModel(plan, chunks, config, schedule_seq)


def _configured(spec, mode, plan: BuildPlan):
    """A decoder layer's spec as the plan's build options configure it, in their order."""
    for option in plan.options:
        spec = option.layer_spec(spec, mode, plan.backend)
    return spec


def _build_chunk(plan: BuildPlan, config: TransformerConfig, placement, specs, layers_backend, kernels, seed, device,
                 hidden_rows: int, total_rows: int, move: bool):
    """One chunk of :func:`build_model` (``move``: put it on the compute device)."""
    arch = plan.arch
    block_spec = TransformerBlockSubmodules(
        layer_specs=[specs[i] for i in placement.layer_ids], layer_norm=layers_backend.norm
    )
    model = EpasGPTModel(
        config=config,
        block_spec=block_spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_sequence_length,
        pre_process=placement.pre_process,
        post_process=placement.post_process,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        rotary_base=arch.rotary_base,
        receives_handoff=placement.receives_handoff,
        sends_handoff=placement.sends_handoff,
        handoff_heads=handoff_heads(config, plan.share),
        vp_stage=placement.vp_stage,
        output_layer_gradient_accumulation_fusion=output_layer_gradient_accumulation_fusion(kernels, plan.backend),
    )
    if move:
        model.to(device)
    if seed is not None and device.type != "meta":  # meta tensors hold no values to draw
        initialize_model(model, seed, arch.init_method_std, arch.num_layers)
    model.decoder.set_p2p_rows(hidden_rows, total_rows)
    for option in plan.options:
        option.configure_chunk(model)
    return StageFloat16Module(config, model) if (config.bf16 or config.fp16) else model
