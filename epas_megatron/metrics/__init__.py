"""What a run measures and how it is counted: FLOPs and MFU, memory, and where records go.

- :mod:`.flops`: the sharing-aware FLOPs model of a LLaMA decoder (a sharing layer skips its
  Q/K projections and RoPE) and MFU;
- :mod:`.memory_model`: activation, weight and optimizer memory term by term, per layer and per
  pipeline rank;
- :mod:`.activation_memory`: the same activation bytes measured on a forward pass, and live
  through a pipelined iteration (``LiveSavedBytes``);
- :mod:`.logger`: the sinks (``metrics.jsonl``, TensorBoard, wandb).

Layering: a leaf used across levels (config -> model/sharing -> parallel/checkpointing ->
training -> entry points): it imports only :mod:`epas_megatron.runtime`, and the model (FLOPs
shape), parallel (cost model, memory budget), training and bench packages count with it.
"""
