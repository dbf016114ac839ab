"""The training run: a configured run, from setup through its steps and switches to its summary.

:class:`~epas_megatron.training.trainer.Trainer` drives it; the other modules are its parts --
the trainable state for a ``BuildPlan`` (model chunks, DDP, optimizer, learning-rate schedule),
one training or evaluation step through Megatron-Core's pipeline schedules, the EPAS switch
event, optional training features (Random-LTD), the loop's bookkeeping and what the run reports
(console, metrics records, ``SUMMARY``).

Layering: the training level (config -> model/sharing -> parallel/checkpointing -> training ->
entry points): it composes everything below -- config, data, model and sharing, parallel
layouts, checkpointing, metrics -- and is used by ``epas-train`` (and by ``epas-plan`` and the
benchmarks, for its setup).
"""
