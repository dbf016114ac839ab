"""Sharing-aware FLOPs model for a LLaMA decoder, and MFU.

Model: RMSNorm, RoPE, SwiGLU MLP with ffn size ``F``, grouped-query attention with ``n`` query
heads and ``g`` KV heads (query groups), head dim ``d = h / n``, vocab ``V``, sequence ``s``:
a :class:`~epas_megatron.model.architecture.ModelShape` (the architecture at ``s``). Only
matrix multiplications are counted, at 2 FLOPs per multiply-add; norms, RoPE, softmax,
SwiGLU's elementwise product and the embedding lookup are left out (each is O(s·h) or
O(s²·n), under 1% of a layer at the shapes we train). Per layer and sequence, forward:

=====================  ====================  =========================================
matmul                 FLOPs                 skipped by a sharing layer
=====================  ====================  =========================================
Q projection           2·s·h·h               ``share_qk``
K projection           2·s·h·(g·d)           ``share_qk``, ``share_kv``
V projection           2·s·h·(g·d)           ``share_kv``
scores Q·Kᵀ            2·s²·h  (÷2 causal)   never (the kernel still runs)
probs·V                2·s²·h  (÷2 causal)   never
output projection      2·s·h·h               never
MLP (gate, up, down)   3 · 2·s·h·F           never
=====================  ====================  =========================================

plus the LM head, ``2·s·h·V`` once per sequence (tied or untied embeddings: the matmul is the
same). ``share_qk`` is EPAS (own V, source's post-RoPE Q and K); ``share_kv`` is the KV-sharing
variant named in the paper (own Q, source's K and V; CLA/YOCO-like). A sharing layer keeps its
Q/K weights but does not run them, so they cost no FLOPs.

Training = 3 × forward (the backward pass runs two GEMMs per forward GEMM: data and weight
gradients), or 4 × forward with full activation recompute (the forward runs twice). Use
``full_recompute=False`` for MFU (model FLOPs, PaLM's convention) and ``True`` for hardware
FLOPs utilisation.

Conventions
-----------
The only knob on which published formulas disagree is causal halving of the ``s²`` terms:

* :attr:`Convention.PAPER` (default): no halving, the full ``s × s`` score matrix is counted.
  This is the convention of the EPAS paper's Table 1 and of Megatron-LM's
  ``num_floating_point_operations`` before it learnt about causal masks.
* :attr:`Convention.MEGATRON`: both ``s²`` terms halved for the causal mask, as Megatron-Core
  0.19's ``megatron.training.training.num_floating_point_operations`` does (the version this
  project pins). With ``num_sharing_layers=0`` our number equals Megatron's, and matches its log
  exactly with the same padded vocabulary (the architecture's is padded to 128, Megatron's to
  128 x TP).

Reproducing the paper's Table 1 (FLOPs per sample, seq 2048, 50% of layers sharing)
-----------------------------------------------------------------------------------
We computed, not guessed, which accounting yields the published numbers: 3 × forward vs
4 × forward, causal halving or not, LM head counted or not, GQA counted exactly or as full MHA,
and the free shape parameters (ffn size, vocab). The 1.1B row pins the convention down since its
shape is fully published (TinyLLaMA): the baseline/EPAS *difference* depends only on the skipped
Q/K projections, ``3 · 11 · 2·s·h·(h + g·d) = 0.638 TF`` (paper: 0.64), which rules out 4 ×
forward (0.85 TF) and GQA-as-MHA (1.13 TF); the *total* then only fits with the LM head
counted and no causal halving (halving: -7.6%; no LM head: -5.4%). The result is
:attr:`Convention.PAPER`, 3 × forward, LM head counted, GQA exact, matmuls only:

==========================================================  =================  ================
model (shape)                                               baseline (paper)    EPAS (paper)
==========================================================  =================  ================
125M: 12 layers, h 768, 12 heads, F 2048, V 32000           1.8095 (1.81)       1.7226 (1.72)
                                                            -0.03%              +0.15%
1.1B TinyLLaMA: 22 layers, h 2048, 32/4 heads, F 5632,      14.979 (14.98)      14.341 (14.34)
V 32000                                                     -0.01%              +0.01%
3B, inferred: 26 layers, h 3072, MHA, F 8192, V 32000       41.409 (41.41)      38.394 (38.39)
                                                            -0.00%              +0.01%
7B LLaMA-2-7B: 32 layers, h 4096, 32 heads, F 11008,        87.785 (85.62)      81.188 (79.21)
V 32000                                                     +2.53%              +2.50%
==========================================================  =================  ================

* 125M: a LLaMA-style shape with ``F = 8h/3 = 2048`` and the LLaMA vocab fits; GPT-2's
  ``F = 3072`` with vocab 50257 gives 2.33 TF (+29%) and is not what the paper ran.
* 3B: the paper publishes no shape. The fit above is one natural shape among several that fit
  both numbers within 0.2% (two numbers cannot pin five unknowns); OpenLLaMA-3B (26 layers,
  h 3200, F 8640) gives 45.03 TF (+8.8%). Treat it as a consistency check, not a derivation.
* 7B: not reproduced. The skipped-Q/K difference for 16 sharing layers of h 4096 is 6.60 TF
  whatever the convention, the paper's is 6.41 TF; no natural 32-layer shape fits both numbers.
  Both paper numbers are about 2.5% below ours, so the ratio (1.0813 vs the paper's 1.0809)
  agrees; the absolute 7B numbers look scaled by something we could not identify.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Literal, Sequence

from epas_megatron.errors import ConfigError
from epas_megatron.model.architecture import ModelShape

__all__ = [
    "PEAK_TFLOPS",
    "Convention",
    "LayerMatmulFlops",
    "flop_limit_ratio",
    "flops_per_iteration",
    "forward_flops_per_sequence",
    "layer_forward_flops",
    "layer_matmul_flops",
    "layerwise_forward_flops",
    "lm_head_forward_flops",
    "mfu",
    "peak_name_for_device",
    "peak_tflops",
    "tflops_per_device",
    "training_flops_per_sequence",
]

LayerFlopsMode = Literal["compute", "share_qk", "share_kv"]
"""How a layer runs attention: its own Q/K/V, the source's Q/K (EPAS), or the source's K/V."""
ShareVariant = Literal["qk", "kv"]
"""What sharing layers reuse from the source: ``"qk"`` (EPAS) or ``"kv"`` (the KV variant)."""


class Convention(enum.Enum):
    """How the ``s²`` attention matmuls are counted (see the module docstring)."""

    PAPER = "paper"
    """Full ``s × s`` scores: the EPAS paper's Table 1 and pre-causal Megatron-LM."""
    MEGATRON = "megatron"
    """Scores and probs·V halved for the causal mask: Megatron-Core 0.19's formula."""

    @property
    def causal_halving(self) -> bool:
        """Whether the ``s²`` terms are halved."""
        return self is Convention.MEGATRON


