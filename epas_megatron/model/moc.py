"""Mixture-of-Channels (Wu et al., "Mixture-of-Channels: Exploiting Sparse FFNs for Efficient LLMs
Pre-Training and Inference", arXiv 2511.09323): a SwiGLU MLP that keeps, per token, the Top-K
channels of the gate pre-activation and stores only those for backward.

With ``G, U`` the two halves of ``linear_fc1``'s output, ``M = TopK(G)`` (per token, within
fixed groups of channels), the layer computes ``Z = SiLU(G) * U * M`` and ``D = Z W_down^T``.
The mask is a constant of the backward pass. What the layer keeps for backward is the sparse
form: per token and group the ``k`` kept channel indices (the narrowest integer type that
holds a group) and the ``k``-wide values of ``G`` and ``U``; ``Z`` -- the input ``linear_fc2``
would keep dense -- is rebuilt from them in backward. The GEMMs stay dense in training (a
scatter makes ``Z``), as in the paper; ``linear_fc1`` keeps its input as usual.

``TopK`` is :func:`epas_megatron.hf.moc_topk.topk_channels`: the ``k`` largest values, equal
values to the lower channel index. A rule, not ``torch.topk(sorted=False)``'s tie-breaking: bf16
gates tie at the boundary in 4-17 % of (token, group) pairs, and ``topk`` may break a tie
differently with the tensor's shape or device. The same function chooses the channels in the
recompute (the forward runs again), in the sparse-read decode
(:mod:`epas_megatron.inference.moc_decode`) and in the Hugging Face export, which ships it.

Groups: ``groups`` equal runs of the ``ffn_hidden_size`` gate channels; the count must be a
multiple of the tensor-parallel size, so that no group straddles a shard and TP=2 is the same
model as TP=1 (Megatron's column-parallel ``linear_fc1`` gives each rank a contiguous slice of
``G`` and the matching slice of ``U``; a group's choice depends on its own values only, so each
rank keeps exactly TP=1's channels, ties included). ``topk`` is the kept fraction: ``k =
round(topk * channels per group)``, at least 1; where ``k`` is the whole group the function
computes Megatron's SwiGLU operation for operation (same bits; it keeps ``G`` and ``U`` and
rebuilds ``Z``).
The builder uses Megatron's own ``MLP`` for ``--moc-topk 1``.

:class:`MoCMLP` is Megatron-Core's ``MLP`` with the activation and ``linear_fc2``'s GEMM done by
:class:`_MoCSwiGLUDown`; ``linear_fc2`` keeps its weight, checkpoint keys and tensor-parallel
reduction (all-reduce, or reduce-scatter with sequence parallelism). Its weight gradient joins
the weight-gradient split of the split-backward pipeline schedules
(:mod:`epas_megatron.model.weight_grad`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP

from epas_megatron.model.moc_channels import index_bytes, kept_channels, moc_saved_bytes_per_token  # noqa: F401 -- re-exported
from epas_megatron.model.weight_grad import WEIGHT_GRAD_STORE, gather_sequence, sequence_shard
from epas_megatron.model.weight_grad import _accumulate as accumulate_weight_grad


def index_dtype(per_group: int) -> torch.dtype:
    """The narrowest integer type that holds a channel's index within its group."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[index_bytes(per_group)]


def select_channels(gate, k: int):
    """The ``k`` channels each group keeps: :func:`epas_megatron.hf.moc_topk.topk_channels` (the
    rule of the module notes). Imported at first use: any module of ``epas_megatron.hf`` imports
    transformers (about 2 s), which a run without Mixture-of-Channels layers does not need."""
    from epas_megatron.hf.moc_topk import topk_channels  # heavy package (transformers), MoC runs only

    return topk_channels(gate, k)


