"""The process runtime: what every layer above needs from the machine, and nothing about EPAS.

- :mod:`.distributed`: torch.distributed from the torchrun environment (or a world of one),
  Megatron-Core's model-parallel groups, seeding, small collectives;
- :mod:`.device`: the compute device model chunks and their inputs live on, and moving data there;
- :mod:`.accelerator`: no silent CPU fallback on a GPU node, and the supported torch range;
- :mod:`.fs`: atomic file writes and cross-process file locks;
- :mod:`.rng`: capture and restore every random-number generator's state;
- :mod:`.wrapping`: the model chunk inside its DDP / ``Float16Module`` wrappers (``unwrap_model``).

Layering: the bottom of the project, just above :mod:`epas_megatron.compat` (the CPU stand-ins
and Megatron-Core fixes that :func:`.distributed.init_distributed` installs). Every other package
-- config, model and sharing, parallel and checkpointing, metrics, training, the entry points --
may import from here; nothing here imports from them.
"""
