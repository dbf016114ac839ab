"""The distributed optimizer's shards through an in-memory switch, by element range.

A checkpoint stores the distributed optimizer's fp32 state (main weights, Adam moments) in model
space, gathered over data parallelism (``fully_reshardable``): at 7B with TP=2 PP=2 that is
about 20 GB per GPU at every save. The in-memory switch (:mod:`epas_megatron.checkpointing.in_memory`)
never gathers it. Each rank keeps its own shard of every parameter, keyed by the parameter's
identity (its checkpoint shard id, or its factory's signature: the same for a layer that did
not switch), and the new optimizer's shards -- whose boundaries have moved, since the switching
layer's Q/K rows left the gradient buffer -- are filled by element range: from the same rank
where the range did not move, point to point where it did or where the layer changed stage. A
switching layer's fused QKV state, whose V rows its new ``linear_v`` needs, is assembled whole
on one rank that held part of it, split there by its own factory and served from there: only
that one layer's state is ever whole on a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epas_megatron.checkpointing.exchange import (
    ExchangeStats,
    HeldState,
    built_shards,
    model_identities,
    send_and_receive,
    shard_id_functions,
)


def distributed_parts(optimizer) -> list:
    """The optimizer's ``DistributedOptimizer`` parts (all of them, or none)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if optimizer is None:
        return []
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return parts if all(isinstance(part, DistributedOptimizer) for part in parts) else []


def _owned_ranges(part):
    """(model parameter, the range of its flattened elements this DP rank owns) of one part."""
    for gbuf_range_maps in part.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for gbuf_range_map in per_bucket:
                for model_param, ranges in gbuf_range_map["param_map"].items():
                    yield model_param, ranges["param"]


@dataclass
class OptimizerShard:
    """Elements [start, end) of a flattened parameter's fp32 main weights and Adam moments."""

    numel: int
    start: int
    end: int
    tensors: dict  # "param", "exp_avg", "exp_avg_sq": 1-D, end - start elements


def hold_distributed_shards(held: HeldState, model_chunks, optimizer) -> None:
    """Record the distributed optimizer's own shards by parameter identity (no gather)."""
    identities = model_identities(model_chunks)
    parts = distributed_parts(optimizer)
    half = any(part.config.bf16 or part.config.fp16 for part in parts)
    held.dist_kinds = tuple(sorted((("param",) if half else ()) + tuple(parts[0].optimizer_state_keys)))
    for part in parts:
        for param, owned in _owned_ranges(part):
            identity = identities.get(id(param))
            if identity is None:
                raise RuntimeError("in-memory switch: a distributed-optimizer parameter has no checkpoint identity; "
                                   "--epas-switch-mode checkpoint works for any parameter")
            tensors = {k: v.detach().view(-1) for k, v in part._get_main_param_and_optimizer_states(param).items()
                       if torch.is_tensor(v) and v.dim() > 0}
            if not half:
                del tensors["param"]  # fp32: the main weight is the model's own (a view of it), moved with the model
            held.dist_shards[identity] = OptimizerShard(param.numel(), owned.start, owned.end, tensors)
    held.optimizer_common = optimizer.state_dict()  # param groups, step, loss scaler: no parameter state


def _overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int]:
    return max(a0, b0), min(a1, b1)


