"""Bytes one decode step moves (reads, and writes of its attention scores): the ceiling of a memory-bound step, baseline against EPAS.

A decode step (one new token for each of ``b`` sequences at context ``c``) does little
arithmetic per byte: it reads every weight it uses once and the KV cache of every layer. Per
step, with ``h`` hidden, ``np`` query heads, ``ng`` KV groups, ``hn`` head size, ``f`` FFN size
(SwiGLU: three ``h x f`` matrices), ``V`` vocabulary and ``e`` bytes per element:

* weights: per computing layer two norms ``2h``, QKV ``h·(np + 2ng)·hn``, output projection
  ``np·hn·h`` and MLP ``3h·f``; a sharing layer reads only its own projection (V: ``h·ng·hn`` for
  'qk', Q: ``h·np·hn`` for 'kv') instead of the QKV (its frozen Q/K rows are never read); plus the
  final norm ``h``, the LM head ``h·V`` and ``b`` embedding rows;
* KV cache: a computing layer reads its K and V, ``2·b·ng·c·hn``; a 'qk' sharing layer reads the
  source's K and its own V on the Q/K path (the same ``2·b·ng·c·hn``: the paper's inference saves
  cache *memory*, not cache *reads*), but only its own V with probability reuse; a 'kv' sharing
  layer reads the source's K and V.
* scores: every layer that runs the softmax (computing layers, and sharing layers except with
  probability reuse) moves its ``s = b·np·c`` scores as :func:`~epas_megatron.inference.attention.probabilities`
  and ``attend`` are written -- ``Q Kᵀ`` writes them in fp32 (``4s``), the scale and the mask
  each read and write them in place (``8s`` each), the softmax reads and writes them (``8s``),
  the cast to the model's dtype reads them and writes ``P`` (``(4 + e)s``, nothing in fp32, where
  the cast is no copy) and ``P · V`` reads ``P`` (``e·s``); a sharing layer with reuse reads only
  the source's ``P`` (``e·s``). One read and one write per pass: a kernel making more passes moves
  more. With grouped-query attention these bytes are not small: at the ``1b`` shape (32 query
  heads over 4 KV groups) a layer's scores move half as many bytes as its K and V in fp32.

The byte-limit ratio (baseline bytes / EPAS bytes) is the speed-up a purely memory-bound step
could reach; the decode benchmark reports measured / limit. Activations (``b·h`` per layer) are
left out: they are tiny next to weights and cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epas_megatron.sharing.shape import LayerMode


@dataclass(frozen=True)
class StepBytes:
    """Bytes moved by one decode step."""

    weights: int
    """Parameters read (embedding: the batch's rows only)."""

    kv_cache: int
    """KV cache read."""

    scores: int = 0
    """Attention scores and probabilities written and read (see the module doc)."""

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.scores


def score_bytes(batch: int, heads: int, context: int, bytes_per_element: int, softmax: bool) -> int:
    """Bytes one layer's ``[b, np, c]`` scores and probabilities move (module doc): the whole
    softmax path, or (``softmax`` False: probability reuse) only reading the source's ``P``."""
    scores = batch * heads * context
    if not softmax:
        return scores * bytes_per_element
    cast = 0 if bytes_per_element == 4 else 4 + bytes_per_element
    # Q K^T writes fp32; scale and mask in place; softmax; the cast to the model's dtype; P . V reads P
    return scores * (4 + 8 + 8 + 8 + cast + bytes_per_element)


def decode_bytes_per_step(arch, modes: Sequence[LayerMode | str], share: str, decode_attention: str, batch: int,
                          context: int, bytes_per_element: int) -> StepBytes:
    """See the module doc; ``arch`` is a :class:`~epas_megatron.model.builder.LlamaArchitecture`."""
    h, heads, groups = arch.hidden_size, arch.num_attention_heads, arch.num_query_groups
    hn = h // heads
    qkv = h * (heads + 2 * groups) * hn
    own = h * groups * hn if share == "qk" else h * heads * hn
    rest = 2 * h + heads * hn * h + 3 * h * arch.ffn_hidden_size  # norms, output projection, MLP
    kv_layer = 2 * batch * groups * context * hn * bytes_per_element
    weights = h + h * arch.vocab_size + batch * h  # final norm, LM head, embedding rows
    cache = scores = 0
    for mode in modes:
        reuse = mode == LayerMode.SHARE and share == "qk" and decode_attention == "reuse"
        weights += (own if mode == LayerMode.SHARE else qkv) + rest
        cache += kv_layer // 2 if reuse else kv_layer
        scores += score_bytes(batch, heads, context, bytes_per_element, softmax=not reuse)
    return StepBytes(weights=weights * bytes_per_element, kv_cache=cache, scores=scores)


def max_batch_for_budget(kv_budget_bytes: int, kv_bytes_per_token: int, context: int) -> int:
    """Most sequences of ``context`` positions whose caches fit in ``kv_budget_bytes``."""
    return kv_budget_bytes // (kv_bytes_per_token * context)
