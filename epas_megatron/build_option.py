"""An option that changes what is built, as an object with hooks: :class:`BuildOption`.

Training features (:mod:`epas_megatron.training.features`) change how a run trains; a build option
changes the model itself -- which module fills a layer's slot, a ``TransformerConfig`` setting, a
property set on the built chunks. Mixture-of-Channels (:class:`~epas_megatron.model.moc_sizes.MoCSettings`)
and Random-LTD's token dropping (:class:`~epas_megatron.random_ltd.option.RandomLTDSettings`) are
build options. An option is three things:

* **its module**: a frozen dataclass subclassing :class:`BuildOption` -- its fields are the
  settings a :class:`~epas_megatron.model.build_plan.BuildPlan` carries (``plan.options``), its
  hooks what the builder asks of it;
* **its config section**: the dataclass of its flags -- a section of ``RunConfig`` in
  :mod:`epas_megatron.config.schema`, or its own (:attr:`BuildOption.section`), which the registry
  enrols so that its flags parse from the command line and YAML and are saved with a checkpoint;
* **its registry line**: :data:`epas_megatron.model.option_registry.BUILD_OPTIONS`, or
  :func:`~epas_megatron.model.option_registry.enrol` for an option outside the package.

The hooks, each a no-op here, so an option implements only what it changes:

* :meth:`BuildOption.check_config`: its own flags against the run's facts, on or off, before
  anything is built (a ``ConfigError`` naming the flag; warnings for the start-up report);
* :meth:`BuildOption.from_config`: its settings for the plan (None: off);
* :meth:`BuildOption.layer_spec`: configure a decoder layer's ``ModuleSpec``;
* :meth:`BuildOption.transformer_config`: settings of Megatron's ``TransformerConfig`` it needs;
* :meth:`BuildOption.configure_chunk`: set up a built model chunk;
* :meth:`BuildOption.check_resume`: refuse a checkpoint trained with other settings of it.

The builder reads ``plan.options`` and never names an option; the assembly asks the registry for
a run's options; the resolver asks every enrolled option to check its flags.

Layering: this module sits just above the config (it knows the ``RunConfig`` it reads) and below
every package that defines an option (Random-LTD, the model); the spec and chunk objects its
hooks receive are Megatron-Core's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from epas_megatron.config.schema import RunConfig


@dataclass(frozen=True)
class BuildFacts:
    """What an option's flags are checked against: the run's resolved shape and machine."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    backend: str = "local"
    """The decoder layers' classes: 'local' or 'transformer_engine'."""

    precision: str = "fp32"
    """'fp32', 'bf16' or 'fp16'."""

    cuda: bool = False
    """Whether the run's processes use CUDA devices."""


@dataclass(frozen=True)
class BuildOption:
    """An option's settings (its subclass's fields) and its hooks, all no-ops (module doc)."""

    name: ClassVar[str]
    """The option's name: its config section's when it has its own, and in messages."""

    flag: ClassVar[str]
    """The command-line flag that turns it on (named in messages)."""

    section: ClassVar[Optional[type]] = None
    """Its own config dataclass (one docstring per field, as every section), enrolled as the
    ``RunConfig`` section :attr:`name`; None: its flags live in a built-in section."""

    training_only: ClassVar[bool] = False
    """Built for training only: a checkpoint's model is built without it for evaluation,
    generation and export (Random-LTD drops tokens in training alone)."""

    @classmethod
    def check_config(cls, cfg: RunConfig, facts: BuildFacts) -> list[str]:
        """Check the option's flags in ``cfg`` (the resolved config), on or off: a ``ConfigError``
        naming the flag to change, or warnings (a flag without effect)."""
        return []

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Optional["BuildOption"]:
        """The option's settings in ``cfg`` (None: off); its flags passed :meth:`check_config`."""
        return None

    @classmethod
    def check_resume(cls, saved: Optional["BuildOption"], current: Optional["BuildOption"]) -> Optional[str]:
        """Why a run with ``current`` settings of this option (None: off) cannot resume a checkpoint
        trained with ``saved`` (None: off): the model would be built otherwise. None: it can."""
        if saved == current:
            return None
        def said(option: Optional[BuildOption]) -> str:
            return "off" if option is None else str(option)
        return f"{cls.flag}: the checkpoint was trained with {said(saved)}, this run has {said(current)}"

    def layer_spec(self, spec: Any, mode: Any, backend: str) -> Any:
        """The ``ModuleSpec`` of a decoder layer in ``mode`` (a
        :class:`~epas_megatron.sharing.shape.LayerMode`) with ``backend``'s classes, configured
        for this option (the spec itself when the option does not change layers)."""
        return spec

    def transformer_config(self) -> dict[str, Any]:
        """``TransformerConfig`` settings this option needs (over the builder's own)."""
        return {}

    def configure_chunk(self, model: Any) -> None:
        """Set a built model chunk (an ``EpasGPTModel``, before any wrapper) up for this option."""
