"""Activation and parameter memory of a whole pipeline rank, built on the layer terms of
:mod:`epas_megatron.metrics.memory_model`: the parameter state (weights, gradients, optimizer
state), the activations its schedule keeps in flight, the pipeline messages it holds
(:func:`rank_memory_bytes`).

In flight, a pipeline schedule is part of the memory (Qi et al., "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024). 1F1B keeps ``p - r`` micro-batches on rank ``r``; under V
placement each rank's two chunks differ (rank 0 holds the embedding and the head) and a split
backward (v-half, v-min) releases most of a pass at the end of its input-gradient backward
``B``: from there to its weight-gradient ``W`` it keeps only what the deferred GEMMs need
(:func:`weight_grad_terms`: each trainable linear's input and output gradient, ~60% of a layer's
bytes at small widths). :func:`rank_memory_bytes` walks the rank's action list with each pass
weighed by its chunk's bytes in each phase (:func:`schedule_activation_peak`); measured through a
real pipelined iteration (:class:`~epas_megatron.metrics.activation_memory.LiveSavedBytes`,
``tests/metrics/test_pipeline_memory.py``) every rank of 1f1b, v-1f1b, v-half and v-min is
within 1.0% (the measurement is higher by one output gradient a ``B`` holds before it releases
the pass's other tensors).
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from epas_megatron.metrics.memory_model import Role, layer_activation_bytes, layer_activation_terms, weight_grad_bytes
from epas_megatron.model.architecture import ModelShape
from epas_megatron.model.moc_sizes import MoCSettings
from epas_megatron.model.v_placement import v_stage
from epas_megatron.parallel.pipeline_p2p import sends_in_flight
from epas_megatron.parallel.pipeline_schedule import PipelineSchedule, build_schedule, megatron_schedule, pipeline_schedule
from epas_megatron.parallel.schedule_simulation import peak_in_flight, rank_peak_bytes


def head_activation_bytes(shape: ModelShape, element_bytes: int = 4, *, tp: int = 1,
                          sequence_parallel: bool = False, fused_norm: bool = False) -> int:
    """The final norm, the LM head's fp32 logits and the loss's integer targets and mask, per
    micro-batch (the last pipeline stage)."""
    norm = {k: v for k, v in layer_activation_terms(shape, "compute", "qk", element_bytes, tp=tp, sequence_parallel=sequence_parallel,
                                                      fused_norm=fused_norm).items() if k.startswith("norm1")}
    s, b = shape.seq_length, shape.micro_batch_size
    return sum(norm.values()) + s * b * (shape.vocab_size // tp) * 4 + s * b * 9


def head_weight_grad_bytes(shape: ModelShape, element_bytes: int = 4, *, tp: int = 1,
                           sequence_parallel: bool = False) -> int:
    """What the LM head's deferred weight-gradient GEMM keeps from ``B`` to ``W`` (split
    backward): its input (the final norm's output; a column-parallel GEMM, so the sequence shard
    under sequence parallelism) and the logits' gradient (the whole sequence), per micro-batch."""
    s, b = shape.seq_length, shape.micro_batch_size
    sn = s // tp if sequence_parallel else s
    return (sn * b * shape.hidden_size + s * b * (shape.vocab_size // tp)) * element_bytes


def loss_mask_bytes(shape: ModelShape) -> int:
    """The training loss function's fp32 copy of the loss mask (``losses * mask``), per
    micro-batch on the stage with the loss."""
    return shape.seq_length * shape.micro_batch_size * 4


def embedding_activation_bytes(shape: ModelShape) -> int:
    """The token ids the embedding's backward needs (the first pipeline stage)."""
    return shape.seq_length * shape.micro_batch_size * 8


def layer_parameters(shape: ModelShape, role: Role, share: str = "qk", tp: int = 1) -> tuple[int, int]:
    """(trainable, frozen) parameters of one layer on one tensor-parallel rank: a sharing layer
    keeps its Q/K (``qk``) or K/V (``kv``) rows frozen -- weights without gradients or
    optimizer state."""
    h, d = shape.hidden_size, shape.head_dim
    a, g, f = shape.num_attention_heads // tp, shape.num_query_groups // tp, shape.ffn_hidden_size // tp
    common = a * d * h + 3 * h * f + 2 * h  # output projection, SwiGLU MLP, two norms (replicated)
    if role == "compute":
        return common + h * (a + 2 * g) * d, 0
    own, frozen = (g * d, (a + g) * d) if share == "qk" else (a * d, 2 * g * d)
    return common + h * own, h * frozen


def parameter_state_bytes(trainable: int, frozen: int, precision: str = "fp32", distributed_optimizer: bool = False,
                          dp: int = 1) -> int:
    """Weights (all), gradients and Adam state (trainable only) on one rank: weights in the
    training precision, gradients in fp32 (Megatron reduces half-precision gradients in fp32),
    fp32 main weights (half precision only) and two fp32 moments -- divided over DP with the
    distributed optimizer."""
    weight = 4 if precision == "fp32" else 2
    optimizer = 8 if precision == "fp32" else 12
    return (trainable + frozen) * weight + trainable * 4 + trainable * optimizer // (dp if distributed_optimizer else 1)


def _schedule(name: Optional[str]) -> PipelineSchedule:
    """The pipeline schedule called ``name`` (None: Megatron's 1F1B or, with ``vpp``, interleaved:
    placed on stages alike)."""
    return megatron_schedule() if name is None else pipeline_schedule(name)


def in_flight_microbatches(pp_rank: int, pp: int, vpp: int, num_microbatches: int, schedule: Optional[str] = None) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of the whole
    rank's activations for one micro-batch, under ``schedule`` (a ``--pipeline-schedule`` name;
    None: 1F1B, or the interleaved schedule where ``vpp > 1``). 1F1B keeps ``pp - rank`` (its
    warm-up plus one); the interleaved schedule keeps ``2 (pp - rank - 1) + (vpp - 1) pp + 1``
    chunk passes, each a ``1 / vpp`` share of the rank (as if chunks were alike); never more than
    there are. A V schedule keeps what its simulation says (chunk passes held from a forward to
    the end of their weight gradient, over 2 chunks; as if chunks were alike and held their whole
    activations to the end: :func:`schedule_activation_peak` weighs them exactly)."""
    if _schedule(schedule).v_placement:
        return peak_in_flight(schedule, pp, num_microbatches)[pp_rank]
    if vpp <= 1:
        return float(min(pp - pp_rank, num_microbatches))
    passes = min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1, num_microbatches * vpp)
    return passes / vpp


def schedule_activation_peak(schedule: str, pp_rank: int, pp: int, num_microbatches: int,
                             chunk_bytes: Sequence[tuple[float, float]]) -> float:
    """Peak activation bytes of ``pp_rank`` under ``schedule`` (``1f1b`` or a V schedule), its
    chunk ``c``'s passes weighed by ``chunk_bytes[c]`` = (what a pass holds from its forward to
    the end of its input-gradient backward, what it holds from there to the end of its weight
    gradient): what :func:`~epas_megatron.parallel.schedule_simulation.simulate` gives, counted along
    the rank's own list (the order fixes the peak, not the pass costs: ``rank_peak_bytes``)."""
    built = build_schedule(schedule, pp, num_microbatches)
    if len(chunk_bytes) != built.chunks_per_rank:
        raise ValueError(f"{schedule} runs {built.chunks_per_rank} chunk(s) per rank, got bytes for {len(chunk_bytes)}")
    stage_bytes = {(v_stage(pp_rank, c, pp) if built.v_placement else pp_rank): tuple(b) for c, b in enumerate(chunk_bytes)}
    return rank_peak_bytes(built, pp_rank, stage_bytes)


