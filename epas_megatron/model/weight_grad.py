"""The weight-gradient split of the local linear layers: an input-gradient backward now, the
weight-gradient GEMMs later (the ``B`` / ``W`` passes of V-Half and V-Min, Qi et al., NeurIPS 2024).

Megatron-Core's local ``ColumnParallelLinear`` / ``RowParallelLinear`` compute both gradients in
one autograd node (their ``backward_dw`` is a no-op; only Transformer Engine's layers delay the
weight gradient, and Megatron-Core's ``delay_wgrad_compute`` knob requires expert-parallel
overlap). :class:`DelayedWgradColumnParallelLinear` and :class:`DelayedWgradRowParallelLinear`
are those classes with one change: while :data:`WEIGHT_GRAD_STORE` is *armed* (a pipeline
schedule with a split backward runs), a trainable weight's GEMM goes through
:class:`_LinearWithDelayedWgrad`, whose backward returns the input gradient (all-reduced or
reduce-scattered over tensor parallelism as Megatron's does) and, while the store *collects* for
a pass, leaves the weight (and bias) gradient as a closure in the store under that pass's key.
``W`` of that pass runs the closures: the same GEMM as Megatron's (``grad_output^T @ input``),
added to ``main_grad`` as Megatron DDP's hook adds ``param.grad`` (or to ``.grad`` without DDP).
Outside a collecting pass the node computes the weight gradient at once and returns it, like
Megatron's. Disarmed -- every other schedule -- the layers are Megatron's, node for node.

What stays in ``B``: the parameters that are not linear weights (norms, the embedding, and a
row-parallel bias, which Megatron adds after the reduction, outside the GEMM), whose gradients
are cheap; frozen Q/K rows (:class:`~epas_megatron.model.attention.FrozenProjection`)
have no weight gradient. What a deferred closure holds until ``W`` (the layer's input and the
output gradient) is what the schedules' memory accounting keeps from ``F`` to the end of ``W``.

Under sequence parallelism a closure keeps only this rank's sequence shard of the full-sequence
operand and ``W`` all-gathers it again over the tensor-parallel group: a column-parallel linear's
input (which arrives as the shard), and a row-parallel linear's output gradient (the layer
reduce-scatters its output to the shard outside the linear, so the gradient arrives all-gathered:
``B`` copies this rank's shard out, :func:`sequence_shard`, and the full tensor is freed when ``B``
ends). Mixture-of-Channels' fc2 (:mod:`epas_megatron.model.moc`) does the same. A column-parallel
GEMM's gather is Megatron's own (its backward gathers the input again too); a row-parallel one
pays one all-gather of ``[s, b, h]`` in ``W`` and a shard-sized copy in ``B``. The gathered
tensors are the ones Megatron's backward uses, bit for bit, so the weight gradients are unchanged.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Hashable, Iterator, Optional

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute


class WeightGradStore:
    """Deferred weight-gradient GEMMs, per backward pass.

    ``armed``: the delayed-wgrad linears build :class:`_LinearWithDelayedWgrad` nodes (decided at
    forward time); :meth:`collecting` a key: their backward defers into that key; :meth:`run`
    executes and drops a key's GEMMs (in the order their ``B`` made them)."""

    def __init__(self):
        self.armed = False
        self.computed = 0
        """Deferred GEMMs run so far by this process (a count for tests and benchmarks)."""
        self.on_put: Optional[Callable[[tuple[torch.Tensor, ...]], object]] = None
        """A memory tracker's hook: called with the tensors a deferred GEMM keeps alive until it
        runs; what it returns is kept with the GEMM and dropped when the GEMM has run
        (:class:`~epas_megatron.metrics.activation_memory.LiveSavedBytes`)."""
        self._key: Optional[Hashable] = None
        self._pending: dict[Hashable, list[tuple[Callable[[], None], object]]] = defaultdict(list)

    @contextlib.contextmanager
    def arming(self) -> Iterator["WeightGradStore"]:
        """Arm the store for a run of split-backward passes; every deferred GEMM must have run at
        the end (a pass whose ``W`` never ran would silently lose its weight gradients)."""
        if self.armed:
            raise RuntimeError("the weight-gradient store is already armed")
        self.armed = True
        try:
            yield self
            if self._pending:
                raise RuntimeError(f"weight gradients of {sorted(map(str, self._pending))} were deferred and never computed")
        finally:
            self.armed = False
            self._key = None
            self._pending.clear()

    @contextlib.contextmanager
    def collecting(self, key: Hashable) -> Iterator[None]:
        """Defer the weight gradients of the backward run inside into ``key``."""
        if self._key is not None:
            raise RuntimeError(f"already collecting for {self._key!r}")
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def defers(self) -> bool:
        return self._key is not None

    def put(self, compute: Callable[[], None], holds: tuple[torch.Tensor, ...] = ()) -> None:
        """Defer ``compute``, which keeps the tensors ``holds`` alive until it runs."""
        self._pending[self._key].append((compute, self.on_put(holds) if self.on_put is not None else None))

    def pending(self, key: Hashable) -> int:
        """How many GEMMs ``key`` has waiting."""
        return len(self._pending.get(key, ()))

    def run(self, key: Hashable) -> int:
        """Run ``key``'s deferred GEMMs; returns how many ran."""
        computes = self._pending.pop(key, [])
        with torch.no_grad():  # as inside autograd's backward
            for compute, _ in computes:
                compute()
        self.computed += len(computes)
        return len(computes)


