"""Benchmarks behind ``epas-bench``: what EPAS buys and costs, measured in one process.

- :mod:`.cli`: the ``epas-bench`` command (``train``, ``decode``, ``pipeline``, ``switch``,
  ``memory``, and ``quality``, whose recipe lives in :mod:`epas_megatron.experiments`);
- :mod:`.common`: a trainable model on synthetic tokens and A/B timing, shared by the benchmarks;
- :mod:`.train_bench`, :mod:`.decode_bench`, :mod:`.pipeline_bench`: training, generation and
  pipeline-parallel throughput, baseline against EPAS, as ratios measured in the same run;
- :mod:`.switch_bench` and :mod:`.switch_model`: the cost of one EPAS switch per
  ``--epas-switch-mode``, measured on the real trainer, and predicted at 7B;
- :mod:`.memory_bench`: activation bytes of computing and sharing layers, measured against the
  memory model.

Layering: the top, beside the entry points (config -> model/sharing -> parallel/checkpointing
-> training -> entry points). A benchmark builds models and training states through the same
build path as the trainer and reads the metrics and parallel cost models; no library code
imports from here.
"""