@dataclass(frozen=True)
class LayerMatmulFlops:
    """Forward FLOPs of each matmul of one computing decoder layer, for one sequence."""

    q_proj: int
    """``2·s·h·h``."""
    k_proj: int
    """``2·s·h·(g·d)``."""
    v_proj: int
    """``2·s·h·(g·d)``."""
    attention_scores: int
    """``Q·Kᵀ`` over all heads: ``2·s²·h``, halved under :attr:`Convention.MEGATRON`."""
    attention_values: int
    """``probs·V`` over all heads: ``2·s²·h``, halved under :attr:`Convention.MEGATRON`."""
    out_proj: int
    """``2·s·h·h``."""
    mlp: int
    """Gate, up and down projections: ``3 · 2·s·h·F``."""

    @property
    def total(self) -> int:
        """Sum of all matmuls: the forward FLOPs of a computing layer."""
        return (
            self.q_proj
            + self.k_proj
            + self.v_proj
            + self.attention_scores
            + self.attention_values
            + self.out_proj
            + self.mlp
        )

    def skipped(self, mode: LayerFlopsMode) -> int:
        """FLOPs a layer in ``mode`` does not run, compared with a computing layer."""
        if mode == "compute":
            return 0
        if mode == "share_qk":
            return self.q_proj + self.k_proj
        if mode == "share_kv":
            return self.k_proj + self.v_proj
        raise ValueError(f"unknown layer mode {mode!r}; expected compute, share_qk or share_kv")


