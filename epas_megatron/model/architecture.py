"""The decoder's shape: :class:`LlamaArchitecture`, and the one way to make it from each source.

A run's ``ModelConfig`` (:func:`architecture_from_config`), a preset
(:func:`architecture_from_preset`, for benchmarks that build a model without a run) and a
checkpoint (through its saved config, :mod:`epas_megatron.assembly`) all become the same frozen
object, with the vocabulary padded the same way, so a checkpoint's weights fit the model that
any entry point builds for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from epas_megatron.model.moc_sizes import MoCSettings

VOCAB_PAD_MULTIPLE = 128

DEFAULT_TOKENIZER_VOCAB = 8192
"""Vocabulary of a preset without one (the default tokenizer's size): what benchmarks assume."""


@dataclass(frozen=True)
class LlamaArchitecture:
    """What the builder needs to know about the architecture."""

    num_layers: int
    """Decoder layers."""

    hidden_size: int
    """Hidden size."""

    num_attention_heads: int
    """Query heads."""

    num_query_groups: int
    """Key/value heads."""

    ffn_hidden_size: int
    """SwiGLU inner size."""

    vocab_size: int
    """Vocabulary (the embedding is padded by Megatron to a multiple of TP if needed)."""

    max_sequence_length: int
    """Longest sequence."""

    rotary_base: int = 10000
    """RoPE base."""

    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""

    init_method_std: float = 0.02
    """Init std."""

    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""

    moc_topk: float = 1.0
    """Mixture-of-Channels kept fraction of the SwiGLU channels (1: the dense MLP;
    :mod:`epas_megatron.model.moc`)."""

    moc_groups: int = 8
    """Mixture-of-Channels channel groups (each keeps its own Top-K)."""

    @property
    def moc(self) -> Optional[MoCSettings]:
        """The Mixture-of-Channels MLPs (None: dense)."""
        return MoCSettings.from_flags(self.moc_topk, self.moc_groups)


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """Vocabulary padded to a multiple of 128 (not of 128 x TP as Megatron-LM does), so the
    model's shape -- and its checkpoints and initialisation -- do not depend on TP; any TP that
    divides 128 divides it."""
    return -(-vocab_size // multiple) * multiple


def architecture_from_config(model_cfg) -> LlamaArchitecture:
    """The architecture of a resolved ``ModelConfig`` (vocabulary padded, see above)."""
    m = model_cfg
    return LlamaArchitecture(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        vocab_size=padded_vocab_size(m.vocab_size),
        max_sequence_length=m.max_position_embeddings,
        rotary_base=m.rotary_base,
        norm_epsilon=m.norm_epsilon,
        init_method_std=m.init_method_std,
        tie_embeddings=not m.untie_embeddings_and_output_weights,
        moc_topk=m.moc_topk,
        moc_groups=m.moc_groups,
    )


def architecture_from_preset(preset, seq_length: Optional[int] = None) -> LlamaArchitecture:
    """A :class:`~epas_megatron.config.presets.Preset`'s architecture, as benchmarks build it:
    its vocabulary (the default tokenizer's 8192 pieces where the preset leaves it to the
    tokenizer), padded; room for ``seq_length`` tokens (at least the preset's sequence);
    the other fields at their defaults."""
    longest = max(seq_length or 0, preset.seq_length)
    return LlamaArchitecture(preset.num_layers, preset.hidden_size, preset.num_attention_heads, preset.num_query_groups,
                             preset.ffn_hidden_size, padded_vocab_size(preset.vocab_size or DEFAULT_TOKENIZER_VOCAB), longest)
