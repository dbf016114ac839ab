"""Core attention for local (non-Transformer-Engine) layers on PyTorch's fused SDPA kernels.

Megatron-Core's local ``DotProductAttention`` materialises the ``[b, np, sq, sk]`` score matrix
(``baddbmm``, softmax, ``bmm``): memory grows with ``s²`` and on a GPU it is several times slower
than a fused kernel. :class:`SDPAttention` fills the same ``core_attention`` slot of a layer spec
with ``torch.nn.functional.scaled_dot_product_attention``, which dispatches to FlashAttention-2 or
the memory-efficient kernel on CUDA and to a fused flash kernel on CPU, never keeping the scores.
Computing and sharing layers use it alike (a sharing layer's core attention is the same module;
it just receives the source's Q/K), and selective recompute (``core_attn``) re-runs it the same way.

Semantics follow ``DotProductAttention`` exactly: scale ``softmax_scale`` (default
``1/sqrt(hn)``), Megatron's mask convention (``True`` = masked out), the causal mask when no
mask is given (top-left aligned, as Megatron's default causal mask), GQA without materialising
repeated K/V heads, dropout under the tensor-parallel RNG tracker. Not supported (clear errors):
packed sequences, attention bias, sliding windows, non-vanilla softmax, context parallelism --
all Transformer Engine features.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

# The choices of ``--core-attention`` (local layers) and the module each selects.
CORE_ATTENTION_CHOICES = ("sdpa", "unfused")


class SDPAttention(MegatronModule):
    """``softmax(Q Kᵀ · scale + mask) V`` with PyTorch's fused kernels; Megatron's interface."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine attention (--transformer-impl transformer_engine)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type {config.softmax_type!r} is not supported by SDPA attention; use --core-attention unfused")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("sliding-window attention is not supported by SDPA attention; use --core-attention unfused")
        tp = 1 if pg_collection is None else pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = config.num_query_groups // tp
        self.hidden_size_per_attention_head = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        """query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> context ``[sq, b, np * hn]``."""
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences need Transformer Engine attention")
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported by SDPA attention")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, batch, heads, head_dim = query.shape
        # [s, b, n, hn] -> [b, n, s, hn] (views; the kernels take strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        sdpa_mask = None
        if attention_mask is not None:
            # Megatron: True = masked out; SDPA: True = attend.
            sdpa_mask = ~attention_mask
        is_causal = attention_mask is None and mask_type == AttnMaskType.causal
        dropout = self.dropout_p if self.training else 0.0
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 and not self.config.sequence_parallel else nullcontext()
        with rng:
            context = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=sdpa_mask,
                dropout_p=dropout,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=k.size(1) != heads,
            )
        # [b, np, sq, hn] -> [sq, b, np, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * head_dim)

