"""What an in-memory switch allocates on one pipeline rank above the training state it starts
from: the bound the switch keeps and ``epas-plan`` checks against a step's peak.

The switch (:mod:`epas_megatron.checkpointing.switch_adoption`, driven by ``training.switch``) builds
the new region's objects so that no piece of the state exists twice:

1. The old gradient buffer goes first (nothing in it survives a step).
2. The new chunks are built with their parameters on the meta device; every parameter whose
   identity did not change takes the old tensor over (no copy). Allocated: a switching layer's
   new ``linear_v`` and frozen Q/K (its old fused QKV goes right after: the same bytes), and the
   layers that arrive from another pipeline stage. With the distributed optimizer in half
   precision, the trainable weights are not taken over at all: they are the fp32 main weights
   rounded, and are rebuilt from them (step 4), so the old parameter buffer goes here too.
3. DDP builds its buffers (the old ones are gone). Megatron's DDP with the distributed
   optimizer builds its parameter buffer whole: in fp32 the trainable weights -- the only copy
   of the main weights -- are in the old buffer until the new one holds them (``4·T'``: the one
   piece Megatron-Core does not let the switch build without allocating).
4. The optimizer's fp32 state moves kind by kind (main weights, then each Adam moment) through
   the new gradient buffer (:mod:`epas_megatron.checkpointing.stash`): the old kind is copied
   there and freed, the new kind allocated and filled from it. Megatron's FP32 optimizer keeps
   its state on the model's parameters: taken over. Moments of a parameter whose identity did not
   change are taken over by the mixed-precision optimizer too.
5. A switching layer's fused QKV is split: while its new ``linear_v`` and frozen Q/K are filled,
   the fused rows, their split pieces (copies: the rows of a KV group are interleaved) and the
   frozen rows merged for loading exist at once (``3·w`` per fused element); later its optimizer
   state (the two moments of the fp32 optimizer, main weights and moments of the mixed-precision
   one) is split the same way next to the new ``linear_v``'s state -- the distributed optimizer's
   one kind at a time, the fused state assembled whole on one rank (``8`` bytes per fused element
   and ``4`` per V element).

The bound (:func:`switch_transient_terms`): the switching layers' split (5), the state of layers
that arrive, the fp32 distributed optimizer's parameter buffer, and what of the old optimizer
state does not fit the gradient buffer (a rank that loses layers at a re-layout with the
distributed optimizer at DP 1). Terms are summed although their phases do not
overlap: an upper bound. Measured with torch's CPU allocation counter around real switches
(``tests/metrics/test_switch_memory.py``) and the CUDA allocator (``tests/gpu``).
"""

from __future__ import annotations

from typing import Collection, Sequence

from epas_megatron.metrics.memory_model import Role
from epas_megatron.metrics.rank_memory import RankMemorySettings, layer_parameters, qkv_parameters, rank_parameters
from epas_megatron.model.architecture import ModelShape


def optimizer_state_bytes_per_parameter(settings: RankMemorySettings) -> float:
    """Bytes of optimizer state per trainable parameter on one rank: two fp32 moments, and fp32
    main weights in half precision; over DP with the distributed optimizer."""
    per = 8 if settings.precision == "fp32" else 12
    return per / settings.dp if settings.distributed_optimizer else per


def switch_transient_terms(shape: ModelShape, roles_before: Sequence[Role], roles_after: Sequence[Role],
                           layers_before: Collection[int], layers_after: Collection[int], pp_rank: int, pp: int,
                           settings: RankMemorySettings) -> dict[str, float]:
    """The bytes one pipeline rank allocates during an in-memory switch above the state it held
    before (``parameters`` of :func:`~epas_megatron.metrics.rank_memory.rank_memory_bytes` at
    the region before), by term, and ``transient``, their sum (a bound; see the module doc).

    ``roles_before`` / ``roles_after``: every decoder layer's role in the regions before and
    after the switch; ``layers_before`` / ``layers_after``: the rank's layers in the layouts
    before and after it (the same without a re-layout)."""
    w = settings.element_bytes
    state = optimizer_state_bytes_per_parameter(settings)
    switching = {i for i, (old, new) in enumerate(zip(roles_before, roles_after)) if old == "compute" and new == "share"}
    split_layers = len(switching & set(layers_before))
    t_before, _ = rank_parameters(shape, [roles_before[i] for i in layers_before], pp_rank, pp, settings)
    t_after, _ = rank_parameters(shape, [roles_after[i] for i in layers_after], pp_rank, pp, settings)
    arrived_trainable = arrived_frozen = 0
    for i in layers_after:
        if i not in layers_before:
            trainable, frozen = layer_parameters(shape, roles_after[i], settings.share, settings.tp)
            arrived_trainable, arrived_frozen = arrived_trainable + trainable, arrived_frozen + frozen
    fp32_distributed = settings.distributed_optimizer and settings.precision == "fp32"
    # The old distributed optimizer's shards of one kind (T / dp elements) against the new
    # gradient buffer (T' elements): what does not fit stays through the new kind's allocation.
    overflow = max(0.0, t_before / settings.dp - t_after) * 4 if settings.distributed_optimizer else 0.0
    qkv = qkv_parameters(shape, settings.tp)
    v = shape.hidden_size * shape.num_query_groups * shape.head_dim // settings.tp  # the new linear_v
    state_split = 8 * qkv + 4 * v if settings.distributed_optimizer else state * (qkv + v)
    terms = {
        "split": (3 * w * qkv + state_split) * split_layers,
        "arrived": (w + 4 + state) * arrived_trainable + w * arrived_frozen,
        "ddp_parameter_buffer": 4 * t_after if fp32_distributed else 0,
        "unstashed": overflow,
    }
    return {**terms, "transient": sum(terms.values())}
