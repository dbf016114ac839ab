"""The training state moved from one set of built objects to another in memory: the EPAS switch
without a checkpoint round trip (``--epas-switch-mode memory``).

The exchange speaks the language of a distributed checkpoint so that it is exact by the same
construction. The old objects describe their state as a *saving* sharded state dict
(:func:`~epas_megatron.checkpointing.checkpoint.sharded_state`: a computing layer's fused QKV is
a factory of ``linear_q/k/v`` rows, the distributed optimizer's flat shards are model-space
tensors), the new objects describe what they need as a *loading* one, and every shard the new
objects need is matched to the old shard with the same id (key, global offset, flattened range)
-- the id under which a checkpoint would have stored and found it:

- a shard this rank already holds (any replica) is copied locally;
- a shard held elsewhere (a layer that moved to another pipeline stage) is sent point to point
  by the rank that holds its *main* replica -- the copy a checkpoint would have written;
- the non-sharded ("common") state is rank 0's, as a checkpoint load reads it.

The loaded state dict is then assembled exactly as ``dist_checkpointing.load`` assembles it
(factory merges: ``linear_v`` from the V rows, the frozen Q/K from the Q/K rows) and put into the
new objects by the same :func:`~epas_megatron.checkpointing.checkpoint.apply_loaded_state` as a
resume. Nothing is written to disk and nothing is serialised except the small common state and
the shard ids.

Cheaper than a checkpoint load in time and memory, with the same result:

- *Unchanged factories are not split.* A factory (fused QKV, SwiGLU's fused FC1, and the
  optimizer states that follow them) whose pieces are the same before and after -- a layer
  that did not switch -- is copied whole; splitting and re-fusing rows would give the same bits
  through two temporary copies. Only a layer that switches (or moves stage) is split.
- *Model first, then optimizer.* The old weights are dropped as soon as the new modules hold
  them, before any optimizer state is allocated.
- *Adopted, not copied.* The new parameters take the old tensors of their identity over (built
  on the meta device: nothing allocated for them), the non-distributed optimizers take the old
  Adam moments of every parameter that did not change, and the fp32 state that the new
  optimizer must allocate moves through the new gradient buffer kind by kind
  (:mod:`epas_megatron.checkpointing.switch_adoption`): no second copy of the state exists.
- *The distributed optimizer's shards are never gathered*: they move by element range
  (:mod:`epas_megatron.checkpointing.distributed_shards`).

What both exchanges share (the held state, parameter identities, the statistics, the
point-to-point round) is in :mod:`epas_megatron.checkpointing.exchange`.

Use: :func:`hold_state` before the old objects are released (it keeps only their tensors),
build the new objects through a :class:`~epas_megatron.checkpointing.switch_adoption.SwitchAdoption`
of it (or, into objects already built,
:func:`~epas_megatron.checkpointing.switch_adoption.restore_state`), then drop the
:class:`HeldState`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from epas_megatron.checkpointing.checkpoint import (
    grad_scalers,
    optimizer_has_state,
    scaler_states,
    sharded_state,
)
from epas_megatron.checkpointing.distributed_shards import (
    distributed_parts,
    hold_distributed_shards,
)
from epas_megatron.checkpointing.exchange import (
    ExchangeStats,
    HeldState,
    ShardId,
    built_shards,
    factory_signature,
    model_identities,
    nbytes,
    send_and_receive,
    shard_id_functions,
)


def parameter_pairs(optimizer) -> list[tuple]:
    """(torch optimizer, model parameter, the parameter the torch optimizer steps) of Megatron's
    non-distributed optimizers: the model parameter itself for the fp32 optimizer (and fp32
    parameters of a mixed-precision one), its fp32 main weight for a half-precision parameter of
    the mixed-precision optimizer. Empty for any other optimizer."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    pairs = []
    for part in parts:
        if type(part) is FP32Optimizer:
            pairs += [(part.optimizer, p, p) for group in part.optimizer.param_groups for p in group["params"]]
        elif type(part) is Float16OptimizerWithFloat16Params:
            for halves, mains in zip(part.float16_groups, part.fp32_from_float16_groups):
                pairs += [(part.optimizer, p, main) for p, main in zip(halves, mains)]
            pairs += [(part.optimizer, p, p) for group in part.fp32_from_fp32_groups for p in group]
        else:
            return []
    return pairs


