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
``norm1_input``              s·b·h                   RMSNorm (x for the backward of x²)
``norm1_input_fp32``          s·b·h  (fp32)           RMSNorm in bf16/fp16: its fp32 copy of x
``norm1_rstd``               s·b    (fp32)           RMSNorm (1 / rms)
``norm1_normalized``         s·b·h                   RMSNorm's weight gradient (x / rms)
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
own total at small FFN widths. The norm statistics and the log-sum-exp are always fp32.

Tensor parallelism (``t``) divides the head and FFN terms (``a``, ``g``, ``F`` by ``t``); the
norms and the GEMM inputs they feed keep the whole sequence on every rank, or ``s / t`` of it
with sequence parallelism (Megatron's column-parallel GEMM keeps its local input and gathers it
again in backward). Selective recompute (``core_attn``) runs the attention kernel again in
backward from Q, K and V, which the layer keeps anyway: it drops only the log-sum-exp (and keeps
a 4-byte argument) -- Korthikanti's ``5·a·s²·b`` that it was designed to remove is never stored
by a fused kernel.

Scope: the local backend's kernels (CPU SDPA's flash path; Transformer Engine fuses more and
keeps less). Full recompute (each group keeps only its inputs -- for a group that starts inside
a sharing region, the hand-off Q and K too) and the pipeline's in-flight micro-batches are not
modelled yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["compute", "share"]


@dataclass(frozen=True)
class LayerShape:
    """What a layer's activations depend on."""

    hidden_size: int
    """h."""

    num_attention_heads: int
    """a (query heads)."""

    num_query_groups: int
    """g (KV heads)."""

    ffn_hidden_size: int
    """F (SwiGLU width)."""

    seq_length: int
    """s."""

    micro_batch_size: int
    """b."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def layer_activation_terms(shape: LayerShape, role: Role, share: str = "qk", element_bytes: int = 4, *,
                           tp: int = 1, sequence_parallel: bool = False, recompute: str = "none") -> dict[str, int]:
    """Bytes per term (see the module doc) that one layer keeps for backward, per micro-batch,
    on one tensor-parallel rank."""
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
        terms[f"{norm}_input"] = sn * b * h * e
        if e < 4:  # half precision: the norm computes in fp32 and keeps that copy of its input
            terms[f"{norm}_input_fp32"] = sn * b * h * 4
        terms[f"{norm}_rstd"] = sn * b * 4
        terms[f"{norm}_normalized"] = sn * b * h * e
        terms[f"{norm}_output"] = sn * b * h * e
    if role == "compute":
        terms["qkv_output"] = s * b * (a + 2 * g) * d * e
        terms["q_rope"] = s * b * a * d * e
        terms["k_rope"] = s * b * g * d * e
        terms["rope_tables"] = 4 * s * d * e
    elif role == "share" and share == "qk":
        terms["v_output"] = s * b * g * d * e
    elif role == "share":
        terms["q_rope"] = s * b * a * d * e
        terms["rope_tables"] = 2 * s * d * e
    else:
        raise ValueError(f"role must be 'compute' or 'share', got {role!r}")
    terms["attention_output"] = s * b * a * d * e
    if recompute == "selective":  # the kernel runs again in backward from the Q, K, V kept above
        terms["recompute_argument"] = 4  # an int32 scalar the checkpoint keeps
    else:
        terms["attention_lse"] = b * a * s * 4
    terms["fc1_output"] = s * b * 2 * f * e
    terms["swiglu"] = 3 * s * b * f * e
    return terms


def layer_activation_bytes(shape: LayerShape, role: Role, share: str = "qk", element_bytes: int = 4, **parallel) -> int:
    """Total of :func:`layer_activation_terms` (same arguments)."""
    return sum(layer_activation_terms(shape, role, share, element_bytes, **parallel).values())


def region_saving_bytes(shape: LayerShape, num_layers: int, region: int, share: str = "qk", element_bytes: int = 4,
                        **parallel) -> tuple[int, int]:
    """(decoder activation bytes with no layer sharing, with ``region`` layers sharing), per
    micro-batch: what EPAS saves on the layers' activations at that region."""
    compute = layer_activation_bytes(shape, "compute", share, element_bytes, **parallel)
    sharing = layer_activation_bytes(shape, "share", share, element_bytes, **parallel)
    return num_layers * compute, (num_layers - region) * compute + region * sharing
