"""The decoder block of one pipeline stage (model chunk), with the QK hand-off threaded through.

Megatron-Core's ``TransformerBlock`` builds the stage's layers from a per-layer spec list and
owns the final norm; we keep its construction and replace its forward, because the stock forward
drops the last layer's ``context`` (our hand-off) and its recompute helper returns only hidden
states. Differences from the stock forward, all deliberate:

* the hand-off (``context``) flows layer to layer, into and out of every recompute chunk;
* when the sharing region crosses this chunk's input boundary, the tensor received from the
  previous stage is ``[hidden | hand-off]`` and is split into views (:meth:`set_input_tensor`);
  when it crosses the output boundary, the hand-off is appended to the output;
* Random-LTD (:mod:`epas_megatron.random_ltd`): in training, a Random-LTD layer runs on the kept
  tokens of each sequence only (gathered before it, scattered back after it, with RoPE at the
  kept positions); the kept positions of all of this chunk's Random-LTD layers are drawn once per
  micro-batch in one vectorised pass where the sample ids are (the host: a GPU gets them as one
  asynchronous copy, nothing waits; :func:`~epas_megatron.random_ltd.keyed_draw.kept_index`) and
  enter recompute chunks as one more tensor argument, like the hand-off. A layer
  that hands Q/K on (a source) computes Q/K for every token and the rest for its kept tokens,
  so the hand-off always covers the whole sequence and a sharing layer takes the source's Q/K
  rows at its own kept tokens;
* no FP8/FP4 contexts, CPU offloading, CUDA graphs or KV-cache inference (the trainer rejects
  those configurations with EPAS).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import make_viewless_tensor

from epas_megatron.random_ltd import tokens as ltd_tokens
from epas_megatron.random_ltd.keyed_draw import kept_index
from epas_megatron.sharing import handoff as qk_handoff
from epas_megatron.sharing.shape import LayerMode


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
        self.random_ltd_layers: frozenset = frozenset()
        """Global (0-based) ids of the Random-LTD layers (the whole model's; empty: off)."""
        self.random_ltd_seed = 0
        self.random_ltd_ops = None
        self.kept_tokens: Optional[int] = None
        """Tokens a Random-LTD layer keeps in this step (set by the trainer; None: all)."""
        self._random_ltd_rows: dict[int, int] = {}

    def configure_random_ltd(self, layers, seed: int, kernels: str = "auto") -> None:
        """Make ``layers`` (global ids) drop tokens in training, drawing with ``seed``."""
        self.random_ltd_layers = frozenset(layers)
        self.random_ltd_seed = int(seed)
        self.random_ltd_ops = ltd_tokens.token_ops(kernels)
        # local layer index -> row of the kept-index tensor, for this chunk's dropping layers
        dropping = [local for local, layer in enumerate(self.layers) if layer.layer_number - 1 in self.random_ltd_layers]
        self._random_ltd_rows = {local: row for row, local in enumerate(dropping)}

    def _kept_index(self, sample_ids, seq_length: int, device):
        """``[dropping layers, b, kept]`` positions for this micro-batch, or None (no dropping)."""
        kept = self.kept_tokens
        if not self.training or not self.random_ltd_layers or kept is None or kept >= seq_length:
            return None
        rows = self._random_ltd_rows
        if not rows:
            return None
        if sample_ids is None:
            raise RuntimeError("Random-LTD needs the micro-batch's sample ids (batch['sample_ids']) to draw kept tokens")
        layers = [self.layers[local].layer_number - 1 for local in rows]
        # Drawn where the ids are (the host, from forward_step) and copied asynchronously: no sync.
        return kept_index(sample_ids, layers, seq_length, kept, self.random_ltd_seed, device)

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

    def _run_layers(self, start, end, hidden_states, handoff, attention_mask, rotary_pos_emb, attention_bias, packed_seq_params,
                    kept_index=None):
        rows = self._random_ltd_rows if kept_index is not None else {}
        common = dict(attention_mask=attention_mask, attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        for local in range(start, end):
            layer = self.layers[local]
            if local not in rows:
                hidden_states, handoff = layer(hidden_states=hidden_states, context=handoff, rotary_pos_emb=rotary_pos_emb, **common)
                continue
            # Random-LTD: the layer sees its kept tokens only. [b, r]
            index = kept_index[rows[local]]
            mode = layer.epas_mode
            if mode == LayerMode.SOURCE:
                # Q/K for every token (the hand-off), the rest for the kept ones: [r, b, h] out.
                kept_output, handoff = layer(hidden_states=hidden_states, context=handoff, rotary_pos_emb=rotary_pos_emb,
                                             kept_index=index, **common)
                # PyTorch's scatter: DeepSpeed's ScatterTokens is only correct paired with its
                # GatherTokens (whose backward overwrites the kept rows' gradient).
                hidden_states = ltd_tokens.scatter_tokens(hidden_states, kept_output, index)
                continue
            # [s, b, h] -> [r, b, h]; hand-off [s, b, heads, hn] -> [r, b, heads, hn]
            kept_hidden = self.random_ltd_ops.gather(hidden_states, index)
            sharing = mode == LayerMode.SHARE
            layer_handoff = tuple(ltd_tokens.gather_rows(t, index) for t in handoff) if sharing else handoff
            kept_output, passed_on = layer(hidden_states=kept_hidden, context=layer_handoff,
                                           rotary_pos_emb=ltd_tokens.gather_rotary(rotary_pos_emb, index), **common)
            # [r, b, h] back into [s, b, h]; dropped tokens skip the layer.
            hidden_states = self.random_ltd_ops.scatter(hidden_states, kept_output, index)
            if not sharing:  # a computing layer passes the (whole) hand-off on untouched
                handoff = passed_on
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
        sample_ids=None,
    ):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("KV-cache inference is not supported by EpasTransformerBlock")
        handoff = None
        if not self.pre_process:
            hidden_states = self.input_tensor
            handoff = self.input_handoff
        # [s, b, h]
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        kept_index = self._kept_index(sample_ids, hidden_states.size(0), hidden_states.device)
        rng_context = (
            tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        )
        with rng_context:
            if self.config.recompute_granularity == "full" and self.training:
                for start, end, checkpointed in self._recompute_chunks():
                    # The hand-off pair enters and leaves each chunk as two tensor arguments, so
                    # the checkpoint saves them and recomputation replays the same tensors.
                    def run(hidden, first, second, mask, rope, kept, start=start, end=end):
                        shared = None if first is None else (first, second)
                        hidden, shared = self._run_layers(start, end, hidden, shared, mask, rope, attention_bias, packed_seq_params, kept)
                        return (hidden, None, None) if shared is None else (hidden, *shared)

                    first, second = handoff if handoff is not None else (None, None)
                    args = (hidden_states, first, second, attention_mask, rotary_pos_emb, kept_index)
                    if checkpointed:
                        hidden_states, first, second = tensor_parallel.checkpoint(run, self.config.distribute_saved_activations, *args)
                    else:
                        hidden_states, first, second = run(*args)
                    handoff = None if first is None else (first, second)
            else:
                hidden_states, handoff = self._run_layers(
                    0, len(self.layers), hidden_states, handoff, attention_mask, rotary_pos_emb,
                    attention_bias, packed_seq_params, kept_index,
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
