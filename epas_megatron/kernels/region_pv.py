"""``P · V`` of every sharing layer of the region over the cached positions, in one launch.

Contract (both implementations)::

    probs  [b, g, m, T]        attention probabilities of the source layer (m = query heads per
                               KV group x new tokens), columns ``[:length]`` used
    values [L, b, g, T_max, d] the sharing layers' V caches, positions ``[:length]`` used
    ->     [L, b, g, m, d]     out[l] = probs[..., :length] @ values[l, ..., :length, :]

``probs`` is cast to ``values``' dtype first (as the engine's per-layer ``P · V`` does);
products accumulate in fp32 and the result has ``values``' dtype.

**PyTorch** (:func:`region_pv_reference`, the default): one broadcast batched matmul over the
``L`` layers.

**Triton** (:func:`region_pv_triton`): one launch on a grid of ``(b·g, L, d-tiles)``. A program
owns one (sequence, KV group), one layer and one tile of head dimensions; it walks the cached
positions in tiles of ``BLOCK_T``, loading the ``[m, BLOCK_T]`` probability tile and the
layer's ``[BLOCK_T, BLOCK_D]`` value tile and accumulating their product in fp32 with
``tl.dot``. The ``L`` programs of one (sequence, group) read the same probability tiles, which
the GPU's L2 cache serves after the first read -- so ``P`` comes from memory about once and
the region costs one launch instead of ``L``. ``m`` (a few query heads per group at decode) is
padded to ``tl.dot``'s minimum of 16 rows with masks. Tiles are upcast to fp32 and multiplied
at IEEE fp32 precision (exact against the reference; Triton's interpreter also mishandles a
bf16 ``tl.dot``). On a GPU the candidates to tune are a bf16 ``tl.dot`` with fp32 accumulation,
the block sizes (``BLOCK_T`` 64 here) and ``num_warps``. Not yet measured on a GPU (see
README.md here).

Triton is imported only when the Triton path is called; on CPU it runs only under Triton's
interpreter (``TRITON_INTERPRET=1`` set before Triton is imported).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

KERNELS = ("torch", "triton")


def _check(probs: Tensor, values: Tensor, length: int) -> None:
    if probs.dim() != 4 or values.dim() != 5:
        raise ValueError(f"probs [b, g, m, T] and values [L, b, g, T, d] expected, got {tuple(probs.shape)} and {tuple(values.shape)}")
    if tuple(probs.shape[:2]) != tuple(values.shape[1:3]):
        raise ValueError(f"probs {tuple(probs.shape)} and values {tuple(values.shape)} differ in batch or groups")
    if not 0 <= length <= min(probs.size(-1), values.size(-2)):
        raise ValueError(f"length {length} outside the probabilities' {probs.size(-1)} / values' {values.size(-2)} positions")


def region_pv_reference(probs: Tensor, values: Tensor, length: int) -> Tensor:
    """The contract above as one batched matmul."""
    _check(probs, values, length)
    # [b, g, m, length] -> [1, b, g, m, length]; [L, b, g, length, d]
    p = probs[..., :length].to(values.dtype).unsqueeze(0)
    # [1, b, g, m, length] @ [L, b, g, length, d] -> [L, b, g, m, d]
    return torch.matmul(p, values[:, :, :, :length, :])


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def region_pv_kernel(
        p_ptr, v_ptr, out_ptr, m, length, d,
        stride_p_bg, stride_p_m, stride_p_t,
        stride_v_l, stride_v_bg, stride_v_t, stride_v_d,
        stride_o_l, stride_o_bg, stride_o_m, stride_o_d,
        BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        bg = tl.program_id(0)
        layer = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        steps = tl.arange(0, BLOCK_T)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for start in range(0, length, BLOCK_T):
            pos = start + steps
            p = tl.load(p_ptr + bg * stride_p_bg + rows[:, None] * stride_p_m + pos[None, :] * stride_p_t,
                        mask=(rows[:, None] < m) & (pos[None, :] < length), other=0.0)
            v = tl.load(v_ptr + layer * stride_v_l + bg * stride_v_bg + pos[:, None] * stride_v_t + cols[None, :] * stride_v_d,
                        mask=(pos[:, None] < length) & (cols[None, :] < d), other=0.0)
            acc += tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        tl.store(out_ptr + layer * stride_o_l + bg * stride_o_bg + rows[:, None] * stride_o_m + cols[None, :] * stride_o_d,
                 acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < m) & (cols[None, :] < d))

    return triton, region_pv_kernel


def region_pv_triton(probs: Tensor, values: Tensor, length: int, block_t: int = 64) -> Tensor:
    """The contract above in one Triton launch (see module doc)."""
    _check(probs, values, length)
    triton, kernel = _triton_kernel()
    layers, b, g, _, d = values.shape
    m = probs.size(2)
    # [b, g, m, T] -> [b * g, m, T] in V's dtype (a copy only if the dtype differs)
    p = probs.to(values.dtype).reshape(b * g, m, probs.size(-1))
    # [L, b, g, T_max, d] -> [L, b * g, T_max, d] (a view of the contiguous cache)
    v = values.reshape(layers, b * g, values.size(-2), d)
    out = torch.empty(layers, b * g, m, d, dtype=values.dtype, device=values.device)
    block_m = max(16, triton.next_power_of_2(m))
    block_d = min(128, max(16, triton.next_power_of_2(d)))
    grid = (b * g, layers, triton.cdiv(d, block_d))
    if layers and length:
        kernel[grid](p, v, out, m, length, d, *p.stride(), *v.stride(), *out.stride(),
                     BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_D=block_d)
    elif layers:
        out.zero_()
    # [L, b * g, m, d] -> [L, b, g, m, d]
    return out.view(layers, b, g, m, d)


def region_pv(probs: Tensor, values: Tensor, length: int, kernel: str = "torch") -> Tensor:
    """Dispatch to the PyTorch reference (``'torch'``) or the Triton kernel (``'triton'``)."""
    if kernel == "torch":
        return region_pv_reference(probs, values, length)
    if kernel == "triton":
        if values.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the Triton region kernel needs a CUDA device, or TRITON_INTERPRET=1 (set before "
                               "Triton is imported) to run in Triton's interpreter on CPU")
        return region_pv_triton(probs, values, length)
    raise ValueError(f"unknown region kernel {kernel!r}; choose one of {', '.join(KERNELS)}")


def region_pv_bytes(layers: int, batch: int, groups: int, m: int, length: int, head_dim: int,
                     bytes_per_element: int) -> dict[str, int]:
    """Memory traffic of the region's cached ``P · V``: ``one_launch`` reads ``P`` once, every
    layer's V over ``length`` positions and writes the outputs; ``per_layer`` is ``L`` separate
    products, which read ``P`` once per layer."""
    p = batch * groups * m * length * bytes_per_element
    v = layers * batch * groups * length * head_dim * bytes_per_element
    out = layers * batch * groups * m * head_dim * bytes_per_element
    return {"one_launch": p + v + out, "per_layer": layers * p + v + out}
