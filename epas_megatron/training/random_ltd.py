"""Random-LTD as a training feature: the hooks through which the trainer runs it
(:class:`~epas_megatron.training.features.TrainingFeature`).

What each hook does is the schedule's (:mod:`.schedule`), which counts DeepSpeed's ``step`` --
completed iterations, so the 1-based ``iteration`` runs at step ``iteration - 1``: the model's
layers keep :meth:`~.schedule.RandomLTDSchedule.kept_tokens` tokens in the step (set on the built
chunks before it, :func:`.model.set_kept_tokens`); with ``--random-ltd-layer-token-lr`` the LR
schedule counts layer tokens instead of iterations; the FLOPs model counts the kept tokens; the
metrics report the kept tokens and DeepSpeed's layer-token count; a checkpoint records DeepSpeed's
scheduler state, which a resume checks against the config.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional, Sequence

from epas_megatron.config.cli import flag_name
from epas_megatron.errors import ConfigError
from epas_megatron.random_ltd.model import set_kept_tokens
from epas_megatron.random_ltd.schedule import RandomLTDSchedule
from epas_megatron.random_ltd.tokens import deepspeed_kernels_load
from epas_megatron.training.features import TrainingFeature
from epas_megatron.validation import ResolvedRun


@dataclass(frozen=True)
class RandomLTDFeature(TrainingFeature):
    """``--random-ltd``: layers drop tokens on the schedule, optionally with the LayerToken LR."""

    name: ClassVar[str] = "random_ltd"
    flag: ClassVar[str] = "--random-ltd"

    schedule: RandomLTDSchedule
    """The kept-token schedule and layer-token accounting."""

    layer_token_lr: bool = False
    """The LR schedule advances by each step's layer tokens (``--random-ltd-layer-token-lr``)."""

    @staticmethod
    def schedule_of(cfg) -> Optional[RandomLTDSchedule]:
        """The kept-token schedule of a resolved config's ``--random-ltd-*`` flags (None: off); a
        ``ConfigError`` naming the flag when they make none."""
        r, m, t = cfg.random_ltd, cfg.model, cfg.training
        if not r.random_ltd:
            return None
        return RandomLTDSchedule.from_flags(
            m.num_layers, t.seq_length, t.global_batch_size, t.train_iters, layers=r.random_ltd_layers,
            min_value=r.random_ltd_min_value, max_value=r.random_ltd_max_value, require_steps=r.random_ltd_require_steps,
            seq_per_step=r.random_ltd_seq_per_step,
        )

    @classmethod
    def check_config(cls, run: ResolvedRun) -> list[str]:
        r = run.cfg.random_ltd
        cls.schedule_of(run.cfg)  # the schedule's own checks (layers, min / max values, steps)
        if not r.random_ltd:
            given = [flag_name(f.name) for f in fields(r) if f.name not in ("random_ltd", "random_ltd_layer_token_lr", "random_ltd_kernels")
                     and getattr(r, f.name) is not None]
            return [f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without --random-ltd"] if given else []
        if run.cfg.parallel.sequence_parallel:
            raise ConfigError("--random-ltd does not support --sequence-parallel (kept tokens are gathered from the whole "
                              "sequence, which sequence parallelism splits over TP ranks); drop one of them")
        if r.random_ltd_kernels == "deepspeed":
            problem = deepspeed_kernels_load() if run.cuda else "no CUDA device"
            if problem is not None:
                raise ConfigError(f"--random-ltd-kernels deepspeed: DeepSpeed's Random-LTD kernels do not load ({problem}); "
                                  "use --random-ltd-kernels torch or auto")
        return []

    @classmethod
    def from_run(cls, run: ResolvedRun) -> Optional["RandomLTDFeature"]:
        schedule = cls.schedule_of(run.cfg)
        if schedule is None:
            return None
        return cls(schedule, layer_token_lr=run.cfg.random_ltd.random_ltd_layer_token_lr)

    def check_resume(self, saved: Optional[dict], iteration: int) -> None:
        self.schedule.check_resume(saved, iteration)

    def describe(self, train_iters: int) -> str:
        return self.schedule.describe(train_iters) + ("; LayerToken LR" if self.layer_token_lr else "")

    def before_step(self, model: Sequence, step: int) -> None:
        set_kept_tokens(model, self.schedule.kept_tokens(step))

    def lr_increment(self, step: int) -> Optional[int]:
        return self.schedule.layer_tokens(step) if self.layer_token_lr else None

    def lr_schedule_units(self, warmup_iters: int, train_iters: int) -> Optional[tuple[int, int]]:
        return self.schedule.lr_steps(warmup_iters, train_iters) if self.layer_token_lr else None

    def flop_tokens(self, iteration: int) -> list[int]:
        return self.schedule.tokens_per_layer(iteration - 1)

    def record(self, iteration: int) -> dict[str, Any]:
        """The kept tokens of the last step, DeepSpeed's layer-token count and the mean tokens
        per layer that step's count amounts to."""
        ltd = self.schedule
        step_tokens = ltd.layer_tokens(iteration - 1)
        return {"random_ltd_kept_tokens": ltd.kept_tokens(iteration - 1),
                "consumed_layer_tokens": ltd.consumed_layer_tokens(iteration),
                "layer_averaged_seq_length": step_tokens / (ltd.global_batch_size * ltd.num_layers)}

    def state_dict(self, iteration: int) -> dict:
        return self.schedule.state_dict(iteration)
