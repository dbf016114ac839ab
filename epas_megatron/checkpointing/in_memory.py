"""The training state moved from one set of built objects to another in memory: the EPAS switch
without a checkpoint round trip (``--epas-switch-mode memory``).

The exchange speaks the language of a distributed checkpoint so that it is exact by the same
construction. The old objects describe their state as a *saving* sharded state dict
(:func:`~epas_megatron.checkpointing.checkpoint.sharded_state`; factories applied, so a computing
layer's fused QKV already appears as ``linear_q/k/v`` rows and the distributed optimizer's flat
shards as model-space tensors), the new objects describe what they need as a *loading* one, and
every shard the new objects need is matched to the old shard with the same id (key, global
offset, flattened range) -- the id under which a checkpoint would have stored and found it:

- a shard this rank already holds (any replica) is copied locally;
- a shard held elsewhere (a layer that moved to another pipeline stage) is sent point to point
  by the rank that holds its *main* replica -- the copy a checkpoint would have written;
- the non-sharded ("common") state is rank 0's, as a checkpoint load reads it.

The loaded state dict is then assembled exactly as ``dist_checkpointing.load`` assembles it
(factory merges: ``linear_v`` from the V rows, the frozen Q/K from the Q/K rows) and put into the
new objects by the same :func:`~epas_megatron.checkpointing.checkpoint.apply_loaded_state` as a
resume. Nothing is written to disk and nothing is serialised except the small common state and
the shard ids.

Use: :func:`hold_state` before the old objects are released (it keeps only their tensors),
build the new objects, :func:`restore_state`, then drop the :class:`HeldState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from epas_megatron.checkpointing.checkpoint import (
    _grad_scalers,
    _scaler_states,
    apply_loaded_state,
    optimizer_has_state,
    sharded_state,
)

ShardId = tuple
"""Megatron's shard id of a tensor or object: (key, global offset, flattened range or shape)."""


@dataclass
class HeldState:
    """The data of a saving sharded state on one rank, detached from the objects that made it."""

    tensors: dict[ShardId, torch.Tensor]
    """Every tensor shard this rank holds (main replica or not)."""

    main: dict[ShardId, tuple[tuple[int, ...], str]]
    """Shape and dtype of the shards whose main replica is on this rank (the ones it sends)."""

    objects: dict[ShardId, Any]
    """Sharded objects (e.g. Transformer Engine's extra state) this rank holds."""

    main_objects: set[ShardId]
    """Sharded objects whose main replica is on this rank."""

    common: dict
    """The non-sharded part (scheduler, optimizer param groups, train state)."""

    with_optimizer: bool
    """Whether optimizer state exists (none before the first step)."""


@dataclass
class ExchangeStats:
    """What one in-memory exchange moved, on this rank."""

    tensors_local: int = 0
    """Shards copied from a tensor this rank held."""

    bytes_local: int = 0
    """Bytes of those."""

    tensors_received: int = 0
    """Shards received from another rank (layers that changed pipeline stage)."""

    bytes_received: int = 0
    """Bytes of those."""

    bytes_sent: int = 0
    """Bytes this rank sent to others."""

    objects_received: int = 0
    """Sharded objects received from another rank."""

    def as_dict(self) -> dict:
        return dict(vars(self))


def _shard_ids():
    from megatron.core.dist_checkpointing.utils import _sharded_object_id, _sharded_tensor_shard_id

    return _sharded_tensor_shard_id, _sharded_object_id