def layer_matmul_flops(
    shape: ModelShape, convention: Convention = Convention.PAPER
) -> LayerMatmulFlops:
    """Per-matmul forward FLOPs of one computing layer for one sequence."""
    s, h = shape.seq_length, shape.hidden_size
    # Both s² matmuls over all heads: [n, s, d] x [n, d, s] and [n, s, s] x [n, s, d].
    core = 2 * s * s * h
    if convention.causal_halving:
        core //= 2  # exact: 2·s²·h is even
    return LayerMatmulFlops(
        q_proj=2 * s * h * h,
        k_proj=2 * s * h * shape.kv_projection_size,
        v_proj=2 * s * h * shape.kv_projection_size,
        attention_scores=core,
        attention_values=core,
        out_proj=2 * s * h * h,
        mlp=3 * 2 * s * h * shape.ffn_hidden_size,
    )


def layer_forward_flops(
    shape: ModelShape, mode: LayerFlopsMode = "compute", convention: Convention = Convention.PAPER
) -> int:
    """Forward FLOPs of one decoder layer in ``mode`` for one sequence."""
    matmuls = layer_matmul_flops(shape, convention)
    return matmuls.total - matmuls.skipped(mode)


def lm_head_forward_flops(shape: ModelShape) -> int:
    """Forward FLOPs of the output projection to the vocabulary, ``2·s·h·V``."""
    return 2 * shape.seq_length * shape.hidden_size * shape.vocab_size


def _check_sharing(shape: ModelShape, num_sharing_layers: int, share: ShareVariant) -> None:
    if (
        not isinstance(num_sharing_layers, int)
        or isinstance(num_sharing_layers, bool)
        or not 0 <= num_sharing_layers <= shape.num_layers - 1
    ):
        raise ConfigError(
            f"--epas-target-layers: {num_sharing_layers!r} sharing layers is not possible in a "
            f"{shape.num_layers}-layer model (0..{shape.num_layers - 1}; one source must remain)"
        )
    if share not in ("qk", "kv"):
        raise ValueError(f"share must be 'qk' or 'kv', got {share!r}")


def forward_flops_per_sequence(
    shape: ModelShape,
    num_sharing_layers: int = 0,
    share: ShareVariant = "qk",
    convention: Convention = Convention.PAPER,
) -> int:
    """Forward FLOPs for one sequence with ``num_sharing_layers`` layers sharing."""
    _check_sharing(shape, num_sharing_layers, share)
    num_computing = shape.num_layers - num_sharing_layers
    return (
        num_computing * layer_forward_flops(shape, "compute", convention)
        + num_sharing_layers * layer_forward_flops(shape, f"share_{share}", convention)
        + lm_head_forward_flops(shape)
    )


