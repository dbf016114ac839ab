"""The new region's training state built from a held one (:mod:`epas_megatron.checkpointing.in_memory`)
as its objects are built: the in-memory switch without a second copy of the state.

:class:`SwitchAdoption` is the build's :class:`~epas_megatron.engine.state.StateAdoption`: the
chunks come with their parameters on the meta device and take the held tensors over by
identity; the optimizer's fp32 state moves kind by kind through the new gradient buffer
(:mod:`epas_megatron.checkpointing.stash`). :func:`restore_state` loads a held state into objects
already built. What it costs: :mod:`epas_megatron.metrics.switch_memory`.
"""

from __future__ import annotations

import torch

from epas_megatron.checkpointing.checkpoint import apply_loaded_state, sharded_state
from epas_megatron.checkpointing.distributed_shards import (
    allocate_state,
    distributed_parts,
    fill_distributed,
    gather_weights,
    plan_distributed,
    restore_distributed_shards,
    stash_distributed,
    state_keys,
)
from epas_megatron.checkpointing.exchange import ExchangeStats, HeldState, model_identities
from epas_megatron.checkpointing.in_memory import exchange_state, is_optimizer_key, parameter_pairs, rank0_common
from epas_megatron.checkpointing.stash import GradientBufferStash, release_storage
from epas_megatron.runtime.wrapping import unwrap_model


def _adopt_optimizer_states(held: HeldState, model_chunks, optimizer, stats: ExchangeStats) -> None:
    """Give every new parameter whose identity is unchanged the old optimizer's state tensors
    (before the optimizer allocates its own: Megatron only initialises empty states)."""
    if not held.optimizer_states:
        return
    identities = model_identities(model_chunks)
    for torch_optimizer, param, stepped in parameter_pairs(optimizer):
        old = held.optimizer_states.pop(identities.get(id(param)), None)
        if old is None or torch_optimizer.state.get(stepped):
            continue
        if any(torch.is_tensor(v) and v.dim() > 0 and v.shape != stepped.shape for v in old.values()):
            continue
        torch_optimizer.state[stepped] = old
        stats.tensors_adopted += sum(1 for v in old.values() if torch.is_tensor(v) and v.dim() > 0)
    held.optimizer_states.clear()


def _stash_main_weights(held: HeldState, model_chunks, stash) -> dict:
    """Mixed-precision optimizer: every held fp32 main weight whose parameter is in the new model
    goes to the gradient buffer and its memory is freed (the new optimizer allocates its own
    next). Returns identity -> the stashed copy."""
    identities = model_identities(model_chunks)
    stashed = {}
    for chunk in model_chunks:
        for param in chunk.parameters():
            identity = identities.get(id(param))
            main = held.main_weights.get(identity)
            if main is None or main.shape != param.shape:
                continue
            copy = stash.put(main)
            if copy is not None:
                stashed[identity] = copy
                del held.main_weights[identity]
                release_storage(main)  # its views among the held checkpoint shards too: skipped (filled)
    return stashed


class SwitchAdoption:
    """The new region's training state built from a :class:`HeldState` without a second copy
    (a :class:`~epas_megatron.engine.state.StateAdoption`: the build calls it between the steps
    that allocate).

    1. :meth:`model`: the chunks come with their parameters on the meta device; each takes the
       held tensor of its identity (:func:`~epas_megatron.checkpointing.exchange.model_identities`:
       an unchanged layer's weights, fused ones included) -- no copy --, the rest (a switching
       layer's new ``linear_v`` and frozen Q/K, layers arriving from another pipeline stage) are
       allocated and filled by the exchange. The held weights that nothing adopted (the switching
       layers' fused QKV) go before DDP is built.
    2. :meth:`optimizer`: the optimizer's state, as :func:`restore_state`'s second half.

    Collective: every rank builds (and so calls it) together."""

    def __init__(self, held: HeldState):
        self.held = held
        self.stats = ExchangeStats()
        """What the exchange moved, on this rank."""
        self.common: dict | None = None
        self.stash = None
        self.stashed: dict = {}
        self.kinds: list[str] = []
        self.weights_from_main = False
        self.placeholders: set[int] = set()

    def _common(self) -> dict:
        if self.common is None:
            self.common = rank0_common(self.held.common)
        return self.common

    def model(self, chunks: list) -> None:
        from epas_megatron.model.materialize import materialize
        from epas_megatron.runtime.device import compute_device

        held, device = self.held, compute_device()
        identities = model_identities(chunks)
        # The distributed optimizer's half-precision weights are its fp32 main weights rounded
        # (copied and gathered after every step): rebuilt from them once the optimizer is
        # filled, the old weights go before DDP builds its new parameter buffer. In fp32 the
        # weights are the main weights themselves: they are taken over here (views of the old
        # DDP parameter buffer), and Megatron-Core's DDP builds its new parameter buffer in one
        # allocation while the old one still holds them -- the one piece this switch cannot build
        # without allocating (4 bytes per trainable parameter: metrics/switch_memory.py).
        self.weights_from_main = held.optimizer_common is not None and any(
            p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for chunk in chunks for p in chunk.parameters())

        def held_tensor(param):
            if self.weights_from_main and param.requires_grad:
                placeholder = torch.empty_strided(param.shape, (0,) * param.dim(), dtype=param.dtype, device=device)
                self.placeholders.add(placeholder.data_ptr())
                return placeholder
            identity = identities.get(id(param))
            if identity is None:
                return None
            kind, key = identity
            source = held.factories[key].data if kind == "factory" and key in held.factories else (
                held.tensors.get(key) if kind == "tensor" else None)
            if source is None or source.shape != param.shape or source.dtype != param.dtype or source.device != device:
                return None
            return source

        counts = materialize(chunks, device, held_tensor)
        self.stats.tensors_adopted += counts["adopted"] - len(self.placeholders)
        _restore_model(held, chunks, self._common(), self.stats, frozenset(self.placeholders))

    def before_optimizer(self, model: list) -> None:
        held = self.held
        self.stash = GradientBufferStash(model)
        if held.optimizer_common is not None:  # the distributed optimizer, with state (every rank alike)
            self.kinds = state_keys(held)
            self.stashed = stash_distributed(held, ["param"], self.stash, set())
        elif held.main_weights:
            self.stashed = _stash_main_weights(held, model, self.stash)

    def optimizer(self, model: list, optimizer, scheduler) -> None:
        held, stats, stash = self.held, self.stats, self.stash
        if held.optimizer_common is not None:
            # Kind by kind: the old kind into the gradient buffer and freed, the new kind
            # allocated and filled from there.
            plan = plan_distributed(held, model, optimizer)
            if "param" in self.kinds:
                fill_distributed(plan, held, ["param"], self.stashed, stats)
                stash.clear()
            if self.weights_from_main:  # as a step ends: main weights into the model's, gathered over DP
                for part in distributed_parts(optimizer):
                    part._copy_main_params_to_model_params()
                gather_weights(model)
            for kind in (kind for kind in self.kinds if kind != "param"):
                stashed = stash_distributed(held, [kind], stash, set())
                allocate_state(optimizer, kind)
                fill_distributed(plan, held, [kind], stashed, stats)
                stash.clear()
            optimizer.load_state_dict(held.optimizer_common)  # the state exists: param groups, step, scaler
            scheduler.load_state_dict(held.scheduler_state)
            return
        filled = set()
        if self.stashed:
            identities = model_identities(model)
            for _, param, stepped in parameter_pairs(optimizer):
                copy = self.stashed.get(identities.get(id(param)))
                if copy is not None:
                    stepped.copy_(copy)
                    filled.add(stepped.data_ptr())
            stash.clear()
        _restore_optimizer(held, model, optimizer, scheduler, self._common(), stats, frozenset(filled))