class _MoCSwiGLUDown(torch.autograd.Function):
    """``(SiLU(G) * U * TopK(G)) @ W_down^T`` of one TP rank, keeping the sparse form for backward.
    ``scatter_group``: the tensor-parallel group when the caller reduce-scatters the output to the
    sequence shard (sequence parallelism), else None."""

    @staticmethod
    def forward(ctx, fc1_out, weight, groups: int, k: int, scatter_group=None):
        gate, up = torch.chunk(fc1_out, 2, dim=-1)  # [s, b, f/tp] each
        s, b, f = gate.shape
        per_group = f // groups
        ctx.weight = weight  # where a deferred gradient goes
        ctx.scatter_group = scatter_group
        ctx.dense = k == per_group
        if ctx.dense:  # every channel kept: Megatron's SwiGLU, operation for operation (same bits)
            z = F.silu(gate) * (up + 0.0)
            ctx.save_for_backward(fc1_out, weight)  # Z is rebuilt in backward: 2f kept, not 3f
            return torch.matmul(z, weight.t())
        gate_g = gate.reshape(s, b, groups, per_group)
        up_g = up.reshape(s, b, groups, per_group)
        index = select_channels(gate_g, k)  # [s, b, groups, k], ranked; ties to the lower channel
        gate_k, up_k = gate_g.gather(-1, index), up_g.gather(-1, index)
        z = torch.zeros_like(gate_g).scatter_(-1, index, F.silu(gate_k) * up_k).reshape(s, b, f)
        output = torch.matmul(z, weight.t())  # [s, b, h] (partial sum over TP)
        ctx.save_for_backward(index.to(index_dtype(per_group)), gate_k, up_k, weight)
        ctx.shape = (s, b, groups, per_group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.dense:
            return _MoCSwiGLUDown._dense_backward(ctx, grad_output)
        narrow_index, gate_k, up_k, weight = ctx.saved_tensors
        index = narrow_index.long()
        shape = ctx.shape
        s, b, groups, per_group = shape
        grad_z = grad_output.matmul(weight).reshape(shape)  # [s, b, groups, per_group]
        grad_zk = grad_z.gather(-1, index)
        grad_up_k = grad_zk * F.silu(gate_k)
        grad_gate_k = torch.ops.aten.silu_backward(grad_zk * up_k, gate_k)
        grad_fc1 = torch.cat([torch.zeros_like(grad_z).scatter_(-1, index, grad_gate_k).reshape(s, b, -1),
                              torch.zeros_like(grad_z).scatter_(-1, index, grad_up_k).reshape(s, b, -1)], dim=-1)

        def weight_grad(total_grad_output):  # (a deferred one holds the narrow indices, not the int64 copy)
            z = torch.zeros(shape, dtype=gate_k.dtype, device=gate_k.device).scatter_(-1, narrow_index.long(),
                                                                                      F.silu(gate_k) * up_k)
            return total_grad_output.reshape(s * b, -1).t().matmul(z.reshape(s * b, -1))  # [h, f/tp], as Megatron's

        return _MoCSwiGLUDown._finish(ctx, grad_fc1, weight_grad, grad_output, (narrow_index, gate_k, up_k))

    @staticmethod
    def _dense_backward(ctx, grad_output):
        """Autograd's SwiGLU backward, operation for operation (see forward)."""
        fc1_out, weight = ctx.saved_tensors
        gate, up = torch.chunk(fc1_out, 2, dim=-1)
        act, up_offset = F.silu(gate), up + 0.0
        grad_z = grad_output.matmul(weight)
        grad_fc1 = torch.cat([torch.ops.aten.silu_backward(grad_z * up_offset, gate), grad_z * act], dim=-1)

        def weight_grad(total_grad_output):
            z = (F.silu(gate) * (up + 0.0)).reshape(-1, gate.shape[-1])
            return total_grad_output.reshape(-1, total_grad_output.shape[-1]).t().matmul(z)

        return _MoCSwiGLUDown._finish(ctx, grad_fc1, weight_grad, grad_output, (fc1_out,))

    @staticmethod
    def _finish(ctx, grad_fc1, weight_grad, grad_output, holds):
        """The gradients to return; ``linear_fc2``'s weight gradient (``weight_grad`` of the whole
        sequence's output gradient) deferred to the W pass while the weight-gradient store collects
        (:mod:`epas_megatron.model.weight_grad`), keeping ``holds`` and the output gradient."""
        if WEIGHT_GRAD_STORE.defers():
            param, group = ctx.weight, ctx.scatter_group
            # Under sequence parallelism the output is reduce-scattered outside this function, so its
            # gradient arrives all-gathered: keep this rank's sequence shard, [s, b, h] -> [s / tp, b, h],
            # and gather it again in W. Every TP rank defers the same layers' fc2 in the same order (the
            # branch depends on the configuration only, never on the rank), so the all-gathers match.
            kept_grad_output = sequence_shard(grad_output, group) if group is not None else grad_output

            def deferred():
                total_grad_output = gather_sequence(kept_grad_output, group) if group is not None else kept_grad_output
                accumulate_weight_grad(param, weight_grad(total_grad_output))

            WEIGHT_GRAD_STORE.put(deferred, holds=(*holds, kept_grad_output))
            return grad_fc1, None, None, None, None
        return grad_fc1, weight_grad(grad_output), None, None, None


class MoCMLP(MLP):
    """Megatron-Core's SwiGLU ``MLP`` with Mixture-of-Channels activations (see the module doc)."""

    def __init__(self, config, submodules, *, topk: float, groups: int, tp_group=None, **kwargs):
        super().__init__(config=config, submodules=submodules, tp_group=tp_group, **kwargs)
        if not (config.gated_linear_unit and config.activation_func is F.silu) or config.add_bias_linear:
            raise ValueError("Mixture-of-Channels is built for the SwiGLU MLP without biases")
        tp = self.tp_group.size() if self.tp_group is not None else 1
        ffn = self.config.ffn_hidden_size
        if groups % tp or ffn % groups:
            raise ValueError(f"{groups} MoC groups must divide ffn_hidden_size {ffn} and be a multiple of TP {tp}")
        self.moc_topk, self.moc_groups = topk, groups
        self.groups_local = groups // tp
        self.kept = kept_channels(ffn, groups, topk)

    @classmethod
    def slot(cls, submodules, moc) -> functools.partial:
        """A layer spec's ``mlp`` slot for the Mixture-of-Channels MLP ``moc``
        (:class:`~epas_megatron.model.moc_sizes.MoCSettings`) with the linears ``submodules``."""
        return functools.partial(cls.as_moc_submodule, submodules=submodules, topk=moc.topk, groups=moc.groups)

    @classmethod
    def as_moc_submodule(cls, submodules, config, pg_collection, is_mtp_layer, *, topk: float, groups: int,
                         name=None, **kwargs):
        """The builder a layer spec's ``mlp`` slot calls (as ``MLP.as_mlp_submodule``)."""
        del is_mtp_layer
        return cls(config=config, submodules=submodules, topk=topk, groups=groups, tp_group=pg_collection.tp, name=name)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise ValueError("Mixture-of-Channels MLP is not an expert: no per-token scale")
        intermediate, _ = self.linear_fc1(hidden_states)  # [s, b, 2 f/tp]
        scatter_group = self.tp_group if self.config.sequence_parallel else None
        partial = _MoCSwiGLUDown.apply(intermediate, self.linear_fc2.weight, self.groups_local, self.kept, scatter_group)
        if self.config.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group), None
        return reduce_from_tensor_model_parallel_region(partial, group=self.tp_group), None
