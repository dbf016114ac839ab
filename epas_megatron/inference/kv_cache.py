"""A preallocated, in-place KV cache that stores only what each layer of an EPAS model owns.

Per layer mode (``share`` is what sharing layers reuse):

=============================  ===========  =============================================
layer                          caches       reads at attention
=============================  ===========  =============================================
computing / source             K and V      its own K and V
sharing, ``share='qk'``        V only       the source's K (or, with probability reuse,
                                            the source's probabilities and no K at all)
sharing, ``share='kv'``        nothing      the source's K and V
=============================  ===========  =============================================

Buffers are allocated once for ``max_length`` positions and written in place at every step (no
``torch.cat``). Computing layers' K and V live in two ``[Lc, b, g, T, hn]`` tensors and the
sharing layers' V in one ``[Ls, b, g, T, hn]`` tensor, so a kernel can read the V of the whole
region in one launch (:mod:`epas_kernels.region_pv`).

Batched prompts are **left-padded**: every sequence's newest token sits at the same slot, so one
write position serves the batch; ``pad[i]`` slots at the start of row ``i`` are masked out of
attention and the row's RoPE positions start at 0 after its padding.

Writes take the first slot as a Python int (eager forwards: a slice copy) or the slots as a
device tensor (the fixed-shape decode step of :mod:`epas_megatron.inference.engine`, which a
CUDA graph replays: ``index_copy_`` at a slot the graph reads from memory, so the same captured
step serves every position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from epas_megatron.sharing.shape import LayerMode


def cached_parts(mode: LayerMode | str, share: str) -> tuple[str, ...]:
    """What a layer in ``mode`` keeps in the cache: ``('k', 'v')``, ``('v',)`` or ``()``."""
    if mode != LayerMode.SHARE:
        return ("k", "v")
    return ("v",) if share == "qk" else ()


def kv_bytes_per_token(modes: Sequence[LayerMode | str], share: str, num_query_groups: int, head_dim: int,
                       bytes_per_element: int) -> int:
    """Cache bytes one token (one sequence position) takes over all layers."""
    tensors = sum(len(cached_parts(mode, share)) for mode in modes)
    return tensors * num_query_groups * head_dim * bytes_per_element


def source_layer(modes: Sequence[LayerMode | str]) -> Optional[int]:
    """Index of the first source layer (the last computing layer before the region, or before its
    shallowest block with ``--epas-blocks``), None if no region."""
    for index, mode in enumerate(modes):
        if mode == LayerMode.SOURCE:
            return index
    return None


def sources_of(modes: Sequence[LayerMode | str]) -> dict[int, int]:
    """Each sharing layer's source: the last source layer before it (one per block)."""
    owners, source = {}, None
    for index, mode in enumerate(modes):
        if mode == LayerMode.SOURCE:
            source = index
        elif mode == LayerMode.SHARE:
            owners[index] = source
    return owners


class KVCache:
    """Cache buffers for ``batch`` sequences of up to ``max_length`` positions (see module doc)."""

    def __init__(self, modes: Sequence[LayerMode | str], share: str, batch: int, max_length: int,
                 num_query_groups: int, head_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.modes = tuple(LayerMode(m) for m in modes)
        self.share = share
        self.batch, self.max_length = batch, max_length
        self.source = source_layer(self.modes)
        self._source_of = sources_of(self.modes)
        computing = [i for i, m in enumerate(self.modes) if "k" in cached_parts(m, share)]
        v_only = [i for i, m in enumerate(self.modes) if cached_parts(m, share) == ("v",)]
        shape = (batch, num_query_groups, max_length, head_dim)
        # [Lc, b, g, T, hn] each; [Ls, b, g, T, hn] for the sharing layers' V.
        self.computing_keys = torch.zeros((len(computing), *shape), dtype=dtype, device=device)
        self.computing_values = torch.zeros((len(computing), *shape), dtype=dtype, device=device)
        self.sharing_values = torch.zeros((len(v_only), *shape), dtype=dtype, device=device)
        self._computing_slot = {layer: slot for slot, layer in enumerate(computing)}
        self._sharing_slot = {layer: slot for slot, layer in enumerate(v_only)}
        self.length = 0
        """Positions filled so far (the same for every row: prompts are left-padded)."""
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)
        """Left-padding slots of each row."""

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the cache."""
        return sum(t.numel() * t.element_size() for t in (self.computing_keys, self.computing_values, self.sharing_values))

    def sharing_slot(self, layer: int) -> int:
        """Index of ``layer``'s V in :attr:`sharing_values` (``share='qk'`` sharing layers)."""
        return self._sharing_slot[layer]

    def keys(self, layer: int) -> Tensor:
        """``[b, g, T, hn]`` keys ``layer`` attends over: its own, or its source's when it shares."""
        owner = self._source_of.get(layer, layer)
        return self.computing_keys[self._computing_slot[owner]]

    def values(self, layer: int) -> Tensor:
        """``[b, g, T, hn]`` values ``layer`` attends over (its own, or the source's for 'kv')."""
        if layer in self._computing_slot:
            return self.computing_values[self._computing_slot[layer]]
        if layer in self._sharing_slot:
            return self.sharing_values[self._sharing_slot[layer]]
        return self.computing_values[self._computing_slot[self._source_of[layer]]]

    def write(self, layer: int, slots: int | Tensor, key: Optional[Tensor], value: Optional[Tensor]) -> None:
        """Store ``[n, b, g, hn]`` key/value of ``layer`` at slots ``slots .. slots + n`` (an int)
        or at the slots of a ``[n]`` long tensor on the cache's device."""
        for buffer, part in ((self.keys, key), (self.values, value)):
            if part is None:
                continue
            # [n, b, g, hn] -> [b, g, n, hn], copied in place
            part = part.permute(1, 2, 0, 3)
            if isinstance(slots, Tensor):
                buffer(layer).index_copy_(2, slots, part)
            else:
                buffer(layer)[:, :, slots:slots + part.size(2)].copy_(part)
