"""epas-megatron: EPAS (progressive QK sharing) pretraining on NVIDIA Megatron-Core."""

__version__ = "0.1.0"
