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
  in one launch at the source (:mod:`epas_kernels.region_pv`), and each layer adds only
  its new positions.
* **sharing, 'kv'**: Q from ``linear_q`` (RoPE'd), the source's cached K and V; caches nothing.

Two ways to run a step (see :mod:`epas_megatron.inference.decode_step` for when each is used):

* :meth:`DecodeEngine.forward` (eager): ``n`` new tokens per row at the cache's next slots
  (prefill chunks and decode steps); attention reads slots ``[:end]`` only.
* :meth:`DecodeEngine.decode_step` (fixed shapes): one token per row at the slot held in a
  device tensor; K/V written with ``index_copy_``, attention over all ``max_length`` slots with
  the later ones masked. No Python value of the step depends on the position, so one CUDA graph
  capture replays every step.

Mixture-of-Channels MLPs (``--moc-topk < 1``) run as trained (the MLP's dense GEMM over the
masked activations) or, with ``moc_decode='sparse'``, read in each forward of one token per row
only the kept rows of ``W_down`` (:mod:`epas_megatron.inference.moc_decode`).

Per-step work is kept to what the model needs: RoPE's cos/sin are computed once per step (not
per layer), the mask once per step, no copy of the cache in another dtype (see
:mod:`epas_megatron.inference.attention` for the precision of each product), no synchronisation
with the host.

Scope: one process, TP = PP = 1, local or Transformer Engine layers in inference (eval) mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.rope_utils import _rotate_half

from epas_kernels.region_pv import region_pv
from epas_megatron.errors import ConfigError
from epas_megatron.inference import attention as attn_ops
from epas_megatron.inference.kv_cache import KVCache, source_layer
from epas_megatron.inference.moc_decode import MOC_DECODE_CHOICES, row_readers
from epas_megatron.sharing.shape import LayerMode

DECODE_ATTENTION_CHOICES = ("qk", "reuse")
REGION_KERNEL_CHOICES = (None, "torch", "triton")


@dataclass(frozen=True)
class _Slots:
    """Where one forward writes and reads the cache."""

    start: Optional[int]
    """Eager forward: the first new slot (slots ``[:start]`` hold earlier tokens). None: the
    fixed-shape step (the new slot is a tensor, ``new``)."""

    new: Tensor
    """``[n]`` slots of the new tokens."""

    visible: int
    """Attention reads slots ``[:visible]``."""

    blocked: Tensor
    """``[b, 1, n, visible]``: slots each new token may not attend to."""

    is_new: Optional[Tensor] = None
    """Fixed-shape step: ``[visible]``, True at the new token's slot."""

    @property
    def write_at(self) -> int | Tensor:
        """What :meth:`KVCache.write` takes: the first slot, or the slots tensor."""
        return self.new if self.start is None else self.start


@dataclass(frozen=True)
class _Rope:
    """RoPE at each row's positions, cos and sin computed once per step: ``[n, b, 1, rot]``."""

    cos: Tensor
    sin: Tensor
    interleaved: bool

    def __call__(self, tensor: Tensor) -> Tensor:
        # tensor [n, b, heads, hn]; the first ``rot`` head dimensions rotate (all of them for LLaMA).
        rot = self.cos.size(-1)
        if rot == tensor.size(-1):
            return tensor * self.cos + _rotate_half(tensor, self.interleaved) * self.sin
        head, tail = tensor[..., :rot], tensor[..., rot:]
        return torch.cat((head * self.cos + _rotate_half(head, self.interleaved) * self.sin, tail), dim=-1)