def is_optimizer_key(key: str) -> bool:
    return key.startswith("optimizer.")


@torch.no_grad()
def hold_state(model_chunks, optimizer, scheduler, train_state: dict) -> HeldState:
    """The old objects' state as shard id -> tensor (what a checkpoint save would write).

    Tensors are detached views of the live ones (no copy) -- except the distributed optimizer's,
    which its model-space format gathers over data parallelism, as a save does."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory, is_main_replica
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    tensor_id, object_id = shard_id_functions()
    with_optimizer = optimizer_has_state(optimizer)
    if not with_optimizer and grad_scalers(optimizer):
        train_state = {**train_state, "grad_scalers": scaler_states(optimizer)}

    held = HeldState(with_optimizer=with_optimizer)
    lean_distributed = with_optimizer and bool(distributed_parts(optimizer))
    if lean_distributed:  # its own shards, by parameter: no gather over data parallelism
        hold_distributed_shards(held, model_chunks, optimizer)
        held.scheduler_state = scheduler.state_dict()
    elif with_optimizer:
        identities = model_identities(model_chunks)
        for torch_optimizer, param, stepped in parameter_pairs(optimizer):
            identity = identities.get(id(param))
            if identity is not None and torch_optimizer.state.get(stepped):
                held.optimizer_states[identity] = dict(torch_optimizer.state[stepped])
                if stepped is not param:
                    held.main_weights[identity] = stepped
    state = sharded_state(model_chunks, optimizer, scheduler, train_state, loading=False,
                          with_optimizer=with_optimizer and not lean_distributed, with_rng=False)
    factories, rest = extract_matching_values(state, lambda x: isinstance(x, ShardedTensorFactory))
    unsigned = []
    for factory in nested_values(factories):
        factory = replace(factory, data=factory.data.detach())  # not the Parameter (its .main_grad keeps DDP's buffer)
        _unpin_closures(factory.build_fn)
        _unpin_closures(factory.merge_fn)
        signature = factory_signature(factory)
        if signature is None:
            unsigned.extend(built_shards(factory.build()))
            continue
        held.factories[signature] = factory
        held.templates[signature] = replace(factory, data=factory.data.to("meta"))
        for st in built_shards(factory.build_fn(factory.key, factory.data.to("meta"), factory.replica_id, factory.flattened_range)):
            held.factory_of[tensor_id(st)] = signature
            if is_main_replica(st.replica_id):
                held.main[tensor_id(st)] = (tuple(st.local_shape), str(st.dtype))
    sharded, held.common = save_preprocess(rest, validate_access_integrity=False)
    for item in [*nested_values(sharded), *unsigned]:
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


def _unpin_closures(fn, depth: int = 3) -> None:
    """Megatron's factories' build functions close over the original ``ShardedTensor`` (SwiGLU's
    FC1: for its offsets and shape), whose data is the old Parameter -- a view into the old DDP
    parameter buffer: a held factory (or its meta template) would keep that whole buffer to the
    end of the switch. The closed-over shard keeps its metadata and loses its data (meta)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, ShardedTensor) and value.data is not None and not value.data.is_meta:
            cell.cell_contents = replace(value, data=value.data.detach().to("meta"))
        elif callable(value) and depth > 0 and hasattr(value, "__closure__"):
            _unpin_closures(value, depth - 1)