def _model_keys(model_chunks) -> list[str]:
    return [f"model{i or ''}" for i in range(len(model_chunks))]


def _restore_model(held: HeldState, model_chunks, common: dict, stats: ExchangeStats, later: frozenset = frozenset()) -> None:
    """Load the held model state into the chunks -- but the parameters whose data pointers are in
    ``later`` (filled after the optimizer) --; then the held weights go (before any optimizer
    state is allocated)."""
    model_keys = _model_keys(model_chunks)
    state = sharded_state(model_chunks, None, None, {}, loading=True, with_optimizer=False, with_rng=False)
    state.pop("train_state")
    loaded = exchange_state(state, held, {k: v for k, v in common.items() if k in model_keys}, stats, later)
    if later:
        for key, chunk in zip(model_keys, model_chunks):
            skipped = {name for name, value in loaded[key].items() if torch.is_tensor(value) and value.data_ptr() in later}
            result = unwrap_model(chunk).load_state_dict({k: v for k, v in loaded[key].items() if k not in skipped},
                                                         strict=False)
            if set(result.missing_keys) != skipped or result.unexpected_keys:
                raise RuntimeError(f"in-memory switch: loading {key} left {sorted(set(result.missing_keys) - skipped)} "
                                   f"missing and {result.unexpected_keys} unexpected")
    else:
        apply_loaded_state(loaded, model_chunks, None, None, with_optimizer=False, restore_rng=False)
    held.release(keep=is_optimizer_key)
    del loaded, state  # the loaded model state (a switching layer's merged frozen Q/K rows among it)


def _restore_optimizer(held: HeldState, model_chunks, optimizer, scheduler, common: dict, stats: ExchangeStats,
                       filled: frozenset = frozenset()) -> None:
    """The optimizer and LR schedule (or, before the first step, the fp16 loss scale)."""
    model_keys = _model_keys(model_chunks)
    rest = {k: v for k, v in common.items() if k not in model_keys}
    if held.optimizer_common is not None:
        restore_distributed_shards(held, model_chunks, optimizer, stats)
        scheduler.load_state_dict(held.scheduler_state)
        return
    if held.with_optimizer:
        _adopt_optimizer_states(held, model_chunks, optimizer, stats)
        state = sharded_state(model_chunks, optimizer, scheduler, {}, loading=True, with_optimizer=True, with_rng=False)
        for key in (*model_keys, "train_state"):
            state.pop(key)
        loaded = exchange_state(state, held, rest, stats, filled)
    else:
        loaded = rest
    apply_loaded_state(loaded, model_chunks, optimizer, scheduler, with_optimizer=held.with_optimizer, restore_rng=False,
                       with_model=False)


def restore_state(held: HeldState, model_chunks, optimizer, scheduler) -> ExchangeStats:
    """Load ``held`` into objects already built (a switch builds through :class:`SwitchAdoption`
    instead), as a checkpoint load of the same state would. Collective: every rank calls it.
    Random-number state is left alone (the caller's). The model's tensors leave ``held`` once
    loaded; drop ``held`` afterwards. The old objects must not be used again: the new ones may own
    their tensors now."""
    adoption = SwitchAdoption(held)
    _restore_model(held, model_chunks, adoption._common(), adoption.stats)
    adoption.optimizer(model_chunks, optimizer, scheduler)
    return adoption.stats