WEIGHT_GRAD_STORE = WeightGradStore()
"""The process's store (one per process, as autograd's engine is)."""


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` where the parameter's gradient goes: Megatron DDP's ``main_grad`` (what its
    backward hook does with ``param.grad``), else ``.grad`` (as autograd accumulates)."""
    if hasattr(param, "main_grad"):
        param.main_grad.add_(grad)
    elif param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def gather_sequence(shard: torch.Tensor, tp_group) -> torch.Tensor:
    """The full sequence of a sequence shard, in tensor-parallel rank order (a new tensor).

    A collective: in ``W`` every tensor-parallel rank runs the same deferred GEMMs in the same
    order (the ranks of a TP group run the same pipeline actions on the same layers), so the
    all-gathers match; whether a closure gathers must depend only on the layer and the run's
    configuration (never on a rank-specific branch), or the group would hang."""
    total = torch.empty((shard.shape[0] * tp_group.size(), *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    torch.distributed.all_gather_into_tensor(total, shard.contiguous(), group=tp_group)
    return total


def sequence_shard(full: torch.Tensor, tp_group) -> torch.Tensor:
    """This rank's sequence shard of a full-sequence tensor, copied out (``[s, ...] -> [s / tp, ...]``):
    a view would keep the whole tensor's storage alive. :func:`gather_sequence` of the shards
    gives back ``full``, bit for bit, where ``full`` is the same on every rank (an all-gather's
    output)."""
    length = full.shape[0] // tp_group.size()
    return full.narrow(0, tp_group.rank() * length, length).clone(memory_format=torch.contiguous_format)


class _LinearWithDelayedWgrad(torch.autograd.Function):
    """``input @ weight^T + bias`` of a tensor-parallel linear whose weight gradient may be
    deferred (see the module docstring); the input gradient is Megatron's.

    ``sequence_parallel``: the input is the sequence shard (a column-parallel linear under
    sequence parallelism); ``output_scattered``: the caller reduce-scatters the output to the
    sequence shard (a row-parallel one), so the output gradient arrives whole."""

    @staticmethod
    def forward(ctx, input_, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, output_scattered=False):
        ctx.save_for_backward(input_, weight)
        ctx.params = (weight, bias)  # where a deferred gradient goes
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.output_scattered = output_scattered
        ctx.tp_group = tp_group
        total_input = gather_sequence(input_, tp_group) if sequence_parallel else input_  # [s, b, h_in]
        output = torch.matmul(total_input, weight.t())  # [s, b, h_out / tp]
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        tp_group, sequence_parallel = ctx.tp_group, ctx.sequence_parallel
        weight_param, bias = ctx.params
        use_bias = bias is not None
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=tp_group)
        if sequence_parallel:
            sub_grad_input = torch.empty(input_.shape, dtype=input_.dtype, device=input_.device)
            torch.distributed.reduce_scatter_tensor(sub_grad_input, grad_input.contiguous(), group=tp_group)
            grad_input = sub_grad_input

        def weight_grads(total_grad_output):  # [s, b, h_out / tp]
            total_input = gather_sequence(input_, tp_group) if sequence_parallel else input_  # [s, b, h_in]
            grad_out_2d, total_input_2d = prepare_input_tensors_for_wgrad_compute(total_grad_output, total_input)
            grad_weight = grad_out_2d.t().matmul(total_input_2d)  # [h_out / tp, h_in], as Megatron's
            return grad_weight, (grad_out_2d.sum(dim=0) if use_bias else None)

        store = WEIGHT_GRAD_STORE
        if store.defers():
            # A row-parallel linear under sequence parallelism keeps its output gradient's sequence
            # shard, [s, b, h] -> [s / tp, b, h], and gathers it again in W (gather_sequence: every TP
            # rank takes this branch for the same layers, so the all-gathers match).
            output_scattered = ctx.output_scattered
            kept_grad_output = sequence_shard(grad_output, tp_group) if output_scattered else grad_output

            def deferred():
                total_grad_output = gather_sequence(kept_grad_output, tp_group) if output_scattered else kept_grad_output
                grad_weight, grad_bias = weight_grads(total_grad_output)
                _accumulate(weight_param, grad_weight)
                if grad_bias is not None:
                    _accumulate(bias, grad_bias)

            store.put(deferred, holds=(input_, kept_grad_output))
            return grad_input, None, None, None, None, None, None
        grad_weight, grad_bias = weight_grads(grad_output)
        return grad_input, grad_weight, grad_bias, None, None, None, None


class _DelayedWgrad:
    """The ``_forward_impl`` of both delayed-wgrad linears (see the module docstring)."""

    def _output_scattered(self) -> bool:
        """Whether the layer reduce-scatters the linear's output to the sequence shard itself."""
        return False

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 -- Megatron's keyword
        if not (WEIGHT_GRAD_STORE.armed and weight.requires_grad):
            return super()._forward_impl(input, weight, *args, **kwargs)
        # (gradient-accumulation fusion is not needed: a deferred GEMM adds to main_grad itself)
        tp_group = kwargs.get("tp_group") or self.tp_group
        return _LinearWithDelayedWgrad.apply(input, weight, kwargs.get("bias"), kwargs.get("allreduce_dgrad", False),
                                             kwargs.get("sequence_parallel", False), tp_group, self._output_scattered())


class DelayedWgradColumnParallelLinear(_DelayedWgrad, ColumnParallelLinear):
    """Megatron-Core's ``ColumnParallelLinear`` whose weight gradient the split-backward schedules
    defer (:data:`WEIGHT_GRAD_STORE`); otherwise the same layer."""


class DelayedWgradRowParallelLinear(_DelayedWgrad, RowParallelLinear):
    """Megatron-Core's ``RowParallelLinear`` whose weight gradient the split-backward schedules
    defer (:data:`WEIGHT_GRAD_STORE`); otherwise the same layer."""

    def _output_scattered(self) -> bool:
        # RowParallelLinear.forward: the linear runs with sequence_parallel=False, then the output is
        # reduce-scattered to the sequence shard (unless experts communicate it themselves).
        return bool(self.sequence_parallel and not self.explicit_expert_comm)