def drop_gradients(model_chunks) -> None:
    """Detach the old parameters from DDP's gradient buffer (``.main_grad``, ``.grad``, and the
    ``.grad`` of a half-precision parameter's fp32 main weight, which the mixed-precision and
    distributed optimizers point at the buffer) before the old objects go: a factory held in
    :class:`HeldState` may keep a parameter alive, and one live view would keep the whole buffer
    through the switch (measured: 4 bytes per parameter more at its peak)."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            param.grad = None
            if hasattr(param, "main_grad"):
                param.main_grad = None
            main = getattr(param, "main_param", None)
            if main is not None:
                main.grad = None


def rank0_common(common: dict) -> dict:
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


def _whole_storage(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes(tensor)


def _copy_into(target: torch.Tensor, source: torch.Tensor, what: str, stats: ExchangeStats) -> None:
    """Give ``target`` the values of ``source``: nothing if it already is ``source`` (an adopted
    optimizer state); a parameter with storage of its own takes ``source``'s storage over (the
    old weights become the new ones, no copy); a copy otherwise."""
    if target.shape != source.shape:
        raise RuntimeError(f"in-memory switch: {what} has shape {tuple(source.shape)} before the switch and {tuple(target.shape)} after")
    if target.data_ptr() == source.data_ptr() and target.stride() == source.stride():
        return
    if (isinstance(target, torch.nn.Parameter) and target.dtype == source.dtype and target.device == source.device
            and _whole_storage(target) and _whole_storage(source)):
        target.data = source
        stats.tensors_adopted += 1
        return
    target.copy_(source)
    stats.tensors_local += 1
    stats.bytes_local += nbytes(source)


@torch.no_grad()
def _fill_tensors(needs: dict[ShardId, list], held: HeldState, stats: ExchangeStats) -> None:
    """Fill every needed shard: local copies, then one round of point-to-point transfers."""
    remote = sorted((s for s in needs if not held.holds(s)), key=_sort_key)
    for shard, targets in needs.items():
        if held.holds(shard):
            source = held.tensor(shard)
            for target in targets:
                _copy_into(target.data, source, shard[0], stats)
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
            tensor = held.tensor(shard).contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, dst))
            stats.bytes_sent += nbytes(tensor)
        elif dst == me:
            target = needs[shard][0].data
            buffer = target if target.is_contiguous() else torch.empty_like(target, memory_format=torch.contiguous_format)
            ops.append(dist.P2POp(dist.irecv, buffer, src))
            received.append((shard, buffer))
    send_and_receive(ops)
    for shard, buffer in received:
        for target in needs[shard]:
            if target.data is not buffer:
                target.data.copy_(buffer)
        stats.tensors_received += 1
        stats.bytes_received += nbytes(buffer)


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


@torch.no_grad()
def exchange_state(state: dict, held: HeldState, common: dict, stats: ExchangeStats, filled: frozenset = frozenset()) -> dict:
    """Fill a loading sharded state from ``held``; the loaded state dict, as
    ``dist_checkpointing.load`` returns it (``common`` is merged into and returned). ``filled``:
    data pointers of tensors that already hold their values (left as they are)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge, nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
        apply_factory_merges,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    tensor_id, object_id = shard_id_functions()
    unchanged: dict[ShardId, torch.Tensor] = {}

    def unchanged_factory(item):
        # Loaded as it is, no split and fuse: the factory's place is taken by an object that only
        # this rank has and already holds (the result keeps the state dict's list positions).
        if isinstance(item, ShardedTensorFactory):
            signature = factory_signature(item)
            if item.data.data_ptr() in filled or (signature is not None and signature in held.factories):
                if item.data.data_ptr() not in filled:
                    _copy_into(item.data, held.factories[signature].data, item.key, stats)
                placeholder = ShardedObject(f"in_memory_switch.unchanged.{len(unchanged)}", item.data, (1,), (0,), replica_id=0)
                unchanged[object_id(placeholder)] = item.data
                return placeholder
        return item

    dict_list_map_inplace(unchanged_factory, state)
    sharded, nonpersistent, factories = load_preprocess(state)
    merge(common, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)
    tensor_needs: dict[ShardId, list] = {}
    object_needs: dict[ShardId, list] = {}
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor) and item.data.data_ptr() not in filled:
            tensor_needs.setdefault(tensor_id(item), []).append(item)
        elif isinstance(item, ShardedObject):
            object_needs.setdefault(object_id(item), []).append(item)
    _fill_tensors(tensor_needs, held, stats)
    _fill_objects({s: t for s, t in object_needs.items() if s not in unchanged}, held, stats)
    loaded = dict_list_map_inplace(lambda item: item.data if isinstance(item, (ShardedTensor, ShardedObject)) else item, sharded)
    merge(common, loaded)
    return apply_factory_merges(common, factories)