@dataclass(frozen=True)
class RankMemorySettings:
    """What a rank's memory depends on besides the model's shape (its
    :class:`~epas_megatron.model.architecture.ModelShape`: the vocabulary and a tied head included)
    and the layout."""

    tp: int = 1
    """Tensor parallel size."""

    dp: int = 1
    """Data parallel size."""

    num_microbatches: int = 1
    """Micro-batches per iteration (bounds the in-flight ones)."""

    precision: str = "fp32"
    """'fp32', 'bf16' or 'fp16'."""

    distributed_optimizer: bool = False
    """Adam state and fp32 main weights divided over DP."""

    sequence_parallel: bool = False
    """Norm activations, and the column-parallel GEMM inputs they feed, divided over TP (a
    row-parallel GEMM's deferred output gradient stays whole: :func:`weight_grad_terms`)."""

    recompute: str = "none"
    """'none' or 'selective'."""

    recompute_modules: tuple[str, ...] = ("core_attn",)
    """With 'selective': what is recomputed ('core_attn', 'mlp')."""

    moc: Optional[MoCSettings] = None
    """Mixture-of-Channels MLPs: (kept fraction, groups); None: dense."""

    share: str = "qk"
    """What sharing layers reuse."""

    fused_norm: bool = False
    """RMSNorm is one kernel keeping its input and 1 / rms (torch's CUDA ``rms_norm``), not the
    composite fp32 one (CPU): :func:`epas_megatron.model.fusions.activation_kernels`."""

    fused_swiglu: bool = False
    """SwiGLU is Megatron's fused kernel (``bias_activation_fusion``), which keeps only its input."""

    fused_rope: bool = False
    """RoPE is Transformer Engine's fused kernel (``apply_rope_fusion``), which keeps no tables of
    its own: :func:`epas_megatron.assembly.memory_kernels` reads it off the builder's flags."""

    pipeline_schedule: Optional[str] = None
    """The ``--pipeline-schedule`` (None: 1F1B, or interleaved where ``vpp > 1``): how many
    micro-batches are in flight, and -- V schedules -- the placement (both ends on rank 0) and
    what a pass holds between its input-gradient and weight-gradient backward."""

    @property
    def kernels(self) -> dict[str, bool]:
        """The kernel keywords of :func:`layer_activation_terms`."""
        return {"fused_norm": self.fused_norm, "fused_swiglu": self.fused_swiglu, "fused_rope": self.fused_rope}

    @property
    def element_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


