"""Activation memory of a decoder layer, computing or sharing, term by term.

Korthikanti et al. count what a GPT layer keeps for backward as ``s·b·h·(34 + 5·a·s/h)``
bytes in fp16: 2-byte activations at every GEMM input, the norms, the dropout masks (1 byte),
GeLU's input, and the ``a·s²`` softmax and dropout tensors of unfused attention. The LLaMA
layer here differs in ways that change the count: RMSNorm (no bias, no mean), no dropout, a
SwiGLU MLP of width ``F`` instead of a 4h GeLU, grouped-query attention with ``g`` KV heads,
RoPE, and fused (flash-style) attention that keeps the output and the log-sum-exp instead of
the ``a·s²`` probabilities. The terms below are what this project's local layers keep, per
micro-batch of ``b`` sequences of ``s`` tokens, with ``e`` bytes per activation element
(4 in fp32, 2 in bf16/fp16), ``h`` hidden, ``a`` query heads, ``g`` KV heads, ``d = h / a``.
Each term names the tensor and who keeps it; :mod:`epas_megatron.metrics.activation_memory`
measures the same thing and the tests hold the two equal, byte for byte.

Every layer:

===========================  ======================  ==============================================
term                         elements                kept by
===========================  ======================  ==============================================
``norm1_input``              s·b·h  (fp32)           RMSNorm (x for the backward of x²; in half precision its fp32 copy)
``norm1_rstd``               s·b    (fp32)           RMSNorm (1 / rms)
``norm1_normalized``         s·b·h  (fp32)           RMSNorm's weight gradient (x / rms)
``norm1_output``             s·b·h                   the attention's input GEMM(s)
``attention_output``         s·b·a·d                 the attention kernel, and linear_proj's input
``attention_lse``            b·a·s  (fp32)           the attention kernel (log-sum-exp)
``norm2_*``                  as norm1                as norm1, before the MLP
``fc1_output``               s·b·2F                  SwiGLU (gate and up halves)
``swiglu``                   3·s·b·F                 SiLU's contiguous input copy, its output, the product (fc2's input)
===========================  ======================  ==============================================

Attention projections, by role (EPAS ``qk`` sharing; ``kv`` is the KV-sharing variant):

========================  ==================  ======================================================
role                      term                elements
========================  ==================  ======================================================
computing                 ``qkv_output``      s·b·(a + 2g)·d: the fused GEMM's output (V is a view of it)
                          ``q_rope``          s·b·a·d: Q after RoPE
                          ``k_rope``          s·b·g·d: K after RoPE
                          ``rope_tables``     4·s·d: cos and sin for Q and for K
sharing, ``qk``           ``v_output``        s·b·g·d: its own V (Q and K are the source's, kept there)
sharing, ``kv``           ``q_rope``          s·b·a·d: its own Q after RoPE (K and V are the source's)
                          ``rope_tables``     2·s·d
========================  ==================  ======================================================

So a ``qk`` sharing layer keeps ``s·b·(2a + 2g)·d + 4·s·d - s·b·g·d`` elements less than a
computing one -- the fused QKV output, the rotated Q and K, the RoPE tables, less its own V:
about ``2.5·s·b·h`` of Korthikanti's ``34·s·b·h`` (MHA) and more than an eighth of this layer's
own total at small FFN widths. The norms' input, statistics and normalized values and the
log-sum-exp are fp32 in every precision (the norm computes in fp32).

Tensor parallelism (``t``) divides the head and FFN terms (``a``, ``g``, ``F`` by ``t``); the
norms and the GEMM inputs they feed keep the whole sequence on every rank, or ``s / t`` of it
with sequence parallelism (Megatron's column-parallel GEMM keeps its local input and gathers it
again in backward). Selective recompute (``core_attn``) runs the attention kernel again in
backward from Q, K and V, which the layer keeps anyway: it drops only the log-sum-exp (and keeps
a 4-byte argument) -- Korthikanti's ``5·a·s²·b`` that it was designed to remove is never stored
by a fused kernel. Recomputing the MLP (``mlp``: Megatron-Core's checkpoint around the whole
SwiGLU MLP) keeps only its input, ``norm2_output``, which the layer keeps anyway: it drops
``fc1_output`` and ``swiglu`` -- about half a layer's bytes -- for one more MLP forward.

GPU kernels keep less (``fused_norm``, ``fused_swiglu``; measured against the CUDA allocator by
``tests/gpu/test_gpu_memory_and_nccl.py``). torch's CUDA ``rms_norm`` is one kernel that keeps
its input as it came (``s·b·h``, not an fp32 copy) and ``1 / rms``, and no ``x / rms``: a norm
keeps ``s·b·h·e`` + ``s·b·4`` + its output instead of ``s·b·h·(8 + e)`` + ``s·b·4``. Megatron's fused
SwiGLU (``bias_activation_fusion``) keeps only its input (``fc1_output``), so ``swiglu`` is its
output alone, fc2's input: ``s·b·F``. At the GPU test's shape (h 1024, F 2816, s 1024, b 2, bf16)
the two take 46 MiB off a computing layer's 111 MiB.

Fused RoPE (``fused_rope``: ``apply_rope_fusion``, Transformer Engine's kernel, which Megatron-Core
calls for local layers too where TE is installed). The unfused rotation ``t·cos + rotate(t)·sin``
keeps ``cos`` and ``sin`` -- fresh ``s·d`` tables in the activation dtype -- for every rotated
tensor: the ``rope_tables`` term. TE's ``FusedRoPEFunc`` keeps only ``freqs`` (``ctx.save_for_backward(freqs,
cu_seqlens)``, ``cu_seqlens`` None here), and ``freqs`` is Megatron's ``RotaryEmbedding`` output,
an fp32 ``[s, 1, 1, d]`` table its ``lru_cache`` holds for the run -- one tensor for every layer and
micro-batch, which exists whether RoPE is fused or not. So a fused layer keeps no RoPE term of its
own; the rotated Q and K (``q_rope``, ``k_rope``: the kernel's outputs, which core attention
keeps) stay. :func:`rotary_table_bytes` is the shared table, resident, outside the
per-micro-batch terms.

Scope: the local backend's kernels (SDPA's flash path; Transformer Engine fuses more and
keeps less). Full recompute (each group keeps only its inputs -- for a group that starts inside
a sharing region, the hand-off Q and K too) is not modelled yet.

A whole pipeline rank (parameter state, in-flight activations) is
:mod:`epas_megatron.metrics.rank_memory`'s; what an in-memory switch allocates on it,
:mod:`epas_megatron.metrics.switch_memory`'s.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

from epas_megatron.model.architecture import ModelShape
from epas_megatron.model.moc_sizes import MoCSettings, index_bytes, moc_saved_bytes_per_token

Role = Literal["compute", "share"]


def layer_activation_terms(shape: ModelShape, role: Role, share: str = "qk", element_bytes: int = 4, *,
                           tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                           recompute_modules: Sequence[str] = ("core_attn",),
                           fused_norm: bool = False, fused_swiglu: bool = False, fused_rope: bool = False,
                           moc: Optional[MoCSettings] = None) -> dict[str, int]:
    """Bytes per term (see the module doc) that one layer keeps for backward, per micro-batch,
    on one tensor-parallel rank; ``recompute_modules``: what selective recompute runs again
    (module doc); ``fused_norm`` / ``fused_swiglu`` / ``fused_rope``: the fused kernels (module
    doc); ``moc``: ``(topk, groups)`` of Mixture-of-Channels MLPs (below 1: ``moc_sparse``
    replaces ``fc1_output`` and ``swiglu``)."""
    if share not in ("qk", "kv"):
        raise ValueError(f"share must be 'qk' or 'kv', got {share!r}")
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute {recompute!r} is not modelled (full recompute keeps only each group's inputs)")
    if shape.num_query_groups % tp or shape.ffn_hidden_size % tp or (sequence_parallel and shape.seq_length % tp):
        raise ValueError(f"TP {tp} does not divide the KV heads, the FFN width (or, with sequence parallelism, the sequence)")
    s, b, h = shape.seq_length, shape.micro_batch_size, shape.hidden_size
    a, g, d, f = shape.num_attention_heads // tp, shape.num_query_groups // tp, shape.head_dim, shape.ffn_hidden_size // tp
    sn = s // tp if sequence_parallel else s  # tokens of the norms and the GEMM inputs they feed
    e = element_bytes
    terms = {}
    for norm in ("norm1", "norm2"):
        if fused_norm:  # one kernel: its input as it came and 1 / rms
            terms[f"{norm}_input"] = sn * b * h * e
            terms[f"{norm}_rstd"] = sn * b * 4
        else:  # composite, in fp32: its input (an fp32 copy in half precision) and x / rms
            terms[f"{norm}_input"] = sn * b * h * 4
            terms[f"{norm}_rstd"] = sn * b * 4
            terms[f"{norm}_normalized"] = sn * b * h * 4
        terms[f"{norm}_output"] = sn * b * h * e
    if role == "compute":
        terms["qkv_output"] = s * b * (a + 2 * g) * d * e
        terms["q_rope"] = s * b * a * d * e
        terms["k_rope"] = s * b * g * d * e
        if not fused_rope:  # cos and sin for Q and for K (the fused kernel keeps the shared freqs)
            terms["rope_tables"] = 4 * s * d * e
    elif role == "share" and share == "qk":
        terms["v_output"] = s * b * g * d * e
    elif role == "share":
        terms["q_rope"] = s * b * a * d * e
        if not fused_rope:
            terms["rope_tables"] = 2 * s * d * e
    else:
        raise ValueError(f"role must be 'compute' or 'share', got {role!r}")
    terms["attention_output"] = s * b * a * d * e
    selective = set(recompute_modules) if recompute == "selective" else set()
    if "core_attn" in selective:  # the kernel runs again in backward from the Q, K, V kept above
        terms["recompute_argument"] = 4  # an int32 scalar the checkpoint keeps
    else:
        terms["attention_lse"] = b * a * s * 4
    if "mlp" in selective:  # recomputed, the MLP keeps only its input (norm2_output, above)
        pass
    elif moc is not None:  # the sparse form: k indices and k values of G and of U per group
        terms["moc_sparse"] = s * b * moc_saved_bytes_per_token(f, moc.groups // tp, moc.topk, e)
    else:
        terms["fc1_output"] = s * b * 2 * f * e
        terms["swiglu"] = (1 if fused_swiglu else 3) * s * b * f * e
    return terms


TENSORS_PER_TERM = {"rope_tables": None, "swiglu": 3}
"""Terms that stand for several equal tensors: RoPE's cos and sin per rotated tensor (4 for a
computing layer, 2 for a ``kv`` sharing layer: ``None`` = one per ``s·d`` block), SwiGLU's 3."""


