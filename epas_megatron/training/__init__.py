"""The training run: a configured run, from setup through its steps and switches to its summary.

:class:`~epas_megatron.training.trainer.Trainer` drives it; the other modules are its parts --
the EPAS switch event, the training features (Random-LTD, the LR re-warm and the blended switch:
each with its hooks), validation at other regions in memory, checkpoint saving, the data the run
reads and what it reports (console, metrics records, ``SUMMARY``). The trainable state, one step
and the pipeline executor are the engine's (:mod:`epas_megatron.engine`).

Layering: the training level (config -> model/sharing -> parallel/checkpointing -> training ->
entry points): it composes everything below -- config, data, model and sharing, parallel
layouts, checkpointing, metrics -- and is used by ``epas-train`` (and by ``epas-plan`` and the
benchmarks, for its setup).
"""
