"""Hugging Face ``LlamaForCausalLM`` <-> epas-megatron parameter mapping (full, unsharded tensors).

Both directions work on plain state dicts of a whole model (TP=1, PP=1). Megatron-Core's RoPE
(``rotary_interleaved=False``) rotates half-dimensions like Hugging Face's LLaMA, so Q/K rows need
no permutation; the fused QKV holds, per KV group, that group's query heads, then its key and its
value head; SwiGLU's ``linear_fc1`` is ``[gate; up]``. The vocabulary is padded on the Megatron
side (multiple of 128) and cut back on export. A model with a sharing region exports like the
plain model: the frozen Q/K rows and the trained V (or Q) rows are fused back, so the exported
model runs with region 0 (plain LLaMA) and can be re-imported with any region.

The EPAS export (``hf-export --region R``, :mod:`epas_megatron.hf`) names the same tensors, except
that a layer of its sharing region keeps only what it owns under the usual names (``v_proj``
for share 'qk', ``q_proj`` for 'kv') and the frozen rows as ``frozen_{q,k}_proj`` ('qk') or
``frozen_{k,v}_proj`` ('kv'): :func:`to_epas_hf` and :func:`from_epas_hf` rename between the two.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.attention import fuse_qkv_rows, split_qkv_rows

_OWN_FROZEN = {"linear_v": ("v", ("q", "k")), "linear_q": ("q", ("k", "v"))}


def fused_layer_qkv(state: dict, prefix: str, arch: LlamaArchitecture) -> torch.Tensor:
    """A layer's fused QKV weight, from a computing layer or rebuilt from a sharing layer."""
    key = f"{prefix}self_attention.linear_qkv.weight"
    if key in state:
        return state[key]
    qpg = arch.num_attention_heads // arch.num_query_groups
    for own_name, (own, frozen) in _OWN_FROZEN.items():
        own_key = f"{prefix}self_attention.{own_name}.weight"
        if own_key in state:
            frozen_key = f"{prefix}self_attention.linear_{''.join(frozen)}.weight"
            parts = split_qkv_rows(state[frozen_key], frozen, arch.num_query_groups, qpg, arch.head_dim)
            parts[own] = state[own_key]
            return fuse_qkv_rows(parts, ("q", "k", "v"), arch.num_query_groups, qpg, arch.head_dim)
    raise KeyError(f"no attention weights for {prefix}")


def megatron_to_hf(state: dict, arch: LlamaArchitecture, vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """epas-megatron state dict (any region) of ``arch`` -> ``LlamaForCausalLM`` state dict with
    the first ``vocab_size`` rows of the embedding and the LM head: the true vocabulary, which the
    padded one of the architecture (the default) extends."""
    vocab_size = arch.vocab_size if vocab_size is None else vocab_size
    qpg = arch.num_attention_heads // arch.num_query_groups
    hf = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab_size],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    head = state.get("output_layer.weight", state["embedding.word_embeddings.weight"])
    hf["lm_head.weight"] = head[:vocab_size]
    for i in range(arch.num_layers):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        parts = split_qkv_rows(fused_layer_qkv(state, p, arch), ("q", "k", "v"), arch.num_query_groups, qpg, arch.head_dim)
        gate, up = state[f"{p}mlp.linear_fc1.weight"].chunk(2, dim=0)
        hf.update({
            f"{h}self_attn.q_proj.weight": parts["q"],
            f"{h}self_attn.k_proj.weight": parts["k"],
            f"{h}self_attn.v_proj.weight": parts["v"],
            f"{h}self_attn.o_proj.weight": state[f"{p}self_attention.linear_proj.weight"],
            f"{h}mlp.gate_proj.weight": gate,
            f"{h}mlp.up_proj.weight": up,
            f"{h}mlp.down_proj.weight": state[f"{p}mlp.linear_fc2.weight"],
            f"{h}input_layernorm.weight": state[f"{p}input_layernorm.weight"],
            f"{h}post_attention_layernorm.weight": state[f"{p}pre_mlp_layernorm.weight"],
        })
    return {k: v.detach().clone().contiguous() for k, v in hf.items()}


