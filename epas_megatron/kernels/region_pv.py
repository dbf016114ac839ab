"""``P · V`` of every sharing layer of the region over the cached positions, in one launch.

Contract (both implementations)::

    probs  [b, g, m, T]        attention probabilities of the source layer (m = query heads per
                               KV group x new tokens), columns ``[:length]`` used
    values [L, b, g, T_max, d] the sharing layers' V caches, positions ``[:length]`` used
    ->     [L, b, g, m, d]     out[l] = probs[..., :length] @ values[l, ..., :length, :]

``probs`` is cast to ``values``' dtype first (as the engine's per-layer ``P · V`` does) and the
result has ``values``' dtype (the probabilities' dtype when both match, as in the engine). The
Triton kernel accumulates in fp32 explicitly; the PyTorch path leaves it to ``torch.matmul``,
whose bf16/fp16 kernels (CPU and cuBLAS) accumulate in fp32 and round the output once.

**PyTorch** (:func:`region_pv_reference`, the default): one broadcast batched matmul over the
``L`` layers.

**Triton** (:func:`region_pv_triton`): one launch on a grid of ``(b·g, d-tiles)``. A program
owns one (sequence, KV group) and one tile of ``BLOCK_D`` head dimensions *for all ``L``
layers*: it reads the sharing layers' V tiles side by side as one ``[BLOCK_T, BLOCK_L·BLOCK_D]``
matrix (column ``n`` is layer ``n // BLOCK_D``), so each ``[m, BLOCK_T]`` probability tile is
loaded once and a single ``tl.dot`` per position step accumulates every layer's output tile in
fp32 (``P · [V_1 | … | V_L]``). ``P`` is therefore read once per d-tile -- exactly once when
``L·d`` fits in ``max_columns`` (256 by default), e.g. ``L = 2, d = 128`` -- against ``L`` times
for ``L`` separate products. Padding: ``m`` (a few query heads per group at decode) up to
``tl.dot``'s minimum of 16 rows, ``L`` up to a power of two, ``d`` up to a power of two >= 16,
all masked; cache strides are passed as they are (no copy of the cache).

Trade-offs: ``P`` is small next to the V caches (re-reading it per layer adds about ``m / d`` of
the V bytes, see :func:`region_pv_bytes`), so the saving that matters most is one launch instead
of ``L``; reading ``P``
once costs a wider register tile per program and ``b·g·(d-tiles)`` programs, which for a small
batch and a long context may leave a GPU's SMs idle (splitting the positions over programs with a
final reduction, as in split-K / flash-decoding, would be the fix). Tiles are upcast to fp32 and
multiplied at IEEE fp32 precision (exact against the reference; Triton's interpreter also
mishandles a bf16 ``tl.dot``). On a GPU the candidates to tune are a bf16 ``tl.dot`` with fp32
accumulation, ``block_t`` (32), ``max_columns``, ``num_warps`` / ``num_stages``, and the split over
positions. Not yet run or measured on a GPU (see README.md here).

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
        p_ptr, v_ptr, out_ptr, groups, layers, m, length, d,
        stride_p_b, stride_p_g, stride_p_m, stride_p_t,
        stride_v_l, stride_v_b, stride_v_g, stride_v_t, stride_v_d,
        stride_o_l, stride_o_b, stride_o_g, stride_o_m, stride_o_d,
        BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # This program: one (sequence, KV group) and one tile of BLOCK_D head dimensions, for all
        # layers. Its output tile is [BLOCK_M, BLOCK_L * BLOCK_D]; column n belongs to layer
        # n // BLOCK_D and head dimension tile * BLOCK_D + n % BLOCK_D -- the layers' V tiles side
        # by side, so one P tile times this wide V tile is every layer's product at once.
        bg = tl.program_id(0)
        seq = (bg // groups).to(tl.int64)
        group = (bg % groups).to(tl.int64)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_L * BLOCK_D)
        layer = (cols // BLOCK_D).to(tl.int64)
        dim = tl.program_id(1) * BLOCK_D + cols % BLOCK_D
        row_ok = rows < m
        col_ok = (layer < layers) & (dim < d)
        # [BLOCK_M] and [BLOCK_L * BLOCK_D] base pointers (position 0)
        p_rows = p_ptr + seq * stride_p_b + group * stride_p_g + rows * stride_p_m
        v_cols = v_ptr + layer * stride_v_l + seq * stride_v_b + group * stride_v_g + dim * stride_v_d
        acc = tl.zeros((BLOCK_M, BLOCK_L * BLOCK_D), dtype=tl.float32)
        for start in range(0, length, BLOCK_T):
            pos = start + tl.arange(0, BLOCK_T)
            pos_ok = pos < length
            # [BLOCK_M, BLOCK_T]: read once, used for every layer
            p = tl.load(p_rows[:, None] + pos[None, :].to(tl.int64) * stride_p_t,
                        mask=row_ok[:, None] & pos_ok[None, :], other=0.0)
            # [BLOCK_T, BLOCK_L * BLOCK_D]: all layers' V at these positions
            v = tl.load(v_cols[None, :] + pos[:, None].to(tl.int64) * stride_v_t,
                        mask=pos_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        out = (out_ptr + layer[None, :] * stride_o_l + seq * stride_o_b + group * stride_o_g
               + rows[:, None] * stride_o_m + dim[None, :] * stride_o_d)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return triton, region_pv_kernel


def region_pv_triton(probs: Tensor, values: Tensor, length: int, block_t: int = 32, max_columns: int = 256) -> Tensor:
    """The contract above in one Triton launch (see module doc). ``block_t`` positions per step;
    ``max_columns`` bounds a program's ``layers x head-dims`` tile (the head dimensions are split
    into more tiles, each reading ``P`` once, when ``L x d`` is wider)."""
    _check(probs, values, length)
    triton, kernel = _triton_kernel()
    layers, b, g, _, d = values.shape
    m = probs.size(2)
    # [b, g, m, T] in V's dtype (a copy only if the dtype differs; P is small)
    p = probs.to(values.dtype)
    # [L, b, g, m, d]
    out = torch.empty(layers, b, g, m, d, dtype=values.dtype, device=values.device)
    if not (layers and b and g and m and d):
        return out
    if not length:
        return out.zero_()
    block_m = max(16, triton.next_power_of_2(m))
    block_l = triton.next_power_of_2(layers)
    block_d = max(16, min(triton.next_power_of_2(d), max_columns // block_l))
    grid = (b * g, triton.cdiv(d, block_d))
    kernel[grid](p, values, out, g, layers, m, length, d, *p.stride(), *values.stride(), *out.stride(),
                 BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_L=block_l, BLOCK_D=block_d)
    return out


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
