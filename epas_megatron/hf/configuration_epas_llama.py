"""``EpasLlamaConfig``: a LLaMA configuration that also records an EPAS sharing region.

A model exported with ``epas-convert hf-export --region R`` is a LLaMA whose ``R`` layers
``epas_sharing_layers`` (the deepest ones, where the trained regions end; with several sharing
blocks, ``--epas-blocks``, that many runs of layers) run in *sharing mode*: with
``epas_share='qk'`` such a layer reuses the post-RoPE Q and K of the last computing layer before
it (its *source*; each block has its own) and computes only its own V; with ``'kv'`` it computes
its own Q and reuses the source's K and V. ``epas_region`` (0 .. ``len(epas_sharing_layers)``)
picks how many of those layers share when the model runs: the first ``epas_region`` of
``epas_region_order`` (the order in which training switched them; by default the deepest first,
one block's order). A smaller region runs the other layers with their own (frozen during
training) Q/K (K/V) projections, which the export keeps. It can be chosen at load time without
a new export::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, epas_region=1)

A model trained with Mixture-of-Channels (Wu et al., "Mixture-of-Channels: Exploiting Sparse
FFNs for Efficient LLMs Pre-Training and Inference", arXiv 2511.09323; ``--moc-topk``,
``--moc-groups``) records its Top-K in ``moc_topk`` and ``moc_groups``: every MLP keeps, per
token, the channels with the largest gate pre-activation within each group. A configuration
without them (every export written before they existed) is the dense LLaMA MLP.

This file ships inside every exported model directory: it imports only ``transformers`` and
``huggingface_hub`` (a dependency of transformers, whose config classes use its ``strict``).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

SHARE_KINDS = ("qk", "kv")
"""What a sharing layer reuses from its source: post-RoPE Q and K, or K and V."""


@strict
class EpasLlamaConfig(LlamaConfig):
    """LLaMA plus the EPAS region (see the module notes)."""

    model_type = "epas_llama"

    epas_share: str = "qk"
    """'qk': sharing layers reuse the source's post-RoPE Q and K and own V (the paper's EPAS);
    'kv': they own Q and reuse the source's K and V (cross-layer KV sharing)."""

    epas_sharing_layers: list[int] | None = None
    """The exported (largest) sharing region, ascending (one run of layers per block, each after
    a computing layer): these layers hold only what they own in sharing mode, plus their frozen
    projections (``frozen_*_proj``)."""

    epas_region_order: list[int] | None = None
    """``epas_sharing_layers`` in the order training switched them to sharing: a region of ``r``
    layers is the first ``r`` (None: the deepest first, the order of one block)."""

    epas_region: int | None = None
    """Layers that share when the model runs: the first ``epas_region`` of
    ``epas_region_order`` (None: all of them)."""

    epas_reuse_probs: bool = False
    """'qk' only: a sharing layer applies its source's attention probabilities to its own V
    instead of recomputing ``softmax(Q Kᵀ)`` from the same Q, K and mask (exact, and no K read;
    the source then runs eager attention to have the probabilities)."""

    moc_topk: float | int = 1.0
    """Mixture-of-Channels: the fraction of each group's gate channels an MLP keeps per token
    (the Top-K of the gate pre-activation ``G``, by value); 1.0: the dense ``LlamaMLP``."""

    moc_groups: int = 8
    """Mixture-of-Channels: equal runs of the ``intermediate_size`` gate channels, each keeping
    its own ``moc_kept_channels`` (read only when ``moc_topk < 1``)."""

    def __post_init__(self, **kwargs):
        self.epas_sharing_layers = [int(i) for i in (self.epas_sharing_layers or [])]
        if self.epas_region_order is None:
            self.epas_region_order = sorted(self.epas_sharing_layers, reverse=True)
        self.epas_region_order = [int(i) for i in self.epas_region_order]
        if self.epas_region is None:
            self.epas_region = len(self.epas_sharing_layers)
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        super().validate_architecture()
        layers = self.epas_sharing_layers
        if self.epas_share not in SHARE_KINDS:
            raise ValueError(f"epas_share must be one of {SHARE_KINDS}, got {self.epas_share!r}")
        if layers != sorted(set(layers)):
            raise ValueError(f"epas_sharing_layers must be ascending layer numbers, got {layers}")
        if layers and not 1 <= layers[0] <= layers[-1] < self.num_hidden_layers:
            raise ValueError(f"epas_sharing_layers {layers}: a sharing layer needs a computing layer before it "
                             f"and the model has {self.num_hidden_layers} layers")
        if sorted(self.epas_region_order) != layers:
            raise ValueError(f"epas_region_order {self.epas_region_order} must list epas_sharing_layers {layers}, each once")
        if not 0 <= int(self.epas_region) <= len(layers):
            raise ValueError(f"epas_region must be between 0 and {len(layers)} (the exported sharing region), "
                             f"got {self.epas_region}")
        if self.epas_reuse_probs and self.epas_share != "qk":
            raise ValueError("epas_reuse_probs needs epas_share='qk' (kv-sharing layers have their own Q)")
        if not 0.0 < self.moc_topk <= 1.0:
            raise ValueError(f"moc_topk must be in (0, 1] (the kept fraction of the MLP channels), got {self.moc_topk}")
        if self.moc_topk < 1.0 and (self.moc_groups < 1 or self.intermediate_size % self.moc_groups):
            raise ValueError(f"moc_groups {self.moc_groups} must divide intermediate_size {self.intermediate_size}")

    @property
    def epas_active_layers(self) -> tuple[int, ...]:
        """The layers that share at ``epas_region``, ascending: the first ``epas_region`` of
        ``epas_region_order``."""
        return tuple(sorted(self.epas_region_order[: int(self.epas_region)]))

    @property
    def moc_kept_channels(self) -> int | None:
        """Channels a Mixture-of-Channels MLP keeps per token in each group, ``round(moc_topk *
        intermediate_size / moc_groups)``, at least 1 (as the training framework counts them);
        None for the dense MLP."""
        if self.moc_topk >= 1.0:
            return None
        per_group = self.intermediate_size // self.moc_groups
        return max(1, min(per_group, round(self.moc_topk * per_group)))


__all__ = ["EpasLlamaConfig", "SHARE_KINDS"]
