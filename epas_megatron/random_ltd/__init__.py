"""Random-LTD (random layerwise token dropping, Yao et al. 2022) in the Megatron-Core model:
the kept-token schedule and layer-token accounting (:mod:`.schedule`), and the per-layer token
selection with gather/scatter around the selected layers (:mod:`.tokens`)."""