@torch.no_grad()
def hold_state(model_chunks, optimizer, scheduler, train_state: dict) -> HeldState:
    """The old objects' state as shard id -> tensor (what a checkpoint save would write).

    The tensors are detached views of the live ones (no copy) -- except the distributed
    optimizer's, which its model-space format gathers over data parallelism, as a save does."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    tensor_id, object_id = _shard_ids()
    with_optimizer = optimizer_has_state(optimizer)
    if not with_optimizer and _grad_scalers(optimizer):
        train_state = {**train_state, "grad_scalers": _scaler_states(optimizer)}
    state = sharded_state(model_chunks, optimizer, scheduler, train_state, loading=False, with_optimizer=with_optimizer, with_rng=False)
    sharded, common = save_preprocess(state, validate_access_integrity=False)
    held = HeldState({}, {}, {}, set(), common, with_optimizer)
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor):
            shard = tensor_id(item)
            held.tensors[shard] = item.data.detach()
            if is_main_replica(item.replica_id):
                held.main[shard] = (tuple(item.data.shape), str(item.data.dtype))
        elif isinstance(item, ShardedObject):
            shard = object_id(item)
            held.objects[shard] = item.data
            if is_main_replica(item.replica_id):
                held.main_objects.add(shard)
    return held


def _rank0_common(common: dict) -> dict:
    """Rank 0's common state on every rank (what a checkpoint load reads)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return common
    holder = [common if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _sort_key(shard: ShardId) -> str:
    return repr(shard)


def _plan_transfers(gathered: list[dict]) -> list[tuple[int, int, ShardId]]:
    """(source rank, destination rank, shard) for every shard some rank needs from another, in
    one order every rank computes alike: the source is the rank holding the main replica."""
    owner: dict[ShardId, tuple[int, tuple]] = {}
    for rank, info in enumerate(gathered):
        for shard, meta in info["main"].items():
            owner.setdefault(shard, (rank, meta))
    transfers = []
    for dst, info in enumerate(gathered):
        for shard, meta in info["needs"]:
            if shard not in owner:
                raise RuntimeError(f"in-memory switch: rank {dst} needs {shard[0]} (offset {shard[1]}) which no rank holds; "
                                   f"--epas-switch-mode checkpoint reports what is missing from a checkpoint instead")
            src, held_meta = owner[shard]
            if held_meta != meta:
                raise RuntimeError(f"in-memory switch: {shard[0]} is {held_meta} on rank {src} but rank {dst} needs {meta}")
            transfers.append((src, dst, shard))
    return transfers


def _send_and_receive(ops: list) -> None:
    if not ops:
        return
    if dist.get_backend() == "nccl":
        works = dist.batch_isend_irecv(ops)
    else:  # gloo: plain non-blocking pairs, matched in the order both sides posted them
        works = [dist.isend(op.tensor, op.peer) if op.op is dist.isend else dist.irecv(op.tensor, op.peer) for op in ops]
    for work in works:
        work.wait()


@torch.no_grad()
def _fill_tensors(needs: dict[ShardId, list], held: HeldState, stats: ExchangeStats) -> None:
    """Fill every needed shard: local copies, then one round of point-to-point transfers."""
    remote = sorted((s for s in needs if s not in held.tensors), key=_sort_key)
    for shard, targets in needs.items():
        if shard in held.tensors:
            source = held.tensors[shard]
            for target in targets:
                if target.data.shape != source.shape:
                    raise RuntimeError(f"in-memory switch: {shard[0]} has shape {tuple(source.shape)} before the switch "
                                       f"and {tuple(target.data.shape)} after")
                target.data.copy_(source)
            stats.tensors_local += 1
            stats.bytes_local += source.numel() * source.element_size()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if remote:
            raise RuntimeError(f"in-memory switch: {remote[0][0]} is needed but was not held")
        return
    me = dist.get_rank()
    info = {"main": held.main, "needs": [(s, (tuple(needs[s][0].data.shape), str(needs[s][0].data.dtype))) for s in remote]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, info)
    ops, received = [], []
    for src, dst, shard in _plan_transfers(gathered):
        if src == me:
            tensor = held.tensors[shard].contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, dst))
            stats.bytes_sent += tensor.numel() * tensor.element_size()
        elif dst == me:
            target = needs[shard][0].data
            buffer = target if target.is_contiguous() else torch.empty_like(target, memory_format=torch.contiguous_format)
            ops.append(dist.P2POp(dist.irecv, buffer, src))
            received.append((shard, buffer))
    _send_and_receive(ops)
    for shard, buffer in received:
        for target in needs[shard]:
            if target.data is not buffer:
                target.data.copy_(buffer)
        stats.tensors_received += 1
        stats.bytes_received += buffer.numel() * buffer.element_size()


def _fill_objects(needs: dict[ShardId, list], held: HeldState, stats: ExchangeStats) -> None:
    remote = sorted((s for s in needs if s not in held.objects), key=_sort_key)
    for shard, targets in needs.items():
        if shard in held.objects:
            for target in targets:
                target.data = held.objects[shard]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if remote:
            raise RuntimeError(f"in-memory switch: object {remote[0][0]} is needed but was not held")
        return
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"main": sorted(held.main_objects, key=_sort_key), "needs": remote})
    wanted = {shard for info in gathered for shard in info["needs"]}
    if not wanted:
        return
    offered = [None] * dist.get_world_size()
    dist.all_gather_object(offered, {s: held.objects[s] for s in held.main_objects if s in wanted})
    available = {}
    for part in offered:
        for shard, value in part.items():
            available.setdefault(shard, value)
    for shard in remote:
        if shard not in available:
            raise RuntimeError(f"in-memory switch: object {shard[0]} is needed but no rank holds it")
        for target in needs[shard]:
            target.data = available[shard]
        stats.objects_received += 1


def restore_state(held: HeldState, model_chunks, optimizer, scheduler) -> ExchangeStats:
    """Load ``held`` into freshly built objects, as a checkpoint load of the same state would.
    Collective: every rank calls it. Random-number state is left alone (the caller's)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    tensor_id, object_id = _shard_ids()
    state = sharded_state(model_chunks, optimizer, scheduler, {}, loading=True, with_optimizer=held.with_optimizer, with_rng=False)
    if not held.with_optimizer:
        state.pop("opt_param_scheduler", None)
    sharded, nonpersistent, factories = load_preprocess(state)
    common = _rank0_common(held.common)
    merge(common, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)

    tensor_needs: dict[ShardId, list] = {}
    object_needs: dict[ShardId, list] = {}
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor):
            tensor_needs.setdefault(tensor_id(item), []).append(item)
        elif isinstance(item, ShardedObject):
            object_needs.setdefault(object_id(item), []).append(item)
    stats = ExchangeStats()
    _fill_tensors(tensor_needs, held, stats)
    _fill_objects(object_needs, held, stats)

    loaded = dict_list_map_inplace(lambda item: item.data if isinstance(item, (ShardedTensor, ShardedObject)) else item, sharded)
    merge(common, loaded)
    loaded = apply_factory_merges(common, factories)
    apply_loaded_state(loaded, model_chunks, optimizer, scheduler, with_optimizer=held.with_optimizer, restore_rng=False)
    return stats