class DecodeEngine:
    """Cached forward passes of one model chunk (the whole model: PP = 1)."""

    def __init__(self, model, decode_attention: str = "reuse", region_kernel: Optional[str] = None,
                 moc_decode: str = "masked"):
        from epas_megatron.runtime.wrapping import unwrap_model

        model = unwrap_model(model)
        if not (model.pre_process and model.post_process):
            raise ConfigError("generation needs the whole model in one process (PP = 1)")
        if model.config.tensor_model_parallel_size != 1:
            raise ConfigError("generation runs with TP = 1 (tensor-parallel decoding is not implemented)")
        if decode_attention not in DECODE_ATTENTION_CHOICES:
            raise ConfigError(f"--decode-attention {decode_attention!r}: choose one of {', '.join(DECODE_ATTENTION_CHOICES)}")
        if region_kernel not in REGION_KERNEL_CHOICES:
            raise ConfigError(f"--region-kernel {region_kernel!r}: choose one of torch, triton")
        if moc_decode not in MOC_DECODE_CHOICES:
            raise ConfigError(f"--moc-decode {moc_decode!r}: choose one of {', '.join(MOC_DECODE_CHOICES)}")
        self.model = model.eval()
        self.layers = list(model.decoder.layers)
        self.moc_decode = moc_decode
        self.moc_readers = row_readers(self.layers) if moc_decode == "sparse" else {}
        """Per Mixture-of-Channels layer index: its sparse-read MLP for one-token forwards."""
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

    def _rope(self, positions: Tensor, max_length: int) -> _Rope:
        if self._rope_table is None or self._rope_table.size(0) < max_length:
            # [T, 1, 1, rot] (fp32); built before a CUDA graph capture by its warm-up steps
            self._rope_table = self.model.rotary_pos_emb(max_length)
        # [b, n] -> [b, n, 1, 1, rot] -> [n, b, 1, rot]
        freqs = self._rope_table[positions].squeeze(2).transpose(0, 1)
        return _Rope(freqs.cos().to(self.dtype), freqs.sin().to(self.dtype), self.rotary_interleaved)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, last_only: bool = True) -> Tensor:
        """Run ``tokens [b, n]`` at the cache's next ``n`` slots (prefill: the padded prompts;
        decode: ``n = 1``) and advance the cache. Returns fp32 logits ``[b, n or 1, vocab]``."""
        n = tokens.size(1)
        start, end = cache.length, cache.length + n
        if end > cache.max_length:
            raise ConfigError(f"sequence of {end} positions exceeds the cache's {cache.max_length}")
        new = torch.arange(start, end, device=tokens.device)
        logits = self._run(tokens, cache, _Slots(start, new, end, attn_ops.blocked_slots(cache.pad, new, end)), last_only)
        cache.length = end
        return logits

    @torch.inference_mode()
    def decode_step(self, tokens: Tensor, cache: KVCache, slot: Tensor) -> Tensor:
        """One token per row, ``tokens [b, 1]``, written at ``slot`` (a ``[1]`` long tensor on
        the device) with fixed shapes: attention over all ``cache.max_length`` slots, the later
        ones masked. Leaves ``cache.length`` alone (the caller advances it). Returns fp32 logits
        ``[b, 1, vocab]``."""
        visible = cache.max_length
        is_new = torch.arange(visible, device=slot.device) == slot
        slots = _Slots(None, slot, visible, attn_ops.blocked_slots(cache.pad, slot, visible), is_new)
        return self._run(tokens, cache, slots, last_only=True)

    def _run(self, tokens: Tensor, cache: KVCache, slots: _Slots, last_only: bool) -> Tensor:
        # [b, n]: RoPE position of each new token, counted from the row's first real token.
        positions = (slots.new[None, :] - cache.pad[:, None]).clamp(min=0)
        rope = self._rope(positions, cache.max_length)
        # [b, n] -> [n, b, h]
        hidden = self.model.embedding(input_ids=tokens, position_ids=positions)
        region = {}  # what the source hands the sharing layers
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, cache, slots, rope, region)
        hidden = self.model.decoder.final_layernorm(hidden)
        if last_only:
            hidden = hidden[-1:]
        # [n, b, h] -> [n, b, v] -> [b, n, v]
        logits = self.model.lm_head(hidden)
        return logits.transpose(0, 1).float()

    def _layer(self, index, layer, hidden, cache, slots, rope, region):
        residual = hidden
        normed = layer.input_layernorm(hidden)
        if isinstance(normed, tuple):  # norms that also return the residual (as in model/layer.py)
            normed, residual = normed
        context = self._attention(index, layer.self_attention, normed, cache, slots, rope, region)
        # [n, b, np * hn] -> [n, b, h]
        output = layer.self_attention.linear_proj(context)
        hidden = layer.self_attn_bda(False, layer.config.bias_dropout_fusion)(output, residual, layer.hidden_dropout)
        reader = self.moc_readers.get(index)
        if reader is not None and hidden.size(0) == 1:  # one new token per row: only the kept rows of W_down
            return reader.forward_layer(layer, hidden)
        return layer._forward_mlp(hidden)

    def _attention(self, index, attention, normed, cache, slots, rope, region) -> Tensor:
        mode = self.modes[index]
        n = normed.size(0)
        visible = slots.visible
        if mode != LayerMode.SHARE:
            # [n, b, h] -> [n, b, np, hn], [n, b, g, hn], [n, b, g, hn]
            query, key, value = attention.get_query_key_value_tensors(normed)
            query, key = rope(query), rope(key)
            cache.write(index, slots.write_at, key, value)
            grouped = attn_ops.group_queries(query, self.num_groups)
            probs = attn_ops.probabilities(grouped, cache.keys(index)[:, :, :visible], slots.blocked, self.scale)
            if mode == LayerMode.SOURCE:
                region.update(query=grouped, probs=probs)
                if self.region_kernel is not None:
                    self._region_cached(probs, cache, slots, region)
            context = attn_ops.attend(probs, cache.values(index)[:, :, :visible])
            return attn_ops.ungroup_context(context, self.num_heads, n)

        own, _ = attention.own_projection(normed)
        heads = self.num_groups if self.share == "qk" else self.num_heads
        # [n, b, heads * hn] -> [n, b, heads, hn]
        own = own.view(n, own.size(1), heads, self.head_dim)
        if self.share == "kv":
            grouped = attn_ops.group_queries(rope(own), self.num_groups)
            probs = attn_ops.probabilities(grouped, cache.keys(index)[:, :, :visible], slots.blocked, self.scale)
        else:
            cache.write(index, slots.write_at, None, own)
            if self.decode_attention == "reuse":
                probs = region["probs"]
                if "cached" in region:
                    # the cached slots from the one launch, plus this layer's new slots:
                    # [b, g, m, n] @ ([n, b, g, hn] -> [b, g, n, hn]) -> [b, g, m, hn]
                    context = region["cached"][cache.sharing_slot(index)]
                    context = context + attn_ops.attend(probs.index_select(-1, slots.new), own.permute(1, 2, 0, 3))
                    return attn_ops.ungroup_context(context, self.num_heads, n)
            else:
                probs = attn_ops.probabilities(region["query"], cache.keys(index)[:, :, :visible], slots.blocked, self.scale)
        context = attn_ops.attend(probs, cache.values(index)[:, :, :visible])
        return attn_ops.ungroup_context(context, self.num_heads, n)

    def _region_cached(self, probs: Tensor, cache: KVCache, slots: _Slots, region: dict) -> None:
        """Every sharing layer's ``P · V`` over the slots written before this step, in one launch
        (the sharing layers have not written their new slots yet)."""
        if slots.start is None:
            # Fixed shapes: every slot, the new one's probability zeroed (its V is stale until
            # the layer writes it; the later slots' probabilities are already zero).
            region["cached"] = region_pv(probs.masked_fill(slots.is_new, 0.0), cache.sharing_values, slots.visible,
                                         kernel=self.region_kernel)
        elif slots.start > 0:
            region["cached"] = region_pv(probs, cache.sharing_values, slots.start, kernel=self.region_kernel)
