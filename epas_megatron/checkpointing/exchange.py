"""What the in-memory switch's two exchanges share: shard identities, the state held between the
old objects and the new ones, what an exchange moved, and the point-to-point round.

The in-memory switch (:mod:`epas_megatron.checkpointing.in_memory`) moves the model and the
non-distributed optimizers' state by checkpoint shard id; the distributed optimizer's flat
shards move by element range (:mod:`epas_megatron.checkpointing.distributed_shards`). Both
identify a parameter the same way (:func:`model_identities`), fill one :class:`HeldState`,
count into one :class:`ExchangeStats` and send with :func:`send_and_receive`; those live here so
that neither module imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from epas_megatron.runtime.wrapping import unwrap_model

ShardId = tuple
"""Megatron's shard id of a tensor or object: (key, global offset, flattened range or shape)."""

Signature = tuple
"""What a factory produces: its key, data shape and dtype, and the id, shape and dtype of every
shard it builds. Two factories with one signature split and fuse the same rows of the same
global tensor."""


def shard_id_functions():
    """Megatron's (tensor shard id, object shard id) functions."""
    from megatron.core.dist_checkpointing.utils import _sharded_object_id, _sharded_tensor_shard_id

    return _sharded_tensor_shard_id, _sharded_object_id


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def built_shards(built) -> list:
    """The ``ShardedTensor`` s of a factory's build (any nesting)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [item for item in nested_values(built) if isinstance(item, ShardedTensor)]


def factory_signature(factory) -> Optional[Signature]:
    """The factory's :data:`Signature`, from a build on the meta device (no data touched);
    None if the factory cannot build on meta."""
    tensor_id, _ = shard_id_functions()
    try:
        built = factory.build_fn(factory.key, factory.data.detach().to("meta"), factory.replica_id, factory.flattened_range)
    except Exception:  # a factory that needs real data: it takes the general path
        return None
    shards = sorted((repr(tensor_id(st)), tuple(st.local_shape), str(st.dtype)) for st in built_shards(built))
    return (factory.key, tuple(factory.data.shape), str(factory.data.dtype), tuple(shards))


def model_identities(model_chunks) -> dict[int, tuple]:
    """id(parameter) -> what identifies it in any region: its shard id, or its factory's
    signature (so a parameter of an unchanged layer has the same identity before and after)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    tensor_id, _ = shard_id_functions()
    identities = {}
    for chunk in model_chunks:
        for item in nested_values(unwrap_model(chunk).sharded_state_dict()):
            if isinstance(item, ShardedTensorFactory):
                signature = factory_signature(item)
                if signature is not None:
                    identities[id(item.data)] = ("factory", signature)
            elif isinstance(item, ShardedTensor) and item.flattened_range is None:
                identities[id(item.data)] = ("tensor", tensor_id(item))
    return identities


@dataclass
class HeldState:
    """The data of a saving sharded state on one rank, detached from the objects that made it."""

    tensors: dict[ShardId, torch.Tensor] = field(default_factory=dict)
    """Tensor shards this rank holds (main replica or not); factories' shards once split."""

    factories: dict[Signature, Any] = field(default_factory=dict)
    """Factories (fused QKV, SwiGLU FC1 and their optimizer states) with detached data, unsplit."""

    factory_of: dict[ShardId, Signature] = field(default_factory=dict)
    """Which held factory produces a shard (split on first use)."""

    main: dict[ShardId, tuple] = field(default_factory=dict)
    """Shape and dtype of the shards whose main replica is on this rank (the ones it sends)."""

    objects: dict[ShardId, Any] = field(default_factory=dict)
    """Sharded objects (e.g. Transformer Engine's extra state) this rank holds."""

    main_objects: set = field(default_factory=set)
    """Sharded objects whose main replica is on this rank."""

    optimizer_states: dict[tuple, dict] = field(default_factory=dict)
    """Model-parameter identity -> the old optimizer's state of that parameter (adoptable)."""

    main_weights: dict[tuple, torch.Tensor] = field(default_factory=dict)
    """Mixed-precision optimizer: model-parameter identity -> its old fp32 main weight."""

    common: dict = field(default_factory=dict)
    """The non-sharded part (scheduler, optimizer param groups, train state)."""

    with_optimizer: bool = False
    """Whether optimizer state exists (none before the first step)."""

    templates: dict[Signature, Any] = field(default_factory=dict)
    """Every held factory without its data (a meta tensor of its shape): how to split a fused
    tensor's optimizer state that is assembled later."""

    dist_shards: dict[tuple, Any] = field(default_factory=dict)
    """Distributed optimizer: parameter identity -> this rank's shard of its fp32 main weights
    and moments (:class:`~epas_megatron.checkpointing.distributed_shards.OptimizerShard`), taken
    without any gather."""

    dist_kinds: tuple = ()
    """Distributed optimizer: the kinds of state every rank holds (``param``, the fp32 main
    weights, in half precision; the Adam moments) -- the same on every rank, whatever its shards."""

    optimizer_common: Any = None
    """Distributed optimizer: its state dict without parameter state (groups, step, scaler)."""

    scheduler_state: Any = None
    """Distributed optimizer: the LR schedule's state."""

    def tensor(self, shard: ShardId) -> Optional[torch.Tensor]:
        """The held data of ``shard``, splitting its factory on first use."""
        if shard not in self.tensors and shard in self.factory_of:
            tensor_id, _ = shard_id_functions()
            factory = self.factories[self.factory_of[shard]]
            with torch.no_grad():
                for st in built_shards(factory.build()):
                    self.tensors[tensor_id(st)] = st.data
        return self.tensors.get(shard)

    def holds(self, shard: ShardId) -> bool:
        return shard in self.tensors or shard in self.factory_of

    def release(self, keep: Callable[[str], bool]) -> None:
        """Drop everything whose key ``keep`` rejects (its tensors are freed if nothing else
        refers to them)."""
        self.tensors = {s: t for s, t in self.tensors.items() if keep(s[0])}
        self.factories = {sig: f for sig, f in self.factories.items() if keep(sig[0])}
        self.factory_of = {s: sig for s, sig in self.factory_of.items() if sig in self.factories}
        self.main = {s: m for s, m in self.main.items() if keep(s[0])}


@dataclass
class ExchangeStats:
    """What one in-memory exchange moved, on this rank."""

    tensors_local: int = 0
    """Shards (or whole unchanged factories) copied from a tensor this rank held."""

    bytes_local: int = 0
    """Bytes of those."""

    tensors_adopted: int = 0
    """Tensors the new objects took over without a copy (weights with storage of their own,
    optimizer states kept on the model's parameters)."""

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


def send_and_receive(ops: list) -> None:
    """Post ``ops`` (``dist.P2POp``) as one ``batch_isend_irecv`` and wait for all of them -- on
    every backend alike (what CI runs on gloo is what runs on NCCL).

    Why this cannot hang on NCCL: each rank posts all of its sends and receives of the round as
    one batch, whose ops start together; a send completes once the peer's receive has started,
    and that receive is in the peer's one batch, which starts as soon as the peer posts it. Every
    rank reaches this call (each after the same collectives). The multi-process switch tests run
    it under the NCCL-rules transport (epas_megatron/compat/nccl_rules.py)."""
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()