def _range_transfers(gathered: list[dict], wants: list[tuple[int, tuple, int, int]]) -> list[tuple]:
    """(source rank, destination rank, identity, lo, hi) covering every wanted range
    ``(rank, identity, start, end)`` from the ranks that hold the identity's elements."""
    holders: dict[tuple, list[tuple[int, int, int]]] = {}
    for rank, info in enumerate(gathered):
        for identity, (numel, start, end) in info["holds"].items():
            holders.setdefault(identity, []).append((rank, start, end))
    transfers = []
    for dst, identity, start, end in wants:
        uncovered = [(start, end)]
        # The wanting rank's own elements first; a replicated parameter (tied embeddings on two
        # stages) is taken from one holder only.
        for src, h0, h1 in sorted(holders.get(identity, []), key=lambda h: (h[0] != dst, h[0])):
            remaining = []
            for u0, u1 in uncovered:
                lo, hi = _overlap(u0, u1, h0, h1)
                if lo < hi:
                    transfers.append((src, dst, identity, lo, hi))
                    remaining += [(u0, lo)] if u0 < lo else []
                    remaining += [(hi, u1)] if hi < u1 else []
                else:
                    remaining.append((u0, u1))
            uncovered = remaining
        if uncovered:
            raise RuntimeError(f"in-memory switch: elements {uncovered[0][0]}-{uncovered[0][1]} of {identity[1][0]} are held by "
                               f"no rank; --epas-switch-mode checkpoint")
    return transfers


def _run_range_transfers(transfers, me: int, source_of, target_of, keys, stats: ExchangeStats) -> None:
    """Copy local pieces, send and receive the rest (one round of point-to-point operations)."""
    ops = []
    for src, dst, identity, lo, hi in transfers:
        if src == me and dst == me:
            for key in keys:
                target_of(identity, key, lo, hi).copy_(source_of(identity, key, lo, hi))
            stats.bytes_local += 4 * len(keys) * (hi - lo)  # fp32 main weights and moments
        elif src == me:
            for key in keys:
                ops.append(dist.P2POp(dist.isend, source_of(identity, key, lo, hi).contiguous(), dst))
            stats.bytes_sent += 4 * len(keys) * (hi - lo)
        elif dst == me:
            for key in keys:
                ops.append(dist.P2POp(dist.irecv, target_of(identity, key, lo, hi), src))
            stats.bytes_received += 4 * len(keys) * (hi - lo)
            stats.tensors_received += 1
    send_and_receive(ops)


@dataclass
class DistributedPlan:
    """Who holds and who needs which elements of which parameter's optimizer state (every
    rank's view, gathered once) and how a switching layer's fused state is assembled."""

    gathered: list
    needs: dict  # identity -> (numel, start, end, part, model parameter): this rank's new shards
    changed: dict  # needed identity -> the fused identity it is a piece of
    assembler: dict  # fused identity -> the rank that assembles it
    numel_of: dict


def plan_distributed(held: HeldState, model_chunks, optimizer) -> DistributedPlan:
    """Collective: gather every rank's held and needed ranges (no tensor moves)."""
    identities = model_identities(model_chunks)
    needs = {}
    for part in distributed_parts(optimizer):
        for param, owned in _owned_ranges(part):
            needs[identities[id(param)]] = (param.numel(), owned.start, owned.end, part, param)
    world = dist.get_world_size() if dist.is_initialized() else 1
    pieces_of = {identity: [p[0] for p in identity[1][3]] for identity in held.dist_shards if identity[0] == "factory"}
    info = {"holds": {i: (s.numel, s.start, s.end) for i, s in held.dist_shards.items()},
            "needs": {i: (n[0], n[1], n[2]) for i, n in needs.items()}, "pieces": pieces_of}
    gathered = [info] if world == 1 else [None] * world
    if world > 1:
        dist.all_gather_object(gathered, info)
    # Which needed identities nobody holds as such: pieces of a held fused tensor (a switch).
    held_anywhere = {i for g in gathered for i in g["holds"]}
    piece_owner: dict[str, tuple] = {}
    for g in gathered:
        for factory, pieces in g["pieces"].items():
            for piece in pieces:
                piece_owner.setdefault(piece, factory)
    changed = {}
    for g in gathered:
        for identity in g["needs"]:
            if identity in held_anywhere:
                continue
            if identity[0] != "tensor" or repr(identity[1]) not in piece_owner:
                raise RuntimeError(f"in-memory switch: no rank holds the optimizer state of {identity[1][0]}; "
                                   f"--epas-switch-mode checkpoint")
            changed[identity] = piece_owner[repr(identity[1])]
    assembler = {factory: min(rank for rank, g in enumerate(gathered) if factory in g["holds"])
                 for factory in sorted(set(changed.values()), key=repr)}
    numel_of = {i: h[0] for g in gathered for i, h in g["holds"].items()}
    return DistributedPlan(gathered, needs, changed, assembler, numel_of)


