"""Random-LTD (random layerwise token dropping, Yao et al. 2022) in the Megatron-Core model:
the kept-token schedule and layer-token accounting (:mod:`.schedule`), the per-layer token
selection with gather/scatter around the selected layers (:mod:`.tokens`), the keyed token draw
(:mod:`.keyed_draw`), the per-step kept count on built chunks (:mod:`.model`), and the training
feature that turns it on in a run (:mod:`.feature`).

Layering: a baseline beside EPAS, spread over two levels (config -> model/sharing ->
parallel/checkpointing -> training -> entry points): its schedule, token selection and draw are
model-level pieces the model's layers and block call; :mod:`.feature` plugs it into the trainer
at the training level.
"""
