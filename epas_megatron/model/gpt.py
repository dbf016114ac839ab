"""The LLaMA-architecture language model of one pipeline stage (model chunk).

Why not Megatron-Core's ``GPTModel`` or ``HybridModel``: ``GPTModel`` (deprecated in 0.19)
constructs the stock ``TransformerBlock`` itself, with no way to pass a block class, and the
stock block drops the per-layer ``context`` our QK hand-off travels in. ``HybridModel`` builds one
spec per layer *symbol* from a fixed symbol set (attention and MLP are separate layers), so a
per-layer attention variant would need a new symbol patched into Megatron. We therefore build the
same model from Megatron-Core parts on ``LanguageModule``: ``LanguageModelEmbedding``,
``RotaryEmbedding``, :class:`EpasTransformerBlock` with per-layer specs, a column-parallel LM head
and ``compute_language_model_loss``. Parameter names and sharded-state-dict keys are those of
``GPTModel`` (``embedding.word_embeddings.weight``, ``decoder.layers.N...``,
``decoder.final_layernorm.weight``, ``output_layer.weight``), except that each layer's fused QKV
is saved as ``linear_q/k/v.weight`` (see :mod:`epas_megatron.model.attention`).
"""

from __future__ import annotations

import copy
from typing import Optional

from torch import Tensor

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from epas_megatron.model.block import EpasTransformerBlock
from epas_megatron.model.weight_grad import DelayedWgradColumnParallelLinear


class EpasGPTModel(LanguageModule):
    """Embedding (first stage) -> decoder layers of this chunk -> LM head and loss (last stage)."""

    def __init__(
        self,
        config: TransformerConfig,
        block_spec: TransformerBlockSubmodules,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        share_embeddings_and_output_weights: bool = False,
        rotary_base: int = 10000,
        receives_handoff: bool = False,
        sends_handoff: bool = False,
        handoff_heads: tuple = (0, 0),
        vp_stage: Optional[int] = None,
        pg_collection=None,
        output_layer_gradient_accumulation_fusion: Optional[bool] = None,
    ):
        """``output_layer_gradient_accumulation_fusion``: the LM head's own setting where it
        differs from ``config.gradient_accumulation_fusion`` (None: the config's) -- TE decoder
        layers fuse it without apex, the local head needs apex (:mod:`epas_megatron.model.fusions`)."""
        super().__init__(config=config, pg_collection=pg_collection)
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.parallel_output = True
        self.vp_stage = vp_stage
        self.model_type = ModelType.encoder_or_decoder
        self.position_embedding_type = "rope"
        self.mtp_process = False

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                position_embedding_type="rope",
                tp_group=self.pg_collection.tp,
            )
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=rotary_base,
            use_cpu_initialization=config.use_cpu_initialization,
            cp_group=self.pg_collection.cp,
        )
        self.decoder = EpasTransformerBlock(
            config=config,
            spec=block_spec,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=self.pg_collection,
            vp_stage=vp_stage,
            receives_handoff=receives_handoff,
            sends_handoff=sends_handoff,
            handoff_heads=handoff_heads,
        )
        if post_process:
            head_config = config
            fuse_head = output_layer_gradient_accumulation_fusion
            if fuse_head is not None and fuse_head != config.gradient_accumulation_fusion:
                # A per-layer setting: a shallow copy (no __post_init__ rerun) for this layer only.
                head_config = copy.copy(config)
                head_config.gradient_accumulation_fusion = fuse_head
            self.output_layer = DelayedWgradColumnParallelLinear(
                config.hidden_size,
                vocab_size,
                config=head_config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=False,
                skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
                tp_group=self.pg_collection.tp,
            )
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline schedules hand the tensor received from the previous stage in here."""
        if isinstance(input_tensor, list):
            assert len(input_tensor) == 1, "one input tensor per stage"
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        sample_ids: Optional[Tensor] = None,
    ) -> Tensor:
        """Per-token loss ``[b, s]`` when labels are given (last stage), logits ``[b, s, v/tp]``
        without labels, hidden states ``[s, b, h(+hand-off)]`` on other stages. ``sample_ids``
        (``[b]``, the samples' positions in the training stream) key Random-LTD's token draws."""
        decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids) if self.pre_process else None
        rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, self.decoder, decoder_input, self.config, None)
        rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len)
        hidden_states = self.decoder(
            hidden_states=decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, sample_ids=sample_ids
        )
        if not self.post_process:
            return hidden_states
        # [s, b, h] -> [s, b, v/tp]
        logits = self.lm_head(hidden_states)
        if labels is None:
            # [s, b, v/tp] -> [b, s, v/tp]
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def lm_head(self, hidden_states: Tensor) -> Tensor:
        """Logits ``[s, b, v/tp]`` of final-norm hidden states ``[s, b, h]`` (last stage): the one
        way to call the LM head. With tied embeddings the head owns no weight (on the first stage;
        a later last stage holds Megatron's synchronised copy) and must be handed the embedding's,
        which a bare ``output_layer(hidden)`` call does not do."""
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight)
        return logits

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        # As GPTModel: the LM head's (empty) extra state is not part of the checkpoint.
        state.pop(f"{prefix}output_layer._extra_state", None)
        return state
