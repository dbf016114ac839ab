"""A dummy build option for the tests of the option registry (tests/model/test_build_options.py,
tests/training/test_build_option_run.py): only its module (this), its config section
(:class:`MLPScaleConfig`) and a registry line (:func:`enrolled`) -- every decoder layer's MLP
output scaled."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Optional

from epas_megatron.build_option import BuildFacts, BuildOption
from epas_megatron.config.schema import RunConfig
from epas_megatron.errors import ConfigError
from epas_megatron.model.option_registry import enrol, withdraw
from epas_megatron.runtime.wrapping import unwrap_model


@dataclass
class MLPScaleConfig:
    """A test's build option: every decoder layer's MLP output scaled."""

    test_mlp_scale: float = 1.0
    """Factor on every decoder layer's MLP output (1: off)."""


def _scaled_mlp(build_mlp, scale: float, *args, **kwargs):
    """The slot's own MLP, its output scaled (the bias, None here, passes as it is)."""
    mlp = build_mlp(*args, **kwargs)
    mlp.register_forward_hook(lambda module, inputs, output: (output[0] * scale, output[1]))
    mlp.test_mlp_scale = scale  # what the test reads back off a built model
    return mlp


@dataclass(frozen=True)
class MLPScale(BuildOption):
    name: ClassVar[str] = "test_mlp_scale_option"
    flag: ClassVar[str] = "--test-mlp-scale"
    section: ClassVar[Optional[type]] = MLPScaleConfig

    scale: float
    """The factor."""

    @classmethod
    def check_config(cls, cfg: RunConfig, facts: BuildFacts) -> list[str]:
        scale = cfg.test_mlp_scale_option.test_mlp_scale
        if not scale >= 0.0:
            raise ConfigError(f"--test-mlp-scale must be >= 0, got {scale}")
        return []

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Optional["MLPScale"]:
        scale = cfg.test_mlp_scale_option.test_mlp_scale
        return None if scale == 1.0 else cls(scale)

    def layer_spec(self, spec: Any, mode: Any, backend: str) -> Any:
        mlp = functools.partial(_scaled_mlp, spec.submodules.mlp, self.scale)
        return replace(spec, submodules=replace(spec.submodules, mlp=mlp))


@contextlib.contextmanager
def enrolled():
    """:class:`MLPScale` in the registry for the block (its line in BUILD_OPTIONS)."""
    enrol(MLPScale)
    try:
        yield MLPScale
    finally:
        withdraw(MLPScale)


def built_scales(chunk) -> list[Optional[float]]:
    """Each decoder layer's MLP scale in a built chunk (None: the option did not build it)."""
    return [getattr(layer.mlp, "test_mlp_scale", None) for layer in unwrap_model(chunk).decoder.layers]