def hf_to_megatron(hf: dict, arch: LlamaArchitecture) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` state dict -> epas-megatron state dict of the plain model of ``arch``
    (region 0; it loads into any region, see ``SharedAttention._load_from_state_dict``), the
    embedding and the LM head padded with zero rows to the architecture's vocabulary."""
    qpg = arch.num_attention_heads // arch.num_query_groups

    def pad_vocab(t: torch.Tensor) -> torch.Tensor:
        padded = t.new_zeros((arch.vocab_size, t.shape[1]))
        padded[: t.shape[0]] = t
        return padded

    out = {
        "embedding.word_embeddings.weight": pad_vocab(hf["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": pad_vocab(hf.get("lm_head.weight", hf["model.embed_tokens.weight"])),
    }
    for i in range(arch.num_layers):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        parts = {x: hf[f"{h}self_attn.{x}_proj.weight"] for x in "qkv"}
        out.update({
            f"{p}self_attention.linear_qkv.weight": fuse_qkv_rows(parts, ("q", "k", "v"), arch.num_query_groups, qpg, arch.head_dim),
            f"{p}self_attention.linear_proj.weight": hf[f"{h}self_attn.o_proj.weight"],
            f"{p}mlp.linear_fc1.weight": torch.cat((hf[f"{h}mlp.gate_proj.weight"], hf[f"{h}mlp.up_proj.weight"])),
            f"{p}mlp.linear_fc2.weight": hf[f"{h}mlp.down_proj.weight"],
            f"{p}input_layernorm.weight": hf[f"{h}input_layernorm.weight"],
            f"{p}pre_mlp_layernorm.weight": hf[f"{h}post_attention_layernorm.weight"],
        })
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def frozen_parts(share: str) -> tuple[str, str]:
    """The projections a sharing layer keeps frozen: ('q', 'k') for share 'qk', ('k', 'v') for 'kv'."""
    return _OWN_FROZEN["linear_v" if share == "qk" else "linear_q"][1]


def to_epas_hf(hf: dict, sharing_layers, share: str) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` state dict -> ``EpasLlamaForCausalLM``'s for ``sharing_layers``: the
    frozen projections of those layers renamed ``frozen_*_proj``."""
    out = dict(hf)
    for i in sharing_layers:
        for part in frozen_parts(share):
            out[f"model.layers.{i}.self_attn.frozen_{part}_proj.weight"] = out.pop(f"model.layers.{i}.self_attn.{part}_proj.weight")
    return out


def from_epas_hf(state: dict) -> dict[str, torch.Tensor]:
    """``EpasLlamaForCausalLM`` state dict -> ``LlamaForCausalLM``'s (every layer's full q/k/v)."""
    return {re.sub(r"\.frozen_([qkv])_proj\.", r".\1_proj.", key): value for key, value in state.items()}


def hf_config_kwargs(arch: LlamaArchitecture, vocab_size: Optional[int] = None) -> dict:
    """``LlamaConfig`` keyword arguments for ``arch`` with a vocabulary of ``vocab_size`` (the
    true one of an export, :func:`megatron_to_hf`; default: the architecture's, padded)."""
    return dict(
        vocab_size=arch.vocab_size if vocab_size is None else vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups,
        max_position_embeddings=arch.max_sequence_length,
        rms_norm_eps=arch.norm_epsilon,
        rope_theta=float(arch.rotary_base),
        tie_word_embeddings=arch.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )


def strip_extra_state(state: dict) -> dict:
    """Drop Transformer Engine / Megatron ``_extra_state`` entries of a plain state dict."""
    return {k: v for k, v in state.items() if not re.search(r"_extra_state$", k)}
