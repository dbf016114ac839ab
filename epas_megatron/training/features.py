"""Optional training features as objects with hooks: what the trainer asks of a feature that changes
how a run trains (Random-LTD, :class:`epas_megatron.training.random_ltd.RandomLTDFeature`; the LR re-warm
after EPAS switches, :class:`epas_megatron.training.rewarm.SwitchRewarmFeature`).

The trainer never branches on a feature. It holds a :class:`TrainingFeatures` -- every feature
*kind* it knows, and the enabled instances of them (none without the feature's flag) -- and calls
each hook at its point of the run: checking the feature's own flags (every kind, on or off,
before anything is built), checking a resume, the start-up banner,
before every step, the LR schedule, the FLOPs of an iteration, the metrics records and the
checkpoint's metadata. A :class:`TrainingFeature` has no-op defaults, so a feature implements only
the hooks it needs.

How the hooks combine over several enabled features:

* a feature checks its own flags and how they combine with the rest of the run
  (:meth:`~TrainingFeature.check_config`: a :class:`ConfigError` naming the flag, or warnings for
  the start-up report); the resolver (:mod:`epas_megatron.validation`) checks only what every run
  has;
* records (:meth:`~TrainingFeature.record`) are merged; two
  features supplying the same key is an error;
* a single value the trainer needs (:meth:`~TrainingFeature.lr_increment`,
  :meth:`~TrainingFeature.lr_schedule_units`, :meth:`~TrainingFeature.lr_factor`,
  :meth:`~TrainingFeature.flop_tokens`) is supplied by
  at most one feature -- a feature that does not supply it returns None -- and the default of a
  plain run applies when none does; two suppliers are an error, since the trainer could not tell
  how their values should compose;
* the checkpoint metadata holds one record per enabled feature, under its name, written by its
  :meth:`~TrainingFeature.state_dict` and read back by :meth:`~TrainingFeature.saved_state`
  (nothing in :mod:`epas_megatron.checkpointing` knows a feature's keys); a feature without a
  record was off, and a resume with a feature switched off is refused as one with other
  settings is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, Sequence

from epas_megatron.checkpointing.metadata import CheckpointMeta
from epas_megatron.errors import ConfigError
from epas_megatron.validation import ResolvedRun


class TrainingFeature:
    """A feature's hooks, all no-ops: a plain run trains as if it were absent."""

    name: ClassVar[str]
    """Key of its checkpoint-metadata entry and of its record in the run's summary."""

    flag: ClassVar[str]
    """The command-line switch that turns it on (named in messages)."""

    resume_flags: ClassVar[str] = ""
    """What a resume must repeat, in the refusal of a checkpoint trained with the feature by a
    run without it ("" : the ``flag`` and its ``-*`` flags)."""

    @classmethod
    def check_config(cls, run: ResolvedRun) -> list[str]:
        """Check the feature's own flags in ``run``, on or off, before anything is built or read:
        a :class:`ConfigError` naming the flag to change, or warnings for the start-up report (a
        flag without effect)."""
        return []

    @classmethod
    def from_run(cls, run: ResolvedRun) -> Optional["TrainingFeature"]:
        """The feature of a run (None: the run has it off); its flags passed :meth:`check_config`."""
        return None

    @classmethod
    def saved_state(cls, meta: CheckpointMeta) -> Optional[dict]:
        """Its record in a checkpoint's metadata, written by :meth:`state_dict` (None: trained
        without it)."""
        return meta.features.get(cls.name)

    def check_resume(self, saved: Optional[dict], iteration: int) -> None:
        """Refuse (:class:`ConfigError`) a checkpoint whose entry ``saved`` (None: trained without
        the feature) this run's settings would not continue at ``iteration``."""

    def describe(self, train_iters: int) -> Optional[str]:
        """A line for the start-up banner (None: nothing to say)."""
        return None

    def before_step(self, model: Sequence, step: int) -> None:
        """Prepare the built model chunks for the step at ``step`` (completed iterations so far)."""

    def lr_increment(self, step: int) -> Optional[int]:
        """How far the LR schedule advances at ``step`` (None: not this feature's to say)."""
        return None

    def lr_schedule_units(self, warmup_iters: int, train_iters: int) -> Optional[tuple[int, int]]:
        """(warm-up, decay) lengths of the LR schedule in the units of :meth:`lr_increment`
        (None: iterations)."""
        return None

    def lr_factor(self, iteration: int) -> Optional[float]:
        """A factor on the LR schedule's learning rate for the step of ``iteration`` (1-based),
        every parameter group (None: not this feature's to say)."""
        return None

    def flop_tokens(self, iteration: int) -> Optional[list[int]]:
        """Tokens each decoder layer processes per sequence at ``iteration`` (1-based), for the
        FLOPs model (None: the whole sequence everywhere)."""
        return None

    def record(self, iteration: int) -> dict[str, Any]:
        """Its metrics after ``iteration`` completed iterations (interval records and summary)."""
        return {}

    def state_dict(self, iteration: int) -> Optional[dict]:
        """Its checkpoint-metadata entry after ``iteration`` completed iterations."""
        return None


