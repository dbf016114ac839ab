"""Prefill and incremental decode of an EPAS model over a :class:`~epas_megatron.inference.kv_cache.KVCache`.

The engine runs the trained Megatron-Core modules themselves -- embedding, each layer's norms,
``linear_qkv`` / ``linear_v``, ``linear_proj`` and MLP, the final norm and LM head -- and replaces
only what a KV cache changes: attention reads cached keys and values
(:mod:`epas_megatron.inference.attention`), and RoPE is applied at each sequence's own positions.
Per layer mode:

* **computing / source**: Q, K, V from ``linear_qkv``; K and V go into the cache; attention over
  its cache. The source keeps its post-RoPE Q and its probabilities ``P`` for the region.
* **sharing, 'qk'**: V from ``linear_v`` into the cache. ``decode_attention='qk'`` (the paper's
  inference): ``softmax(Q_src K_srcᵀ)`` recomputed over the source's cached K, then ``· V_own``.
  ``'reuse'``: the source's ``P · V_own`` -- the same numbers without K or the softmax.
  With ``region_kernel`` set, the cached part of ``P · V`` is computed for every sharing layer
  in one launch at the source (:mod:`epas_megatron.kernels.region_pv`), and each layer adds only
  its new positions.
* **sharing, 'kv'**: Q from ``linear_q`` (RoPE'd), the source's cached K and V; caches nothing.

Scope: one process, TP = PP = 1, local or Transformer Engine layers in inference (eval) mode.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from epas_megatron.errors import ConfigError
from epas_megatron.inference import attention as attn_ops
from epas_megatron.inference.kv_cache import KVCache, source_layer
from epas_megatron.sharing.schedule import LayerMode

DECODE_ATTENTION_CHOICES = ("qk", "reuse")
REGION_KERNEL_CHOICES = (None, "torch", "triton")


class DecodeEngine:
    """Cached forward passes of one model chunk (the whole model: PP = 1)."""

    def __init__(self, model, decode_attention: str = "reuse", region_kernel: Optional[str] = None):
        from epas_megatron.model.wrapping import unwrap_model

        model = unwrap_model(model)
        if not (model.pre_process and model.post_process):
            raise ConfigError("generation needs the whole model in one process (PP = 1)")
        if model.config.tensor_model_parallel_size != 1:
            raise ConfigError("generation runs with TP = 1 (tensor-parallel decoding is not implemented)")
        if decode_attention not in DECODE_ATTENTION_CHOICES:
            raise ConfigError(f"--decode-attention {decode_attention!r}: choose one of {', '.join(DECODE_ATTENTION_CHOICES)}")
        if region_kernel not in REGION_KERNEL_CHOICES:
            raise ConfigError(f"--region-kernel {region_kernel!r}: choose one of torch, triton")
        self.model = model.eval()
        self.layers = list(model.decoder.layers)
        self.modes = tuple(layer.epas_mode for layer in self.layers)
        shared = [layer.self_attention for layer in self.layers if layer.epas_mode == LayerMode.SHARE]
        self.share = shared[0].share if shared else "qk"
        if decode_attention == "reuse" and self.share != "qk":
            raise ConfigError("--decode-attention reuse needs a 'qk' sharing model (a 'kv' sharing layer has its own Q)")
        self.decode_attention = decode_attention
        self.region_kernel = region_kernel if (decode_attention == "reuse" and shared) else None
        self.source = source_layer(self.modes)
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.head_dim = config.kv_channels
        self.scale = config.softmax_scale if config.softmax_scale is not None else self.head_dim ** -0.5
        self.rotary_interleaved = config.rotary_interleaved
        self.dtype = config.params_dtype
        self.device = next(model.parameters()).device
        self._rope_table: Optional[Tensor] = None

    def new_cache(self, batch: int, max_length: int) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``max_length`` positions."""
        return KVCache(self.modes, self.share, batch, max_length, self.num_groups, self.head_dim,
                       self.dtype, self.device)

    def _rope(self, tensor: Tensor, freqs: Tensor) -> Tensor:
        # tensor [n, b, heads, hn], freqs [n, b, 1, hn]: each row at its own positions.
        return _apply_rotary_pos_emb_bshd(tensor, freqs, rotary_interleaved=self.rotary_interleaved)

    def _freqs(self, positions: Tensor, max_length: int) -> Tensor:
        if self._rope_table is None or self._rope_table.size(0) < max_length:
            # [T, 1, 1, hn]
            self._rope_table = self.model.rotary_pos_emb(max_length)
        # [b, n] -> [b, n, 1, 1, hn] -> [n, b, 1, hn]
        return self._rope_table[positions].squeeze(2).transpose(0, 1)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, last_only: bool = True) -> Tensor:
        """Run ``tokens [b, n]`` at the cache's next ``n`` slots (prefill: the padded prompts;
        decode: ``n = 1``) and advance the cache. Returns fp32 logits ``[b, n or 1, vocab]``."""
        b, n = tokens.shape
        start, end = cache.length, cache.length + n
        if end > cache.max_length:
            raise ConfigError(f"sequence of {end} positions exceeds the cache's {cache.max_length}")
        slots = torch.arange(start, end, device=tokens.device)
        # [b, n]: RoPE position of each new token, counted from the row's first real token.
        positions = (slots[None, :] - cache.pad[:, None]).clamp(min=0)
        freqs = self._freqs(positions, cache.max_length)
        mask = attn_ops.attention_mask(cache.pad, start, n, self.num_heads // self.num_groups)
        # [b, n] -> [n, b, h]
        hidden = self.model.embedding(input_ids=tokens, position_ids=positions)
        region = {}  # what the source hands the sharing layers
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, cache, start, end, freqs, mask, region)
        cache.length = end
        hidden = self.model.decoder.final_layernorm(hidden)
        if last_only:
            hidden = hidden[-1:]
        # [n, b, h] -> [n, b, v] -> [b, n, v]
        logits, _ = self.model.output_layer(hidden)
        return logits.transpose(0, 1).float()

    def _layer(self, index, layer, hidden, cache, start, end, freqs, mask, region):
        residual = hidden
        normed = layer.input_layernorm(hidden)
        if isinstance(normed, tuple):  # norms that also return the residual (as in model/layer.py)
            normed, residual = normed
        context = self._attention(index, layer.self_attention, normed, cache, start, end, freqs, mask, region)
        # [n, b, np * hn] -> [n, b, h]
        output = layer.self_attention.linear_proj(context)
        hidden = layer.self_attn_bda(False, layer.config.bias_dropout_fusion)(output, residual, layer.hidden_dropout)
        return layer._forward_mlp(hidden)

    def _attention(self, index, attention, normed, cache, start, end, freqs, mask, region) -> Tensor:
        mode = self.modes[index]
        n = normed.size(0)
        if mode != LayerMode.SHARE:
            # [n, b, h] -> [n, b, np, hn], [n, b, g, hn], [n, b, g, hn]
            query, key, value = attention.get_query_key_value_tensors(normed)
            query, key = self._rope(query, freqs), self._rope(key, freqs)
            cache.write(index, start, key, value)
            grouped = attn_ops.group_queries(query, self.num_groups)
            probs = attn_ops.probabilities(grouped, cache.keys(index)[:, :, :end], mask, self.scale)
            if mode == LayerMode.SOURCE:
                region.update(query=grouped, probs=probs)
                if self.region_kernel is not None and start > 0:
                    from epas_megatron.kernels.region_pv import region_pv

                    # Every sharing layer's P . V over the cached slots, in one launch.
                    region["cached"] = region_pv(probs, cache.sharing_values, start, kernel=self.region_kernel)
            context = attn_ops.attend(probs, cache.values(index)[:, :, :end])
            return attn_ops.ungroup_context(context, self.num_heads, n)

        own, _ = attention.own_projection(normed)
        heads = self.num_groups if self.share == "qk" else self.num_heads
        # [n, b, heads * hn] -> [n, b, heads, hn]
        own = own.view(n, own.size(1), heads, self.head_dim)
        if self.share == "kv":
            grouped = attn_ops.group_queries(self._rope(own, freqs), self.num_groups)
            probs = attn_ops.probabilities(grouped, cache.keys(index)[:, :, :end], mask, self.scale)
        else:
            cache.write(index, start, None, own)
            if self.decode_attention == "reuse":
                probs = region["probs"]
                if "cached" in region:
                    values = cache.values(index)
                    # cached slots from the one launch, plus this layer's new slots
                    context = region["cached"][cache.sharing_slot(index)].to(values.dtype)
                    context = context + attn_ops.attend(probs[..., start:end], values[:, :, start:end])
                    return attn_ops.ungroup_context(context, self.num_heads, n)
            else:
                probs = attn_ops.probabilities(region["query"], cache.keys(index)[:, :, :end], mask, self.scale)
        context = attn_ops.attend(probs, cache.values(index)[:, :, :end])
        return attn_ops.ungroup_context(context, self.num_heads, n)
