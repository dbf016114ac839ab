"""Mixture-of-Channels decode steps that read only the selected rows of ``W_down``.

A Mixture-of-Channels MLP (Wu et al., "Mixture-of-Channels: Exploiting Sparse FFNs for Efficient
LLMs Pre-Training and Inference", arXiv 2511.09323; :mod:`epas_megatron.model.moc`) keeps, per
token and within each of ``groups`` channel groups, the ``k`` channels with the largest gate
pre-activation ``G``: ``Z = SiLU(G) * U * M``, ``D = Z W_down^T``. Its own forward does the last
product as a dense GEMM over ``Z`` (zero outside the kept channels), as in training: a decode
step reads all of ``W_down``, ``h * f`` values per layer, whatever the batch. In a decode step
(one new token per sequence) a token needs only its ``K = groups * k`` kept channels, so
:class:`MoCRowReader` computes ``D_t = Z_t[idx_t] · W_down^T[idx_t]`` -- per token a gather of
its ``K`` rows of ``W_down^T`` and a ``K``-long product (the paper's decode saving):

=====================  ===========================  =====================================
decode step            ``W_down`` values read        per token (batch ``b``)
=====================  ===========================  =====================================
dense-masked (MLP's)   ``h * f`` per layer          ``h * f / b``
sparse read (here)     ``b * K * h`` per layer      ``K * h`` (a row two tokens chose is read twice)
=====================  ===========================  =====================================

So the sparse read moves fewer bytes only while ``b * K < f`` (``b < 1 / topk``): one or a few
sequences, the paper's decode setting; :func:`down_bytes_per_step` gives both counts. The
gate and up projections stay dense (``G`` picks the channels; reading only the kept rows of
``U``'s weight would save more, not done here).

**Layout.** Megatron's ``linear_fc2.weight`` is ``[h, f]``: a channel is a column whose ``h``
values lie ``f`` apart, and gathering columns reads scattered memory. The reader keeps a
row-major copy ``W_down^T`` ``[f, h]`` (one contiguous ``h``-vector per channel), made once when
the engine is built: one more ``h * f`` matrix per layer in memory (a third of the MLP's
weights). The model's own weight stays for prefill; a model whose weights change after the
engine is built needs a new engine.

**Where it runs.** :class:`~epas_megatron.inference.engine.DecodeEngine` with
``moc_decode='sparse'`` uses it for every forward of one token per sequence (the decode steps,
eager or fixed-shape / CUDA graph, and the prefill of one-token prompts); a prefill of several
tokens runs the MLP's own forward (there the dense GEMM reads ``W_down`` once for many tokens).
The channels are exactly those of the MLP's forward, ties included: both call
:func:`epas_megatron.hf.moc_topk.topk_channels` (the ``k`` largest values of ``G``, equal values
to the lower channel index) on the same ``G``, and its choice does not depend on the leading
shape (``[t, groups, c]`` here, ``[s, b, groups, c]`` there); so the result is the dense-masked
one up to summation order. It needs the local layers at TP = 1 (the engine runs only TP = 1;
Mixture-of-Channels is built only for the local layers); a model without Mixture-of-Channels MLPs
is refused by name, never run dense silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from epas_megatron.errors import ConfigError
from epas_megatron.model.moc import MoCMLP, kept_channels, select_channels

MOC_DECODE_CHOICES = ("masked", "sparse")
"""``masked``: the MLP's own forward (dense GEMM over the masked ``Z``); ``sparse``: decode
steps read only the selected rows of ``W_down`` (:class:`MoCRowReader`)."""


class MoCRowReader:
    """One Mixture-of-Channels layer's MLP for decode steps, reading only the kept rows of
    ``W_down^T`` (see the module notes)."""

    def __init__(self, mlp: MoCMLP):
        tp = mlp.tp_group.size() if mlp.tp_group is not None else 1
        if tp != 1:
            raise ConfigError(f"--moc-decode sparse runs at TP = 1 (this MLP is one of {tp} tensor-parallel shards)")
        self.mlp = mlp
        self.groups, self.kept = mlp.groups_local, mlp.kept
        # [h, f] -> [f, h]: a channel's h values contiguous (the module notes' layout)
        self.rows = mlp.linear_fc2.weight.detach().t().contiguous()
        ffn = self.rows.size(0)
        self.per_group = ffn // self.groups
        # [groups, 1]: the first channel of each group
        self.offsets = torch.arange(0, ffn, self.per_group, device=self.rows.device)[:, None]

    def __call__(self, normed: Tensor) -> Tensor:
        """``[n, b, h]`` (the pre-MLP norm's output) -> the MLP's output ``[n, b, h]``."""
        fc1, _ = self.mlp.linear_fc1(normed)  # [n, b, 2f]
        gate, up = torch.chunk(fc1, 2, dim=-1)  # [n, b, f] each
        n, b, _ = gate.shape
        tokens = n * b
        # [n, b, f] -> [t, groups, f / groups]
        gate = gate.reshape(tokens, self.groups, self.per_group)
        up = up.reshape(tokens, self.groups, self.per_group)
        index = select_channels(gate, self.kept)  # [t, groups, k], as MoCMLP picks them (ties included)
        z = F.silu(gate.gather(-1, index)) * up.gather(-1, index)  # [t, groups, k]
        channels = (index + self.offsets).reshape(tokens, -1)  # [t, K] channel ids in [0, f)
        rows = F.embedding(channels, self.rows)  # [t, K, h]: each token's K rows of W_down^T
        # [t, 1, K] @ [t, K, h] -> [t, 1, h] -> [n, b, h]
        return torch.bmm(z.reshape(tokens, 1, -1), rows).reshape(n, b, -1)

    def forward_layer(self, layer, hidden: Tensor) -> Tensor:
        """``layer._forward_mlp(hidden)`` with this MLP: Megatron's pre-MLP norm, residual and
        bias-dropout-add around :meth:`__call__`."""
        normed = layer._forward_pre_mlp_layernorm(hidden)
        if isinstance(normed, tuple):  # norms that also return the residual
            normed, residual = normed
        else:
            residual = hidden
        if layer.config.fp32_residual_connection:
            residual = residual.float()
        return layer._forward_post_mlp((self(normed), None), residual)


def row_readers(layers) -> dict[int, MoCRowReader]:
    """A :class:`MoCRowReader` for every decoder layer (by index) whose MLP is a Mixture-of-Channels
    one; a ``ConfigError`` naming ``--moc-decode`` where there is none."""
    readers = {index: MoCRowReader(layer.mlp) for index, layer in enumerate(layers) if isinstance(layer.mlp, MoCMLP)}
    if not readers:
        raise ConfigError("--moc-decode sparse: this model has no Mixture-of-Channels MLP (it was trained without "
                          "--moc-topk < 1); use --moc-decode masked")
    return readers


@dataclass(frozen=True)
class DownBytes:
    """``W_down`` bytes one decode step reads over all Mixture-of-Channels layers."""

    masked: int
    """The MLP's own dense GEMM: every ``W_down`` once."""

    sparse: int
    """The sparse read: each token's ``K`` rows."""


def down_bytes_per_step(num_layers: int, hidden_size: int, ffn_hidden_size: int, groups: int, topk: float, batch: int,
                        bytes_per_element: int) -> DownBytes:
    """See the module notes' table (``K = groups * kept_channels``)."""
    kept = groups * kept_channels(ffn_hidden_size, groups, topk)
    return DownBytes(masked=num_layers * hidden_size * ffn_hidden_size * bytes_per_element,
                     sparse=num_layers * batch * kept * hidden_size * bytes_per_element)
