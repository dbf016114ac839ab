"""V placement as a layout Megatron-Core's layers understand.

Under V placement (:mod:`epas_megatron.parallel.pipeline_schedule`) the decoder layers are split
into ``2p`` contiguous virtual stages taken in V order: stage ``s`` is held by rank ``s`` (its
chunk 0) going down and by rank ``2p-1-s`` (its chunk 1) coming back up, so rank 0 holds the first
stage (embedding) and the last (output layer and loss). Megatron-Core's
``PipelineParallelLayerLayout`` numbers virtual stages in interleaved order (``vp * p + rank``)
and puts the loss on the last rank, so it cannot say this; but its layers ask the layout only for
a chunk's layer offset and count (``get_transformer_layer_offset``, ``get_num_layers_to_build``:
the global layer numbers, hence the checkpoint keys, ``decoder.layers.<global id>``), and check it
once (``validate_layer_layout``). :class:`VPipelineLayout` answers those in V order; a model
built with it numbers its layers as any other layout does, so its checkpoints load into 1F1B and
interleaved layouts and back.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from epas_megatron.model.v_placement import v_chunk, v_layout_string, v_rank, v_stage


class VPipelineLayout(PipelineParallelLayerLayout):
    """``stage_sizes`` decoder layers per V stage (``2p`` of them, in V order) for ``pp`` ranks,
    as Megatron-Core's layout object (see the module doc)."""

    def __init__(self, stage_sizes: Sequence[int], pipeline_model_parallel_size: int):
        pp = pipeline_model_parallel_size
        if len(stage_sizes) != 2 * pp:
            raise ValueError(f"V placement over {pp} ranks has {2 * pp} stages, got {len(stage_sizes)} sizes")
        self.stage_sizes = tuple(int(size) for size in stage_sizes)
        self.input_data = v_layout_string(self.stage_sizes)
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = 2
        self.layout = [[[] for _ in range(2)] for _ in range(pp)]
        self.flatten_layout = []
        for s, size in enumerate(self.stage_sizes):
            types = ([LayerType.embedding] if s == 0 else []) + [LayerType.decoder] * size + ([LayerType.loss] if s == 2 * pp - 1 else [])
            self.layout[v_rank(s, pp)][v_chunk(s, pp)] = types
            self.flatten_layout += types

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: Optional[int]) -> bool:
        """Megatron's checks in V order: embedding first, loss last, every decoder layer once."""
        if mtp_num_layers:
            raise ValueError("V placement does not place multi-token-prediction layers")
        if self.flatten_layout.count(LayerType.decoder) != num_layers:
            raise ValueError(f"the V layout holds {self.flatten_layout.count(LayerType.decoder)} decoder layers, the model {num_layers}")
        return False  # no standalone MTP stage

    def _rank(self, pp_rank: Optional[int]) -> int:
        return parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank

    def get_num_layers_to_build(self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None,
                                pp_rank: Optional[int] = None) -> int:
        return self.layout[self._rank(pp_rank)][vp_stage or 0].count(layer_type)

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None,
                         pp_rank: Optional[int] = None) -> int:
        stage = v_stage(self._rank(pp_rank), vp_stage or 0, self.pipeline_model_parallel_size)
        return sum(self.layout[v_rank(s, self.pipeline_model_parallel_size)][v_chunk(s, self.pipeline_model_parallel_size)]
                   .count(layer_type) for s in range(stage))

    def is_first_stage(self, pp_rank: int, vp_stage: Optional[int]) -> bool:
        """The chunk holds the embedding (V stage 0)."""
        return v_stage(pp_rank, vp_stage or 0, self.pipeline_model_parallel_size) == 0

    def is_last_stage(self, pp_rank: int, vp_stage: Optional[int]) -> bool:
        """The chunk holds the output layer and loss (V stage ``2p-1``, on rank 0)."""
        return v_stage(pp_rank, vp_stage or 0, self.pipeline_model_parallel_size) == 2 * self.pipeline_model_parallel_size - 1
