"""The training engine's components, below the run resolution and the assembly: the trainable
state for a ``BuildPlan`` (model chunks, DDP, optimizer, learning-rate schedule:
:mod:`.state`, :mod:`.optimizer`), one training or evaluation step through Megatron-Core's
schedules or the project's pipeline executor (:mod:`.step`, :mod:`.pipeline_executor`), and a
logging interval's bookkeeping (:mod:`.progress`).

Layering: above model, parallel layouts and checkpointing; below the run resolution
(:mod:`epas_megatron.validation`), the assembly and the training run
(:mod:`epas_megatron.training`), which compose these parts. Benchmarks and evaluation use them
through the assembly.
"""
