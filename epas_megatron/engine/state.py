"""A trainable model for a build plan: chunks, DDP, optimizer and learning-rate schedule.

:func:`build_training_state` is the one place that wires them; the trainer (at start and at
every switch), the benchmarks and evaluation (chunks only, ``settings=None``) call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from epas_megatron.engine.optimizer import OptimizerSettings
from epas_megatron.model.build_plan import BuildPlan


@dataclass
class TrainingState:
    """What one rank trains (or evaluates) for one build plan."""

    plan: BuildPlan
    """What was built."""

    model: list
    """This rank's model chunks: DDP-wrapped when there is an optimizer, bare otherwise."""

    optimizer: Optional[Any]
    """Megatron's optimizer over the chunks' trainable parameters (None: evaluation only)."""

    scheduler: Optional[Any]
    """Megatron's ``OptimizerParamScheduler`` (None: evaluation only)."""

    tf_config: Any
    """The chunks' ``TransformerConfig`` (the schedules' hooks get installed on it)."""

    schedule_seq_length: int
    """The ``seq_length`` to give Megatron's schedules (the p2p rows, hand-off included)."""


class StateAdoption(Protocol):
    """A build that takes its state over from tensors held elsewhere instead of allocating it
    twice (the in-memory switch: :mod:`epas_megatron.checkpointing.switch_adoption`). Called by
    :func:`build_training_state` between the steps that allocate: the chunks are built with
    their parameters on the meta device."""

    def model(self, chunks: list) -> None:
        """Give every meta parameter of the bare ``chunks`` its data (before DDP sees them)."""

    def before_optimizer(self, model: list) -> None:
        """DDP is built (its gradient buffer exists), the optimizer is not yet."""

    def optimizer(self, model: list, optimizer, scheduler) -> None:
        """Fill the new optimizer and LR schedule."""


def build_training_state(plan: BuildPlan, settings: Optional[OptimizerSettings] = None, seed: Optional[int] = None,
                         adoption: Optional[StateAdoption] = None) -> TrainingState:
    """Build the plan's chunks and, with ``settings``, wrap them in Megatron's DDP and make the
    optimizer and LR schedule. ``seed``: initialise the weights (layout- and region-independent);
    None when every weight is loaded next (a resume, a switch, evaluation): then none is drawn.
    ``adoption``: the state comes from it, step by step (no seed)."""
    from epas_megatron.engine.optimizer import build_optimizer, build_scheduler, wrap_ddp
    from epas_megatron.model.builder import build_model

    if adoption is not None and (seed is not None or settings is None):
        raise ValueError("build_training_state: an adoption fills a training state (settings, no seed)")
    built = build_model(plan, seed=seed, load_follows=seed is None, parameters_on_meta=adoption is not None)
    if adoption is not None:
        adoption.model(built.chunks)
    if settings is None:
        return TrainingState(plan, built.chunks, None, None, built.config, built.schedule_seq_length)
    if settings.precision != plan.precision:
        raise ValueError(f"optimizer precision {settings.precision!r} differs from the plan's {plan.precision!r}")
    model = wrap_ddp(built.chunks, built.config, settings)
    if adoption is not None:
        adoption.before_optimizer(model)
    optimizer = build_optimizer(model, settings, built.config)
    scheduler = build_scheduler(optimizer, settings)
    if adoption is not None:
        adoption.optimizer(model, optimizer, scheduler)
    return TrainingState(plan, model, optimizer, scheduler, built.config, built.schedule_seq_length)