def layerwise_forward_flops(
    shape: ModelShape,
    modes: Sequence[LayerFlopsMode],
    tokens_per_layer: Sequence[int] | None = None,
    convention: Convention = Convention.PAPER,
    qkv_tokens_per_layer: Sequence[int] | None = None,
) -> int:
    """Forward FLOPs for one sequence when layer ``i`` runs in ``modes[i]`` on
    ``tokens_per_layer[i]`` tokens (default: all ``s``), plus the LM head on all ``s``.

    Random-LTD: a dropping layer runs every matmul on its ``r`` kept tokens only, so its linear
    terms scale with ``r`` and its attention core with ``r²`` (the kept tokens attend causally
    among themselves); the LM head still sees every token. ``qkv_tokens_per_layer`` (default: the
    same counts) is what the Q/K/V projections run on: the whole sequence for a dropping layer
    that hands Q/K on to a sharing region."""
    s = shape.seq_length
    tokens = [s] * shape.num_layers if tokens_per_layer is None else list(tokens_per_layer)
    qkv_tokens = list(tokens) if qkv_tokens_per_layer is None else list(qkv_tokens_per_layer)
    if not len(modes) == len(tokens) == len(qkv_tokens) == shape.num_layers:
        raise ValueError(f"need one mode and one token count per layer ({shape.num_layers}), got {len(modes)}, "
                         f"{len(tokens)} and {len(qkv_tokens)}")
    if any(not 1 <= t <= s for t in tokens + qkv_tokens):
        raise ValueError(f"tokens per layer must be in 1..{s}, got {tokens} / {qkv_tokens}")
    total = lm_head_forward_flops(shape)
    for mode, kept, qkv in zip(modes, tokens, qkv_tokens):
        at_kept = layer_matmul_flops(dataclasses.replace(shape, seq_length=kept), convention)
        at_qkv = layer_matmul_flops(dataclasses.replace(shape, seq_length=qkv), convention)
        projections = lambda m: m.q_proj + m.k_proj + m.v_proj  # noqa: E731
        total += at_kept.total - projections(at_kept) + projections(at_qkv) - at_qkv.skipped(mode)
    return total


def training_flops_per_sequence(
    shape: ModelShape,
    num_sharing_layers: int = 0,
    share: ShareVariant = "qk",
    convention: Convention = Convention.PAPER,
    full_recompute: bool = False,
) -> int:
    """Forward + backward FLOPs for one sequence: 3 × forward, 4 × with full recompute.

    Sharing layers skip their Q/K projections in the recomputed forward too.
    """
    multiplier = 4 if full_recompute else 3
    return multiplier * forward_flops_per_sequence(shape, num_sharing_layers, share, convention)


def flops_per_iteration(
    shape: ModelShape,
    global_batch_size: int,
    num_sharing_layers: int = 0,
    share: ShareVariant = "qk",
    convention: Convention = Convention.PAPER,
    full_recompute: bool = False,
) -> int:
    """Training FLOPs of one iteration (all ranks together) of ``global_batch_size`` sequences.

    Pass the region in effect for that iteration (``SharingSchedule.region_size``).
    """
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(
            f"--global-batch-size must be a positive integer, got {global_batch_size!r}"
        )
    return global_batch_size * training_flops_per_sequence(
        shape, num_sharing_layers, share, convention, full_recompute
    )


def flop_limit_ratio(
    shape: ModelShape,
    num_sharing_layers: int,
    share: ShareVariant = "qk",
    convention: Convention = Convention.PAPER,
    full_recompute: bool = False,
) -> float:
    """Baseline / EPAS training FLOPs: the speed-up EPAS could give if throughput were purely
    FLOP-bound (the upper bound its measured tokens/s gain is compared with)."""
    baseline = training_flops_per_sequence(shape, 0, share, convention, full_recompute)
    epas = training_flops_per_sequence(shape, num_sharing_layers, share, convention, full_recompute)
    return baseline / epas


