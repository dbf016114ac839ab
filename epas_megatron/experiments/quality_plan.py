"""What ``epas-bench quality`` runs: the scales (model, data, steps per arm; ``cpu`` is the one
sized for a CPU) and every arm of every part of the recipe -- its trainer flags, evaluation and
what it is compared with (:func:`plan_arms`). Pure data: the recipe that launches the arms and
reports them is :mod:`epas_megatron.experiments.quality`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


@dataclass(frozen=True)
class QualityScale:
    """One size of the recipe: the model, the token budget and the EPAS schedule of every arm."""

    preset: str
    """Model preset."""

    seq_length: int
    """Tokens per sequence."""

    micro_batch_size: int
    """Sequences per micro-batch per data-parallel rank."""

    global_batch_size: int
    """Sequences per iteration."""

    scratch_iters: int
    """Iterations of the from-scratch runs (and of the ablation)."""

    epas_interval: int
    """From scratch: iterations between switches (one layer per switch)."""

    continual_iters: int
    """Iterations of the continual-pretraining runs."""

    continual_region: int
    """Continual pretraining: the final EPAS region (the paper: 5 of TinyLLaMA's 22 layers)."""

    continual_interval: int
    """Continual pretraining: iterations between switches."""

    eval_interval: int
    """Iterations between validations (every run)."""

    eval_iters: int
    """Validation batches per evaluation during training."""

    final_eval_iters: int
    """Validation batches of the continual runs' final evaluation at every region."""

    lr: float = 1e-3
    """From scratch: peak learning rate (cosine decay to a tenth)."""

    warmup_iters: int = 20
    """From scratch: warm-up iterations."""

    continual_lr: float = 3e-4
    """Continual pretraining: peak learning rate (cosine decay to a tenth)."""

    target_layers: str = "0.5"
    """From scratch: the final EPAS region (a count or a fraction of the layers)."""

    seeds: tuple[int, ...] = (1234, 4321)
    """From scratch: one baseline and one EPAS run per seed (the spread between seeds is what a
    gap must exceed to mean anything)."""

    extra_args: tuple[str, ...] = ()
    """Further epas-train flags of every run (precision, parallelism, ...)."""

    continual_only: bool = False
    """Skip the from-scratch runs and the ablation (a large pretrained base model)."""

    rewarm_steps: Optional[int] = None
    """``--parts rewarm``: the ``--epas-switch-rewarm`` of its EPAS runs. Default: a quarter of
    :attr:`epas_interval` (at least 1)."""

    ramp_steps: Optional[int] = None
    """``--parts ramp``: the ``--epas-switch-ramp`` of its EPAS runs (blending iterations before
    each switch). Default: a quarter of :attr:`epas_interval` (at least 1)."""

    ablation_blocks: int = 2
    """``--parts blocks``: the ``--epas-blocks`` of its EPAS runs (the same target region and
    schedule as plain EPAS, split into that many blocks)."""

    moc_topk: float = 0.2
    """``--parts moc``: the ``--moc-topk`` of its runs (the kept fraction of the SwiGLU channels;
    the paper's K of about 20%), with the default ``--moc-groups``."""

    @property
    def switch_rewarm(self) -> int:
        """The re-warm iterations of the ``rewarm`` arms (:attr:`rewarm_steps` resolved)."""
        return self.rewarm_steps if self.rewarm_steps is not None else max(1, self.epas_interval // 4)

    @property
    def switch_ramp(self) -> int:
        """The blending iterations of the ``ramp`` arms (:attr:`ramp_steps` resolved)."""
        return self.ramp_steps if self.ramp_steps is not None else max(1, self.epas_interval // 4)

    def remedy_steps(self, part: str) -> int:
        """N of a switch remedy's arms (``rewarm`` or ``ramp``: its flag's value)."""
        return {"rewarm": self.switch_rewarm, "ramp": self.switch_ramp}[part]

    def target_layer_count(self) -> int:
        """The from-scratch target region in layers (:attr:`target_layers` resolved for the preset's
        layers, as the trainer resolves it)."""
        from epas_megatron.config.presets import get_preset
        from epas_megatron.sharing.schedule import resolve_target_layers

        return resolve_target_layers(self.target_layers, get_preset(self.preset).num_layers)


SCALES: dict[str, QualityScale] = {
    # CI: the whole recipe in about a minute (numbers meaningless).
    "smoke": QualityScale("tiny", 64, 4, 4, scratch_iters=8, epas_interval=2, continual_iters=8, continual_region=1,
                          continual_interval=4, eval_interval=4, eval_iters=1, final_eval_iters=2, warmup_iters=2,
                          seeds=(1234,)),
    # This 2-core CPU: ~19M parameters, 400 x 2048 tokens (about two epochs of the embedded
    # corpus's 0.44M training tokens), half the layers sharing from iteration 200.
    "cpu": QualityScale("small", 256, 8, 8, scratch_iters=400, epas_interval=50, continual_iters=200, continual_region=2,
                        continual_interval=50, eval_interval=25, eval_iters=4, final_eval_iters=16),
    # GPUs (pass --nproc and --data): the paper's 1B-token budget at 0.5M tokens per iteration.
    "125m": QualityScale("125m", 2048, 8, 256, scratch_iters=2000, epas_interval=100, continual_iters=1000,
                         continual_region=3, continual_interval=200, eval_interval=100, eval_iters=20, final_eval_iters=100,
                         lr=6e-4, warmup_iters=100, seeds=(1234,), extra_args=("--precision", "bf16")),
    "1b": QualityScale("1b", 2048, 4, 256, scratch_iters=2000, epas_interval=100, continual_iters=1000,
                       continual_region=5, continual_interval=200, eval_interval=100, eval_iters=20, final_eval_iters=100,
                       lr=4e-4, warmup_iters=100, seeds=(1234,), extra_args=("--precision", "bf16")),
    # The paper's continual pretraining of TinyLLaMA (needs --base-checkpoint and --data).
    "tinyllama": QualityScale("1b", 2048, 4, 256, scratch_iters=0, epas_interval=1, continual_iters=8000,
                              continual_region=5, continual_interval=1000, eval_interval=500, eval_iters=20,
                              final_eval_iters=200, seeds=(), extra_args=("--precision", "bf16"), continual_only=True),
}
"""Recipe sizes (``--scale``)."""


PARTS = ("scratch", "continual", "ablation", "random_ltd", "fixed", "rewarm", "blocks", "ramp", "moc")
"""Every experiment ``--parts`` can name, in the order of the module doc."""

DEFAULT_PARTS = ("scratch", "continual", "ablation")
"""The experiments run without ``--parts``."""


@dataclass
class ArmSpec:
    """One run of the recipe."""

    name: str
    """Directory name under the output directory."""

    train_args: list[str]
    """epas-train flags (the output directory is added when it runs)."""

    needs: Optional[str] = None
    """An arm whose final checkpoint this one starts from."""


def _common_args(scale: QualityScale, iters: int, lr: float, warmup: int, seed: int, data_args: Sequence[str]) -> list[str]:
    return [
        "--preset", scale.preset, "--seq-length", str(scale.seq_length), "--micro-batch-size", str(scale.micro_batch_size),
        "--global-batch-size", str(scale.global_batch_size), "--train-iters", str(iters), "--lr", f"{lr:g}",
        "--min-lr", f"{lr / 10:g}", "--lr-warmup-iters", str(warmup), "--eval-interval", str(scale.eval_interval),
        "--eval-iters", str(scale.eval_iters), "--log-interval", str(max(1, scale.eval_interval // 5)), "--seed", str(seed),
        "--keep-last", "1", *data_args, *scale.extra_args,
    ]


def plan_arms(scale: QualityScale, out: Path, base_checkpoint: Optional[str] = None,
              data_args: Sequence[str] = (), parts: Sequence[str] = DEFAULT_PARTS) -> list[ArmSpec]:
    """The runs of the recipe, in the order they run (an arm after the arm it starts from)."""
    from epas_megatron.experiments.quality_report import REMEDIES

    arms: list[ArmSpec] = []
    epas = ["--epas-target-layers", scale.target_layers, "--epas-interval", str(scale.epas_interval)]
    if not scale.continual_only and ("scratch" in parts or ("continual" in parts and base_checkpoint is None)):
        for number, seed in enumerate(scale.seeds):
            suffix = "" if number == 0 else f"_seed{seed}"
            common = _common_args(scale, scale.scratch_iters, scale.lr, scale.warmup_iters, seed, data_args)
            arms.append(ArmSpec(f"scratch_baseline{suffix}", [*common, "--epas-target-layers", "0"]))
            if "scratch" in parts:
                arms.append(ArmSpec(f"scratch_epas{suffix}", [*common, *epas, "--eval-regions", "0,half,max"]))
    if not scale.continual_only and "ablation" in parts:
        common = _common_args(scale, scale.scratch_iters, scale.lr, scale.warmup_iters, scale.seeds[0], data_args)
        planned = {arm.name for arm in arms}
        for arm in (ArmSpec("scratch_baseline", [*common, "--epas-target-layers", "0"]),  # what it compares with
                    ArmSpec("scratch_epas", [*common, *epas, "--eval-regions", "0,half,max"]),
                    ArmSpec("ablation_exclude_last", [*common, *epas, "--epas-exclude-last", "1"])):
            if arm.name not in planned:
                arms.append(arm)
    if not scale.continual_only and "random_ltd" in parts:
        common = _common_args(scale, scale.scratch_iters, scale.lr, scale.warmup_iters, scale.seeds[0], data_args)
        planned = {arm.name for arm in arms}
        for arm in (ArmSpec("scratch_baseline", [*common, "--epas-target-layers", "0"]),  # what it compares with
                    ArmSpec("scratch_epas", [*common, *epas, "--eval-regions", "0,half,max"]),
                    ArmSpec("scratch_random_ltd", [*common, "--epas-target-layers", "0", "--random-ltd"]),
                    ArmSpec("scratch_epas_random_ltd", [*common, *epas, "--random-ltd"])):
            if arm.name not in planned:
                arms.append(arm)
    if not scale.continual_only and {"fixed", "blocks", "moc", *(remedy.name for remedy in REMEDIES)} & set(parts):
        planned = {arm.name for arm in arms}
        for number, seed in enumerate(scale.seeds):
            suffix = "" if number == 0 else f"_seed{seed}"
            common = _common_args(scale, scale.scratch_iters, scale.lr, scale.warmup_iters, seed, data_args)
            candidates = [ArmSpec(f"scratch_baseline{suffix}", [*common, "--epas-target-layers", "0"]),
                          ArmSpec(f"scratch_epas{suffix}", [*common, *epas, "--eval-regions", "0,half,max"])]
            if "fixed" in parts:  # the whole region switches before the first step
                candidates.append(ArmSpec(f"scratch_fixed{suffix}", [*common, *epas, "--epas-first-switch", "1", "--epas-growth",
                                                                    str(scale.target_layer_count())]))
            if "blocks" in parts:  # the same target and schedule, in several blocks
                candidates.append(ArmSpec(f"scratch_blocks{suffix}", [*common, *epas, "--epas-blocks", str(scale.ablation_blocks)]))
            for remedy in REMEDIES:  # the remedies for the jump at a switch: plain EPAS plus one flag
                if remedy.name in parts:
                    candidates.append(ArmSpec(f"scratch_{remedy.name}{suffix}",
                                              [*common, *epas, remedy.flag, str(scale.remedy_steps(remedy.name))]))
            if "moc" in parts:  # Mixture-of-Channels on the baseline and on plain EPAS: one flag more each
                moc = ["--moc-topk", f"{scale.moc_topk:g}"]
                candidates += [ArmSpec(f"scratch_moc{suffix}", [*common, "--epas-target-layers", "0", *moc]),
                               ArmSpec(f"scratch_epas_moc{suffix}", [*common, *epas, *moc])]
            for arm in candidates:
                if arm.name not in planned:
                    arms.append(arm)
                    planned.add(arm.name)
    if "continual" in parts:
        base = base_checkpoint or str(out / "scratch_baseline" / "run" / "checkpoints")
        needs = None if base_checkpoint else "scratch_baseline"
        seed = scale.seeds[0] if scale.seeds else 1234
        common = _common_args(scale, scale.continual_iters, scale.continual_lr, max(1, scale.warmup_iters // 2), seed, data_args)
        regions = ",".join(str(r) for r in range(scale.continual_region + 1))
        arms.append(ArmSpec("continual_epas", [*common, "--pretrained", base, "--epas-target-layers", str(scale.continual_region),
                                               "--epas-interval", str(scale.continual_interval), "--eval-regions", regions], needs))
        arms.append(ArmSpec("continual_baseline", [*common, "--pretrained", base, "--epas-target-layers", "0",
                                                   "--eval-regions", regions, "--eval-untrained-regions"], needs))
    return arms