def _single(values: Sequence[tuple[TrainingFeature, Any]], hook: str) -> Any:
    """The one supplied (non-None) value of a hook, None when no feature supplies it."""
    supplied = [(feature, value) for feature, value in values if value is not None]
    if len(supplied) > 1:
        raise ValueError(f"{hook}: supplied by more than one feature ({', '.join(f.name for f, _ in supplied)})")
    return supplied[0][1] if supplied else None


def _merged(values: Sequence[tuple[TrainingFeature, dict]], hook: str) -> dict:
    merged: dict = {}
    for feature, record in values:
        clash = sorted(set(merged) & set(record))
        if clash:
            raise ValueError(f"{hook}: {feature.name} supplies {clash}, which another feature supplies too")
        merged.update(record)
    return merged


@dataclass(frozen=True)
class TrainingFeatures:
    """The features the trainer knows, and those a run has on; every hook fanned out (see module doc)."""

    kinds: tuple[type[TrainingFeature], ...]
    """Every feature kind (on or off): each has an entry in the checkpoint metadata."""

    enabled: tuple[TrainingFeature, ...] = ()
    """The features this run has on, in the order of ``kinds``."""

    warnings: tuple[str, ...] = ()
    """What the kinds' :meth:`~TrainingFeature.check_config` had to say about the run's flags."""

    @classmethod
    def for_run(cls, run: ResolvedRun, kinds: Sequence[type[TrainingFeature]]) -> "TrainingFeatures":
        """Every kind's flags checked (refusals raise), then the enabled features of ``run``."""
        warnings = tuple(warning for kind in kinds for warning in kind.check_config(run))
        features = (kind.from_run(run) for kind in kinds)
        return cls(tuple(kinds), tuple(feature for feature in features if feature is not None), warnings)

    def __iter__(self) -> Iterator[TrainingFeature]:
        return iter(self.enabled)

    def __len__(self) -> int:
        return len(self.enabled)

    def _enabled(self, kind: type[TrainingFeature]) -> Optional[TrainingFeature]:
        return next((feature for feature in self.enabled if type(feature) is kind), None)

    def check_resume(self, meta: CheckpointMeta) -> None:
        """Every kind checks the checkpoint's entry; one the run has off refuses a checkpoint trained with it."""
        for kind in self.kinds:
            feature, saved = self._enabled(kind), kind.saved_state(meta)
            if feature is not None:
                feature.check_resume(saved, meta.iteration)
            elif saved is not None:
                same = kind.resume_flags or f"{kind.flag}-* flags"
                raise ConfigError(f"--load: the checkpoint at iteration {meta.iteration} was trained with {kind.flag}; resume "
                                  f"with the same {same} (or start from its weights with --pretrained)")

    def describe(self, train_iters: int) -> list[str]:
        return [line for line in (f.describe(train_iters) for f in self) if line is not None]

    def before_step(self, model: Sequence, step: int) -> None:
        for feature in self:
            feature.before_step(model, step)

    def lr_increment(self, step: int) -> int:
        """The LR schedule's advance at ``step``: one iteration unless a feature supplies it."""
        value = _single([(f, f.lr_increment(step)) for f in self], "lr_increment")
        return 1 if value is None else value

    def lr_factor(self, iteration: int) -> Optional[float]:
        """The factor on the scheduler's LR for the step of ``iteration``; None when no feature
        supplies one (the scheduler's LR is then left alone, not multiplied by 1)."""
        return _single([(f, f.lr_factor(iteration)) for f in self], "lr_factor")

    def lr_schedule_units(self, warmup_iters: int, train_iters: int) -> Optional[tuple[int, int]]:
        return _single([(f, f.lr_schedule_units(warmup_iters, train_iters)) for f in self], "lr_schedule_units")

    def flop_tokens(self, iteration: int) -> Optional[list[int]]:
        return _single([(f, f.flop_tokens(iteration)) for f in self], "flop_tokens")

    def record(self, iteration: int) -> dict[str, Any]:
        return _merged([(f, f.record(iteration)) for f in self], "record")

    def summary(self, iteration: int) -> dict[str, dict]:
        """``{name: record}`` of each enabled feature for the run's summary (none before a step)."""
        return {f.name: f.record(iteration) for f in self} if iteration else {}

    def checkpoint_meta(self, iteration: int) -> dict[str, dict]:
        """The checkpoint's feature records: each enabled feature's state, by its name."""
        states = {feature.name: feature.state_dict(iteration) for feature in self.enabled}
        return {name: state for name, state in states.items() if state is not None}
