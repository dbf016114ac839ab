"""Random-LTD's kept-token schedule and its layer-token accounting, with DeepSpeed's semantics.

DeepSpeed's ``RandomLTDScheduler`` (``deepspeed.runtime.data_pipeline.data_routing.scheduler``)
defines the schedule this module reproduces exactly (``tests/random_ltd/test_schedule.py``
compares the two step by step):

* ``step`` counts completed optimizer steps (DeepSpeed's ``global_steps``): the first iteration
  runs at step 0. The trainer's 1-based ``iteration`` runs at step ``iteration - 1``.
* ``fixed_linear``: the kept count at ``step`` is
  ``floor(step / require_steps * (max_value - min_value) + min_value)``, rounded down to a
  multiple of ``seq_per_step`` and capped at ``max_value``. (DeepSpeed calls the kept count the
  "reserved length"; ``min_value``/``max_value``/``require_steps``/``seq_per_step`` are its
  config names.) A layer drops tokens only while the kept count is below the sequence length.
* Layer tokens of a step: ``global_batch_size * (kept * ltd_layers + max_value * other_layers)``
  -- DeepSpeed counts ``max_value`` tokens for the layers that never drop. Their running sum is
  the scheduler's ``consumed_layer_tokens``.

**LayerToken learning rate** (the paper's LayerToken LR; Megatron-DeepSpeed drives its
token-based LR decay with the same layer-averaged count): the LR schedule advances by the layer
tokens of each step instead of by one iteration. Its warm-up ends where the layer tokens of the
first ``--lr-warmup-iters`` iterations are consumed and its decay where the whole run's are
(:meth:`RandomLTDSchedule.lr_steps`), so the LR still reaches its peak and its minimum at the
same iterations as without Random-LTD, but decays more slowly while few tokens are kept.

The schedule is a pure function of the config and the iteration, so a resume recomputes it; the
checkpoint still records DeepSpeed's state dict, and a resume checks it against the config
(:meth:`RandomLTDSchedule.check_resume`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from epas_megatron.errors import ConfigError


def parse_layer_set(spec: str, num_layers: int, flag: str = "--random-ltd-layers") -> tuple[int, ...]:
    """``"1-10"``, ``"1,3,5-7"`` (0-based, inclusive ranges) -> sorted layer ids; a
    :class:`ConfigError` naming ``flag`` for anything outside ``[0, num_layers)``."""
    layers: set[int] = set()
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-", 1))
                if last < first:
                    raise ValueError
                layers.update(range(first, last + 1))
            else:
                layers.add(int(part))
        except ValueError:
            raise ConfigError(f"{flag} {spec!r}: expected layer ids and ranges such as '1-10' or '1,3,5-7'") from None
    if not layers:
        raise ConfigError(f"{flag} {spec!r} names no layer")
    outside = sorted(i for i in layers if not 0 <= i < num_layers)
    if outside:
        raise ConfigError(f"{flag} {spec!r}: layers {outside} do not exist in a {num_layers}-layer model (ids 0..{num_layers - 1})")
    return tuple(sorted(layers))


def layer_ids(num_layers: int, layers: Optional[str] = None) -> tuple[int, ...]:
    """The layers that drop tokens: ``--random-ltd-layers`` parsed, default every layer but the
    first and last."""
    if num_layers < 3 and layers is None:
        raise ConfigError(f"--random-ltd: a {num_layers}-layer model has no middle layers; name the layers with --random-ltd-layers")
    return default_layers(num_layers) if layers is None else parse_layer_set(layers, num_layers)


def default_layers(num_layers: int) -> tuple[int, ...]:
    """Every layer but the first and the last (DeepSpeed's GPT examples)."""
    return tuple(range(1, num_layers - 1))


@dataclass(frozen=True)
class RandomLTDSchedule:
    """How many tokens the Random-LTD layers keep at each step (DeepSpeed's ``fixed_linear``)."""

    num_layers: int
    """Decoder layers of the model (DeepSpeed's ``total_layer_num``)."""

    layers: tuple[int, ...]
    """The layers that drop tokens (0-based; DeepSpeed's ``random_ltd_layer_id``)."""

    seq_length: int
    """Tokens per sequence."""

    min_value: int
    """Kept tokens at step 0 (before rounding to ``seq_per_step``)."""

    max_value: int
    """Kept tokens at the end of the ramp (at most ``seq_length``)."""

    require_steps: int
    """Steps for the kept count to ramp from ``min_value`` to ``max_value``."""

    seq_per_step: int
    """Kept counts are multiples of this (DeepSpeed's ``seq_per_step``)."""

    global_batch_size: int
    """Sequences per step (for the layer-token count)."""

    def __post_init__(self):
        if not self.layers:
            raise ConfigError("--random-ltd-layers: no layer drops tokens")
        if any(not 0 <= i < self.num_layers for i in self.layers):
            raise ConfigError(f"--random-ltd-layers {list(self.layers)}: ids must be in 0..{self.num_layers - 1}")
        if self.seq_per_step < 1:
            raise ConfigError(f"--random-ltd-seq-per-step must be >= 1, got {self.seq_per_step}")
        if not self.seq_per_step <= self.min_value <= self.max_value <= self.seq_length:
            raise ConfigError(
                f"Random-LTD needs --random-ltd-seq-per-step <= --random-ltd-min-value <= --random-ltd-max-value "
                f"<= --seq-length, got {self.seq_per_step} <= {self.min_value} <= {self.max_value} <= {self.seq_length}"
            )
        if self.require_steps < 1:
            raise ConfigError(f"--random-ltd-require-steps must be >= 1, got {self.require_steps}")
        if self.global_batch_size < 1:
            raise ConfigError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")

    @classmethod
    def from_flags(cls, num_layers: int, seq_length: int, global_batch_size: int, train_iters: int, *,
                   layers: Optional[str] = None, min_value: Optional[int] = None, max_value: Optional[int] = None,
                   require_steps: Optional[int] = None, seq_per_step: Optional[int] = None) -> "RandomLTDSchedule":
        """The schedule of the ``--random-ltd-*`` flags, defaults filled in: every layer but the
        first and last, ``seq_per_step`` 16 (less for sequences under 256 tokens), a start at
        1/16 of the sequence, the full sequence at the end, reached after 70% of ``train_iters``."""
        ids = layer_ids(num_layers, layers)
        step = seq_per_step if seq_per_step is not None else max(1, min(16, seq_length // 16))
        low = min_value if min_value is not None else max(step, seq_length // 16 - (seq_length // 16) % step)
        return cls(
            num_layers=num_layers,
            layers=ids,
            seq_length=seq_length,
            min_value=low,
            max_value=seq_length if max_value is None else max_value,
            require_steps=require_steps if require_steps is not None else max(1, (7 * train_iters) // 10),
            seq_per_step=step,
            global_batch_size=global_batch_size,
        )

    # ------------------------------------------------------------------ kept tokens
    def kept_tokens(self, step: int) -> int:
        """Tokens each Random-LTD layer keeps at ``step`` (0 = the first iteration)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        value = math.floor(step / self.require_steps * (self.max_value - self.min_value) + self.min_value)
        value -= value % self.seq_per_step
        return min(value, self.max_value)

    def kept_tokens_at_iteration(self, iteration: int) -> int:
        """Kept tokens while the trainer runs ``iteration`` (1-based)."""
        return self.kept_tokens(iteration - 1)

    def drops(self, step: int) -> bool:
        """Whether the Random-LTD layers drop any token at ``step``."""
        return self.kept_tokens(step) < self.seq_length

    # ------------------------------------------------------------------ layer tokens
    def layer_tokens(self, step: int) -> int:
        """Layer tokens of one step, DeepSpeed's count (``max_value`` for the other layers)."""
        ltd = len(self.layers)
        return self.global_batch_size * (self.kept_tokens(step) * ltd + self.max_value * (self.num_layers - ltd))

    def consumed_layer_tokens(self, steps: int) -> int:
        """Layer tokens of the first ``steps`` steps (prefix sums over the ramp, then linear)."""
        prefix = self._ramp_prefix_sums
        plateau = len(prefix) - 1  # the first step that keeps max_value
        ramp = min(steps, plateau)
        return prefix[ramp] + (steps - ramp) * self.layer_tokens(plateau)

    @functools.cached_property
    def _ramp_prefix_sums(self) -> list[int]:
        """Layer tokens of steps ``0..k-1`` for every ``k`` up to the plateau (kept == max)."""
        sums, step = [0], 0
        while self.kept_tokens(step) < self.max_value:
            sums.append(sums[-1] + self.layer_tokens(step))
            step += 1
        return sums

    def lr_steps(self, warmup_iters: int, train_iters: int) -> tuple[int, int]:
        """(warm-up, decay) lengths of the LayerToken LR schedule, in layer tokens."""
        return self.consumed_layer_tokens(warmup_iters), self.consumed_layer_tokens(train_iters)

    def tokens_per_layer(self, step: int) -> list[int]:
        """Tokens each decoder layer processes per sequence at ``step``: the kept count in the
        Random-LTD layers, the sequence elsewhere. What the FLOPs model counts (a source of an
        EPAS region runs its Q/K/V projections on the whole sequence, see
        :func:`~epas_megatron.metrics.flops.layerwise_forward_flops`)."""
        kept = min(self.kept_tokens(step), self.seq_length)
        return [kept if i in self.layers else self.seq_length for i in range(self.num_layers)]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, iteration: int) -> dict:
        """DeepSpeed's scheduler state after ``iteration`` completed iterations, plus the config."""
        return {
            "consumed_layer_tokens": self.consumed_layer_tokens(iteration),
            "current_steps": iteration - 1,
            "current_value": self.kept_tokens(max(iteration - 1, 0)) if iteration else self.min_value,
            "min_value": self.min_value,
            "max_value": self.max_value,
            "layers": list(self.layers),
            "require_steps": self.require_steps,
            "seq_per_step": self.seq_per_step,
            "global_batch_size": self.global_batch_size,
        }

    def check_resume(self, saved: Optional[dict], iteration: int) -> None:
        """A checkpoint's Random-LTD state must be the one this config gives at ``iteration``:
        a resume with other --random-ltd-* flags would silently change the schedule."""
        if saved is None:
            raise ConfigError(f"--random-ltd: the checkpoint at iteration {iteration} was trained without Random-LTD; "
                              "resume without --random-ltd or start a new run")
        expected = self.state_dict(iteration)
        diffs = [f"{key}: checkpoint {saved.get(key)!r}, this run {value!r}" for key, value in expected.items() if saved.get(key) != value]
        if diffs:
            raise ConfigError("--random-ltd-*: the checkpoint's Random-LTD schedule differs from this run's (" + "; ".join(diffs) +
                              "); resume with the flags it was trained with")

    def describe(self, train_iters: int) -> str:
        """One line for the start-up banner."""
        full = next((step for step in range(train_iters) if not self.drops(step)), None)
        end = (f"all {self.seq_length} tokens from iteration {full + 1}" if full is not None
               else f"{self.kept_tokens(max(train_iters - 1, 0))} at the end")
        return (f"Random-LTD: layers {_ranges(self.layers)} keep {self.kept_tokens(0)} of {self.seq_length} tokens at first, "
                f"+{self.seq_per_step} steps over {self.require_steps} iterations ({end})")


def _ranges(ids: Sequence[int]) -> str:
    parts, start = [], None
    for i, value in enumerate(ids):
        if start is None:
            start = value
        if i + 1 == len(ids) or ids[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)
