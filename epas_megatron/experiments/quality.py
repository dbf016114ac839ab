"""``epas-bench quality``: the paper's quality claims, reproduced with this framework.

Experiments, each a set of ordinary ``epas-train`` / ``epas-eval`` runs (one process each,
or torchrun with ``--nproc``) whose outputs the report reads back:

1. **From scratch** (for every seed): the baseline and EPAS growing to the target region (half
   the layers) with the same data, seed, token budget and learning-rate schedule. EPAS runs with
   ``--eval-regions 0,half,max``, so its curves at smaller regions come for free. Reported: final
   validation losses and their gap (the paper: at most +0.05), throughput in the same runs, and
   the training time each run needs to reach the baseline's final validation loss.
2. **Continual pretraining** (the shape of the paper's TinyLLaMA experiment): the from-scratch
   baseline of the first seed (or ``--base-checkpoint``, e.g. an ``epas-convert hf-import`` of
   TinyLLaMA) is trained further (a) with EPAS growing to region R and (b) without EPAS; both are
   evaluated at regions 0..R with ``epas-eval`` ((b) with ``--allow-untrained-regions``: the
   paper's inference-time-sharing baseline).
3. **Ablation** (one the paper reports): the EPAS run with the region ending one layer before
   the last (``--epas-exclude-last 1``) against the default region, which includes it.
4. **Random-LTD** (``--parts`` ``random_ltd``, not in the default set): the from-scratch
   baseline and EPAS of the first seed against Random-LTD (``--random-ltd``, DeepSpeed-style
   defaults: the middle layers, 1/16 of the tokens kept at first, all from 70% of the run, the
   LayerToken LR) and EPAS with Random-LTD, at the same token budget and LR schedule. Reported:
   final validation loss, throughput and training time in the runs, and each run's FLOP-limit
   ratio (the baseline's model FLOPs over the arm's, summed over the run).
5. **Progressive vs fixed** (``--parts`` ``fixed``, not in the default set), for every seed: EPAS
   with the whole target region from the first step (``--epas-first-switch 1 --epas-growth
   <target layers>``: one switch, before the step of iteration 1) against the progressive EPAS
   run and the baseline, same tokens, seed and LR schedule. Reported: the final validation loss
   of each, fixed minus progressive beside the paper's claim (progressive growth is what keeps
   the quality: the difference should be positive) and the seed spreads.
6. **LR re-warm after each switch** (``--parts`` ``rewarm``, not in the default set), for every
   seed: EPAS with ``--epas-switch-rewarm N`` (:attr:`QualityScale.rewarm_steps` or
   ``--switch-rewarm N``, default a quarter of the interval: 12 at the ``cpu`` scale) against
   plain EPAS and the baseline. Reported: final validation loss and gap, the gap against the
   baseline's seed spread, the training time to the baseline's final loss, and the validation
   jump around each switch (:func:`~epas_megatron.experiments.quality_report.switch_jumps`). The
   re-warm costs no FLOPs.
7. **One block vs several** (``--parts`` ``blocks``, not in the default set), for every seed:
   EPAS with the target region split into :attr:`QualityScale.ablation_blocks` blocks
   (``--epas-blocks 2``: the same number of sharing layers, interval and growth) against the
   one-block EPAS run and the baseline. Reported as the progressive-vs-fixed ablation: blocks
   minus one block beside the paper's claim (one block is better: positive) and the seed spreads.
8. **Blended switch** (``--parts`` ``ramp``, not in the default set), for every seed: EPAS with
   ``--epas-switch-ramp N`` (:attr:`QualityScale.ramp_steps` or ``--switch-ramp N``, default a
   quarter of the interval: 12 at the ``cpu`` scale; the switching layers' Q/K blended into
   their source's over the N iterations before each switch) against plain EPAS and the
   baseline, reported as the re-warm (the second remedy for the jump at a switch; neither is in
   the paper).
9. **Mixture-of-Channels** (``--parts`` ``moc``, not in the default set), for every seed: the
   baseline and the EPAS run each trained again with ``--moc-topk`` :attr:`QualityScale.moc_topk`
   (0.2: the paper's K of about 20% of the SwiGLU channels; the default ``--moc-groups``) -- arms
   ``scratch_moc`` and ``scratch_epas_moc``, sharing the baseline and EPAS arms of the seed.
   Reported: the four final validation losses, MoC against the baseline and EPAS + MoC against
   EPAS as loss differences and perplexity changes (``exp(difference) - 1``) beside the paper's
   (C4 perplexity +1.0% to +1.4% at 60M-350M; Wu et al., "Mixture-of-Channels", arXiv
   2511.09323), their means against the baseline's seed spread, and the runs' training time and
   tokens/s (MoC's GEMMs stay dense, so no speed-up is expected; its saving, the activation
   memory kept for backward, is not measured here).

Every arm writes ``<output-dir>/<arm>/`` (``arm.json`` with its training flags, the run
directory, ``train.log``, ``summary.json`` once it finished); an arm whose ``summary.json`` exists
is not run again, so an interrupted recipe continues where it stopped (``--force`` reruns): an
arm interrupted after a checkpoint (a SIGTERM saves one) resumes from it, one interrupted before
any starts again. An arm is reused or resumed only if it was trained with the flags the recipe
plans for it now (:func:`recorded_train_args`); otherwise the recipe stops before any run and
says which flags differ (another ``--seeds``, ``--data``, ``--switch-ramp``... belongs in another
``--output-dir``, or ``--force`` trains the arm again). The report -- ``quality.md`` (tables and
the exact commands), ``quality.json`` (every number), ``loss_vs_tokens.png``,
``loss_vs_time.png``, ``continual_regions.png`` -- is written at the end.

    epas-bench quality                                   # CPU: ~40 minutes on 2 cores
    epas-bench quality --scale 125m --nproc 8            # 8 GPUs
    epas-bench quality --parts fixed,rewarm,blocks       # three ablations (shares baseline and EPAS runs)
    epas-bench quality --parts moc --seeds 1234,1235,1236  # Mixture-of-Channels on the baseline and on EPAS
    epas-bench quality --scale tinyllama --nproc 8 --base-checkpoint ckpts/tinyllama \\
        --data data/slimpajama_text_document --tokenizer-model ckpts/tinyllama/tokenizer.model
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from epas_megatron.errors import ConfigError
from epas_megatron.experiments.quality_plan import DEFAULT_PARTS, SCALES, ArmSpec, QualityScale, plan_arms


def launcher(nproc: int, module: str) -> list[str]:
    """``python -m module`` for one process, torchrun for several."""
    if nproc == 1:
        return [sys.executable, "-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", module]


def _run_logged(cmd: list[str], log_path: Path, prefix: str, echo: Callable[[str], None]) -> tuple[int, str]:
    """Run ``cmd``, writing its output to ``log_path`` and echoing progress lines; (status, stdout)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    lines = []
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            text = line.rstrip()
            if text.startswith((" iteration", " validation", "   at region", "EPAS switch", "error:")):
                echo(f"[{prefix}] {text.strip()}")
        status = proc.wait()
    return status, "".join(lines)