def stash_distributed(held: HeldState, keys: list[str], stash, keep: set) -> dict:
    """Put this rank's held shards of ``keys`` into ``stash``
    (:class:`~epas_megatron.checkpointing.stash.GradientBufferStash`) and free the held tensors
    whose every alias fitted; ``keep``: identities not to stash (a switching layer's fused state,
    assembled from the held tensors later). Returns (identity, key) -> the stashed copy."""
    from epas_megatron.checkpointing.stash import release_storage

    stashed, by_storage = {}, {}
    for identity, shard in held.dist_shards.items():
        for key, tensor in shard.tensors.items():
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append((identity, key, tensor))
            if key in keys and identity not in keep:
                copy = stash.put(tensor)
                if copy is not None:
                    stashed[(identity, key)] = copy
    for aliases in by_storage.values():
        if all((identity, key) in stashed for identity, key, _ in aliases):
            release_storage(aliases[0][2])
            for identity, key, _ in aliases:
                del held.dist_shards[identity].tensors[key]
    return stashed


def _state_tensors(part, param, keys: list[str]) -> dict:
    """The new optimizer's flat tensors of ``keys`` for ``param``'s shard. Only the main weight
    (``param``) is looked up without touching the torch optimizer's state: before its moments
    are allocated (by ``load_state_dict``, which allocates only for an empty state) a lookup
    would enter an empty state for the parameter."""
    if keys == ["param"]:
        group_index, group_order = part.model_param_group_index_map[param]
        return {"param": part.optimizer.param_groups[group_index]["params"][group_order].view(-1)}
    states = part._get_main_param_and_optimizer_states(param)
    return {k: states[k].view(-1) for k in keys}


@torch.no_grad()
def fill_distributed(plan: DistributedPlan, held: HeldState, keys: list[str], stashed: dict, stats: ExchangeStats) -> None:
    """Fill the new distributed optimizer's shards of ``keys`` from the old ones (held or
    ``stashed``): each rank receives exactly the elements it now owns, from whichever ranks owned
    them (its DP peers, or another pipeline stage's ranks for a layer that moved). A parameter
    that changed -- a switching layer's ``linear_v``, the V rows of its old fused QKV -- is
    assembled whole on one rank that held part of it, split there by the fused tensor's own
    factory, and served from there. Collective."""
    tensor_id, _ = shard_id_functions()
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = dist.get_rank() if dist.is_initialized() else 0
    gathered, changed = plan.gathered, plan.changed
    targets = {identity: (start, _state_tensors(part, param, keys)) for identity, (_, start, _, part, param) in plan.needs.items()}
    # Round 1: every unchanged range where it is now owned, and each changed fused tensor whole
    # on the lowest rank that held part of it.
    wants = [(rank, i, n[1], n[2]) for rank, g in enumerate(gathered) for i, n in g["needs"].items() if i not in changed]
    wants += [(rank, factory, 0, plan.numel_of[factory]) for factory, rank in plan.assembler.items()]
    device = next(iter(t for _, ts in targets.values() for t in ts.values()), torch.empty(0)).device
    assembled = {factory: {k: torch.empty(plan.numel_of[factory], dtype=torch.float32, device=device) for k in keys}
                 for factory, rank in plan.assembler.items() if rank == me}

    def source_of(identity, key, lo, hi):
        shard = held.dist_shards[identity]
        tensor = stashed.get((identity, key))
        tensor = shard.tensors[key] if tensor is None else tensor
        return tensor[lo - shard.start:hi - shard.start]

    def target_of(identity, key, lo, hi):
        if identity in assembled:
            return assembled[identity][key][lo:hi]
        start, tensors = targets[identity]
        return tensors[key][lo - start:hi - start]

    plan_round = sorted(_range_transfers(gathered, wants), key=repr)
    _run_range_transfers(plan_round, me, source_of, target_of, keys, stats)
    if not changed:
        return
    # Round 2: the assembling ranks split the fused tensors (the model factory's own row split)
    # and serve the pieces.
    pieces: dict[tuple, dict] = {}
    for factory, full in assembled.items():
        template = held.templates[factory[1]]
        for key, flat in full.items():
            built = template.build_fn(template.key, flat.view(template.data.shape), template.replica_id, template.flattened_range)
            for st in built_shards(built):
                pieces.setdefault(("tensor", tensor_id(st)), {})[key] = st.data.reshape(-1)
    served = [{i: (p[keys[0]].numel(), 0, p[keys[0]].numel()) for i, p in pieces.items()} if rank == me else {}
              for rank in range(world)]
    if world > 1:
        mine = served[me]
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        served = everyone
    wants = [(rank, i, n[1], n[2]) for rank, g in enumerate(gathered) for i, n in g["needs"].items() if i in changed]

    def piece_source(identity, key, lo, hi):
        return pieces[identity][key][lo:hi]

    plan_round = sorted(_range_transfers([{"holds": s} for s in served], wants), key=repr)
    _run_range_transfers(plan_round, me, piece_source, target_of, keys, stats)


