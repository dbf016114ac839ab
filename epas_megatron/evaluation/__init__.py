"""Quality of a trained model at its sharing regions.

``validation_loss`` (``epas-eval``: a checkpoint rebuilt at each requested region, validation
loss and perplexity on any TP x PP x DP world) and ``lm_eval_model`` (the bridge to EleutherAI's
lm-evaluation-harness). Validation at other regions during training is the trainer's
(:mod:`epas_megatron.training.region_eval`). The region grammar they share is
:mod:`epas_megatron.sharing.regions`.

Layering: above the assembly, training components and inference (it builds models through
:mod:`epas_megatron.assembly` and runs them with the training step functions or the decode
engine); below the ``epas-eval`` command (:mod:`epas_megatron.evaluate`).
"""
