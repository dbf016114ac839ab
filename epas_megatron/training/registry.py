"""The training features a run may turn on: the one list the trainer reads
(:class:`~epas_megatron.training.features.TrainingFeatures`). A new feature is its own module of
hooks (a :class:`~epas_megatron.training.features.TrainingFeature`, whose ``check_config``
checks its own flags), its config section and its line here; what it changes in the built model
is a build option's (:mod:`epas_megatron.model.option_registry`)."""

from __future__ import annotations

from epas_megatron.training.features import TrainingFeature, TrainingFeatures
from epas_megatron.training.ramp import SwitchRampFeature
from epas_megatron.training.random_ltd import RandomLTDFeature
from epas_megatron.training.rewarm import SwitchRewarmFeature
from epas_megatron.validation import ResolvedRun

FEATURES: tuple[type[TrainingFeature], ...] = (RandomLTDFeature, SwitchRewarmFeature, SwitchRampFeature)
"""Every feature kind, in the order the trainer calls their hooks."""


def features_for_run(run: ResolvedRun) -> TrainingFeatures:
    """The features ``run`` has on (and every kind, for the resume checks)."""
    return TrainingFeatures.for_run(run, FEATURES)
