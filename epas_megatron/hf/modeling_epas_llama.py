"""``EpasLlamaForCausalLM``: LLaMA with an EPAS sharing region, for ``transformers``.

Built from transformers' LLaMA blocks (``LlamaRMSNorm``, ``LlamaRotaryEmbedding``, ``LlamaMLP``,
``apply_rotary_pos_emb``, the attention-function registry); what differs is the attention of
the layers in the sharing region (:class:`~.configuration_epas_llama.EpasLlamaConfig`), and the
MLP of a Mixture-of-Channels model:

- **The hand-off runs along the decoder loop**, never through the cache: the source (the last
  computing layer before the region) returns its post-RoPE Q and *every* K up to the current
  token ('qk'; with a cache: after its cache update) or its K and V ('kv'), and the loop passes
  them to each sharing layer. So a forward with or without a cache, in training or eval mode,
  runs the same model. Under gradient checkpointing the hand-off tensors are positional
  arguments and outputs of each checkpointed layer call, so gradients reach the source through
  the sharing layers' recomputation.
- **Weights**: a layer of the exported region holds what it owns in sharing mode under the
  usual names (``v_proj`` for 'qk', ``q_proj`` for 'kv'; ``o_proj``, norms, MLP) and its other
  projections under ``frozen_q_proj`` / ``frozen_k_proj`` ('qk') or ``frozen_k_proj`` /
  ``frozen_v_proj`` ('kv'), with ``requires_grad=False``: never run while the layer shares, run
  when a smaller ``epas_region`` makes it compute again (call ``requires_grad_(True)`` on them to
  fine-tune at such a region).
- **RoPE positions** come from ``position_ids`` (``generate`` derives them from the attention
  mask, so left padding starts each row at 0); sharing layers with 'qk' use the source's
  rotated Q and K as they are, 'kv' layers rotate their own Q at the same positions.
- **Cache**: :class:`~.cache_epas.EpasCache` (K+V for computing layers, V for qk-sharing layers,
  nothing for kv-sharing layers); ``generate`` gets one instead of its default ``DynamicCache``.
  Caches that would store K for every layer (``DynamicCache``, static, quantized) are refused
  while layers share (region 0 runs with any).
- **Probability reuse** (``epas_reuse_probs``, 'qk'): the source computes its attention
  probabilities explicitly and hands them on; each sharing layer applies them to its own V --
  the same numbers as recomputing ``softmax(Q Kᵀ + mask)``, as Q, K and the mask are the same.
- **Mixture-of-Channels** (Wu et al., arXiv 2511.09323; ``moc_topk < 1``): every layer's MLP is
  :class:`EpasMoCMLP`, LLaMA's SwiGLU that keeps per token the Top-K gate channels within each
  of ``moc_groups`` groups -- the model it was trained as (a dense ``LlamaMLP`` on the same
  weights is another model). ``moc_topk`` 1.0 (and configurations without it): ``LlamaMLP``.
  The channels are chosen by :func:`~.moc_topk.topk_channels` (largest values, ties to the lower
  channel index), the function training and the sparse decode call: the export keeps training's
  channels exactly, ties included.

This file ships inside every exported model directory: it imports only torch, transformers and
its sibling files.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
    repeat_kv,
    rotate_half,
)
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_epas import EpasCache, layer_cache_kinds
from .configuration_epas_llama import EpasLlamaConfig
from .moc_topk import topk_channels

OWN_PART = {"qk": "v", "kv": "q"}
"""The projection a sharing layer computes itself, per share kind (the other two are frozen)."""


def attention_probabilities(query: torch.Tensor, key: torch.Tensor, mask, scaling: float) -> torch.Tensor:
    """``softmax(Q Kᵀ · scaling + mask)`` in fp32, cast to Q's dtype: [b, np, q, T].

    ``query`` [b, np, q, hn], ``key`` [b, ng, T, hn]; ``mask``: None (causal, the queries being
    the last ``q`` of ``T`` positions), boolean (True: attend; sdpa's form) or additive (eager's).
    Masked scores take the dtype's minimum, as eager attention does: a row with nothing to
    attend (a left-padding position) stays finite."""
    scores = torch.matmul(query, repeat_kv(key, query.shape[1] // key.shape[1]).transpose(2, 3)) * scaling
    lowest = torch.finfo(scores.dtype).min
    if mask is None:
        q_len, t_len = scores.shape[-2:]
        future = torch.ones(q_len, t_len, dtype=torch.bool, device=scores.device).triu(t_len - q_len + 1)
        scores = scores.masked_fill(future, lowest)
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[..., : scores.shape[-1]], lowest)
    else:
        scores = scores + mask[..., : scores.shape[-1]]
    return nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)


class EpasLlamaAttention(nn.Module):
    """LLaMA attention that can run in sharing mode (see the module notes)."""

    def __init__(self, config: EpasLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        rows = {"q": config.num_attention_heads * self.head_dim, "k": config.num_key_value_heads * self.head_dim,
                "v": config.num_key_value_heads * self.head_dim}
        exported_sharing = layer_idx in config.epas_sharing_layers
        for part in "qkv":
            linear = nn.Linear(config.hidden_size, rows[part], bias=config.attention_bias)
            if exported_sharing and part != OWN_PART[config.epas_share]:
                linear.requires_grad_(False)
                setattr(self, f"frozen_{part}_proj", linear)
            else:
                setattr(self, f"{part}_proj", linear)
        self.o_proj = nn.Linear(rows["q"], config.hidden_size, bias=config.attention_bias)

    def projection(self, part: str) -> nn.Linear:
        """The layer's ``q``/``k``/``v`` projection, trained (``{part}_proj``) or frozen."""
        return getattr(self, f"{part}_proj", None) or getattr(self, f"frozen_{part}_proj")

    def forward(self, hidden_states, shared_a=None, shared_b=None, shared_probs=None, *, position_embeddings,
                attention_mask=None, cache: Cache | None = None, sharing: bool = False, hand_on: bool = False, **kwargs):
        """Returns (output [b, s, h], attention probabilities or None, hand-off (a, b, probs) or
        None). ``shared_a, shared_b``: the source's (Q, K) for 'qk', (K, V) for 'kv'
        ([b, heads, s or T, hn], post-RoPE, every cached position for K and V);
        ``shared_probs``: the source's probabilities (probability reuse); ``sharing``: run in
        sharing mode; ``hand_on``: this layer is the source of the region."""
        share = self.config.epas_share
        b, s = hidden_states.shape[:2]
        shape = (b, s, -1, self.head_dim)
        cos, sin = position_embeddings
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        dropout = 0.0 if not self.training else self.attention_dropout
        handoff = probs = None

        if not sharing:
            # [b, s, h] -> [b, heads, s, hn]
            query = self.projection("q")(hidden_states).view(shape).transpose(1, 2)
            key = self.projection("k")(hidden_states).view(shape).transpose(1, 2)
            value = self.projection("v")(hidden_states).view(shape).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)  # [b, ng, T, hn]
            if hand_on and self.config.epas_reuse_probs:
                probs = attention_probabilities(query, key, attention_mask, self.scaling)  # [b, np, s, T]
                output = self._apply(probs, value)
            else:
                output, probs = interface(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
                                          **kwargs)
            if hand_on:
                handoff = ((query, key) if share == "qk" else (key, value)) + (probs if self.config.epas_reuse_probs else None,)
        elif share == "qk":
            query, key = shared_a, shared_b
            value = self.projection("v")(hidden_states).view(shape).transpose(1, 2)  # [b, ng, s, hn]
            if cache is not None:
                value = cache.update_values(value, self.layer_idx)  # [b, ng, T, hn]
            if shared_probs is not None:
                probs = shared_probs
                output = self._apply(probs, value)
            else:
                output, probs = interface(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
                                          **kwargs)
        else:
            query = self.projection("q")(hidden_states).view(shape).transpose(1, 2)  # [b, np, s, hn]
            query = query * cos.unsqueeze(1) + rotate_half(query) * sin.unsqueeze(1)
            key, value = shared_a, shared_b
            output, probs = interface(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
                                      **kwargs)
        output = self.o_proj(output.reshape(b, s, -1).contiguous())
        return output, probs, handoff

    def _apply(self, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``P · V``: probs [b, np, s, T], value [b, ng, T, hn] -> [b, s, np, hn]."""
        return torch.matmul(probs, repeat_kv(value, self.num_key_value_groups)).transpose(1, 2)


class EpasMoCMLP(nn.Module):
    """LLaMA's SwiGLU MLP with Mixture-of-Channels activations: with ``G = gate_proj(x)`` and
    ``U = up_proj(x)``, per token and within each of ``moc_groups`` equal runs of channels the
    mask ``M`` keeps the ``moc_kept_channels`` largest values of ``G`` (values, not magnitudes;
    equal values: the lower channel index first -- :func:`~.moc_topk.topk_channels`, training's
    rule); ``down_proj(act(G) * U * M)``. The mask is a constant for autograd (as in training).
    Same parameter names as ``LlamaMLP``."""

    def __init__(self, config: EpasLlamaConfig):
        super().__init__()
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self.groups = config.moc_groups
        self.kept = config.moc_kept_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)  # [b, s, f] each
        grouped = gate.unflatten(-1, (self.groups, -1))  # [b, s, f] -> [b, s, groups, f / groups]
        index = topk_channels(grouped, self.kept)  # [b, s, groups, k]
        mask = torch.zeros_like(grouped).scatter_(-1, index, 1.0).flatten(-2)  # [b, s, f], no gradient
        return self.down_proj(self.act_fn(gate) * up * mask)


class EpasLlamaDecoderLayer(GradientCheckpointingLayer):
    """A LLaMA decoder layer whose attention may share (the hand-off is positional, see the module notes)."""

    def __init__(self, config: EpasLlamaConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = EpasLlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = EpasMoCMLP(config) if config.moc_topk < 1.0 else LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, shared_a=None, shared_b=None, shared_probs=None, *, attention_mask=None,
                position_ids=None, cache: Cache | None = None, use_cache: bool | None = False, position_embeddings=None,
                sharing: bool = False, hand_on: bool = False, **kwargs):
        """Returns (hidden states [b, s, h], hand-off a, b, probs -- None unless ``hand_on``)."""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, handoff = self.self_attn(hidden_states, shared_a, shared_b, shared_probs,
                                                   position_embeddings=position_embeddings, attention_mask=attention_mask,
                                                   cache=cache, sharing=sharing, hand_on=hand_on, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states, *(handoff or (None, None, None)))


class EpasLlamaPreTrainedModel(PreTrainedModel):
    config_class = EpasLlamaConfig
    config: EpasLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EpasLlamaDecoderLayer"]
    _supports_flash_attn = False  # probability reuse and the sdpa/eager mask forms only
    _supports_sdpa = True
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    _supports_attention_backend = False
    _can_record_outputs = {"hidden_states": EpasLlamaDecoderLayer}

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, then the ``frozen_*_proj`` weights frozen again
        (loading replaces every parameter with a trainable one)."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model.freeze_frozen_projections()
        return loaded

    def freeze_frozen_projections(self) -> None:
        """``requires_grad=False`` on every ``frozen_*_proj`` parameter (not trained in sharing mode)."""
        for name, parameter in self.named_parameters():
            if ".frozen_" in name:
                parameter.requires_grad_(False)


class EpasLlamaModel(EpasLlamaPreTrainedModel):
    """The decoder stack; passes the source's hand-off to the sharing layers."""

    def __init__(self, config: EpasLlamaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([EpasLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, use_cache: bool | None = None, **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        active = set(self.config.epas_active_layers)
        if use_cache and cache is None:
            cache = EpasCache(self.config)
        if cache is not None and active and not isinstance(cache, EpasCache):
            raise TypeError(f"an EPAS model running sharing layers {sorted(active)} needs an EpasCache "
                            f"(it stores only what each layer owns), got {type(cache).__name__}")
        if isinstance(cache, EpasCache) and cache.kinds != layer_cache_kinds(self.config):
            raise ValueError("this EpasCache was built for another epas_region; start a new cache")
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                  cache=cache, position_ids=position_ids)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        handoff = (None, None, None)
        for index, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            sharing = index in active
            hand_on = not sharing and index + 1 in active  # the source
            # The hand-off is positional: a checkpointed call takes it as an input (see the module notes).
            hidden_states, *handed = layer(hidden_states, *(handoff if sharing else (None, None, None)),
                                           attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=use_cache,
                                           position_embeddings=position_embeddings, sharing=sharing, hand_on=hand_on,
                                           **kwargs)
            if hand_on:
                handoff = tuple(handed)
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class EpasLlamaForCausalLM(EpasLlamaPreTrainedModel, GenerationMixin):
    """LLaMA with an EPAS sharing region and an LM head (``generate`` uses :class:`~.cache_epas.EpasCache`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: EpasLlamaConfig):
        super().__init__(config)
        self.model = EpasLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def set_epas_region(self, region: int) -> None:
        """Run with ``region`` sharing layers from now on (0 .. the exported region)."""
        if not 0 <= int(region) <= len(self.config.epas_sharing_layers):
            raise ValueError(f"epas_region must be between 0 and {len(self.config.epas_sharing_layers)}, got {region}")
        self.config.epas_region = int(region)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if type(model_kwargs.get("cache")) is DynamicCache:  # generate's default: one that stores what layers own
            model_kwargs["cache"] = EpasCache(self.config)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None, inputs_embeds=None,
                labels=None, use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
                                        attentions=outputs.attentions)
        return output.to_tuple() if return_dict is False else output


__all__ = ["EpasLlamaForCausalLM", "EpasLlamaModel", "EpasLlamaPreTrainedModel", "EpasMoCMLP", "attention_probabilities"]
