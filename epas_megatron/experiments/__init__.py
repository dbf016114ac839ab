"""Paper experiments: recipes of whole training and evaluation runs, and the reports built from
their outputs.

- :mod:`.quality`: the paper's quality claims (``epas-bench quality``): baseline vs EPAS from
  scratch, continual pretraining evaluated at every region, the last-layer ablation and
  Random-LTD, each arm an ordinary ``epas-train`` / ``epas-eval`` process;
- :mod:`.quality_report`: the report's numbers, tables and plots as pure functions of the runs'
  records.

Unlike :mod:`epas_megatron.bench`, which times one mechanism inside one process, a recipe here
drives the command-line tools as subprocesses and reads back what they wrote, so it sits on top
of the layering, beside the entry points: it imports config, sharing and checkpointing helpers
only to plan the runs and read checkpoints, never the trainer. The ``epas-bench`` command
(:mod:`epas_megatron.bench.cli`) exposes it as ``epas-bench quality``.
"""
