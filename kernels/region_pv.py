"""``P · V`` of every sharing layer of the region over the cached positions, in one launch.

Contract (both implementations)::

    probs  [b, g, m, T]        attention probabilities of the source layer (m = query heads per
                               KV group x new tokens), columns ``[:length]`` used
    values [L, b, g, T_max, d] the sharing layers' V caches, positions ``[:length]`` used
    ->     [L, b, g, m, d]     out[l] = probs[..., :length] @ values[l, ..., :length, :]

``probs`` is cast to ``values``' dtype first (as the engine's per-layer ``P · V`` does; the engine
already hands ``P`` over in the model's dtype, so no copy is made) and the result has ``values``'
dtype. Products accumulate in fp32 in both implementations: explicitly in the Triton kernel,
inside ``torch.matmul``'s bf16/fp16 kernels (CPU and cuBLAS) in the PyTorch path.

**PyTorch** (:func:`region_pv_reference`, the default): one broadcast batched matmul over the
``L`` layers.

**Triton** (:func:`region_pv_triton`): one launch on a grid of ``(b·g, d-tiles, position
splits)``.

* *Layers side by side.* A program owns one (sequence, KV group), one tile of ``BLOCK_D`` head
  dimensions *for all ``L`` layers*, and one range of positions. It reads the sharing layers' V
  tiles as one ``[BLOCK_T, BLOCK_L·BLOCK_D]`` matrix (column ``n`` is layer ``n // BLOCK_D``), so
  each ``[m, BLOCK_T]`` probability tile is loaded once and one product per position step
  accumulates every layer's output tile (``P · [V_1 | … | V_L]``). ``P`` is read once per d-tile
  -- exactly once when ``L·d`` fits in ``max_columns`` (256 by default), e.g. ``L = 2, d = 128``
  -- against ``L`` times for ``L`` separate products.
* *The product.* On a GPU with bf16/fp16 caches: ``tl.dot`` of the half-precision tiles with an
  fp32 accumulator (tensor cores; ``m`` padded to ``tl.dot``'s minimum of 16 rows, masked). With
  fp32 caches, and whenever the kernel runs in Triton's interpreter (CPU tensors), the tiles are
  upcast and multiplied at IEEE fp32 precision (``upcast=True``): the interpreter computes a bf16
  ``tl.dot`` wrongly (checked with triton 3.8: errors around 1e10), so the bf16 ``tl.dot`` variant is
  only exercised on a GPU (``tests/gpu/test_gpu_inference.py``). With one query row (``m = 1``:
  no GQA, one new token) there is no matrix to multiply: the program reduces ``p[t] · V[t, :]``
  over its positions in fp32 (elementwise products and a sum, no padded ``tl.dot``).
* *Positions split over programs* (split-K, as in flash-decoding). ``b·g·(d-tiles)`` programs
  leave most SMs idle for a small batch at a long context (batch 1 with 12 KV groups and two
  d-tiles: 24 programs for 132 SMs), so the positions are split into ``splits`` block-aligned
  ranges, one per program along the grid's third axis; each program writes its fp32 partial
  ``[m, L·d]`` into a workspace ``[splits, L, b, g, m, d]`` and one ``sum`` over the splits (a
  fixed order: deterministic) gives the output. ``P`` is already normalised, so the partials add
  without the log-sum-exp rescaling flash-decoding needs. :func:`position_splits` picks
  ``splits`` so the programs fill about two waves of the SMs, with at least
  ``MIN_POSITIONS_PER_SPLIT`` positions each; one split (no workspace, no reduction) when the
  grid already fills the GPU. In the interpreter the split is 1 unless asked for (the tests ask).
* Padding: ``L`` up to a power of two, ``d`` up to a power of two >= 16, all masked; cache
  strides are passed as they are (no copy of the cache).

Trade-offs: ``P`` is small next to the V caches (re-reading it per layer adds about ``m / d`` of
the V bytes, see :func:`region_pv_bytes`), so the saving that matters most is one launch instead
of ``L``; reading ``P`` once costs a wider register tile per program. To tune on a GPU:
``block_t`` (32), ``max_columns``, ``num_warps`` / ``num_stages`` (Triton's defaults now), the
split heuristic. **Nothing here has run on a GPU yet**: correctness is proven only in the
interpreter (the one-row reduction, the upcast ``tl.dot``, the native-dtype branch on fp32 tiles,
every split path); see README.md here.

Inside a CUDA graph (the engine's fixed-shape decode step): the launch synchronises nothing and
its Python-side arguments (shapes, ``length`` -- the cache's ``max_length`` there, with the
unwritten slots' probabilities zero) are the same every step, so the capture replays it as is;
the split workspace comes from the graph's memory pool.

Triton is imported only when the Triton path is called; on CPU it runs only under Triton's
interpreter (``TRITON_INTERPRET=1`` set before Triton is imported).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

KERNELS = ("torch", "triton")

MIN_POSITIONS_PER_SPLIT = 128
"""A position split is at least this long (shorter ones cost more in partial writes and
reduction than they gain in parallelism)."""


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


def position_splits(programs: int, length: int, sm_count: Optional[int],
                    min_positions: int = MIN_POSITIONS_PER_SPLIT) -> int:
    """How many position ranges to split ``length`` positions into, for a grid of ``programs``
    programs per range on ``sm_count`` SMs (None: not a GPU, no split): enough for about two
    waves of programs, no range shorter than ``min_positions``."""
    if sm_count is None or programs >= sm_count:
        return 1
    wanted = -(-2 * sm_count // programs)  # ceil
    return max(1, min(wanted, length // min_positions))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles and grid of one :func:`region_pv_triton` launch."""

    block_m: int
    """Probability rows per program: ``m`` padded to ``tl.dot``'s 16, or 1 (one-row reduction)."""

    block_l: int
    """Layers side by side (``L`` padded to a power of two)."""

    block_d: int
    """Head dimensions per layer in a program's tile."""

    d_tiles: int
    """Programs along the head dimension."""

    positions_per_split: int
    """Positions of one split (a multiple of ``block_t``)."""

    splits: int
    """Programs along the positions; > 1: fp32 partials summed after the launch."""

    @property
    def one_row(self) -> bool:
        return self.block_m == 1


