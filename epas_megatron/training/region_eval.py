"""Validation of the weights being trained at sharing regions other than the one in training.

``--eval-regions`` asks, at every evaluation, how the model does with a smaller region (down to
0, every layer computing with its own Q/K -- the frozen ones where layers share) or, on request,
a larger one. The training chunks are built for the current region, so another region needs
other modules: :func:`evaluate_region` builds the chunks of that region's plan (same parallel
shape, same pipeline layout, so every rank holds the same layers), loads the training chunks'
weights into them in memory and runs the forward-only schedule over the validation batches.

Why a separate model instead of flags flipped inside the training modules: the modules of a
region *are* its build plan (specs, the p2p tensor's hand-off rows under pipelining); building
the plan keeps one path from plan to modules, and the weights move by the same plain state-dict
conversion that maps a fused QKV to a sharing layer's own and frozen rows and back
(:mod:`epas_megatron.model.attention`). The cost is one extra copy of the weights (no gradients,
no optimizer state) while one region is evaluated, freed before the next.

Nothing here touches training state: the chunks, optimizer and data iterators of training are
only read, and the random-number state -- which Megatron's initialisation of the new modules
draws from -- is restored afterwards, so a run with ``--eval-regions`` trains bit-identically to
one without.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.runtime.wrapping import unwrap_model


@torch.no_grad()
def copy_weights(source_chunks: Sequence[torch.nn.Module], target_chunks: Sequence[torch.nn.Module]) -> None:
    """Load the weights of ``source_chunks`` into ``target_chunks`` (same layers per chunk, any
    sharing modes): fused QKV <-> own + frozen rows are converted by the attention modules."""
    if len(source_chunks) != len(target_chunks):
        raise ValueError(f"{len(source_chunks)} source chunks for {len(target_chunks)} target chunks")
    for source, target in zip(source_chunks, target_chunks):
        unwrap_model(target).load_state_dict(unwrap_model(source).state_dict(), strict=True)


def evaluate_region(plan: BuildPlan, sharing_layers: Sequence[int], training_chunks: Sequence[torch.nn.Module],
                    valid_iterators: Callable[[], list], *, num_microbatches: int, micro_batch_size: int,
                    pipeline_schedule=None):
    """Validation loss (a :class:`~epas_megatron.engine.step.StepResult`) of the training
    chunks' weights with ``sharing_layers`` sharing, on the layout of ``plan`` (run with
    ``pipeline_schedule``'s action lists where the run has one)."""
    from epas_megatron.engine.state import build_training_state
    from epas_megatron.engine.step import eval_step
    from epas_megatron.runtime.rng import preserved_rng_state

    region_plan = plan.with_region(tuple(sharing_layers), plan.layout)
    with preserved_rng_state():
        state = build_training_state(region_plan)  # chunks only
    copy_weights(training_chunks, state.model)
    result = eval_step(state.model, valid_iterators(), num_microbatches=num_microbatches,
                       seq_length=state.schedule_seq_length, micro_batch_size=micro_batch_size, pipeline_schedule=pipeline_schedule)
    del state
    return result
