"""``EpasCache``: a ``transformers`` cache that stores only what each layer of an EPAS model owns.

Per layer, at the region the model runs (``config.epas_active_layers``):

=============================  ======================  ========================================
layer                          cache layer             holds, per token
=============================  ======================  ========================================
computing (the source too)     ``DynamicLayer``        K and V: ``2 * ng * hn`` values
sharing, ``epas_share='qk'``   :class:`ValueOnlyLayer` V only: ``ng * hn`` values (never a K)
sharing, ``epas_share='kv'``   ``DummyLayer``          nothing
=============================  ======================  ========================================

A sharing layer reads the source's Q and K (or K and V) from the hand-off along the decoder
loop, never from this cache (see :mod:`.modeling_epas_llama`). :func:`cache_bytes_per_token` is
the formula; :meth:`EpasCache.cached_bytes` what the tensors hold. The cache is built for one
region: a model whose ``epas_region`` changes needs a new cache.

This file ships inside every exported model directory: it imports only torch and transformers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, DynamicLayer


class ValueOnlyLayer(CacheLayerMixin):
    """The cache of a qk-sharing layer: its own V ``[b, ng, T, hn]``, grown by concatenation;
    ``keys`` stays None (the layer attends with its source's K)."""

    is_sliding = False
    is_croppable = True

    def lazy_initialization(self, key_states, value_states: torch.Tensor) -> None:
        self.device = value_states.device
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states, value_states: torch.Tensor, *args, **kwargs) -> tuple[None, torch.Tensor]:
        """Append ``value_states`` [b, ng, s, hn]; returns (None, every cached V)."""
        if key_states is not None:
            raise ValueError("a qk-sharing layer caches no K (it attends with its source's)")
        if not self.is_initialized:
            self.lazy_initialization(None, value_states)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return None, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if not self.is_initialized else self.values.shape[-2]

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        if self.is_initialized:
            self.values = self.values.to("cpu", non_blocking=True)

    def prefetch(self):
        if self.is_initialized and self.values.device != self.device:
            self.values = self.values.to(self.device, non_blocking=True)

    def reset(self) -> None:
        self.values = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self.values = self.values[..., :tokens_to_remove, :]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.values = self.values[indices, ...]


def layer_cache_kinds(config) -> list[str]:
    """Per layer: 'kv' (K and V), 'v' (V only) or 'none', at ``config``'s running region."""
    active = set(config.epas_active_layers)
    sharing = "v" if config.epas_share == "qk" else "none"
    return [sharing if i in active else "kv" for i in range(config.num_hidden_layers)]


def cache_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes the cache holds per token (one sequence): computing layers ``2 * ng * hn``
    elements, qk-sharing layers ``ng * hn``, kv-sharing layers none."""
    per_part = config.num_key_value_heads * config.head_dim * torch.finfo(dtype).bits // 8
    parts = {"kv": 2, "v": 1, "none": 0}
    return sum(parts[kind] for kind in layer_cache_kinds(config)) * per_part


class EpasCache(Cache):
    """One cache layer per decoder layer, as in the module notes (grows like ``DynamicCache``)."""

    def __init__(self, config):
        factory = {"kv": DynamicLayer, "v": ValueOnlyLayer, "none": DummyLayer}
        self.kinds = layer_cache_kinds(config)
        """Per layer: what it stores ('kv', 'v', 'none')."""
        super().__init__(layers=[factory[kind]() for kind in self.kinds])

    def update_values(self, value_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """A qk-sharing layer's V [b, ng, s, hn] appended; every cached V of the layer returned."""
        return self.layers[layer_idx].update(None, value_states)[1]

    def cached_bytes(self) -> int:
        """Bytes of every tensor the cache holds."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values)
                   if t is not None)


__all__ = ["EpasCache", "ValueOnlyLayer", "cache_bytes_per_token", "layer_cache_kinds"]
