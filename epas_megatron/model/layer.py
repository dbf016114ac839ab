"""A decoder layer that threads the EPAS hand-off from layer to layer.

Megatron-Core's ``TransformerBlock`` (and its activation-recompute path) passes a ``context``
tensor from each layer to the next: ``hidden_states, context = layer(..., context=context)``.
GPT layers have no cross-attention, so :class:`EpasTransformerLayer` uses that slot for the
QK hand-off: a source layer returns its post-RoPE (Q, K) as ``context`` (a blending one, during
a ramp into a switch, blends the incoming ``context`` in first), a sharing layer consumes the
incoming ``context`` and returns it unchanged, a plain computing layer is exactly Megatron's
``TransformerLayer`` (``context`` passes through untouched: with ``--epas-exclude-last`` the
computing layers after the region carry the hand-off on to the end of the stage, where nothing
reads it, and a stage that starts after the region receives none). Under Random-LTD a source
layer takes the whole sequence and ``kept_index``: it computes Q/K/V for every token (the
hand-off) and everything else for its kept tokens, returning ``[r, b, h]``. Because the hand-off is an
ordinary argument and return value, activation checkpointing saves it as an input and
recomputation sees the same tensor (no side channel that a later micro-batch could overwrite).
"""

from __future__ import annotations

from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.typed_torch import apply_module

from epas_megatron.model.attention import ComputingAttention, SharedAttention
from epas_megatron.random_ltd.tokens import gather_tokens
from epas_megatron.sharing.shape import LayerMode


class EpasTransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose attention may hand Q/K on (source) or take them (sharing)."""

    @property
    def epas_mode(self) -> LayerMode:
        """What this layer does with Q/K, read off its attention module."""
        attention = self.self_attention
        if isinstance(attention, SharedAttention):
            return LayerMode.SHARE
        if isinstance(attention, ComputingAttention) and attention.hand_off is not None:
            return LayerMode.SOURCE
        return LayerMode.COMPUTE

    def _forward_attention(
        self,
        hidden_states,
        attention_mask=None,
        context=None,
        context_mask=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        padding_mask=None,
        *,
        inference_params=None,
        kept_index=None,
    ):
        mode = self.epas_mode
        if kept_index is not None and mode != LayerMode.SOURCE:
            raise ValueError("kept_index is for a Random-LTD source layer; other layers get their kept tokens gathered")
        if mode == LayerMode.COMPUTE:
            return super()._forward_attention(
                hidden_states,
                attention_mask=attention_mask,
                context=context,
                context_mask=context_mask,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin,
                attention_bias=attention_bias,
                inference_context=inference_context,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                padding_mask=padding_mask,
                inference_params=inference_params,
            )
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(
                "KV-cache inference is not implemented for EPAS source/sharing layers; "
                "evaluate with full forward passes (epas-eval)"
            )
        residual = hidden_states
        if self.config.fp32_residual_connection:
            residual = residual.float()
        normed = apply_module(self.input_layernorm)(hidden_states)
        if isinstance(normed, tuple):  # norms that also return the residual
            normed, residual = normed
        if mode == LayerMode.SOURCE:
            if kept_index is not None:
                # Random-LTD source: Q/K (the hand-off) for every token, the rest for the kept
                # ones. [s, b, h] -> [r, b, h]
                residual = gather_tokens(residual, kept_index)
            attention_output, context = self.self_attention.forward_and_hand_off(
                normed,
                attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
                kept_index=kept_index,
                incoming=context,
            )
        else:
            attention_output, context = self.self_attention(
                normed,
                attention_mask,
                context,
                rotary_pos_emb=rotary_pos_emb,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        with self.bias_dropout_add_exec_handler():
            hidden_states = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                attention_output, residual, self.hidden_dropout
            )
        return hidden_states, context