# ---------------------------------------------------------------------------- peaks and MFU
PEAK_TFLOPS: dict[str, float | None] = {
    "v100": 125.0,  # fp16 tensor cores, SXM2; V100 has no bf16 (the paper trained in fp16)
    "v100-pcie": 112.0,  # fp16 tensor cores (V100 data sheet: PCIe 112, SXM2 125)
    "a10": 125.0,
    "a100": 312.0,  # SXM4 and PCIe alike (A100 data sheet)
    "l4": 121.0,
    "l40": 181.0,  # L40 data sheet: 362.1 with sparsity
    "l40s": 362.0,
    "h100": 989.0,  # SXM5 (H100 data sheet: 1,979 with sparsity)
    "h100-pcie": 756.0,  # H100 data sheet: 1,513 with sparsity
    "h100-nvl": 835.0,  # per GPU; H100 data sheet: 1,671 with sparsity
    "h200": 989.0,  # SXM (H200 data sheet: 1,979 with sparsity)
    "h200-nvl": 835.0,  # H200 data sheet: 1,671 with sparsity
    "gh200": 989.0,  # the Hopper GPU of a Grace Hopper superchip (GH200 data sheet: 1,979 with sparsity)
    "b200": 2250.0,
    "mi300x": 1307.0,
    "cpu": None,  # no meaningful peak; callers print "n/a"
}
"""Dense (no 2:4 sparsity) bf16 tensor-core peak per device in TFLOP/s, from vendor data
sheets (which quote twice these "with sparsity"); ``None`` where no peak is meaningful."""

# Device family (a word of the device name) -> (its key, {variant word: key}); the SXM part is the default.
_DEVICE_FAMILIES: dict[str, tuple[str, dict[str, str]]] = {
    "v100": ("v100", {"pcie": "v100-pcie"}),
    "a10": ("a10", {}),
    "a100": ("a100", {}),
    "l4": ("l4", {}),
    "l40": ("l40", {}),
    "l40s": ("l40s", {}),
    "h100": ("h100", {"pcie": "h100-pcie", "nvl": "h100-nvl"}),
    "h200": ("h200", {"nvl": "h200-nvl"}),
    "gh200": ("gh200", {}),
    "b200": ("b200", {}),
    "mi300x": ("mi300x", {}),
}


def peak_name_for_device(device_name: str) -> str:
    """The :data:`PEAK_TFLOPS` key of a device as ``torch.cuda.get_device_name()`` or
    ``nvidia-smi --query-gpu=name`` call it ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-80GB", "Tesla V100-PCIE-32GB", "AMD Instinct MI300X"), ``"cpu"`` (no peak:
    MFU n/a) for one not in the table. Names are matched word by word (split at spaces, dashes
    and underscores), never by substring: "L40" is not an "L4", "A10G" not an "A10", and an
    "H100 PCIe" or "H100 NVL" is not the SXM part."""
    words = [w for w in re.split(r"[\s\-_/]+", device_name.strip().lower()) if w]
    for word in words:
        if word in _DEVICE_FAMILIES:
            key, variants = _DEVICE_FAMILIES[word]
            return next((variants[w] for w in words if w in variants), key)
    return "cpu"


def peak_tflops(peak_name: str) -> float | None:
    """Peak TFLOP/s of ``peak_name`` (a key of :data:`PEAK_TFLOPS`, case-insensitive)."""
    key = peak_name.strip().lower()
    if key not in PEAK_TFLOPS:
        raise ConfigError(
            f"unknown accelerator {peak_name!r} for MFU; known: {', '.join(sorted(PEAK_TFLOPS))}"
        )
    return PEAK_TFLOPS[key]


def tflops_per_device(flops: float, seconds: float, num_devices: int) -> float:
    """Achieved TFLOP/s per device for ``flops`` done by ``num_devices`` in ``seconds``."""
    if seconds <= 0 or num_devices < 1:
        raise ValueError(f"need seconds > 0 and num_devices >= 1, got {seconds}, {num_devices}")
    return flops / seconds / num_devices / 1e12


def mfu(achieved_tflops_per_device: float, peak_name: str) -> float | None:
    """Model FLOPs utilisation as a fraction of the peak; ``None`` where there is no peak
    (CPU), which callers print as ``"n/a"``."""
    peak = peak_tflops(peak_name)
    if peak is None:
        return None
    return achieved_tflops_per_device / peak
