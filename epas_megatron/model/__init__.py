"""The EPAS model on Megatron-Core: what to build for a sharing region, and the modules.

- :mod:`.build_plan`: :class:`~epas_megatron.model.build_plan.BuildPlan`, everything that
  decides which modules a rank builds for one sharing region (layer modes, TP/PP/VPP, stage
  layout, kernels); the one meaning of "plan" in the project;
- :mod:`.builder`: build plan -> Megatron ``TransformerConfig`` -> this rank's model chunks;
- :mod:`.architecture`: the decoder's shape (:class:`~epas_megatron.model.architecture.LlamaArchitecture`;
  :class:`~epas_megatron.model.architecture.ModelShape`, it at a sequence length, for the FLOP and memory models);
- :mod:`.specs`, :mod:`.attention`, :mod:`.core_attention`, :mod:`.layer`, :mod:`.block`,
  :mod:`.gpt`, :mod:`.norm`: the layer specs per backend and EPAS mode, computing and sharing
  self-attention, and the layer, block and GPT model that thread the Q/K hand-off through;
- :mod:`.fusions`: which fused kernels a run can use; :mod:`.init`: layout-independent
  initialisation (the same seed gives the same model on any parallel layout).

Layering: the model/sharing level (config -> model/sharing -> parallel/checkpointing -> training
-> entry points): it builds on the sharing package (layer modes, hand-off), Random-LTD's token
hooks, the stage layout a plan carries (:class:`~epas_megatron.model.stage_layout.StageLayout`)
and the runtime; training, inference, evaluation, conversion and the benchmarks build models
only by making a ``BuildPlan`` and calling :func:`~epas_megatron.model.builder.build_model` (or
training's ``build_training_state``) with it.
"""