def allocate_state(optimizer, kind: str) -> None:
    """Allocate the new distributed optimizer's Adam state of one ``kind`` (``exp_avg`` or
    ``exp_avg_sq``) for every shard, as Megatron's ``load_state_dict`` does for all kinds at
    once (left unfilled: every element is filled next). ``load_state_dict`` then finds the state
    allocated and only loads the groups, step and scaler into it."""
    for part in distributed_parts(optimizer):
        dtype = part._get_state_key_dtype(kind) if hasattr(part, "_get_state_key_dtype") else torch.float32
        for group in part.optimizer.param_groups:
            for main in group["params"]:
                part.optimizer.state[main][kind] = torch.empty(main.numel(), dtype=dtype, device=main.device)


@torch.no_grad()
def gather_weights(model_chunks) -> None:
    """Every data-parallel rank's part of DDP's parameter buffers to every rank: what the
    distributed optimizer's all-gather does after a step, as one broadcast per rank's part, in
    place (gloo's all-gather stages its output in a temporary buffer of the bucket's size; NCCL's
    does not -- a broadcast needs none on either). Collective over each data-parallel group."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in model_chunks:
        for group in [*getattr(chunk, "bucket_groups", []), *getattr(chunk, "expert_parallel_bucket_groups", [])]:
            size = group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            process_group = group.intra_distributed_optimizer_instance_group
            for bucket in group.buckets:
                for rank, part in enumerate(shard_buffer(bucket.param_data, size)):
                    dist.broadcast(part, src=dist.get_global_rank(process_group, rank), group=process_group)


def state_keys(held: HeldState) -> list[str]:
    """The optimizer state's kinds (``param``: the fp32 main weights; the Adam moments), from the
    optimizer's config: every rank exchanges the same kinds in the same rounds, also one that
    happens to own no element of any parameter (NCCL would wait forever for a missing round)."""
    return list(held.dist_kinds)


@torch.no_grad()
def restore_distributed_shards(held: HeldState, model_chunks, optimizer, stats: ExchangeStats) -> None:
    """Fill a new distributed optimizer (built, its state not yet allocated) from the old one's
    shards, every kind at once (what :class:`~epas_megatron.checkpointing.in_memory.SwitchAdoption`
    does kind by kind through the gradient buffer)."""
    keys = state_keys(held)
    optimizer.load_state_dict(held.optimizer_common)  # param groups, step, scaler; shards allocated
    fill_distributed(plan_distributed(held, model_chunks, optimizer), held, keys, {}, stats)
