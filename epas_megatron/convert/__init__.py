"""Checkpoint conversion: Hugging Face LLaMA <-> epas-megatron."""