def launch_plan(layers: int, batch: int, groups: int, m: int, d: int, length: int, block_t: int = 32,
                max_columns: int = 256, splits: Optional[int] = None, sm_count: Optional[int] = None) -> LaunchConfig:
    """The launch for these shapes (``length >= 1``): ``splits`` None picks
    :func:`position_splits` for ``sm_count`` SMs; any request is cut to the number of
    ``block_t`` blocks and to ranges that are not empty."""
    block_m = 1 if m == 1 else max(16, _next_power_of_2(m))
    block_l = _next_power_of_2(layers)
    block_d = max(16, min(_next_power_of_2(d), max_columns // block_l))
    d_tiles = _cdiv(d, block_d)
    if splits is None:
        splits = position_splits(batch * groups * d_tiles, length, sm_count)
    blocks = _cdiv(length, block_t)
    positions_per_split = block_t * _cdiv(blocks, max(1, min(splits, blocks)))
    return LaunchConfig(block_m, block_l, block_d, d_tiles, positions_per_split, _cdiv(length, positions_per_split))


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count_of(index)


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def region_pv_kernel(
        p_ptr, v_ptr, out_ptr, groups, layers, m, length, d, positions_per_split,
        stride_p_b, stride_p_g, stride_p_m, stride_p_t,
        stride_v_l, stride_v_b, stride_v_g, stride_v_t, stride_v_d,
        stride_o_s, stride_o_l, stride_o_b, stride_o_g, stride_o_m, stride_o_d,
        BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
        ONE_ROW: tl.constexpr, UPCAST: tl.constexpr,
    ):
        # This program: one (sequence, KV group), one tile of BLOCK_D head dimensions for all
        # layers, one range of positions. Its output tile is [BLOCK_M, BLOCK_L * BLOCK_D]; column
        # n belongs to layer n // BLOCK_D and head dimension tile * BLOCK_D + n % BLOCK_D -- the
        # layers' V tiles side by side, so one P tile times this wide V tile is every layer's
        # product at once.
        bg = tl.program_id(0)
        split = tl.program_id(2)
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
        # This program's positions: [first, last), block-aligned, the last range cut at length.
        first = split * positions_per_split
        last = tl.minimum(first + positions_per_split, length)
        for start in range(first, last, BLOCK_T):
            pos = start + tl.arange(0, BLOCK_T)
            pos_ok = pos < last
            # [BLOCK_T, BLOCK_L * BLOCK_D]: all layers' V at these positions
            v = tl.load(v_cols[None, :] + pos[:, None].to(tl.int64) * stride_v_t,
                        mask=pos_ok[:, None] & col_ok[None, :], other=0.0)
            if ONE_ROW:
                # [BLOCK_T, 1]: the one row's probabilities as a column; sum_t p[t] * V[t, :] in fp32
                p = tl.load(p_rows[None, :] + pos[:, None].to(tl.int64) * stride_p_t,
                            mask=pos_ok[:, None] & row_ok[None, :], other=0.0)
                acc += tl.sum(p.to(tl.float32) * v.to(tl.float32), axis=0)[None, :]
            else:
                # [BLOCK_M, BLOCK_T]: read once, used for every layer
                p = tl.load(p_rows[:, None] + pos[None, :].to(tl.int64) * stride_p_t,
                            mask=row_ok[:, None] & pos_ok[None, :], other=0.0)
                if UPCAST:
                    acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(p, v, acc)  # half-precision operands, fp32 accumulator
        out = (out_ptr + split * stride_o_s + layer[None, :] * stride_o_l + seq * stride_o_b + group * stride_o_g
               + rows[:, None] * stride_o_m + dim[None, :] * stride_o_d)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return triton, region_pv_kernel


def region_pv_triton(probs: Tensor, values: Tensor, length: int, block_t: int = 32, max_columns: int = 256,
                     splits: Optional[int] = None, upcast: Optional[bool] = None) -> Tensor:
    """The contract above in one Triton launch, plus a sum over position splits when there is
    more than one (see module doc). ``block_t`` positions per step; ``max_columns`` bounds a
    program's ``layers x head-dims`` tile (the head dimensions are split into more tiles, each
    reading ``P`` once, when ``L x d`` is wider). ``splits``: position ranges (None: chosen by
    :func:`position_splits` on a GPU, 1 in the interpreter); fewer when ``length`` has fewer
    ``block_t`` blocks. ``upcast``: multiply upcast fp32 tiles instead of half-precision ones
    (None: for fp32 caches and in the interpreter, see module doc)."""
    _check(probs, values, length)
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t {block_t}: a power of two >= 16 (tl.dot's minimum)")
    _, kernel = _triton_kernel()
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
    on_gpu = values.device.type == "cuda"
    if upcast is None:
        upcast = values.dtype == torch.float32 or not on_gpu
    plan = launch_plan(layers, b, g, m, d, length, block_t, max_columns, splits, _sm_count(values.device) if on_gpu else None)
    if plan.splits == 1:
        target, split_stride = out, 0
    else:
        # [splits, L, b, g, m, d] fp32 partial products, summed below
        target = torch.empty(plan.splits, layers, b, g, m, d, dtype=torch.float32, device=values.device)
        split_stride = target.stride(0)
    grid = (b * g, plan.d_tiles, plan.splits)
    kernel[grid](p, values, target, g, layers, m, length, d, plan.positions_per_split, *p.stride(), *values.stride(),
                 split_stride, *target.stride()[-5:], BLOCK_M=plan.block_m, BLOCK_T=block_t, BLOCK_L=plan.block_l,
                 BLOCK_D=plan.block_d, ONE_ROW=plan.one_row, UPCAST=upcast)
    if plan.splits > 1:
        # [splits, L, b, g, m, d] -> [L, b, g, m, d]: fp32 sum in a fixed order, rounded once
        out.copy_(target.sum(dim=0))
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
    products, which read ``P`` once per layer. (Position splits add ``splits`` fp32 partial
    outputs, written and read once: small next to V at the lengths that are split.)"""
    p = batch * groups * m * length * bytes_per_element
    v = layers * batch * groups * length * head_dim * bytes_per_element
    out = layers * batch * groups * m * head_dim * bytes_per_element
    return {"one_launch": p + v + out, "per_layer": layers * p + v + out}
