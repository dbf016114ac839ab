"""The progressive sharing schedule: which decoder layers share Q/K at which iteration.

EPAS (Karim et al., "EPAS: Efficient training with Progressive Activation Sharing", Canadian AI
2026) gives a decoder layer one of two modes: it either *computes* its own Q/K or *shares*
(reuses) the post-RoPE Q/K of the last computing layer before it, the *source*. The sharing
region is one contiguous block at the deep end (``--epas-blocks`` splits it, below); by default
it includes the last layer (the paper's choice), and ``exclude_last = N``
(``--epas-exclude-last``) keeps the deepest ``N`` layers computing, so the region ends at layer
``num_layers - 1 - N`` (the paper's ablation of where the region ends). Layers are 0-based.

Algorithm 1 of the paper, in our words: with interval ``I``, target layers
``S_c`` (shallow→deep, a contiguous deep block including the last layer) and growth ``B``
(``B >= 1``, ``B`` divides ``|S_c|``), at every iteration ``t`` (counted from 1) with
``t % I == 0``, while targets remain, the deepest ``B`` remaining targets switch to sharing.
The region never shrinks; the full region is reached at ``t = I * |S_c| / B``.

Our generalisation and decisions (the paper leaves them open):

* ``first_switch`` (default ``interval``): switches happen at iterations ``first_switch``,
  ``first_switch + I``, ``first_switch + 2I``, ... With the default this is exactly Algorithm 1.
* Iterations are 1-based training steps. **A switch at iteration t happens before the training
  step of iteration t**: the region in effect for step ``t`` includes every switch at an
  iteration ``<= t``. Iteration 0 means "before any step" (e.g. a checkpoint saved at
  iteration 0) and never has a region, because ``first_switch >= 1``.
* The target set is described by its size (and ``exclude_last``) only: the ``target_layers``
  layers ending at layer ``num_layers - 1 - exclude_last``. A target count of 0 means EPAS is
  off. The region grows from its end toward shallower layers exactly as with ``exclude_last =
  0``; layers after the region (mode ``COMPUTE``) never share and compute their own Q/K.
* At least one layer must keep computing before the region (the source), so at most
  ``num_layers - 1 - exclude_last`` layers can be targets.
* ``blocks = K`` (``--epas-blocks``, default 1: the paper's single block) splits the targets into
  ``K`` blocks; where the blocks lie and the order their layers switch in is the region
  geometry of :mod:`epas_megatron.sharing.shape`.

Everything here is a pure function of the configuration; the trainer asks the schedule *what*
changes at a switch and one place (model specs, freezing, optimizer, pipeline layout) carries it
out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from fractions import Fraction

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.shape import (
    LayerMode,
    RegionShape,
    check_blocks,
    check_exclude_last,
    format_layers,
    is_int,
    layer_runs,
    place_blocks,
    switching_order,
)

__all__ = [
    "SharingSchedule",
    "resolve_target_layers",
]

#: Warn when the final region is first in effect in the last ``1 / _LATE_FINAL_DENOMINATOR``
#: of training (here: the last 10%).
_LATE_FINAL_DENOMINATOR = 10

_STATE_KEYS = (
    "num_layers", "interval", "growth", "target_layers", "first_switch", "exclude_last", "blocks"
)

#: State keys that checkpoints written before the key existed lack, with the value that gives
#: those runs' behaviour (the region then included the last layer and was one block).
_STATE_DEFAULTS = {"exclude_last": 0, "blocks": 1}

#: Flag to change for each schedule field, used in error and difference messages.
_FIELD_FLAGS = {
    "num_layers": "--num-layers",
    "interval": "--epas-interval",
    "growth": "--epas-growth",
    "target_layers": "--epas-target-layers",
    "first_switch": "--epas-first-switch",
    "exclude_last": "--epas-exclude-last",
    "blocks": "--epas-blocks",
}


def resolve_target_layers(target: float | int | str, num_layers: int) -> int:
    """Number of target (eventually sharing) layers from ``--epas-target-layers``.

    Accepted forms:

    * an ``int`` (or an integral string / float such as ``"6"`` or ``6.0``): that many layers;
    * a fraction in ``(0, 1)`` (float or string such as ``"0.5"``): ``floor(num_layers * f)``
      computed exactly on the decimal the user wrote (so ``0.29 * 100`` gives 29, not 28), and
      at least 1 (a positive fraction never silently turns EPAS off);
    * ``0`` (or ``"0"`` / ``0.0``): EPAS off.

    The result must leave a source layer: ``0 <= result <= num_layers - 1``.
    """
    flag = "--epas-target-layers"
    if not is_int(num_layers) or num_layers < 1:
        raise ConfigError(f"--num-layers must be a positive integer, got {num_layers!r}")
    if isinstance(target, bool):
        raise ConfigError(f"{flag} must be a layer count or a fraction in (0, 1), got {target!r}")
    if isinstance(target, str):
        text = target.strip()
        try:
            value = Fraction(text)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(
                f"{flag} must be a layer count (e.g. 6) or a fraction of the layers in (0, 1) "
                f"(e.g. 0.5), got {target!r}"
            ) from None
    elif is_int(target):
        value = Fraction(target)
    elif isinstance(target, float):
        if not math.isfinite(target):
            raise ConfigError(f"{flag} must be finite, got {target!r}")
        # str() gives the shortest decimal that round-trips: the number the user wrote.
        value = Fraction(str(target))
    else:
        raise ConfigError(
            f"{flag} must be a layer count or a fraction in (0, 1), got {type(target).__name__} "
            f"{target!r}"
        )

    if value < 0:
        raise ConfigError(f"{flag} must be >= 0 (0 turns EPAS off), got {target!r}")
    if 0 < value < 1:
        count = max(1, math.floor(value * num_layers))
    elif value.denominator == 1:
        count = int(value)
    else:
        raise ConfigError(
            f"{flag} {target!r} is neither a whole layer count nor a fraction in (0, 1)"
        )
    if count > num_layers - 1:
        raise ConfigError(
            f"{flag} {target!r} resolves to {count} of {num_layers} layers, but at least one "
            f"layer must keep computing Q/K as the source; use at most {num_layers - 1}"
        )
    return count


@dataclass(frozen=True)
class SharingSchedule:
    """When each target layer switches from computing to sharing Q/K (Algorithm 1, generalised).

    Switch ``k`` (``k = 0, 1, ...``) happens at iteration ``first_switch + k * interval`` and
    moves the next ``growth`` targets of the switching order to sharing: the deepest ones that
    still compute with one block, round-robin over the blocks (deepest block first) with several
    (module docstring). The region in effect for the training step of iteration ``t`` includes
    every switch at an iteration ``<= t``. The deepest target is layer :attr:`region_end`
    (``num_layers - 1 - exclude_last``); the ``exclude_last`` layers after it always compute.
    """

    num_layers: int
    """Decoder layers in the model (``--num-layers``)."""
    interval: int
    """Iterations between two switches, ``I`` in the paper (``--epas-interval``, >= 1)."""
    growth: int
    """Layers that switch at each switch, ``B`` in the paper (``--epas-growth``, >= 1); must
    divide ``target_layers``."""
    target_layers: int
    """Size of the final sharing region, ``|S_c|`` in the paper: the ``target_layers`` layers
    ending at :attr:`region_end` (``--epas-target-layers``, resolved by
    :func:`resolve_target_layers`). 0 turns EPAS off; at most ``num_layers - 1 - exclude_last``
    so that a source layer remains before the region."""
    first_switch: int | None = None
    """Iteration of the first switch (``--epas-first-switch``, >= 1). ``None`` means
    ``interval`` (Algorithm 1); it is resolved to that number on construction, so two schedules
    with the same switches compare equal."""
    exclude_last: int = 0
    """Deepest layers that never share (``--epas-exclude-last``, >= 0): the region ends at layer
    ``num_layers - 1 - exclude_last``. 0 is the paper's default (the region includes the last
    layer, which its ablation found better); a positive value reproduces the ablation."""
    blocks: int = 1
    """Sharing blocks the target region is split into (``--epas-blocks``, >= 1; must divide
    ``target_layers``). 1 is the paper's single block; with ``K`` blocks each block of
    ``target_layers / K`` layers sits at the deep end of its ``1 / K`` share of layers
    ``0..region_end`` with its own source before it (:attr:`block_ranges`), so
    ``target_layers + K <= region_end + 1``. Any value is accepted when EPAS is off."""

    def __post_init__(self) -> None:
        if not is_int(self.num_layers) or self.num_layers < 1:
            raise ConfigError(f"--num-layers must be a positive integer, got {self.num_layers!r}")
        if not is_int(self.interval) or self.interval < 1:
            raise ConfigError(
                f"--epas-interval must be an integer >= 1 (iterations between switches), got "
                f"{self.interval!r}"
            )
        if not is_int(self.growth) or self.growth < 1:
            raise ConfigError(
                f"--epas-growth must be an integer >= 1 (layers per switch), got {self.growth!r}"
            )
        if not is_int(self.target_layers) or self.target_layers < 0:
            raise ConfigError(
                f"--epas-target-layers must be a layer count >= 0 (0 turns EPAS off), got "
                f"{self.target_layers!r}"
            )
        check_exclude_last(self.num_layers, self.exclude_last)
        if self.target_layers > self.region_end:
            excluded = (
                f" with --epas-exclude-last {self.exclude_last} (the region ends at layer "
                f"{self.region_end})"
                if self.exclude_last
                else ""
            )
            raise ConfigError(
                f"--epas-target-layers {self.target_layers} leaves no source layer before the "
                f"region in a {self.num_layers}-layer model{excluded}; use at most "
                f"{self.region_end} target layers"
                + (" or a smaller --epas-exclude-last" if self.exclude_last else "")
            )
        if self.target_layers % self.growth:
            divisors = [d for d in range(1, self.target_layers + 1) if self.target_layers % d == 0]
            raise ConfigError(
                f"--epas-growth {self.growth} does not divide --epas-target-layers "
                f"{self.target_layers}; use a growth among {divisors} (or change the target)"
            )
        check_blocks(self.num_layers, self.exclude_last, self.target_layers, self.blocks)
        if self.first_switch is None:
            object.__setattr__(self, "first_switch", self.interval)
        elif not is_int(self.first_switch) or self.first_switch < 1:
            raise ConfigError(
                f"--epas-first-switch must be an iteration >= 1 (iterations count from 1), got "
                f"{self.first_switch!r}"
            )

    @classmethod
    def from_config(cls, cfg) -> "SharingSchedule":
        """The schedule a run of ``cfg`` (a ``RunConfig``) trains with: its ``--epas-*`` flags and
        ``--num-layers``; a ``ConfigError`` naming the flag if they do not make one."""
        e = cfg.epas
        return cls.from_flags(cfg.model.num_layers, e.epas_interval, e.epas_growth, e.epas_target_layers, e.epas_first_switch,
                              exclude_last=e.epas_exclude_last, blocks=e.epas_blocks)

    @classmethod
    def from_flags(
        cls,
        num_layers: int,
        interval: int,
        growth: int,
        target: float | int | str,
        first_switch: int | None = None,
        exclude_last: int = 0,
        blocks: int = 1,
    ) -> SharingSchedule:
        """Build from command-line values; ``target`` may be a count or a fraction (of all
        ``num_layers`` layers, whatever ``exclude_last`` is)."""
        return cls(
            num_layers=num_layers,
            interval=interval,
            growth=growth,
            target_layers=resolve_target_layers(target, num_layers),
            first_switch=first_switch,
            exclude_last=exclude_last,
            blocks=blocks,
        )

    # ------------------------------------------------------------------ the plan
    @property
    def shape(self) -> RegionShape:
        """Where this schedule's regions lie (:attr:`num_layers`, :attr:`exclude_last`,
        :attr:`blocks`): what the build plan, the checkpoint metadata and the region grammar take."""
        return RegionShape(self.num_layers, self.exclude_last, self.blocks)

    @property
    def region_end(self) -> int:
        """The region's last (deepest) layer: ``num_layers - 1 - exclude_last``."""
        return self.shape.end

    @property
    def block_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(first, last)`` layer of each final block, ascending; ``()`` when EPAS is off. One
        block: ``((region_end + 1 - target_layers, region_end),)``."""
        return place_blocks(self.region_end, self.target_layers, self.blocks)

    @property
    def enabled(self) -> bool:
        """Whether any layer ever shares."""
        return self.target_layers > 0

    @property
    def num_switches(self) -> int:
        """How many switches the schedule has (``target_layers / growth``)."""
        return self.target_layers // self.growth

    @property
    def final_iteration(self) -> int:
        """First iteration whose step runs with the full target region; 0 when EPAS is off.

        ``first_switch + (num_switches - 1) * interval``; with the default ``first_switch``
        this is the paper's ``I * |S_c| / B``.
        """
        if not self.enabled:
            return 0
        return self.first_switch + (self.num_switches - 1) * self.interval

    def _switches_done(self, iteration: int) -> int:
        if not is_int(iteration) or iteration < 0:
            raise ValueError(f"iteration must be an integer >= 0, got {iteration!r}")
        if not self.enabled or iteration < self.first_switch:
            return 0
        return min(self.num_switches, (iteration - self.first_switch) // self.interval + 1)

    def region_size(self, iteration: int) -> int:
        """Number of sharing layers in effect for the step of ``iteration``."""
        return self._switches_done(iteration) * self.growth

    def sharing_layers(self, iteration: int) -> tuple[int, ...]:
        """Sharing layers (ascending) in effect for the step of ``iteration``: the first
        :meth:`region_size` layers of the switching order."""
        return tuple(sorted(switching_order(self.block_ranges)[: self.region_size(iteration)]))

    def source_layers(self, iteration: int) -> tuple[int, ...]:
        """The source of every block that shares at ``iteration`` (the computing layer right
        before the block's sharing layers), ascending; ``()`` when no layer shares."""
        return tuple(first - 1 for first, _ in layer_runs(self.sharing_layers(iteration)))

    def source_layer(self, iteration: int) -> int | None:
        """The last computing layer before the region, whose Q/K the region reuses; ``None``
        when no layer shares at ``iteration``. With several blocks: the deepest block's source
        (see :meth:`source_layers` for all of them)."""
        sources = self.source_layers(iteration)
        return sources[-1] if sources else None

    def layer_modes(self, iteration: int) -> list[LayerMode]:
        """Per-layer mode in effect for the step of ``iteration``."""
        return self.shape.modes(self.sharing_layers(iteration), target_layers=self.target_layers)

    def switch_iterations(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every switch as ``(iteration, layers that switch there, in switching order)``; one
        block: deep -> shallow."""
        order = switching_order(self.block_ranges)
        return [
            (
                self.first_switch + k * self.interval,
                order[k * self.growth : (k + 1) * self.growth],
            )
            for k in range(self.num_switches)
        ]

    def is_switch(self, iteration: int) -> bool:
        """Whether the region grows right before the step of ``iteration``."""
        self._switches_done(iteration)  # validates iteration
        offset = iteration - self.first_switch
        return (
            self.enabled
            and offset >= 0
            and offset % self.interval == 0
            and offset // self.interval < self.num_switches
        )

    def next_switch(self, iteration: int) -> int | None:
        """First switch iteration strictly after ``iteration``; ``None`` if none is left."""
        done = self._switches_done(iteration)
        if done == self.num_switches:
            return None
        return self.first_switch + done * self.interval

    # ------------------------------------------------------------------ checks against training
    def check_against_training(self, train_iters: int) -> list[str]:
        """Check the plan fits in ``--train-iters``; return warnings, raise on errors.

        Raises ``ConfigError`` if the full target region is reached after ``train_iters``.
        Returns a warning when it is reached in the last 10% of training, i.e. when
        ``final_iteration > 0.9 * train_iters`` (the final region then trains for fewer than a
        tenth of the steps). EPAS off: no warnings.
        """
        if not is_int(train_iters) or train_iters < 1:
            raise ConfigError(f"--train-iters must be an integer >= 1, got {train_iters!r}")
        if not self.enabled:
            return []
        final = self.final_iteration
        if final > train_iters:
            raise ConfigError(
                f"the full EPAS region ({self.target_layers} layers) is reached at iteration "
                f"{final} but --train-iters is {train_iters}; lower --epas-interval (now "
                f"{self.interval}) or --epas-first-switch (now {self.first_switch}), or raise "
                f"--epas-growth (now {self.growth})"
            )
        warnings = []
        if final * _LATE_FINAL_DENOMINATOR > (_LATE_FINAL_DENOMINATOR - 1) * train_iters:
            steps = train_iters - final + 1
            warnings.append(
                f"the full EPAS region ({self.target_layers} layers) is reached at iteration "
                f"{final}, in the last 10% of --train-iters {train_iters}: it trains for only "
                f"{steps} step(s); lower --epas-interval or raise --epas-growth to give it longer"
            )
        return warnings

    def describe(self, train_iters: int | None = None) -> str:
        """Multi-line human-readable plan, one line per switch, for printing at start."""
        if not self.enabled:
            return f"EPAS off: all {self.num_layers} layers compute their own Q/K"
        targets = switching_order(self.block_ranges)
        # blocks are never adjacent (each keeps its source before it), so the targets' runs
        # are the blocks
        blocks = (
            f" in {self.blocks} blocks of {self.target_layers // self.blocks}, sources "
            f"{', '.join(str(first - 1) for first, _ in self.block_ranges)}"
            if self.blocks > 1
            else ""
        )
        excluded = (
            f", layer(s) {format_layers(range(self.region_end + 1, self.num_layers))} never "
            f"share (--epas-exclude-last {self.exclude_last})"
            if self.exclude_last
            else ""
        )
        lines = [
            f"EPAS schedule: {self.num_layers} layers, target region {format_layers(targets)} "
            f"({self.target_layers} layers{blocks}){excluded}, growth {self.growth} every "
            f"{self.interval} iteration(s) from iteration {self.first_switch}"
        ]
        width = len(str(self.final_iteration))
        for iteration, switching in self.switch_iterations():
            region = self.sharing_layers(iteration)
            sources = (
                f"source layer(s) {', '.join(map(str, self.source_layers(iteration)))}"
                if self.blocks > 1
                else f"source layer {self.source_layer(iteration)}"
            )
            lines.append(
                f"  iteration {iteration:>{width}}: layer(s) {', '.join(map(str, switching))} "
                f"switch to sharing -> region {format_layers(region)} ({len(region)} layers), "
                f"{sources}"
            )
        final = f"full region from iteration {self.final_iteration}"
        if train_iters is not None and train_iters >= self.final_iteration:
            steps = train_iters - self.final_iteration + 1
            share = 100 * steps / train_iters
            final += f", trained for {steps} of {train_iters} steps ({share:.1f}%)"
        lines.append(final)
        return "\n".join(lines)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, int]:
        """Plain dict of ints for checkpoints (``first_switch`` already resolved)."""
        return {key: getattr(self, key) for key in _STATE_KEYS}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, int]) -> SharingSchedule:
        """Inverse of :meth:`state_dict`; validates like the constructor. Keys added after a
        checkpoint was written (``exclude_last``, ``blocks``) take the value that reproduces that
        run."""
        state = {**_STATE_DEFAULTS, **state}
        missing = [key for key in _STATE_KEYS if key not in state]
        unknown = sorted(set(state) - set(_STATE_KEYS))
        if missing or unknown:
            raise ConfigError(
                f"checkpoint EPAS schedule state is malformed (missing {missing}, unknown "
                f"{unknown}); was it written by another version of epas-megatron?"
            )
        return cls(**{key: state[key] for key in _STATE_KEYS})

    def differences_from(self, saved: SharingSchedule) -> list[str]:
        """One line per field where this run's schedule differs from ``saved`` (typically the
        checkpoint's), naming the flag; empty when they are equal."""
        return [
            f"{_FIELD_FLAGS[f.name]}: {getattr(saved, f.name)} in the checkpoint, "
            f"{getattr(self, f.name)} in this run"
            for f in fields(self)
            if getattr(self, f.name) != getattr(saved, f.name)
        ]

    def check_resume(self, saved_state: Mapping[str, int], iteration: int) -> None:
        """Raise ``ConfigError`` unless this run's schedule equals the checkpoint's.

        ``iteration`` is the checkpoint's iteration; the message also says how the regions
        differ there, i.e. whether the change would alter the model at once.
        """
        saved = SharingSchedule.from_state_dict(saved_state)
        diffs = self.differences_from(saved)
        if not diffs:
            return
        region_note = ""
        if saved.num_layers == self.num_layers:
            here, there = self.sharing_layers(iteration), saved.sharing_layers(iteration)
            if here != there:
                region_note = (
                    f"; at iteration {iteration} the checkpoint's region is "
                    f"{format_layers(there)} but this run's would be {format_layers(here)}"
                )
        raise ConfigError(
            "the EPAS schedule differs from the one saved in the checkpoint ("
            + "; ".join(diffs)
            + f"){region_note}. Resume with the checkpoint's values."
        )
