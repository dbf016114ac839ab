"""EPAS itself: which layers share Q/K when, and how the shared Q/K reach them.

EPAS (Karim et al., "EPAS: Efficient training with Progressive Activation Sharing", Canadian AI
2026) turns deep decoder layers, one interval at a time, into layers that reuse the Q/K of the
last computing layer before them.

- :mod:`.schedule`: layer modes (computing / sharing) and the progressive schedule (the paper's
  Algorithm 1 and this project's generalisations);
- :mod:`.handoff`: the source layer's post-RoPE Q/K (or K/V) travelling to the sharing layers,
  across pipeline stages included;
- :mod:`.regions`: the sharing-region grammar of ``--eval-regions``, ``epas-eval --regions`` and
  ``epas-generate --region``.

Layering: the model/sharing level, its lowest part (config -> model/sharing ->
parallel/checkpointing -> training -> entry points): pure and Megatron-free, it imports nothing
of the project but its errors; model, parallel, training, inference and evaluation build on it.
"""