def rotary_table_bytes(shape: ModelShape) -> int:
    """The rotary embedding's fp32 ``[s, 1, 1, d]`` table (``freqs``), one per model chunk: held by
    Megatron's ``RotaryEmbedding`` cache for the run, fused RoPE or not; the only tensor the fused
    kernel keeps for backward (module doc), shared by every layer and micro-batch."""
    return shape.seq_length * shape.head_dim * 4


def layer_activation_tensors(shape: ModelShape, role: Role, share: str = "qk", element_bytes: int = 4, **parallel) -> list[int]:
    """The bytes of each tensor behind :func:`layer_activation_terms`, sorted: what the
    measurement sees storage by storage."""
    sizes = []
    for name, value in layer_activation_terms(shape, role, share, element_bytes, **parallel).items():
        if name == "moc_sparse":  # the indices, and the k-wide G and U values
            values = value // (2 * element_bytes + index_bytes(shape.ffn_hidden_size // parallel["moc"].groups)) * element_bytes
            sizes += [value - 2 * values, values, values]
            continue
        count = TENSORS_PER_TERM.get(name, 1) if not (name == "swiglu" and parallel.get("fused_swiglu")) else 1
        if count is None:
            count = value // (shape.seq_length * shape.head_dim * element_bytes)
        sizes += [value // count] * count
    return sorted(sizes)


def layer_activation_bytes(shape: ModelShape, role: Role, share: str = "qk", element_bytes: int = 4, **parallel) -> int:
    """Total of :func:`layer_activation_terms` (same arguments)."""
    return sum(layer_activation_terms(shape, role, share, element_bytes, **parallel).values())


def weight_grad_terms(shape: ModelShape, role: Role, share: str = "qk", element_bytes: int = 4, *, tp: int = 1,
                      sequence_parallel: bool = False, moc: Optional[MoCSettings] = None) -> dict[str, int]:
    """Bytes per term that one layer keeps from the end of its input-gradient backward (``B``) to
    its weight-gradient backward (``W``) under a split-backward schedule (v-half, v-min), per
    micro-batch on one tensor-parallel rank: each trainable linear's deferred GEMM keeps its input
    and its output gradient (:mod:`epas_megatron.model.weight_grad`); everything else the layer
    saved is released at the end of ``B``.

    ==================  =============================  ==========================================
    linear              input (also a forward term)    output gradient
    ==================  =============================  ==========================================
    QKV (computing)     ``norm1_output``: sn·b·h       s·b·(a + 2g)·d
    V (``qk`` sharing)  ``norm1_output``: sn·b·h       s·b·g·d
    Q (``kv`` sharing)  ``norm1_output``: sn·b·h       s·b·a·d
    output projection   ``attention_output``: s·b·a·d  sn·b·h
    fc1                 ``norm2_output``: sn·b·h       s·b·2F
    fc2                 SwiGLU's product: s·b·F        sn·b·h
    ==================  =============================  ==========================================

    (``a``, ``g``, ``F`` divided by TP; ``sn`` = ``s / t`` with sequence parallelism.) Under
    sequence parallelism both kinds keep the sequence shard of their full-sequence operand and
    all-gather it again over the tensor-parallel group in ``W``: a column-parallel GEMM (QKV, V,
    Q, fc1) its input, which arrives as the shard; a row-parallel GEMM (the output projection,
    fc2) its output gradient, which arrives all-gathered (the output is reduce-scattered outside
    the linear), so ``B`` copies this rank's shard out and frees the whole (measured at TP = 2 +
    SP, two ranks: ``tests/metrics/test_activation_memory.py``). In the activation dtype.
    Recompute does not change them: a recomputed MLP's fc2 input is made again in ``B`` and kept
    to ``W`` like the original. A Mixture-of-Channels MLP (``moc``) keeps fc2's input in its
    sparse form (``moc_sparse``) and, like the dense fc2, the output gradient's shard."""
    if share not in ("qk", "kv"):
        raise ValueError(f"share must be 'qk' or 'kv', got {share!r}")
    s, b, h = shape.seq_length, shape.micro_batch_size, shape.hidden_size
    a, g, d, f = shape.num_attention_heads // tp, shape.num_query_groups // tp, shape.head_dim, shape.ffn_hidden_size // tp
    sn = s // tp if sequence_parallel else s
    e = element_bytes
    own = {"compute": a + 2 * g, "share": g if share == "qk" else a}[role]
    # Under SP column-parallel inputs and row-parallel output gradients are kept as the sequence shard
    # (model/weight_grad.py gathers them again in W).
    return {"qkv_input": sn * b * h * e, "qkv_grad_output": s * b * own * d * e,
            "proj_input": s * b * a * d * e, "proj_grad_output": sn * b * h * e,
            "fc1_input": sn * b * h * e, "fc1_grad_output": s * b * 2 * f * e,
            "fc2_input": (s * b * moc_saved_bytes_per_token(f, moc.groups // tp, moc.topk, e) if moc is not None
                          else s * b * f * e),
            "fc2_grad_output": sn * b * h * e}


def weight_grad_bytes(shape: ModelShape, role: Role, share: str = "qk", element_bytes: int = 4, **parallel) -> int:
    """Total of :func:`weight_grad_terms` (same arguments)."""
    return sum(weight_grad_terms(shape, role, share, element_bytes, **parallel).values())


def region_saving_bytes(shape: ModelShape, region: int, share: str = "qk", element_bytes: int = 4, **parallel) -> tuple[int, int]:
    """(decoder activation bytes with no layer sharing, with ``region`` layers sharing), per
    micro-batch: what EPAS saves on the layers' activations at that region."""
    compute = layer_activation_bytes(shape, "compute", share, element_bytes, **parallel)
    sharing = layer_activation_bytes(shape, "share", share, element_bytes, **parallel)
    return shape.num_layers * compute, (shape.num_layers - region) * compute + region * sharing