ARM_RECORD = "arm.json"
"""The file of an arm's directory that records the epas-train flags it was trained with."""


def recorded_train_args(directory: Path) -> Optional[list[str]]:
    """The epas-train flags the arm in ``directory`` was trained with: its :data:`ARM_RECORD`, or
    (arms of recipes that wrote none) the flags of the first command in its ``train.log``, without
    the launcher and the output directory. None when it has neither."""
    record = directory / ARM_RECORD
    if record.is_file():
        return list(json.loads(record.read_text())["train_args"])
    log = directory / "train.log"
    if not log.is_file():
        return None
    with open(log) as lines:
        first = lines.readline()
    if not first.startswith("$ "):
        return None
    words = shlex.split(first[2:])
    if "epas_megatron.train" not in words:
        return None
    flags = words[words.index("epas_megatron.train") + 1:]
    return flags[:flags.index("--output-dir")] if "--output-dir" in flags else flags


def _flag_values(args: Sequence[str]) -> dict[str, str]:
    """``['--seed', '1', '--data', 'a', 'b']`` -> ``{'--seed': '1', '--data': 'a b'}``."""
    values: dict[str, list[str]] = {}
    flag = ""
    for word in args:
        if word.startswith("--"):
            flag = word
            values.setdefault(flag, [])
        else:
            values.setdefault(flag, []).append(word)
    return {flag: " ".join(words) for flag, words in values.items()}