def layer_memory(shape: ModelShape, role: Role, settings: RankMemorySettings) -> tuple[int, int]:
    """(parameter-state bytes, activation bytes per micro-batch) of one layer on one rank."""
    trainable, frozen = layer_parameters(shape, role, settings.share, settings.tp)
    static = parameter_state_bytes(trainable, frozen, settings.precision, settings.distributed_optimizer, settings.dp)
    activations = layer_activation_bytes(shape, role, settings.share, settings.element_bytes, tp=settings.tp,
                                         sequence_parallel=settings.sequence_parallel, recompute=settings.recompute,
                                         recompute_modules=settings.recompute_modules, moc=settings.moc,
                                         **settings.kernels)
    return static, activations


def p2p_message_bytes(shape: ModelShape, settings: RankMemorySettings, handoff_crosses: bool) -> int:
    """One pipeline message: ``[rows, b, h]`` in the activation dtype, ``rows`` the sequence (its
    shard under sequence parallelism) plus the hand-off's rows while the sharing region crosses a
    stage boundary (every message of a pipeline has that one shape:
    :func:`epas_megatron.model.builder.pipeline_handoff_rows`)."""
    s, b, h, e = shape.seq_length, shape.micro_batch_size, shape.hidden_size, settings.element_bytes
    rows = s // settings.tp if settings.sequence_parallel else s
    if handoff_crosses:
        from epas_megatron.sharing.handoff import extra_p2p_rows  # imports Megatron-Core, which epas-plan does not otherwise need

        heads = (shape.num_attention_heads + shape.num_query_groups if settings.share == "qk" else 2 * shape.num_query_groups)
        rows += extra_p2p_rows(heads // settings.tp * shape.head_dim, s, h)
    return rows * b * h * e


def sent_messages_held(schedule: Optional[str], pp_rank: int, pp: int, num_microbatches: int) -> int:
    """The most sent pipeline messages ``pp_rank`` holds at once beyond its activations: a sent
    stage output is freed when its send's ``Work`` is dropped. The project's executor (V
    schedules) drops a send once a later exchange it waits for has completed:
    :func:`epas_megatron.parallel.pipeline_p2p.sends_in_flight` counts them along the plan (at most
    two). Megatron-Core's schedules wait for each send before the next pass: one, while it is
    sent. Zero on a single stage."""
    if pp == 1:
        return 0
    if _schedule(schedule).executor:
        return sends_in_flight(build_schedule(schedule, pp, num_microbatches))[pp_rank]
    return 1


def rank_memory_bytes(shape: ModelShape, roles_by_chunk: list[list[Role]], pp_rank: int, pp: int, vpp: int,
                      settings: RankMemorySettings, *, in_flight: Optional[float] = None, head_rank: Optional[int] = None,
                      handoff_crosses: Optional[bool] = None) -> dict[str, float]:
    """Peak bytes of one pipeline rank, by kind: ``parameters`` (weights, gradients, optimizer
    state of its layers, the embedding on rank 0, the LM head and final norm on ``head_rank``,
    default the last rank -- rank 0 under a V schedule) and ``activations``: each chunk's bytes
    per micro-batch (its layers; the embedding's in chunk 0 of rank 0; the LM head's and the loss
    mask's in the last chunk of the head rank; a chunk that starts inside the sharing region also
    keeps the hand-off it received) times ``in_flight`` -- default
    :func:`in_flight_microbatches` under ``settings.pipeline_schedule``; under a V schedule the
    peak of :func:`schedule_activation_peak`, each chunk weighed by its own bytes, those of a
    split backward's ``B``-to-``W`` phase (:func:`weight_grad_bytes`,
    :func:`head_weight_grad_bytes`) included, and ``in_flight`` is that peak over one
    micro-batch's bytes. Also ``deferred``: per chunk, what a pass keeps from ``B`` to ``W``; and
    ``messages``: the sent pipeline messages it holds at most (:func:`sent_messages_held` x
    :func:`p2p_message_bytes`; ``handoff_crosses``: whether the messages carry the hand-off,
    default whether a chunk of this rank receives it), counted in ``total``."""
    schedule = settings.pipeline_schedule
    v_placed = _schedule(schedule).v_placement
    if head_rank is None:
        head_rank = 0 if v_placed else pp - 1
    static = 0.0
    e, tp, d = settings.element_bytes, settings.tp, shape.head_dim
    parallel = {"tp": tp, "sequence_parallel": settings.sequence_parallel}
    handoff_heads = (shape.num_attention_heads + shape.num_query_groups if settings.share == "qk" else 2 * shape.num_query_groups) // tp
    full = [0.0] * len(roles_by_chunk)
    deferred = [0.0] * len(roles_by_chunk)
    for c, roles in enumerate(roles_by_chunk):
        if roles and roles[0] == "share":  # the source is on an earlier stage: the received Q/K (K/V) are kept here
            full[c] += shape.seq_length * shape.micro_batch_size * handoff_heads * d * e
        for role in roles:
            layer_static, layer_activation = layer_memory(shape, role, settings)
            static += layer_static
            full[c] += layer_activation
            deferred[c] += weight_grad_bytes(shape, role, settings.share, e, moc=settings.moc, **parallel)
    table = shape.vocab_size // settings.tp * shape.hidden_size
    if pp_rank == 0:
        static += parameter_state_bytes(table, 0, settings.precision, settings.distributed_optimizer, settings.dp)
        full[0] += embedding_activation_bytes(shape)
    if pp_rank == head_rank:
        static += parameter_state_bytes(table + shape.hidden_size, 0, settings.precision, settings.distributed_optimizer, settings.dp)
        full[-1] += head_activation_bytes(shape, e, tp=tp, sequence_parallel=settings.sequence_parallel,
                                          fused_norm=settings.fused_norm) + loss_mask_bytes(shape)
        deferred[-1] += head_weight_grad_bytes(shape, e, **parallel)
    activation = sum(full)
    if in_flight is not None:
        peak = activation * in_flight
    elif v_placed:
        peak = schedule_activation_peak(schedule, pp_rank, pp, settings.num_microbatches, list(zip(full, deferred)))
        in_flight = peak / activation
    else:
        in_flight = in_flight_microbatches(pp_rank, pp, vpp, settings.num_microbatches, schedule)
        peak = activation * in_flight
    if handoff_crosses is None:
        handoff_crosses = any(roles and roles[0] == "share" for roles in roles_by_chunk)
    messages = sent_messages_held(schedule, pp_rank, pp, settings.num_microbatches) * p2p_message_bytes(shape, settings, handoff_crosses)
    return {"parameters": static, "activations": peak, "in_flight": in_flight, "messages": messages,
            "total": static + peak + messages, "deferred": deferred}


# ---------------------------------------------------------------- parameters of a rank
def qkv_parameters(shape: ModelShape, tp: int = 1) -> int:
    """A computing layer's fused QKV weight on one tensor-parallel rank: ``h·(a + 2g)·d / t``."""
    return shape.hidden_size * (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.head_dim // tp


def rank_parameters(shape: ModelShape, roles: Iterable[Role], pp_rank: int, pp: int, settings: RankMemorySettings) -> tuple[int, int]:
    """(trainable, frozen) parameters of one pipeline rank holding layers of ``roles``: theirs,
    the embedding on the first rank, the LM head (unless tied to the embedding on the same rank)
    and final norm on the last -- on the first too under a V schedule
    (``settings.pipeline_schedule``), whose rank 0 holds both ends."""
    trainable = frozen = 0
    for role in roles:
        layer_trainable, layer_frozen = layer_parameters(shape, role, settings.share, settings.tp)
        trainable, frozen = trainable + layer_trainable, frozen + layer_frozen
    table = shape.vocab_size // settings.tp * shape.hidden_size
    # A tied LM head uses the embedding's weight: one table where one rank holds both (PP = 1);
    # with PP > 1 the last stage keeps Megatron's copy of it, a table of its own.
    head = 0 if (shape.arch.tie_embeddings and pp == 1) else table
    head_rank = 0 if _schedule(settings.pipeline_schedule).v_placement else pp - 1
    return trainable + table * (pp_rank == 0) + (head + shape.hidden_size) * (pp_rank == head_rank), frozen
