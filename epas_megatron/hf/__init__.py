"""EPAS models for Hugging Face ``transformers``: what ``epas-convert hf-export --region R`` writes
(and ``hf-export`` of any Mixture-of-Channels model).

- :mod:`.configuration_epas_llama`: ``EpasLlamaConfig`` (``model_type='epas_llama'``), LLaMA plus
  the sharing region (its layers, the share kind 'qk'/'kv', the running region, probability reuse)
  and the Mixture-of-Channels Top-K (``moc_topk``, ``moc_groups``);
- :mod:`.modeling_epas_llama`: ``EpasLlamaForCausalLM``, LLaMA whose sharing layers take the
  source's post-RoPE Q/K (or K/V) along the decoder loop, in every forward (with and without a
  cache, gradient checkpointing, training), and whose MLPs keep the Top-K gate channels of a
  Mixture-of-Channels model (``EpasMoCMLP``);
- :mod:`.cache_epas`: ``EpasCache``, a ``transformers`` cache that stores K+V for computing
  layers, V for qk-sharing layers and nothing for kv-sharing layers;
- :mod:`.tokenization_epas`: ``EpasTokenizer``, the project's SentencePiece tokenizer (ids as
  ``epas_megatron.data.tokenizer`` gives them: no BOS, lossless text) for ``AutoTokenizer``;
- :mod:`.moc_topk`: ``topk_channels``, the Mixture-of-Channels Top-K with its tie rule (largest
  values, equal values to the lower channel index), written once for the export, training
  (:mod:`epas_megatron.model.moc`) and the sparse decode (:mod:`epas_megatron.inference.moc_decode`).

These five files are copied into every exported directory (``auto_map`` names the first ones,
``modeling_epas_llama`` imports ``moc_topk``), so they import only torch, transformers (and its
``huggingface_hub``) and each other: the directory loads offline with
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` where this package is not
installed. Importing this package registers the classes with ``AutoConfig``,
``AutoModelForCausalLM`` and ``AutoTokenizer`` for users who have it.

Layering: imports nothing from the project (layer 0); :mod:`epas_megatron.convert` uses it, and
:mod:`epas_megatron.model.moc` and :mod:`epas_megatron.inference.moc_decode` take
:func:`.moc_topk.topk_channels` from it (importing any module of this package imports
transformers).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from epas_megatron.hf.cache_epas import EpasCache, cache_bytes_per_token
from epas_megatron.hf.configuration_epas_llama import EpasLlamaConfig
from epas_megatron.hf.modeling_epas_llama import EpasLlamaForCausalLM, EpasLlamaModel, EpasMoCMLP
from epas_megatron.hf.tokenization_epas import EpasTokenizer

SHIPPED_FILES = ("configuration_epas_llama.py", "modeling_epas_llama.py", "cache_epas.py", "tokenization_epas.py",
                 "moc_topk.py")
"""The files an export copies next to its weights (``auto_map`` points into them)."""

SOURCE_DIR = Path(__file__).resolve().parent
"""Where :data:`SHIPPED_FILES` are."""

AUTO_MAP = {
    "AutoConfig": "configuration_epas_llama.EpasLlamaConfig",
    "AutoModelForCausalLM": "modeling_epas_llama.EpasLlamaForCausalLM",
}
"""The config's ``auto_map``: which shipped class each Auto class loads."""

TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["tokenization_epas.EpasTokenizer", None]}
"""``tokenizer_config.json``'s ``auto_map``."""

AutoConfig.register(EpasLlamaConfig.model_type, EpasLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(EpasLlamaConfig, EpasLlamaForCausalLM, exist_ok=True)
AutoTokenizer.register(EpasLlamaConfig, slow_tokenizer_class=EpasTokenizer, exist_ok=True)

__all__ = ["AUTO_MAP", "EpasCache", "EpasLlamaConfig", "EpasLlamaForCausalLM", "EpasLlamaModel", "EpasMoCMLP", "EpasTokenizer",
           "SHIPPED_FILES", "SOURCE_DIR", "TOKENIZER_AUTO_MAP", "cache_bytes_per_token"]
