"""Generation with an EPAS model at any sharing region.

- :mod:`.kv_cache`: a preallocated KV cache that stores only what each layer mode owns (a
  sharing layer keeps no keys of its own);
- :mod:`.attention`: attention over the cache, split in two halves so a sharing layer can skip
  the first;
- :mod:`.engine`: prefill and incremental decode over the built model chunks;
- :mod:`.decode_step`: a fixed-shape decode step, captured once as a CUDA graph;
- :mod:`.moc_decode`: Mixture-of-Channels decode steps that read only the kept rows of ``W_down``;
- :mod:`.sampling`: greedy, temperature, top-k and top-p;
- :mod:`.generator`: :class:`~epas_megatron.inference.generator.Generator`, the Python API
  behind ``epas-generate`` (from a checkpoint, at a chosen region);
- :mod:`.decode_cost`: the bytes one decode step reads, baseline against EPAS.

Layering: beside training (config -> model/sharing -> parallel/checkpointing -> training ->
entry points): it runs the model package's chunks with the sharing package's layer modes and
loads checkpoints through :mod:`epas_megatron.assembly`; ``epas-generate``, ``epas-eval`` and
``epas-bench decode`` use it.
"""