def flag_differences(recorded: Sequence[str], planned: Sequence[str]) -> str:
    """What differs between two flag lists, for an error message: ``'--seed 4321 now, 1234 then;
    --epas-blocks 2 then only'`` (empty when they hold the same flags and values, in any order)."""
    before, now = _flag_values(recorded), _flag_values(planned)
    parts = []
    for flag in dict.fromkeys([*now, *before]):
        if flag not in before:
            parts.append(f"{flag} {now[flag]} now only".replace("  ", " "))
        elif flag not in now:
            parts.append(f"{flag} {before[flag]} then only".replace("  ", " "))
        elif before[flag] != now[flag]:
            parts.append(f"{flag} {now[flag]} now, {before[flag]} then")
    return "; ".join(parts)


def _tagged_json(stdout: str, tag: str) -> Optional[dict]:
    lines = [line for line in stdout.splitlines() if line.startswith(tag + " ")]
    return json.loads(lines[-1][len(tag) + 1:]) if lines else None


@dataclass
class QualityRecipe:
    """Runs the arms of one recipe and writes its report."""

    scale_name: str
    """Key of :data:`SCALES`."""

    out: Path
    """Output directory."""

    nproc: int = 1
    """Processes per run (torchrun when > 1)."""

    base_checkpoint: Optional[str] = None
    """Continual pretraining from this checkpoint instead of the from-scratch baseline."""

    data_args: list[str] = field(default_factory=list)
    """--data / --tokenizer-model flags for every run."""

    parts: tuple[str, ...] = DEFAULT_PARTS
    """Experiments to run (among :data:`PARTS`)."""

    force: bool = False
    """Rerun arms that already finished."""

    seeds: Optional[tuple[int, ...]] = None
    """From-scratch seeds instead of the scale's (``--seeds``); the first is also the seed of the
    single-seed parts. Arms of a seed that an earlier run finished are reused, so adding a seed
    runs only its arms."""

    rewarm_steps: Optional[int] = None
    """The ``rewarm`` arms' ``--epas-switch-rewarm`` instead of the scale's (``--switch-rewarm``)."""

    ramp_steps: Optional[int] = None
    """The ``ramp`` arms' ``--epas-switch-ramp`` instead of the scale's (``--switch-ramp``)."""

    echo: Callable[[str], None] = print
    """Where progress lines go."""

    commands: list[str] = field(default_factory=list)
    """Every command run (for the report)."""

    @property
    def scale(self) -> QualityScale:
        scale = SCALES[self.scale_name]
        changes = {name: value for name, value in (("seeds", None if self.seeds is None else tuple(self.seeds)),
                                                   ("rewarm_steps", self.rewarm_steps), ("ramp_steps", self.ramp_steps))
                   if value is not None}
        return replace(scale, **changes) if changes else scale

    def arms(self) -> list[ArmSpec]:
        return plan_arms(self.scale, self.out, self.base_checkpoint, self.data_args, self.parts)

    def train_command(self, arm: ArmSpec) -> list[str]:
        return [*launcher(self.nproc, "epas_megatron.train"), *arm.train_args, "--output-dir", str(self.out / arm.name / "run")]

    def check_reusable(self, arms: Sequence[ArmSpec]) -> None:
        """Refuse, before any run, to reuse or resume an arm trained with other flags than planned
        (flags and their values; their order does not change a run)."""
        if self.force:
            return
        for arm in arms:
            directory = self.out / arm.name
            kept = (directory / "summary.json").is_file() or \
                (directory / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").is_file()
            recorded = recorded_train_args(directory) if kept else None
            if recorded is not None and _flag_values(recorded) != _flag_values(arm.train_args):
                raise ConfigError(f"{directory} holds a {arm.name} run trained with other flags than this recipe plans for it "
                                  f"({flag_differences(recorded, arm.train_args)}): use another --output-dir, or --force "
                                  "to train it again")

    def run_arm(self, arm: ArmSpec) -> dict:
        """Train one arm unless it finished before; its SUMMARY."""
        directory = self.out / arm.name
        done = directory / "summary.json"
        cmd = self.train_command(arm)
        self.commands.append(shlex.join(cmd))
        if done.is_file() and not self.force:
            self.echo(f"[{arm.name}] finished before; reusing {done}")
            return json.loads(done.read_text())
        run_dir = directory / "run"
        if run_dir.exists():
            import shutil

            checkpoints = run_dir / "checkpoints"
            if not self.force and (checkpoints / "latest_checkpointed_iteration.txt").is_file():
                # An interrupted arm (a SIGTERM saves): it continues, bit for bit (resume is exact).
                cmd = [*cmd, "--load", str(checkpoints)]
                self.echo(f"[{arm.name}] continues its interrupted run from {checkpoints}")
            else:  # --force, or interrupted before anything was saved: from the start
                if not self.force:
                    self.echo(f"[{arm.name}] its interrupted run saved no checkpoint: running it again from the start")
                shutil.rmtree(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ARM_RECORD).write_text(json.dumps({"train_args": arm.train_args}, indent=1))
        self.echo(f"[{arm.name}] {shlex.join(cmd)}")
        start = time.perf_counter()
        status, stdout = _run_logged(cmd, directory / "train.log", arm.name, self.echo)
        summary = _tagged_json(stdout, "SUMMARY")
        if status != 0 or summary is None or summary.get("exit_reason") != "completed":
            raise RuntimeError(f"arm {arm.name} failed (exit {status}); see {directory / 'train.log'}")
        done.write_text(json.dumps(summary, indent=1))
        self.echo(f"[{arm.name}] done in {time.perf_counter() - start:.0f} s: final validation loss {summary['final_valid_lm_loss']:.4f}")
        return summary

    def evaluate_regions(self, arm: str, regions: int) -> list[dict]:
        """epas-eval of an arm's final checkpoint at regions 0..``regions`` (cached in eval.json)."""
        path = self.out / arm / "eval.json"
        cmd = [*launcher(1, "epas_megatron.evaluate"), "--load", str(self.out / arm / "run" / "checkpoints"),
               "--regions", ",".join(str(r) for r in range(regions + 1)), "--allow-untrained-regions",
               "--eval-iters", str(self.scale.final_eval_iters), "--output", str(path)]
        self.commands.append(shlex.join(cmd))
        if not path.is_file() or self.force:
            self.echo(f"[{arm}] {shlex.join(cmd)}")
            status, stdout = _run_logged(cmd, self.out / arm / "eval.log", arm, self.echo)
            if status != 0:
                raise RuntimeError(f"epas-eval of {arm} failed (exit {status}); see {self.out / arm / 'eval.log'}")
        return json.loads(path.read_text())["results"]

    def run(self) -> dict:
        """Every arm, then the report; returns the report's numbers."""
        from epas_megatron.checkpointing.integrity import open_checkpoint
        from epas_megatron.experiments import quality_report as report

        self.out.mkdir(parents=True, exist_ok=True)
        if self.base_checkpoint is not None:
            open_checkpoint(self.base_checkpoint, "--base-checkpoint")
        arms = self.arms()
        self.check_reusable(arms)
        results = {arm.name: self.run_arm(arm) for arm in arms}
        arm = lambda name: report.ArmResult(name, results[name], _read_metrics(self.out / name / "run"))
        scale = self.scale
        numbers: dict = {"scale": self.scale_name, "config": asdict(scale), "nproc": self.nproc}
        sections: list[str] = []
        plots: list[str] = []
        if "scratch" in self.parts and not scale.continual_only:
            full_region_from = self._full_region_iteration()
            per_seed = []
            for number, seed in enumerate(scale.seeds):
                suffix = "" if number == 0 else f"_seed{seed}"
                comparison = report.scratch_comparison(arm(f"scratch_baseline{suffix}"), arm(f"scratch_epas{suffix}"), full_region_from)
                per_seed.append({"seed": seed, **comparison})
                sections.append(f"### From scratch, seed {seed}\n\n{report.scratch_table(comparison)}")
            numbers["scratch"] = per_seed
            numbers["scratch_summary"] = report.seed_summary(per_seed)
            sections.append(report.seed_summary_text(numbers["scratch_summary"]))
            report.plot_curves([arm("scratch_baseline"), arm("scratch_epas")], str(self.out / "loss_vs_tokens.png"),
                               str(self.out / "loss_vs_time.png"), scale.seq_length * scale.global_batch_size)
            plots += ["loss_vs_tokens.png", "loss_vs_time.png"]
        if "ablation" in self.parts and not scale.continual_only:
            reference = arm("scratch_baseline").final_valid_loss
            rows = [("EPAS, region includes the last layer (default)", arm("scratch_epas").final_valid_loss),
                    ("EPAS, region ends one layer before the last (--epas-exclude-last 1)", arm("ablation_exclude_last").final_valid_loss)]
            numbers["ablation"] = {"baseline": reference, **{name: loss for name, loss in rows},
                                   "exclude_last_minus_default": rows[1][1] - rows[0][1]}
            sections.append(f"### Ablation: where the region ends (seed {scale.seeds[0]})\n\n{report.ablation_table(rows, reference)}")
        if "random_ltd" in self.parts and not scale.continual_only:
            rows = report.methods_comparison([arm("scratch_baseline"), arm("scratch_epas"), arm("scratch_random_ltd"),
                                              arm("scratch_epas_random_ltd")])
            numbers["random_ltd"] = rows
            sections.append(f"### Random-LTD, EPAS and both, from scratch at equal tokens (seed {scale.seeds[0]})\n\n"
                            + report.methods_table(rows))
            report.plot_curves([arm(name) for name in ("scratch_baseline", "scratch_epas", "scratch_random_ltd",
                                                       "scratch_epas_random_ltd")],
                               str(self.out / "random_ltd_loss_vs_tokens.png"), str(self.out / "random_ltd_loss_vs_time.png"),
                               scale.seq_length * scale.global_batch_size)
            plots += ["random_ltd_loss_vs_tokens.png", "random_ltd_loss_vs_time.png"]
        for part, names, claim, title, labels in (
                ("fixed", report.FIXED, report.PAPER_PROGRESSIVE_CLAIM,
                 f"Progressive vs fixed region (the full region of {scale.target_layer_count()} layers from iteration 1)",
                 ("progressive EPAS", "fixed region from iteration 1")),
                ("blocks", report.BLOCKS, report.PAPER_BLOCKS_CLAIM,
                 f"One sharing block vs {scale.ablation_blocks} (--epas-blocks {scale.ablation_blocks}, "
                 f"{scale.target_layer_count()} sharing layers in all)",
                 ("EPAS, one block", f"EPAS, {scale.ablation_blocks} blocks"))):
            if part not in self.parts or scale.continual_only:
                continue
            per_seed = [{"seed": seed, **report.paired_comparison(arm(f"scratch_baseline{suffix}"), arm(f"scratch_epas{suffix}"),
                                                                  arm(f"scratch_{part}{suffix}"), names)}
                        for seed, suffix in self._seed_suffixes()]
            numbers[part] = per_seed
            numbers[f"{part}_summary"] = report.paired_summary(per_seed, names, claim)
            difference = f"{names[1].replace('_', ' ').capitalize()} minus {names[0].replace('_', ' ')}"
            sections.append(f"### {title}\n\n{report.paired_table(per_seed, names, labels)}\n\n"
                            + report.paired_summary_text(numbers[f"{part}_summary"], names, difference))
        for remedy in report.REMEDIES:
            if remedy.name not in self.parts or scale.continual_only:
                continue
            name, steps = remedy.name, scale.remedy_steps(remedy.name)
            per_seed = []
            for seed, suffix in self._seed_suffixes():
                comparison = report.remedy_comparison(arm(f"scratch_baseline{suffix}"), arm(f"scratch_epas{suffix}"),
                                                      arm(f"scratch_{name}{suffix}"), name)
                per_seed.append({"seed": seed, **comparison})
                sections.append(f"### {remedy.title} ({remedy.flag} {steps}), seed {seed}\n\n" + report.remedy_table(comparison, remedy))
            numbers[name] = per_seed
            numbers[f"{name}_summary"] = {"steps": steps, **report.remedy_summary(per_seed, name)}
            sections.append(report.remedy_summary_text(numbers[f"{name}_summary"], remedy, steps))
            report.plot_curves([arm("scratch_baseline"), arm("scratch_epas"), arm(f"scratch_{name}")],
                               str(self.out / f"{name}_loss_vs_tokens.png"), str(self.out / f"{name}_loss_vs_time.png"),
                               scale.seq_length * scale.global_batch_size)
            plots += [f"{name}_loss_vs_tokens.png", f"{name}_loss_vs_time.png"]
        if "moc" in self.parts and not scale.continual_only:
            per_seed = [{"seed": seed, **report.moc_comparison(*(arm(f"scratch_{key}{suffix}") for key, _ in report.MOC_ARMS))}
                        for seed, suffix in self._seed_suffixes()]
            numbers["moc"] = per_seed
            numbers["moc_summary"] = {"topk": scale.moc_topk, **report.moc_summary(per_seed)}
            sections.append(f"### Mixture-of-Channels (--moc-topk {scale.moc_topk:g}) on the baseline and on EPAS\n\n"
                            f"{report.moc_table(per_seed)}\n\n{report.moc_speed_table(per_seed, numbers['moc_summary'])}\n\n"
                            + report.moc_summary_text(numbers["moc_summary"], scale.moc_topk))
            report.plot_curves([arm(f"scratch_{key}") for key, _ in report.MOC_ARMS], str(self.out / "moc_loss_vs_tokens.png"),
                               str(self.out / "moc_loss_vs_time.png"), scale.seq_length * scale.global_batch_size)
            plots += ["moc_loss_vs_tokens.png", "moc_loss_vs_time.png"]
        if "continual" in self.parts:
            comparison = report.continual_comparison(self.evaluate_regions("continual_epas", scale.continual_region),
                                                     self.evaluate_regions("continual_baseline", scale.continual_region))
            numbers["continual"] = comparison
            sections.append("### Continual pretraining: validation loss at each inference region (vs region 0)\n\n"
                            + report.continual_table(comparison) + "\n\n" + report.continual_verdict(comparison))
            report.plot_continual(comparison, str(self.out / "continual_regions.png"))
            plots.append("continual_regions.png")
        numbers["commands"] = self.commands
        (self.out / "quality.json").write_text(json.dumps(numbers, indent=1))
        markdown = "\n\n".join([f"## EPAS quality recipe (`--scale {self.scale_name}`)", *sections,
                                "Plots: " + ", ".join(f"`{p}`" for p in plots) if plots else "",
                                "Commands:\n\n```\n" + "\n".join(self.commands) + "\n```"]) + "\n"
        (self.out / "quality.md").write_text(markdown)
        self.echo(markdown)
        return numbers

    def _seed_suffixes(self) -> list[tuple[int, str]]:
        """(seed, arm-name suffix) of every from-scratch seed (the first seed has none)."""
        return [(seed, "" if number == 0 else f"_seed{seed}") for number, seed in enumerate(self.scale.seeds)]

    def _full_region_iteration(self) -> int:
        """First iteration trained with the full from-scratch region: the schedule the trainer
        resolves from the plain EPAS arm's flags (:func:`~epas_megatron.validation.sharing_schedule`)."""
        from epas_megatron.config.cli import parse_config
        from epas_megatron.validation import sharing_schedule

        epas_arm = next(arm for arm in self.arms() if arm.name == "scratch_epas")
        return sharing_schedule(parse_config(epas_arm.train_args)).final_iteration


def _read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
