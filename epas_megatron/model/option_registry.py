"""The build options a run may turn on (:class:`~epas_megatron.build_option.BuildOption`): the one
list the resolver and the assembly read.

A new option that changes what is built is its own module (a ``BuildOption`` subclass), its
config section and its line in :data:`BUILD_OPTIONS` -- or, outside the package, one call of
:func:`enrol` before the config is parsed (its section then parses from the command line and
YAML like a built-in one). The resolver asks every option to check its flags
(:func:`check_build_options`), the assembly asks for a run's or a checkpoint's options
(:func:`build_options`), and the builder reads them off the plan.
"""

from __future__ import annotations

from typing import Optional

from epas_megatron.build_option import BuildFacts, BuildOption
from epas_megatron.config.schema import RunConfig
from epas_megatron.config.sections import enrol_section
from epas_megatron.errors import ConfigError
from epas_megatron.model.blending import SwitchRampSettings
from epas_megatron.model.moc_sizes import MoCSettings
from epas_megatron.random_ltd.option import RandomLTDSettings

BUILD_OPTIONS: list[type[BuildOption]] = [MoCSettings, RandomLTDSettings, SwitchRampSettings]
"""Every build option kind, in the order the builder applies them."""


def enrol(option: type[BuildOption]) -> None:
    """Add ``option`` to :data:`BUILD_OPTIONS` (and its own config section, if it has one, to the
    config); enrolling an option twice is a no-op."""
    if option in BUILD_OPTIONS:
        return
    if any(kind.name == option.name for kind in BUILD_OPTIONS):
        raise ValueError(f"a build option named {option.name!r} is enrolled already")
    if option.section is not None:
        enrol_section(option.name, option.section)
    BUILD_OPTIONS.append(option)


def withdraw(option: type[BuildOption]) -> None:
    """Take an enrolled ``option`` out of :data:`BUILD_OPTIONS` (its config section stays: a config
    read meanwhile keeps its values)."""
    BUILD_OPTIONS.remove(option)


def check_build_options(cfg: RunConfig, facts: BuildFacts) -> list[str]:
    """Every option checks its flags in ``cfg`` (on or off; refusals raise): their warnings."""
    return [warning for kind in BUILD_OPTIONS for warning in kind.check_config(cfg, facts)]


def check_build_options_resume(saved_cfg: RunConfig, cfg: RunConfig, iteration: int) -> None:
    """Refuse (``ConfigError`` naming the option's flag) a resume whose options would build another
    model than the checkpoint at ``iteration`` was trained with (its saved config ``saved_cfg``)."""
    for kind in BUILD_OPTIONS:
        problem = kind.check_resume(kind.from_config(saved_cfg), kind.from_config(cfg))
        if problem is not None:
            raise ConfigError(f"--load: {problem} (iteration {iteration}); resume with the same {kind.flag} "
                              "(or start from its weights with --pretrained)")


def build_options(cfg: RunConfig, training: bool = True) -> tuple[BuildOption, ...]:
    """The options ``cfg`` has on, in registry order; ``training`` False: without the
    training-only ones (a checkpoint's model built for evaluation, generation or export)."""
    found: list[Optional[BuildOption]] = [kind.from_config(cfg) for kind in BUILD_OPTIONS if training or not kind.training_only]
    return tuple(option for option in found if option is not None)
