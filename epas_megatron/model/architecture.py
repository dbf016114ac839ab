"""The decoder's shape: :class:`LlamaArchitecture`, and the one way to make it from each source.

It is the only description of the model's dimensions: the FLOP and memory models read it through
:class:`ModelShape` (the architecture at a sequence length and micro-batch size), Hugging Face
conversion (:mod:`epas_megatron.convert.hf_llama`) and the benchmarks take it as it is.

A run's ``ModelConfig`` (:func:`architecture_from_config`), a preset
(:func:`architecture_from_preset`, for benchmarks that build a model without a run) and a
checkpoint (through its saved config, :mod:`epas_megatron.assembly`) all become the same frozen
object, with the vocabulary padded the same way, so a checkpoint's weights fit the model that
any entry point builds for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from epas_megatron.errors import ConfigError

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

    def __post_init__(self) -> None:
        """Refuse a shape no model has, naming the flag to change, wherever one is made (a run's
        config, a preset, a checkpoint, a Hugging Face import, a test)."""
        _check_positive(self, {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
                               "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
                               "ffn_hidden_size": "--ffn-hidden-size", "vocab_size": "--vocab-size",
                               "max_sequence_length": "--max-position-embeddings"})
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                              f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                              f"--num-query-groups {self.num_query_groups}")

    @property
    def head_dim(self) -> int:
        """``d = h / n`` (Megatron's ``kv_channels``)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        """Output width of the K (and of the V) projection, ``g · d``."""
        return self.num_query_groups * self.head_dim


def _check_positive(value, flags: dict[str, str]) -> None:
    """ConfigError naming the flag of the first of ``value``'s fields ``flags`` that is not a positive int."""
    for name, flag in flags.items():
        field = getattr(value, name)
        if not isinstance(field, int) or isinstance(field, bool) or field < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {field!r}")


def _from_arch(name: str) -> property:
    """A read-only property of :class:`ModelShape` that reads ``name`` off its architecture."""
    return property(lambda shape: getattr(shape.arch, name), doc=f"The architecture's ``{name}``.")


@dataclass(frozen=True)
class ModelShape:
    """An architecture at a sequence length and micro-batch size: what the FLOP model
    (:mod:`epas_megatron.metrics.flops`) and the memory model
    (:mod:`epas_megatron.metrics.memory_model`) count. It holds the architecture rather than
    copying its dimensions, which it reads through (``shape.hidden_size`` is ``shape.arch.hidden_size``)."""

    arch: LlamaArchitecture
    """The decoder."""

    seq_length: int
    """Tokens per sequence ``s`` (``--seq-length``)."""

    micro_batch_size: int = 1
    """Sequences per micro-batch ``b`` (``--micro-batch-size``; the memory model's, FLOPs are per sequence)."""

    num_layers = _from_arch("num_layers")
    hidden_size = _from_arch("hidden_size")
    num_attention_heads = _from_arch("num_attention_heads")
    num_query_groups = _from_arch("num_query_groups")
    ffn_hidden_size = _from_arch("ffn_hidden_size")
    vocab_size = _from_arch("vocab_size")
    head_dim = _from_arch("head_dim")
    kv_projection_size = _from_arch("kv_projection_size")

    def __post_init__(self) -> None:
        """The sequence and the micro-batch: positive, like the architecture's dimensions."""
        _check_positive(self, {"seq_length": "--seq-length", "micro_batch_size": "--micro-batch-size"})


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
    )


def architecture_from_preset(preset, seq_length: Optional[int] = None) -> LlamaArchitecture:
    """A :class:`~epas_megatron.config.presets.Preset`'s architecture, as benchmarks build it:
    its vocabulary (the default tokenizer's 8192 pieces where the preset leaves it to the
    tokenizer), padded; room for ``seq_length`` tokens (at least the preset's sequence);
    the other fields at their defaults."""
    longest = max(seq_length or 0, preset.seq_length)
    return LlamaArchitecture(preset.num_layers, preset.hidden_size, preset.num_attention_heads, preset.num_query_groups,
                             preset.ffn_hidden_size, padded_vocab_size(preset.vocab_size or DEFAULT_TOKENIZER_VOCAB), longest)
