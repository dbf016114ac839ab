"""Random-LTD's token dropping as a build option (:class:`~epas_megatron.build_option.BuildOption`):
which layers drop tokens in training, and how the model is built for it. How many tokens they keep
is set per step on the built chunks (:func:`.model.set_kept_tokens`, by the training feature
:mod:`epas_megatron.training.random_ltd`, which also checks the ``--random-ltd-*`` flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from epas_megatron.build_option import BuildOption
from epas_megatron.config.schema import RunConfig
from epas_megatron.random_ltd.schedule import layer_ids


@dataclass(frozen=True)
class RandomLTDSettings(BuildOption):
    """Which layers drop tokens in training, and how their tokens are drawn and moved."""

    name: ClassVar[str] = "random_ltd"
    flag: ClassVar[str] = "--random-ltd"
    training_only: ClassVar[bool] = True

    layers: tuple[int, ...]
    """Global (0-based) ids of the Random-LTD layers."""

    seed: int = 0
    """Keys the kept-token draws (with each sample's stream position and the layer)."""

    kernels: str = "auto"
    """Gather/scatter: 'torch', 'deepspeed' (DeepSpeed's CUDA kernels) or 'auto'."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Optional["RandomLTDSettings"]:
        r = cfg.random_ltd
        if not r.random_ltd:
            return None
        return cls(layer_ids(cfg.model.num_layers, r.random_ltd_layers), seed=cfg.training.seed, kernels=r.random_ltd_kernels)

    @classmethod
    def check_resume(cls, saved: Optional["RandomLTDSettings"], current: Optional["RandomLTDSettings"]) -> Optional[str]:
        # The training feature checks the whole --random-ltd-* schedule on resume (its layers
        # included); the draw's seed and kernels may change with it.
        return None

    def transformer_config(self) -> dict[str, Any]:
        # Kept tokens rotate by per-sequence positions ([r, b, 1, d]); the fused RoPE kernel
        # takes one [s, 1, 1, d] table for the whole batch.
        return {"apply_rope_fusion": False}

    def configure_chunk(self, model: Any) -> None:
        model.decoder.configure_random_ltd(self.layers, self.seed, self.kernels)
