"""Pipeline stages under EPAS: where each decoder layer lives, rebalanced at every switch.

- the layout itself, :class:`~epas_megatron.model.stage_layout.StageLayout` (the layers each
  virtual pipeline stage holds, and Megatron's layout string; ``VStageLayout``: the same under V
  placement), is the model's: a ``BuildPlan`` carries it;
- :mod:`.cost_model`: per-layer costs (computing, sharing, LM head, the Q/K hand-off's p2p);
- :mod:`.partition`: the exact search for the split with the cheapest slowest rank;
- :mod:`.balancer`: the layout for a sharing region (hand-off priced, ties toward the even split),
  also under V placement;
- :mod:`.memory_budget`: the per-rank memory budget the balancer must respect;
- :mod:`.stage_layouts`: a run's layouts from its ``BuildPlan`` (FLOPs or measured costs);
- :mod:`.layer_timing`: measured layer costs (``--epas-cost-model measured``);
- :mod:`.layout_report`: the layout table printed at start, and predicted pipeline speed-ups.

Layering: the parallel/checkpointing level (config -> model/sharing -> parallel/checkpointing ->
training -> entry points): it prices layouts with the sharing package's layer modes and the
metrics package's FLOPs and memory models; the trainer asks it for a layout at start and at
every switch.
"""
