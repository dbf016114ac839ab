"""V placement (Qi et al., NeurIPS 2024): ``2p`` virtual stages over ``p`` ranks, stage ``s`` on
rank ``s`` (its chunk 0) going down and on rank ``2p-1-s`` (its chunk 1) coming back up -- so
rank 0 holds the first stage (embedding) and the last (output layer and loss). Pure functions;
the layout object Megatron-Core's layers read is :mod:`epas_megatron.model.v_layout`."""

from __future__ import annotations


def v_rank(stage: int, pp: int) -> int:
    """The rank holding virtual ``stage`` under V placement: ``s`` going down, ``2p-1-s`` back up."""
    return stage if stage < pp else 2 * pp - 1 - stage


def v_chunk(stage: int, pp: int) -> int:
    """The model chunk of its rank that virtual ``stage`` is: 0 going down, 1 coming back up."""
    return 0 if stage < pp else 1


def v_stage(pp_rank: int, chunk: int, pp: int) -> int:
    """The virtual stage that chunk ``chunk`` of ``pp_rank`` holds under V placement."""
    return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank


def even_v_stage_sizes(num_layers: int, pp: int) -> tuple[int, ...]:
    """``num_layers`` over ``2p`` V stages as evenly as they go (the deeper stages one fewer)."""
    stages = 2 * pp
    return tuple(num_layers // stages + (1 if s < num_layers % stages else 0) for s in range(stages))
