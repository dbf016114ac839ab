"""The decoder block of one pipeline stage (model chunk), with the QK hand-off threaded through.

Megatron-Core's ``TransformerBlock`` builds the stage's layers from a per-layer spec list and
owns the final norm; we keep its construction and replace its forward, because the stock forward
drops the last layer's ``context`` (our hand-off) and its recompute helper returns only hidden
states. Differences from the stock forward, all deliberate:

* the hand-off (``context``) flows layer to layer, into and out of every recompute chunk;
* when the sharing region crosses this chunk's input boundary, the tensor received from the
  previous stage is ``[hidden | hand-off]`` and is split into views (:meth:`set_input_tensor`);
  when it crosses the output boundary, the hand-off is appended to the output;
* no FP8/FP4 contexts, CPU offloading, CUDA graphs or KV-cache inference (the trainer rejects
  those configurations with EPAS).
"""

from __future__ import annotations

from contextlib import nullcontext

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import make_viewless_tensor

from epas_megatron.sharing import handoff as qk_handoff


class EpasTransformerBlock(TransformerBlock):
    """A ``TransformerBlock`` that carries the QK hand-off within and across stages."""

    def __init__(self, *args, receives_handoff: bool = False, sends_handoff: bool = False, handoff_heads: tuple = (0, 0), **kwargs):
        super().__init__(*args, **kwargs)
        self.receives_handoff = receives_handoff
        """The first layer of this chunk shares Q/K computed on a previous stage."""
        self.sends_handoff = sends_handoff
        """The layer after this chunk (on the next stage) shares Q/K: send them along."""
        self.handoff_heads = tuple(handoff_heads)
        """Heads (on this TP rank) of the two hand-off tensors: (np, ng) for Q/K, (ng, ng) for K/V."""
        self.p2p_rows = None
        """(hidden rows, total rows) of the p2p tensor while hand-offs cross stages, else None."""
        self.input_handoff = None

    def set_p2p_rows(self, hidden_rows: int, total_rows: int) -> None:
        """Stage outputs are ``[total_rows, b, h]`` (see :mod:`epas_megatron.sharing.handoff`)."""
        self.p2p_rows = None if total_rows == hidden_rows else (hidden_rows, total_rows)

    def set_input_tensor(self, input_tensor):
        self.input_handoff = None
        if self.p2p_rows is not None and input_tensor is not None:
            hidden_rows = self.p2p_rows[0]
            shapes = None
            if self.receives_handoff:
                seq = hidden_rows * (self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1)
                # [s, b, heads, hn] per hand-off tensor (full sequence even under SP).
                shapes = [(seq, input_tensor.size(1), heads, self.config.kv_channels) for heads in self.handoff_heads]
            input_tensor, self.input_handoff = qk_handoff.unpack_from_p2p(input_tensor, hidden_rows, shapes)
        self.input_tensor = input_tensor

    def _run_layers(self, start, end, hidden_states, handoff, attention_mask, rotary_pos_emb, attention_bias, packed_seq_params):
        for layer in self.layers[start:end]:
            hidden_states, handoff = layer(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                context=handoff,
                rotary_pos_emb=rotary_pos_emb,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        return hidden_states, handoff

    def _recompute_chunks(self):
        """(start, end, checkpointed) for full activation recompute, as Megatron-Core does."""
        n, k = len(self.layers), self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        if self.config.recompute_method == "block":
            return [(i, i + 1, i < k) for i in range(n)]
        raise ValueError(f"unknown recompute method {self.config.recompute_method!r}")

    def forward(
        self,
        hidden_states,
        attention_mask,
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
        extract_layer_indices=None,
        *,
        inference_params=None,
        dynamic_inference_decode_only=None,
    ):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("KV-cache inference is not supported by EpasTransformerBlock")
        handoff = None
        if not self.pre_process:
            hidden_states = self.input_tensor
            handoff = self.input_handoff
        # [s, b, h]
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        rng_context = (
            tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        )
        with rng_context:
            if self.config.recompute_granularity == "full" and self.training:
                for start, end, checkpointed in self._recompute_chunks():
                    # The hand-off pair enters and leaves each chunk as two tensor arguments, so
                    # the checkpoint saves them and recomputation replays the same tensors.
                    def run(hidden, first, second, mask, rope, start=start, end=end):
                        shared = None if first is None else (first, second)
                        hidden, shared = self._run_layers(start, end, hidden, shared, mask, rope, attention_bias, packed_seq_params)
                        return (hidden, None, None) if shared is None else (hidden, *shared)

                    first, second = handoff if handoff is not None else (None, None)
                    args = (hidden_states, first, second, attention_mask, rotary_pos_emb)
                    if checkpointed:
                        hidden_states, first, second = tensor_parallel.checkpoint(run, self.config.distribute_saved_activations, *args)
                    else:
                        hidden_states, first, second = run(*args)
                    handoff = None if first is None else (first, second)
            else:
                hidden_states, handoff = self._run_layers(
                    0, len(self.layers), hidden_states, handoff, attention_mask, rotary_pos_emb,
                    attention_bias, packed_seq_params,
                )

        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)

        if self.p2p_rows is not None and not self.post_process:
            if self.sends_handoff and handoff is None:
                raise RuntimeError("this stage must send the QK hand-off but produced none")
            # [s, b, h] + hand-off + padding -> [s + r, b, h]
            return qk_handoff.pack_for_p2p(hidden_states, handoff if self.sends_handoff else None, self.p2p_rows[1])

        if not self.pre_process and len(self.layers) == 0 and self.final_layernorm is None:
            hidden_states = hidden_states.clone()
        return hidden_states

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        # Layers differ (computing / sharing), so key each layer separately.
        metadata = dict(metadata or {})
        metadata["non_homogeneous_layers"] = True
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)
