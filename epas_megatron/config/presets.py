"""Model presets: LLaMA shapes from a CPU test model up to LLaMA-2-7B.

A preset fills model fields (and a few training defaults) that the user did not set; any flag
overrides it. Recommended GPU layouts assume 8x H100 80GB per node, bf16, seq 2048.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from epas_megatron.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """One named model shape."""

    name: str
    """Preset name (the value of --preset)."""

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

    vocab_size: Optional[int]
    """Vocabulary (None: the tokenizer's)."""

    seq_length: int
    """Default training sequence length."""

    description: str
    """Where it runs and the recommended parallel layout."""

    training_defaults: dict = field(default_factory=dict)
    """Training/data field defaults that come with the preset (e.g. micro batch size)."""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny", 4, 64, 4, 2, 176, None, 64,
            "Tests and smoke runs on CPU (seconds). TP<=2, PP<=4.",
            {"micro_batch_size": 2, "default_vocab_size": 512},
        ),
        Preset(
            "small", 8, 384, 6, 2, 1024, None, 256,
            "~19M parameters with the default 8192-piece tokenizer: trains usefully on 2 CPU "
            "cores (about 1.5 s/iteration at micro-batch 8). Single process, or TP/PP=2 "
            "for testing.",
            {"micro_batch_size": 8, "default_vocab_size": 8192},
        ),
        Preset(
            "125m", 12, 768, 12, 12, 2048, 32000, 2048,
            "GPT-3-125M-like LLaMA (the paper's 125M). One GPU; data parallel only.",
            {"micro_batch_size": 8},
        ),
        Preset(
            "350m", 24, 1024, 16, 16, 2816, 32000, 2048,
            "One GPU per replica; data parallel only.",
            {"micro_batch_size": 8},
        ),
        Preset(
            "1b", 22, 2048, 32, 4, 5632, 32000, 2048,
            "TinyLLaMA-1.1B shapes (GQA 32/4). One H100 per replica (TP=1, PP=1), micro-batch 4;"
            " the paper's continual-pretraining model.",
            {"micro_batch_size": 4},
        ),
        Preset(
            "3b", 26, 3072, 24, 24, 8192, 32000, 2048,
            "The paper's 3B: its FLOPs/sample (41.41 TF) fit 26 layers of h 3072 (head dim 128), "
            "ffn 8192. H100: TP=2 (or TP=1 with --recompute selective), micro-batch 2.",
            {"micro_batch_size": 2},
        ),
        Preset(
            "7b", 32, 4096, 32, 32, 11008, 32000, 2048,
            "LLaMA-2-7B shapes. H100 node: TP=2 PP=2 (or TP=4), micro-batch 1, distributed "
            "optimizer; PP>1 is where EPAS stage rebalancing pays off.",
            {"micro_batch_size": 1},
        ),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ConfigError naming --preset if there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"--preset {name!r} is not a known preset; choose one of: {', '.join(PRESETS)}"
        ) from None


def default_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU width: 8/3 of the hidden size rounded up to a multiple of 256 (4096 ->
    11008, 2048 -> 5632, 768 -> 2048)."""
    return -(-(8 * hidden_size // 3) // multiple_of) * multiple_of


def decoder_layer_parameters(hidden_size: int, num_attention_heads: int, num_query_groups: int, ffn_hidden_size: int) -> int:
    """Parameters of one LLaMA decoder layer: fused QKV (GQA), output projection, SwiGLU's three
    matrices and the two RMSNorm weights."""
    head_dim = hidden_size // num_attention_heads
    return (hidden_size * (hidden_size + 2 * num_query_groups * head_dim) + hidden_size * hidden_size
            + 3 * hidden_size * ffn_hidden_size + 2 * hidden_size)


def decoder_parameters(num_layers: int, hidden_size: int, num_attention_heads: int, num_query_groups: int,
                       ffn_hidden_size: int) -> int:
    """Parameters of the decoder layers (embeddings and LM head left out: they follow the tokenizer)."""
    return num_layers * decoder_layer_parameters(hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size)


EMBEDDED_DATA_LARGEST_PRESET = "small"
"""The largest preset that trains on the embedded corpus without ``--data embedded``."""


def too_large_for_the_embedded_corpus(num_layers: int, hidden_size: int, num_attention_heads: int, num_query_groups: int,
                                      ffn_hidden_size: int) -> bool:
    """More decoder parameters than :data:`EMBEDDED_DATA_LARGEST_PRESET`: such a model trains on
    the embedded demo corpus only when asked by name (``--data embedded``)."""
    largest = get_preset(EMBEDDED_DATA_LARGEST_PRESET)
    limit = decoder_parameters(largest.num_layers, largest.hidden_size, largest.num_attention_heads, largest.num_query_groups,
                               largest.ffn_hidden_size)
    return decoder_parameters(num_layers, hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size) > limit

