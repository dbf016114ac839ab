"""Checkpoint conversion between Hugging Face LLaMA and epas-megatron (``epas-convert``).

- :mod:`.hf_llama`: the parameter mapping, ``LlamaForCausalLM`` <-> epas-megatron (full,
  unsharded tensors, pure functions);
- :mod:`.cli`: the ``epas-convert hf-import`` / ``hf-export`` command around it.

Layering: an entry point (config -> model/sharing -> parallel/checkpointing -> training ->
entry points): it builds a model through :mod:`epas_megatron.assembly` and reads and writes
distributed checkpoints through :mod:`epas_megatron.checkpointing`; nothing imports it.
"""
