"""Training state on disk and in memory: distributed checkpoints, and the EPAS switch's exchange.

- :mod:`.checkpoint`: save, resolve and load Megatron-Core distributed checkpoints (PyTorch DCP
  underneath). Tensors are stored in model space, so a checkpoint loads into any TP/PP/VPP
  layout and any EPAS sharing region;
- :mod:`.metadata`: a checkpoint's run metadata (``run_meta.json``) as one typed object;
- :mod:`.integrity`: whether a checkpoint is whole, checked before any process group exists
  (and the ``--load-fallback`` search for an older sound one);
- :mod:`.in_memory`: the switch without the files (``--epas-switch-mode memory``): the same
  exchange a checkpoint save + load would make, by shard id, between the old and the new objects;
- :mod:`.distributed_shards`: the distributed optimizer's shards through that switch, by
  element range, never gathered;
- :mod:`.exchange`: what those two share (the held state, parameter identities, statistics,
  the point-to-point round).

Layering: the parallel/checkpointing level (config -> model/sharing -> parallel/checkpointing ->
training -> entry points). It sees model chunks only through their sharded state dicts (and
:func:`epas_megatron.runtime.wrapping.unwrap_model`), imports config and runtime, and is
called by training (saves, resumes, switches), evaluation, inference and conversion.
"""
