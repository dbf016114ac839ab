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


def v_layout_string(stage_sizes, compact: bool = False) -> str:
    """V stage sizes (in V order) as a layout string: ``"V:"``, then the stages ``0 .. 2p-1``
    joined by ``|`` in Megatron-Core's layout syntax -- ``E`` (embedding) opening stage 0, a
    ``t`` per decoder layer, ``L`` (output layer and loss) closing the last stage, which is rank
    0's second chunk; e.g. ``"V:Ett|t|ttt|t|tt|tL"``. ``compact``: runs of more than 3 layers as
    ``t*n`` (Megatron's parser unrolls them)."""
    last = len(stage_sizes) - 1
    body = (f"t*{size}" if compact and size > 3 else "t" * size for size in stage_sizes)
    return "V:" + "|".join(("E" if s == 0 else "") + text + ("L" if s == last else "") for s, text in enumerate(body))
