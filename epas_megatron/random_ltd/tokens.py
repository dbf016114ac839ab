"""Which tokens a Random-LTD layer keeps, and the gather/scatter around the layer.

**Selection.** Each Random-LTD layer keeps ``r`` tokens of every sequence, uniformly without
replacement and sorted by position, drawn per (sample, layer) by a keyed generator so that every
layout and every resume keeps the same tokens (:mod:`epas_megatron.random_ltd.keyed_draw`).

**Causal mask and positions.** Sorted kept tokens attend causally among themselves: token ``i``
of the kept sequence sees kept tokens ``j <= i``, i.e. exactly the kept tokens at earlier
positions, so the ordinary causal mask over ``r`` tokens is the right one (DeepSpeed's GPT
path slices ``[:r, :r]`` of the causal mask for the same reason). RoPE must rotate each kept
token by its *original* position: the layer gets the rotary frequencies gathered at the kept
positions, ``[r, b, 1, d]`` instead of ``[s, 1, 1, d]``.

**Gather/scatter.** ``gather_tokens`` takes the kept rows of ``[s, b, h]`` hidden states; after
the layer, ``scatter_tokens`` writes its output back into those rows, and dropped tokens pass
the layer unchanged (their residual stream skips it). Both are differentiable; the PyTorch path
is plain ``torch.gather``/``torch.scatter``. DeepSpeed's CUDA kernels (``GatherTokens`` /
``ScatterTokens`` of ``deepspeed.ops.random_ltd``) are used with ``--random-ltd-kernels
deepspeed``, or by ``auto`` on CUDA when they load.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from epas_megatron.errors import ConfigError

KERNELS = ("auto", "torch", "deepspeed")


def _row_index(index: Tensor, like: Tensor) -> Tensor:
    """``[b, r]`` positions -> the ``[r, b, ...]`` gather/scatter index for ``[s, b, ...]`` ``like``."""
    # [b, r] -> [r, b, 1, ..., 1] broadcast over the trailing dims
    return index.t().reshape(index.size(1), index.size(0), *([1] * (like.dim() - 2))).expand(-1, -1, *like.shape[2:])


def gather_rows(tensor: Tensor, index: Tensor) -> Tensor:
    """Kept rows ``[r, b, ...]`` of any ``[s, b, ...]`` tensor (hidden states ``[s, b, h]``, a Q/K
    hand-off ``[s, b, heads, hn]``) at ``[b, r]`` positions."""
    return torch.gather(tensor, 0, _row_index(index, tensor))


gather_tokens = gather_rows
"""``[s, b, h]`` hidden states, ``[b, r]`` positions -> the kept rows ``[r, b, h]``."""


def scatter_tokens(hidden: Tensor, kept_output: Tensor, index: Tensor) -> Tensor:
    """``hidden`` ``[s, b, h]`` with the kept rows replaced by the layer's ``[r, b, h]`` output."""
    return torch.scatter(hidden, 0, _row_index(index, hidden), kept_output)


def gather_rotary(rotary_pos_emb, index: Tensor):
    """RoPE frequencies ``[s, 1, 1, d]`` (or a (q, k) pair of them) at the kept positions:
    ``[r, b, 1, d]``, one rotation per kept token of every sequence."""
    if rotary_pos_emb is None:
        return None
    if isinstance(rotary_pos_emb, tuple):
        return tuple(gather_rotary(freqs, index) for freqs in rotary_pos_emb)
    # [s, 1, 1, d] -> [s, d] -> [r, b, d] -> [r, b, 1, d]
    return rotary_pos_emb[:, 0, 0, :][index.t()].unsqueeze(2)


class DeepSpeedTokenOps:
    """DeepSpeed's CUDA gather/scatter kernels (``deepspeed.ops.random_ltd``), same semantics as a
    pair: ``ScatterTokens``' backward passes the whole gradient to the full hidden states and
    ``GatherTokens``' backward overwrites the kept rows with the layer's, so each scatter must
    follow a gather of the same positions from the same tensor."""

    def __init__(self):
        from deepspeed.ops.random_ltd.dropping_utils import GatherTokens, ScatterTokens

        self._gather, self._scatter = GatherTokens, ScatterTokens

    def gather(self, hidden: Tensor, index: Tensor) -> Tensor:
        # The kernels take int32 [b, r] positions; GatherTokens returns (all, kept).
        return self._gather.apply(hidden, index.to(torch.int32), False)[1]

    def scatter(self, hidden: Tensor, kept_output: Tensor, index: Tensor) -> Tensor:
        return self._scatter.apply(hidden, kept_output, index.to(torch.int32), False)


class TorchTokenOps:
    """The PyTorch gather/scatter (every device; what CPU and the tests run)."""

    gather = staticmethod(gather_tokens)
    scatter = staticmethod(scatter_tokens)


def deepspeed_kernels_load() -> Optional[str]:
    """None if DeepSpeed's Random-LTD CUDA kernels load here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from deepspeed.ops.op_builder import RandomLTDBuilder

        builder = RandomLTDBuilder()
        if not builder.is_compatible(verbose=False):
            return "DeepSpeed's RandomLTDBuilder is not compatible with this system"
        builder.load(verbose=False)
    except Exception as error:  # ImportError, a failed JIT build
        return f"{type(error).__name__}: {error}"
    return None


def token_ops(kernels: str = "auto"):
    """The gather/scatter implementation for ``--random-ltd-kernels``."""
    if kernels not in KERNELS:
        raise ConfigError(f"--random-ltd-kernels {kernels!r}: choose one of {', '.join(KERNELS)}")
    if kernels == "torch":
        return TorchTokenOps()
    problem = deepspeed_kernels_load()
    if problem is None:
        return DeepSpeedTokenOps()
    if kernels == "deepspeed":
        raise ConfigError(f"--random-ltd-kernels deepspeed: DeepSpeed's Random-LTD kernels do not load ({problem}); "
                          "use --random-ltd-kernels torch or auto")
    return TorchTokenOps()
